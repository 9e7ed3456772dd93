"""Helpers shared by op families: scalar conversion, dim lookup, slice alignment."""

from __future__ import annotations

import numbers
import operator
import re
from collections.abc import Sequence

import numpy as np

from meshax.core.errors import GraphError, did_you_mean
from meshax.core.graph import Mesh, Tensor
from meshax.core.shape import Dimension, Shape, convert_to_dimension, convert_to_shape
from meshax.ops._dtypes import scalar_dtype


def align(x, from_shape: Shape, to_shape: Shape):
    """Reorder a slice's axes from `from_shape` order to `to_shape` order, with size-1 axes for
    dims it lacks, so that NumPy broadcasting lines it up with a `to_shape` slice."""
    from jax import lax

    names = from_shape.dimension_names
    present = [d.name for d in to_shape if d.name in names]
    perm = [names.index(n) for n in present]
    if perm != list(range(len(perm))):
        x = lax.transpose(x, perm)
    if len(present) == len(to_shape):
        return x
    sizes = iter(x.shape)
    return lax.reshape(x, tuple(next(sizes) if d.name in names else 1 for d in to_shape))


def as_tensor(value, mesh: Mesh, like: np.dtype) -> Tensor:
    """A tensor from a tensor or a Python/NumPy scalar (a rank-0 constant). A Python scalar is
    weakly typed, as in JAX: it takes the dtype it promotes to beside a tensor of dtype `like`."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, numbers.Number | np.number | np.bool_):
        from meshax.ops.inputs import constant

        return constant(mesh, value, [], scalar_dtype(value, like))
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        raise GraphError(
            f"expected a meshax Tensor or a scalar, got an array of shape {tuple(value.shape)} ({value.dtype}): "
            "bring it into the graph with mx.import_tensor(mesh, array, shape), naming its dims"
        )
    raise GraphError(f"expected a meshax Tensor or a scalar, got {type(value).__name__}: {value!r:.80}")


def as_dims(x) -> list[Dimension]:
    """A list of Dimensions from a Dimension, a list of them, or a Shape."""
    if x is None:
        return []
    if isinstance(x, Dimension):
        return [x]
    return list(convert_to_shape(x))


def shape_of_names(spec, inputs: Sequence[Tensor]) -> Shape:
    """A Shape as `convert_to_shape` takes it, where a name without a size ("hidden", or
    "batch;hidden", or beside sizes: "batch;k:4") is the inputs' dim of that name:
    `output_shape=["batch", "hidden"]`."""
    if isinstance(spec, Dimension):
        spec = [spec]
    if isinstance(spec, str):  # (spaces around a colon join its pair, as convert_to_shape reads them)
        tokens = [n for n in re.split(r"[;,.\s]+", re.sub(r"\s*:\s*", ":", spec.strip())) if n]
        spec = spec if all(":" in n for n in tokens) else tokens
    if not (isinstance(spec, list | tuple) and any(isinstance(e, str) and ":" not in e for e in spec)):
        return convert_to_shape(spec)
    dims = {d.name: d for t in inputs for d in t.shape}

    def lookup(name: str) -> Dimension:
        if name not in dims:
            shapes = ", ".join(f"{t.name} {t.shape}" for t in inputs)
            raise GraphError(
                f"no input has a dimension {name!r}{did_you_mean(name, dims)} (inputs: {shapes}); a dim of its own "
                f"needs its size, e.g. '{name}:4'"
            )
        return dims[name]

    return convert_to_shape(
        [(lookup(e) if ":" not in e else convert_to_dimension(e)) if isinstance(e, str) else e for e in spec]
    )


def dim_of(x: Tensor, dim) -> Dimension:
    """The Dimension of x named by `dim` (a Dimension or a name), with a clear error."""
    if not isinstance(dim, str | Dimension):  # (an axis number, as NumPy takes: dims are named here)
        axis = ", not an axis number" if isinstance(dim, numbers.Integral) else ""
        raise GraphError(
            f"{dim!r} ({type(dim).__name__}) names no dimension of {x.name} {x.shape}: give a dim's name "
            f"(one of {x.shape.dimension_names}) or the Dimension itself{axis}"
        )
    name = dim if isinstance(dim, str) else dim.name
    if name not in x.shape:
        raise GraphError(f"tensor {x.name} {x.shape} has no dimension {name!r}")
    d = x.shape.get_dim_by_name(name)
    if not isinstance(dim, str) and d != dim:
        raise GraphError(f"tensor {x.name} has {d}, not {dim}")
    return d


def whole_number(value, what: str) -> int:
    """`value` as an int where an op takes a count, an offset or a size (an int, NumPy's or a
    0-d integer array), refusing a fraction, which int() would drop silently."""
    try:
        if isinstance(value, bool | np.bool_):  # (True was taken for 1)
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise GraphError(
            f"{what} {value!r} ({type(value).__name__}) is not a whole number: give an int (e.g. n // 2, not n / 2)"
        ) from None


def also_accepts(**old_names: str):
    """Let a function that takes Mesh-TensorFlow's argument names also take, as keywords, the
    names meshax used before (`old="new"`), so code written either way runs. Its signature (and
    so its documentation) shows Mesh-TensorFlow's names."""
    import functools

    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            for old, new in old_names.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{fn.__name__}: give {new}= or its older name {old}=, not both")
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        call.also_accepts = dict(old_names)
        return call

    return wrap
