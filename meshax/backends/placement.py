"""`PlacementMeshImpl`: one array per device, every collective an explicit transfer.

Slow and transparent: each op runs on each device's slice in turn, and allreduce, allgather,
alltoall, reduce-scatter and permutes are written out as device-to-device copies in Python (on
virtual CPU devices, which share one host, every slice is kept on the first device while a
program runs, so those copies are the slices themselves: `_homes`).
It shares no collective code with the SIMD backend, so it is an independent check of it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from meshax.layout import slice_index, slice_shape
from meshax.lower.mesh_impl import MeshImpl

_REDUCE = {"sum": jnp.add, "max": jnp.maximum, "min": jnp.minimum}


class PlacementMeshImpl(MeshImpl):
    """A slice list holds `size` arrays, the one at index pnum on device pnum."""

    # While a compiled program runs: its jitted per-call functions, and the position of the next
    # slicewise call. A program makes the same calls in the same order every run, and their
    # functions close over static values only (shapes, axes; data comes in as arguments), so
    # the k-th call's function is jitted once and reused: each device compiles one program per
    # op call instead of one per primitive, and runs one dispatch instead of several.
    _jitted: list | None = None
    _call = 0
    _tracing = False  # `trace` runs: values are abstract, a loop's condition cannot be read

    @property
    def devices(self) -> list:
        if jax.process_count() > 1:
            raise RuntimeError(
                "the placement backend drives every device from one process; in a multi-process run "
                "use the simd backend (--backend simd)"
            )
        return MeshImpl.devices.fget(self)  # type: ignore[attr-defined]

    def _homes(self) -> list:
        """Where each device's slice is kept while a program runs: on its own device, but on CPU,
        whose virtual devices share one host, every slice on the first device (each op compiles
        once, for that device, and runs with no copy in or out). A value goes onto the devices
        themselves where it leaves the backend (`to_padded`)."""
        devices = self.devices
        return [devices[0]] * len(devices) if devices[0].platform == "cpu" else devices

    def _put(self, x, pnum: int):
        if self._tracing:  # (as in _put_each: no device needed)
            return x
        return self._put_each([x], [self._homes()[pnum]])[0]

    def _put_each(self, xs: list, devices: list | None = None) -> list:
        """`xs[p]` onto `devices[p]` (slice p's home by default), in one transfer call (JAX
        batches a list's transfers, about twice as fast as one call per slice); an array already
        there, or abstract (tracing), is passed as it is. While `trace` runs nothing moves, and no
        device is needed: `meshax plan` traces meshes larger than the machine."""
        if self._tracing:
            return list(xs)
        devices = devices or self._homes()
        move = [not _there(x, d) for x, d in zip(xs, devices)]
        if not any(move):
            return list(xs)
        moved = iter(jax.device_put([x for x, m in zip(xs, move) if m], [d for d, m in zip(devices, move) if m]))
        return [next(moved) if m else x for x, m in zip(xs, move)]

    def _groups(self, axes) -> list[list[int]]:
        """Processors that differ only in `axes`, each group ordered by its coordinates there."""
        groups: dict[tuple, list[int]] = {}
        for p in range(self.size):
            c = self.pnum_to_processor_coordinates(p)
            key = tuple(v for m, v in enumerate(c) if m not in axes)
            groups.setdefault(key, []).append(p)
        return list(groups.values())

    # ---- primitives ------------------------------------------------------------------------
    def slicewise(self, fn: Callable, *args):
        if self._jitted is not None:
            if self._call == len(self._jitted):
                self._jitted.append(jax.jit(fn, compiler_options=self.program_compiler_options))
            fn = self._jitted[self._call]
            self._call += 1
        args = tuple(self._put_each(a) if isinstance(a, list) else a for a in args)
        outs = [fn(*[a[p] if isinstance(a, list) else a for a in args]) for p in range(self.size)]
        if isinstance(outs[0], tuple):
            return tuple(self._put_each([o[k] for o in outs]) for k in range(len(outs[0])))
        return self._put_each(outs)

    def pcoord(self, axis: int) -> list:
        return self._put_each([jnp.int32(self.pnum_to_processor_coordinates(p)[axis]) for p in range(self.size)])

    def allreduce(self, xs, axes, op):
        out = [None] * self.size
        for group in self._groups(set(axes)):
            total = self._put(xs[group[0]], group[0])
            for p in group[1:]:
                total = _REDUCE[op](total, self._put(xs[p], group[0]))
            for p in group:
                out[p] = self._put(total, p)
        return out

    def allgather(self, xs, axis, dim):
        out = [None] * self.size
        for group in self._groups({axis}):
            full = jnp.concatenate([self._put(xs[p], group[0]) for p in group], axis=dim)
            for p in group:
                out[p] = self._put(full, p)
        return out

    def alltoall(self, xs, axis, split_dim, concat_dim):
        out = [None] * self.size
        for group in self._groups({axis}):
            pieces = {p: jnp.split(xs[p], len(group), axis=split_dim) for p in group}
            for k, receiver in enumerate(group):
                out[receiver] = jnp.concatenate([self._put(pieces[s][k], receiver) for s in group], axis=concat_dim)
        return out

    def reduce_scatter(self, xs, axis, dim):
        summed = self.allreduce(xs, [axis], "sum")
        out = [None] * self.size
        for group in self._groups({axis}):
            for k, p in enumerate(group):
                out[p] = jnp.split(summed[p], len(group), axis=dim)[k]
        return out

    def shift(self, xs, axis, offset, wrap):
        n = self.shape[axis].size
        out = [None] * self.size
        for group in self._groups({axis}):
            for k, p in enumerate(group):
                src = k - offset
                if wrap:
                    src %= n
                out[p] = self._put(xs[group[src]], p) if 0 <= src < n else self._put(jnp.zeros_like(xs[p]), p)
        return out

    def scan(self, step, carry, xs, length, reverse):
        outs, start = [], self._call
        for i in reversed(range(length)) if reverse else range(length):  # unrolled, in Python
            self._call = start  # every iteration makes the same calls: reuse the first one's jitted functions
            carry, y = step(carry, [[x[p][i] for p in range(self.size)] for x in xs])
            outs.append(y)
        if reverse:
            outs.reverse()
        ys = [[self._put(jnp.stack([y[k][p] for y in outs]), p) for p in range(self.size)] for k in range(len(outs[0]))]
        return carry, ys

    def while_loop(self, cond, body, carry):
        if self._tracing:  # traced for the counters: one iteration
            cond(carry)
            return body(carry)
        outer, at = self._jitted, self._call
        if outer is not None:  # the condition's and the body's calls get lists of their own, kept at
            if at == len(outer):  # this loop's place in the program's: how often they run varies
                outer.append(([], []))
            self._call = at + 1
        lists = outer[at] if outer is not None else (None, None)

        def run(part, calls, value):
            self._jitted, self._call = calls, 0
            try:
                return part(value)
            finally:
                self._jitted, self._call = outer, at + 1

        # in Python: the condition, the same on every device, read from the first
        while bool(np.asarray(run(cond, lists[0], carry)[0])):
            carry = run(body, lists[1], carry)
        return carry

    def switch(self, index, branches):
        if self._tracing:  # traced for the counters: every branch (they return alike)
            outs = [branch() for branch in branches]
            return outs[0]
        outer, at = self._jitted, self._call
        if outer is not None:  # each branch gets a list of calls of its own, kept at this place
            if at == len(outer):
                outer.append(tuple([] for _ in branches))
            self._call = at + 1
        b = int(np.asarray(index[0]))  # in Python: the same on every device, read from the first
        self._jitted, self._call = (outer[at][b] if outer is not None else None), 0
        try:
            return branches[b]()
        finally:
            self._jitted, self._call = outer, at + 1

    # ---- values: a list of per-device arrays, in pnum order ------------------------------------
    def from_padded(self, array, spec):
        by_device = {s.device: s.data for s in array.addressable_shards}
        return self._put_each([by_device[d] for d in self.devices])

    def to_padded(self, value, spec):
        # each device's array is exactly its shard of the layout's NamedSharding over these devices
        return jax.make_array_from_single_device_arrays(
            self.padded_shape(spec), self.named_sharding(spec[2]), self._put_each(list(value), self.devices)
        )

    def put(self, array, spec):
        shape, _, layout = spec
        padded = self._pad(np.asarray(array), spec)
        return self._put_each([padded[where] for where in self._stripes(shape, layout)])

    def fetch(self, value, spec):
        shape, dtype, layout = spec
        full = np.empty(self.padded_shape(spec), dtype=dtype)
        for where, piece in zip(self._stripes(shape, layout), value):
            full[where] = np.asarray(piece)
        return self._unpad(full, spec)

    # ---- execution -------------------------------------------------------------------------
    def _stripes(self, shape, layout) -> list[tuple[slice, ...]]:
        """Per device, where its slice lies in the padded global array."""
        size = slice_shape(shape, layout, self.shape)
        out = []
        for p in range(self.size):
            coords = self.pnum_to_processor_coordinates(p)
            begin = [s * slice_index(a, coords, self.shape) for s, a in zip(size, layout.axes)]
            out.append(tuple(slice(b, b + s) for b, s in zip(begin, size)))
        return out

    def trace(self, body, in_specs):
        def run(seed, *flat):
            it = iter(flat)
            inputs = [[next(it) for _ in range(self.size)] for _ in in_specs]
            body(inputs, [seed] * self.size)

        flat = [
            jax.ShapeDtypeStruct(tuple(slice_shape(s, lay, self.shape)), d)
            for s, d, lay in in_specs
            for _ in range(self.size)
        ]
        self._tracing = True
        try:
            return jax.make_jaxpr(run)(jax.ShapeDtypeStruct((), jnp.uint32), *flat)
        finally:
            self._tracing = False

    def compile(self, body, in_specs, out_specs, donate=()):
        jitted: list = []

        def run(args, seed):
            inputs = [a if isinstance(a, list) else self.put(a, spec) for a, spec in zip(args, in_specs)]
            seeds = self._put_each([np.uint32(seed)] * self.size)
            self._jitted, self._call = jitted, 0
            try:
                return body(inputs, seeds)
            finally:
                self._jitted = None

        return _PlacementRunner(run)


def _there(x, device) -> bool:
    """Whether x needs no transfer to `device`: it is there already, or abstract (being traced)."""
    return isinstance(x, jax.core.Tracer) or (isinstance(x, jax.Array) and x.devices() == {device})


class _PlacementRunner:
    def __init__(self, run):
        self._run = run

    def __call__(self, args, seed):
        return self._run(args, seed)

    def compiled(self):
        raise TypeError(
            "PlacementMeshImpl runs op by op on each device and has no single compiled program; "
            "use SimdMeshImpl to inspect the compiled HLO"
        )
