"""`SimdMeshImpl`: the whole graph traced once inside `jax.shard_map`, jitted.

A slice list holds one array: the slice of whichever device runs the program. Collectives are
`jax.lax` collectives over the mesh's named axes, so the program's size does not grow with
the number of devices. Values are global `jax.Array`s with the layout's `NamedSharding`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshax.lower.mesh_impl import MeshImpl
from meshax.lower.padding import padded_dims

_REDUCERS = {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}


class SimdMeshImpl(MeshImpl):
    """One SPMD program for all devices, partitioned by `jax.shard_map`."""

    @property
    def abstract_mesh(self) -> AbstractMesh:
        """The mesh as a `jax.sharding.AbstractMesh` (shapes and names, no devices), for tracing."""
        return AbstractMesh(tuple(self.shape.to_integer_list), self.axis_names)

    # ---- primitives ------------------------------------------------------------------------
    def slicewise(self, fn: Callable, *args):
        out = fn(*[a[0] if isinstance(a, list) else a for a in args])
        if isinstance(out, tuple):
            return tuple([o] for o in out)
        return [out]

    def pcoord(self, axis: int) -> list:
        return [jax.lax.axis_index(self.axis_names[axis])]

    def allreduce(self, xs, axes, op):
        names = tuple(self.axis_names[m] for m in axes)
        if op in ("max", "min") and jnp.issubdtype(xs[0].dtype, jnp.floating):
            return [_ordered_extreme(xs[0], names, op)]
        return [_REDUCERS[op](xs[0], names)]

    def allgather(self, xs, axis, dim):
        return [jax.lax.all_gather(xs[0], self.axis_names[axis], axis=dim, tiled=True)]

    def alltoall(self, xs, axis, split_dim, concat_dim):
        return [jax.lax.all_to_all(xs[0], self.axis_names[axis], split_dim, concat_dim, tiled=True)]

    def reduce_scatter(self, xs, axis, dim):
        return [jax.lax.psum_scatter(xs[0], self.axis_names[axis], scatter_dimension=dim, tiled=True)]

    def shift(self, xs, axis, offset, wrap):
        n = self.shape[axis].size
        if wrap:
            perm = [(i, (i + offset) % n) for i in range(n)]
        else:
            perm = [(i, i + offset) for i in range(n) if 0 <= i + offset < n]
        if not perm:
            return [jnp.zeros_like(xs[0])]
        return [jax.lax.ppermute(xs[0], self.axis_names[axis], perm)]

    def scan(self, step, carry, xs, length, reverse):
        def one(c, x):  # lax.scan traces this once: the program does not grow with `length`
            c, y = step([[a] for a in c], [[a] for a in x])
            return [s[0] for s in c], [s[0] for s in y]

        c, ys = jax.lax.scan(one, [s[0] for s in carry], [s[0] for s in xs], length=length, reverse=reverse)
        return [[a] for a in c], [[a] for a in ys]

    def while_loop(self, cond, body, carry):
        out = jax.lax.while_loop(
            lambda c: cond([[a] for a in c])[0], lambda c: [s[0] for s in body([[a] for a in c])], [s[0] for s in carry]
        )
        return [[a] for a in out]

    def switch(self, index, branches):
        out = jax.lax.switch(index[0], [lambda b=b: [s[0] for s in b()] for b in branches])
        return [[a] for a in out]

    # ---- values ----------------------------------------------------------------------------
    # A value is the padded global array (the logical one, where the layout's splits divide).
    def from_padded(self, array, spec):
        return array

    def to_padded(self, value, spec):
        return value

    def put(self, array, spec):
        return jax.device_put(self._pad(array, spec), self.named_sharding(spec[2]))

    def fetch(self, value, spec):
        if not (value.is_fully_addressable or value.is_fully_replicated):  # another process holds a part
            from jax.experimental import multihost_utils

            value = multihost_utils.process_allgather(value, tiled=True)
        # a writable copy, as the placement backend's assembled arrays are
        return np.array(self._unpad(np.asarray(value), spec))

    # ---- execution -------------------------------------------------------------------------
    def _local(self, body: Callable) -> Callable:
        def local(seed, *args):
            return tuple(o[0] for o in body([[a] for a in args], [seed]))

        return local

    def trace(self, body, in_specs):
        fn = jax.shard_map(
            self._local(body),
            mesh=self.abstract_mesh,
            in_specs=(P(), *tuple(self.partition_spec(lay) for _, _, lay in in_specs)),
            out_specs=P(),
            check_vma=False,
        )

        # The outputs matter only for what tracing records in the counters: return none of them.
        # Each argument carries its sharding (on the abstract mesh): newer JAX checks shard_map's
        # in_specs against the arguments' own shardings.
        def on_mesh(spec):
            return NamedSharding(self.abstract_mesh, spec)

        return jax.make_jaxpr(lambda seed, *a: (fn(seed, *a), None)[1])(
            jax.ShapeDtypeStruct((), jnp.uint32, sharding=on_mesh(P())),
            *[
                jax.ShapeDtypeStruct(self.padded_shape((s, d, lay)), d, sharding=on_mesh(self.partition_spec(lay)))
                for s, d, lay in in_specs
            ],
        )

    compile_traces_once = True
    dispatch_is_asynchronous = True

    def compile(self, body, in_specs, out_specs, donate=()):
        in_sh = [self.named_sharding(lay) for _, _, lay in in_specs]
        # Explicit in_shardings: host arrays go straight to their shards, and values already laid
        # out (the variables) are passed through without a copy.
        fn = jax.jit(
            jax.shard_map(
                self._local(body),
                mesh=self.jax_mesh,
                in_specs=(P(), *tuple(s.spec for s in in_sh)),
                out_specs=tuple(self.partition_spec(lay) for _, _, lay in out_specs),
                check_vma=False,
            ),
            in_shardings=(NamedSharding(self.jax_mesh, P()), *in_sh),
            donate_argnums=tuple(1 + i for i in donate),
            compiler_options=self.program_compiler_options,
        )
        # Traced once, now (the body records its collectives as it goes), compiled on first use.
        traced = fn.trace(
            jax.ShapeDtypeStruct((), jnp.uint32, sharding=NamedSharding(self.jax_mesh, P())),
            *[jax.ShapeDtypeStruct(self.padded_shape(spec), spec[1], sharding=s) for spec, s in zip(in_specs, in_sh)],
        )
        if jax.process_count() > 1:  # a program takes a host array only whole on each process: make it global
            return _SimdRunner(traced, lambda args: self._global_arrays(args, in_specs))
        uneven = {i: spec for i, spec in enumerate(in_specs) if padded_dims(spec[0], spec[2], self.shape)}
        return _SimdRunner(traced, lambda args: self._padded_host_arrays(args, uneven))

    def _padded_host_arrays(self, args: list, uneven: dict[int, tuple]) -> list:
        """Host arrays (logical) padded where their layout's split does not divide."""
        if not uneven:
            return args
        return [self._pad(a, uneven[i]) if i in uneven and isinstance(a, np.ndarray) else a for i, a in enumerate(args)]

    def _global_arrays(self, args: list, in_specs: list) -> list:
        """Whole host arrays (every process passes the same) as global jax.Arrays."""
        return [self.put(a, spec) if isinstance(a, np.ndarray) else a for a, spec in zip(args, in_specs)]


