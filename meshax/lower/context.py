"""`LoweringContext`: what an op's `lower(ctx)` sees while the graph is being lowered.

It holds each tensor's laid-out value, hands inputs to ops in the layout they ask for
(resharding and settling lazy sums as needed), and is the only place collectives are emitted,
so that every one of them is recorded in the counters with the op and source line behind it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from meshax.core.graph import Operation, Tensor
from meshax.layout import TensorLayout, slice_shape
from meshax.layout.rules import block_sizes, is_padded
from meshax.layout.sharding_rule import Run, choose
from meshax.lower import halo
from meshax.lower.counters import Counters, Site
from meshax.lower.laid_out import LaidOutTensor
from meshax.lower.mesh_impl import MeshImpl


def source(t: Tensor) -> Tensor:
    """The tensor t relabels (itself if it relabels none): what `LoweringContext.get` reads."""
    while getattr(t.operation, "is_rename", False):
        t = t.operation.inputs[0]
    return t


def count_reads(ops: Sequence[Operation], outputs: Sequence[Tensor] = ()) -> dict[Tensor, int]:
    """How many readers each tensor has among `ops` and the program's outputs (as one reader): an
    op reading it twice reads it once; a relabelled tensor's readers are its input's
    (`LoweringContext.get` reads through relabelling); a loop's or recompute's captured tensors
    are not its reads (its body reads them, in a context of its own)."""

    readers = [
        op.inputs[: len(op.inputs) - len(getattr(op, "captured", ()))]
        for op in ops
        if not getattr(op, "is_rename", False)
    ]
    reads: dict[Tensor, int] = {}
    for read in [*readers, outputs]:
        for t in {source(t) for t in read}:
            reads[t] = reads.get(t, 0) + 1
    return reads


def _memo_key(what: str, xs: list, args: tuple = ()) -> tuple:
    """A memo's key: what, the identities of the very slices (kept alive beside it), and args."""
    return (what, tuple(id(x) for x in xs), args)


