"""Annotations a plain JAX function carries: `mx.mesh_split` on jax arrays, `mx.replicated_region`.

`mesh_split` on a jax array binds an identity primitive that records the annotation (its spec and
priority) in the jaxpr. It is linear, so its gradient carries the same annotation (GSPMD
section 3.4), and it lowers to nothing under `jax.jit`: the same function runs unpartitioned.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from meshax.core.errors import LayoutError
from meshax.core.graph import user_source
from meshax.jaxpr.flatten import REPLICATED_SCOPE

mesh_split_p = Primitive("meshax_mesh_split")
mesh_split_p.def_impl(lambda x, *, spec, priority: x)
mesh_split_p.def_abstract_eval(lambda x, *, spec, priority: x)
mlir.register_lowering(mesh_split_p, lambda ctx, x, *, spec, priority: [x])


def _transpose(ct, x, *, spec, priority):
    return [ct if type(ct) is ad.Zero else mesh_split_p.bind(ct, spec=spec, priority=priority)]


ad.deflinear2(mesh_split_p, _transpose)


def _batch(args, dims, *, spec, priority):
    (x,), (d,) = args, dims
    if d is None:  # (not mapped: JAX's batching.not_mapped, None, which jax 0.10 no longer names)
        return mesh_split_p.bind(x, spec=spec, priority=priority), d
    spec = (*spec[:d], None, *spec[d:])  # the mapped axis is not split
    return mesh_split_p.bind(x, spec=spec, priority=priority), d


batching.primitive_batchers[mesh_split_p] = _batch


def _entry(e):
    if e is None or isinstance(e, str):
        return e
    if isinstance(e, list | tuple):
        return tuple(e)
    return e  # mx.OPEN, or something `emit.annotate` will refuse by name


def mesh_split_array(x, dims_mapping, priority: int = 0):
    """A jax array (or tracer) annotated for `mx.partition`: one entry per axis, as `mx.mesh_split`."""
    if isinstance(dims_mapping, str) or len(dims_mapping) != np.ndim(x):
        raise LayoutError(
            f"mesh_split at {user_source()}: {dims_mapping!r} for an array of shape {list(np.shape(x))}; give "
            f"one entry per axis ({np.ndim(x)}): a mesh dim name, a tuple of names, None or mx.OPEN"
        )
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral) or priority < 0:
        raise LayoutError(f"mesh_split at {user_source()}: priority must be an int >= 0, got {priority!r}")
    return mesh_split_p.bind(x, spec=tuple(_entry(e) for e in dims_mapping), priority=int(priority))


def replicated_region(fn: Callable) -> Callable:
    """`fn` marked to run whole on each device under `mx.partition` (its inputs gathered, its
    outputs computed replicated): the way around a primitive meshax cannot partition. Its
    gradient is marked too. Under `jax.jit` it is `fn`."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.named_scope(REPLICATED_SCOPE):
            return fn(*args, **kwargs)

    return wrapped