def _ordered_extreme(x, names: tuple, op: str):
    """The max (min) of floats across mesh dims with a NaN winning, as a max of one device's
    values does: XLA's all-reduce max and min drop NaNs (jnp.max of a split axis holding a NaN
    gave the largest number). Taken over integers in the floats' order (a float's bits, the
    negative ones' magnitude bits flipped), a NaN the largest (smallest) of them: the same
    collective, values and bytes."""
    bits = x.dtype.itemsize * 8
    ints, top = jnp.dtype(f"int{bits}"), (1 << (bits - 1)) - 1
    key = jax.lax.bitcast_convert_type(x, ints)
    key = jnp.where(key < 0, key ^ top, key)
    key = jnp.where(jnp.isnan(x), jnp.iinfo(ints).max if op == "max" else jnp.iinfo(ints).min, key)
    key = _REDUCERS[op](key, names)
    return jax.lax.bitcast_convert_type(jnp.where(key < 0, key ^ top, key), x.dtype)  # (the extremes: NaN bits)


class _SimdRunner:
    def __init__(self, traced, prepare):
        self._traced = traced
        self._prepare = prepare
        self._compiled = None

    def __call__(self, args, seed):
        return list(self.compiled()(np.uint32(seed), *self._prepare(args)))

    def compiled(self):
        if self._compiled is None:
            self._compiled = self._traced.lower().compile()
        return self._compiled