class LoweringContext:
    def __init__(
        self,
        impl: MeshImpl,
        plan: dict[Tensor, TensorLayout],
        counters: Counters,
        rng_seed: list,
        reads: dict[Tensor, int] | None = None,
    ):
        self.impl = impl
        self.plan = plan
        self.counters = counters
        self.rng_seed = rng_seed  # slice list of a uint32 scalar: the per-run seed
        self.reads = reads or {}  # tensor -> how often the program reads it (`count_reads`)
        self.values: dict[Tensor, LaidOutTensor] = {}
        self.updates: dict[Operation, list] = {}  # variable op -> its new slices
        self._cache: dict[tuple, LaidOutTensor] = {}
        self._settled: dict[Tensor, LaidOutTensor] = {}  # a pending sum's first settled value
        self._memo: dict[tuple, tuple] = {}  # (what, id of the slices, args) -> (the slices, result)
        self.trips: dict[Operation, LoweringContext] = {}  # a loop of one trip -> the child that lowered it
        self.op: Operation | None = None  # the op being lowered
        self.blamed: Operation | None = None  # overrides `op` as the cause of collectives
        self.hoisted: dict[tuple, tuple] = {}  # a loop body's outside tensors moved before the loop
        self.taken: set[tuple] = set()  # the keys of `hoisted` this body took

    def adopt(self, other: LoweringContext) -> None:
        """Take `other`'s reshards, settled sums, memos and one-trip loops as this context's own:
        this one goes on from its values (a backward loop of one trip from its forward trip's,
        and so the backward loops of one trip inside it from theirs)."""
        self._cache.update(other._cache)
        self._settled.update(other._settled)
        self._memo.update(other._memo)
        self.trips.update(other.trips)

    @property
    def mesh_shape(self):
        return self.impl.shape

    # ---- values ---------------------------------------------------------------------------
    def layout(self, t: Tensor) -> TensorLayout:
        return self.plan[t]

    def get(self, t: Tensor, layout: TensorLayout | None = None, allow_partial: bool = False) -> LaidOutTensor:
        """t's value in `layout` (default: its planned layout); sums settled unless allow_partial
        (a linear reader) and t has no other reader: a partial sum read twice is settled once,
        where each reader carrying it on would settle its own result."""
        layout = layout or self.plan[t]
        if getattr(t.operation, "is_rename", False):
            # a relabelled tensor (same dims in the same order, other names) is its input: reshard
            # that, so that a tensor used under several names is gathered once, as XLA does
            return self.get(t.operation.inputs[0], layout, allow_partial)
        allow_partial = allow_partial and self.reads.get(t, 0) <= 1
        value = self.values[t]
        if not value.pending and value.layout == layout:  # (nothing to settle or move)
            return value
        key = (t, layout, allow_partial)
        fill = getattr(t.operation, "fill", None)
        if fill is not None and not value.pending:
            # a constant or a range: each device makes its slice in the layout asked for, as XLA
            # does; moving it would be a collective (counted) for values every device can make
            if key not in self._cache:
                self._cache[key] = LaidOutTensor(fill(self, layout), layout, frozenset())
            return self._cache[key]
        if not value.pending and (t, layout, False) in self.hoisted and key not in self._cache:
            self.taken.add((t, layout, False))  # (moved once before the loop: `loops._hoist`)
            self._cache[key] = self.hoisted[(t, layout, False)][0]
        remade = getattr(t.operation, "remade", None)
        if remade is not None and not value.pending and key not in self._cache:
            slices = remade(self, layout)
            if slices is not None:
                self._cache[key] = LaidOutTensor(slices, layout, frozenset())
        if key not in self._cache:
            from meshax.lower.reshard import reshard

            producer = t.operation  # the op whose sums are owed: seen through annotations
            while getattr(producer, "passes_sums", False) and producer.inputs:
                producer = producer.inputs[0].operation
            settling = bool(value.pending) and not allow_partial
            # a sum already settled (into another layout, for another reader) is moved, not summed
            # again; one that a reader that may carry sums settled in part (over the axes its layout
            # splits) is settled on from there
            start = self._settled.get(t, self._cache.get((t, layout, True), value)) if settling else value
            self._cache[key] = reshard(self, start, layout, t.shape, keep_partial=allow_partial, producer=producer)
            # (settled also where a reader that may carry the sums settled them all, as its layout
            # splits their axes: a second read that may not carry them moves this, not sums again)
            if value.pending and not self._cache[key].pending:
                self._settled.setdefault(t, self._cache[key])
        return self._cache[key]

    def set_output(self, t: Tensor, slices: list, layout: TensorLayout | None = None, pending=()) -> None:
        got = np.dtype(slices[0].dtype)
        if got != t.dtype:  # the dtype policy's promise: declared at build time == produced
            raise TypeError(
                f"internal error: {t.name} is declared {t.dtype} but {type(t.operation).__name__}'s "
                f"lowering produced {got}; please report it"
            )
        self.values[t] = LaidOutTensor(list(slices), layout or self.plan[t], frozenset(pending))

    def slicewise(self, fn: Callable, *args) -> list:
        """fn applied to each instance's slices; LaidOutTensor args become their slices."""
        return self.impl.slicewise(fn, *[a.slices if isinstance(a, LaidOutTensor) else a for a in args])

    def pcoord(self, axis: int) -> list:
        return self.impl.pcoord(axis)

    def slice_begins(self, shape, layout: TensorLayout) -> list[list | int]:
        """Per tensor dim, each instance's global index of its slice's first value (0 where not
        split); the values of a slice that are not padding are consecutive from there."""
        begins: list[list | int] = []
        for d, axes in zip(shape, layout.axes):
            begin: list | int = 0
            for m, block in zip(axes, block_sizes(d.size, axes, self.mesh_shape)[1:]):
                begin = self.slicewise(lambda b, c, s=block: b + c * s, begin, self.pcoord(m))
            begins.append(begin)
        return begins

    def valid_sizes(self, size: int, axes: tuple[int, ...]) -> list | int:
        """Each instance's count of values that are not padding in its slice of a dim of `size`
        split over `axes`, as traced scalars (`layout.rules.valid_size` computes it for given
        coordinates); `size` where the dim is not split. They are the first values of the slice."""
        valid: list | int = size
        for m, block in zip(axes, block_sizes(size, axes, self.mesh_shape)[1:]):
            valid = self.slicewise(lambda v, c, b=block: jnp.clip(v - c * b, 0, b), valid, self.pcoord(m))
        return valid

    def _once(self, what: str, xs: list, args: tuple, make: Callable[[], list]) -> list:
        """make(), computed once per (what, slices, args) in a program: a second op that needs
        the same masked slices or halo (a convolution's gradient, say) reuses the first's, so
        the counters record each collective once, as XLA runs it once."""
        key = _memo_key(what, xs, args)
        if key not in self._memo:
            self._memo[key] = (xs, make())  # (xs kept alive: their ids stay theirs)
        return self._memo[key][1]

    def remember(self, what: str, xs: list, value) -> None:
        """Keep `value` for a later op of this program given the very same slices `xs` (`recall`)."""
        self._memo[_memo_key(what, xs)] = (xs, value)

    def recall(self, what: str, xs: list):
        """What `remember` kept for these very slices, or None (other slices: resharded, recomputed)."""
        entry = self._memo.get(_memo_key(what, xs))
        return None if entry is None else entry[1]

    def masked(self, x: LaidOutTensor, shape, dims, fill) -> LaidOutTensor:
        """x with its padding along `dims` (names or Dimensions of `shape`) replaced by `fill`, as
        a sum, max, min or contraction over them needs (the identity). No-op where even."""
        names = {getattr(n, "name", n) for n in dims}
        padded = tuple(
            i
            for i, (d, axes) in enumerate(zip(shape, x.layout.axes))
            if d.name in names and is_padded(d.size, axes, self.mesh_shape)
        )
        if not padded:
            return x

        def mask() -> list:
            slices = x.slices
            for i in padded:

                def keep(a, v, i=i):
                    inside = jax.lax.broadcasted_iota(jnp.int32, a.shape, i) < v
                    return jnp.where(inside, a, jnp.asarray(fill, a.dtype))

                slices = self.slicewise(keep, slices, self.valid_sizes(shape[i].size, x.layout.axes[i]))
            return slices

        return dataclasses.replace(x, slices=self._once("mask", x.slices, (padded, fill), mask))

    def layouts(self, op: Operation) -> Run:
        """How `op` runs (`sharding_rule.choose`): the layouts to fetch its operands in and its
        results come out in, and what the results owe, all read from its sharding rule."""
        return choose(op, [self.plan[t] for t in op.inputs], [self.plan[t] for t in op.outputs], self.mesh_shape)

    def local_size(self, t: Tensor, layout: TensorLayout | None = None) -> int:
        """Elements of t's slice on one device, in `layout` (default: its planned layout)."""
        return int(np.prod(slice_shape(t.shape, layout or self.plan[t], self.mesh_shape), dtype=np.int64))

    def add_flops(self, n: int) -> None:
        if self.op is not None:
            self.counters.add_flops(self.op.name, n, type(self.op).__name__)

    # ---- collectives: recorded here, run by the backend ---------------------------------------
    @contextlib.contextmanager
    def blame(self, op: Operation):
        """Attribute the collectives emitted inside to `op` (e.g. the einsum whose sum they settle)."""
        saved, self.blamed = self.blamed, op
        try:
            yield
        finally:
            self.blamed = saved

    def _record(self, kind: str, axes: Sequence[int], values: int, dtype) -> None:
        op = self.blamed or self.op
        self.counters.add(
            Site(
                kind=kind,
                mesh_axes=tuple(self.mesh_shape[m].name for m in axes),
                values=int(values),
                bytes=int(values) * np.dtype(dtype).itemsize,
                op_name=op.name if op else "<input>",
                op_type=type(op).__name__ if op else "",
                source=op.source if op else "",
                grad_of=op.grad_of.name if op is not None and op.grad_of is not None else "",
            )
        )

    def _live(self, axes: Sequence[int]) -> list[int]:
        """Mesh axes of size > 1: a collective over a size-1 axis moves nothing and is not run."""
        return [m for m in axes if self.mesh_shape[m].size > 1]

    def _run(self, kind: str, xs: list, axes: Sequence[int], run: Callable[[], list]) -> list:
        """Record one collective over `axes` (what each device puts in: its slice), then run it.
        One of no values is not recorded: XLA drops it from the program."""
        x = xs[0]
        values = int(np.prod(x.shape, dtype=np.int64))
        if values:
            self._record(kind, axes, values, x.dtype)
        return run()

    def allreduce(self, xs: list, axes: Sequence[int], op: str = "sum") -> list:
        axes = sorted(self._live(axes))
        if not axes:
            return xs
        return self._run("allreduce", xs, axes, lambda: self.impl.allreduce(xs, axes, op))

    def allgather(self, xs: list, axis: int, dim: int, keep: int | None = None) -> list:
        """The slices along mesh `axis` concatenated along `dim`; the first `keep` values of it
        kept (the coarser block, where the split padded the dim). Once per program for the very
        same slices, as XLA merges two such gathers (two reshards of one tensor to different
        layouts may start alike). Slices of no values along `dim` are the gathered (empty) dim
        itself: nothing to move (and XLA's verifier refuses an all-gather of them)."""
        if not self._live([axis]) or xs[0].shape[dim] == 0:
            return xs
        out = self._once(
            "allgather",
            xs,
            (axis, dim),
            lambda: self._run("allgather", xs, [axis], lambda: self.impl.allgather(xs, axis, dim)),
        )
        return _trim(self, out, dim, keep)

    def alltoall(self, xs: list, axis: int, split_dim: int, concat_dim: int, keep: int | None = None) -> list:
        """`split_dim` split along mesh `axis` (padded to a multiple of its size first), the
        parts exchanged and concatenated along `concat_dim`, of which `keep` values are kept.
        Once per program for the very same slices, as for `allgather`."""
        if not self._live([axis]):
            return xs

        def exchange() -> list:
            parts = _pad_to_parts(self, xs, split_dim, self.mesh_shape[axis].size)
            if parts is not xs:  # (XLA CPU's verifier refuses some all-to-alls of a padded array: `_held`)
                parts = self.slicewise(_held, parts)
            return self._run("alltoall", parts, [axis], lambda: self.impl.alltoall(parts, axis, split_dim, concat_dim))

        out = self._once("alltoall", xs, (axis, split_dim, concat_dim), exchange)
        return _trim(self, out, concat_dim, keep)

    def reduce_scatter(self, xs: list, axis: int, dim: int) -> list:
        if not self._live([axis]):
            return xs
        if self.impl.reduce_scatter_as == "allreduce":  # the sum whole, then this device's part
            return self.allsplit(self.allreduce(xs, [axis]), axis, dim)
        xs = _pad_to_parts(self, xs, dim, self.mesh_shape[axis].size)
        return self._run("reduce_scatter", xs, [axis], lambda: self.impl.reduce_scatter(xs, axis, dim))

    def shift(self, xs: list, axis: int, offset: int, wrap: bool) -> list:
        """Receive the slice of the instance `offset` places back along `axis` (a permute; none
        where no instance is that far back and the axis does not wrap: zeros)."""
        if not wrap and abs(offset) >= self.mesh_shape[axis].size:
            return self.slicewise(jnp.zeros_like, xs)
        if not self._live([axis]):
            return xs if wrap or offset == 0 else self.slicewise(jnp.zeros_like, xs)
        return self._run("permute", xs, [axis], lambda: self.impl.shift(xs, axis, offset, wrap))

    def halo(self, xs: list, axis: int, dim: int, left: int, right: int, wrap: bool = False) -> list:
        """Slices extended by `left` and `right` neighbour values along `dim` (`lower.halo`)."""
        return self._once(
            "halo", xs, (axis, dim, left, right, wrap), lambda: halo.halo(self, xs, axis, dim, left, right, wrap)
        )

    def halo_transpose(self, ext: list, axis: int, dim: int, left: int, right: int, wrap: bool = False) -> list:
        """`halo`'s adjoint: halo parts of a gradient added back onto their owners' slices."""
        return halo.halo_transpose(self, ext, axis, dim, left, right, wrap)

    def allsplit(self, xs: list, axis: int, dim: int) -> list:
        """Keep this instance's stripe of `dim` along mesh `axis`: no communication."""
        parts = self.mesh_shape[axis].size
        if parts == 1:
            return xs
        xs = _pad_to_parts(self, xs, dim, parts)

        def take(x, c):
            piece = x.shape[dim] // parts
            start = [0] * x.ndim
            start[dim] = c * piece
            sizes = list(x.shape)
            sizes[dim] = piece
            return jax.lax.dynamic_slice(x, [jnp.asarray(s, jnp.int32) for s in start], sizes)

        return self.slicewise(take, xs, self.pcoord(axis))


def _pad_to_parts(ctx: LoweringContext, xs: list, dim: int, parts: int) -> list:
    """Slices padded at the end of `dim` to a multiple of `parts` (a local copy; none if even)."""
    extra = -xs[0].shape[dim] % parts
    if not extra:
        return xs
    return ctx.slicewise(lambda x: jnp.pad(x, [(0, extra if i == dim else 0) for i in range(x.ndim)]), xs)


def _held(x):
    """x through an optimization barrier. XLA for the CPU splits an all-to-all of one array
    into an all-to-all of its parts, and simplifies a part that is all padding into a broadcast
    of the pad value, whose layout may differ from the other parts' (a transpose's): its verifier
    then refuses the program ("HLO all-to-all has operands with different shapes: f32[1,2,8] ...
    f32[1,2,8]", jax 0.10.2; plain `shard_map` does the same). Behind the barrier the parts are
    slices of one array."""
    return jax.lax.optimization_barrier(x)


def _trim(ctx: LoweringContext, xs: list, dim: int, keep: int | None) -> list:
    """The first `keep` values of `dim` (all when keep is None or no smaller); once per program
    for the very same slices, so that a gather of them that XLA merges is counted once too."""
    if keep is None or keep >= xs[0].shape[dim]:
        return xs

    def cut() -> list:
        return ctx.slicewise(lambda x: jax.lax.slice_in_dim(x, 0, keep, axis=dim), xs)

    return ctx._once("trim", xs, (dim, keep), cut)
