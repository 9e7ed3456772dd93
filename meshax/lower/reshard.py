"""Resharding: move a laid-out tensor from one layout to another by the cheapest route.

Per tensor dim, a layout is a tuple of mesh axes, major to minor. Going from `cur` to
`target`:
  1. settle owed sums: a pending axis that the target adds as the next (minor) split of some
     dim becomes a reduce-scatter; the rest are one allreduce (a linear reader may carry them
     on, but not through a gather: settled on the slices, before it);
  2. axes to drop from a dim leave it minor-first: an axis that another dim is ready to take
     next moves there with one alltoall, otherwise it is allgathered;
  3. axes to add to a dim are taken with allsplit, which is free.
"""

from __future__ import annotations

from meshax.layout import TensorLayout
from meshax.layout.rules import block_sizes
from meshax.lower.laid_out import LaidOutTensor


def _next_axis(cur: tuple, target: tuple):
    """The axis `target` adds next to `cur`, if cur is a prefix of target; else None."""
    if len(cur) < len(target) and target[: len(cur)] == cur:
        return target[len(cur)]
    return None


def reshard(
    ctx, x: LaidOutTensor, target: TensorLayout, shape, keep_partial: bool = False, producer=None
) -> LaidOutTensor:
    """x in layout `target`. Sums owed are blamed on `producer` (the op that summed); moves on
    the op being lowered, or on the producer when the program's outputs are being gathered."""
    with ctx.blame(producer):
        x = _settle(ctx, x, target, keep_partial)
    with ctx.blame(producer if ctx.op is None else ctx.op):
        return _move(ctx, x, target, [d.size for d in shape])


def _settle(ctx, x: LaidOutTensor, target: TensorLayout, keep_partial: bool) -> LaidOutTensor:
    cur = list(x.layout.axes)
    want = list(target.axes)
    slices = x.slices
    pending = set(x.pending)
    # 1. Owed sums. Partial sums may travel through splits and moves (they are linear), but a
    # pending axis cannot also split a dim, so settle those; settle all unless keep_partial.
    must_settle = pending if not keep_partial else pending & target.mesh_axes_used
    if x.layout.mesh_axes_used - target.mesh_axes_used:
        # the move gathers: a sum carried through it would be settled on the gathered tensor (a
        # gradient's sum over the batch allreduced after its vocab's allgather, 4 times the values)
        must_settle = pending
    for m in sorted(must_settle):
        for i in range(len(cur)):
            if _next_axis(tuple(cur[i]), want[i]) == m:
                slices = ctx.reduce_scatter(slices, m, i)
                cur[i] = (*tuple(cur[i]), m)
                pending.discard(m)
                break
    rest = sorted(pending & must_settle)
    if rest:
        slices = ctx.allreduce(slices, rest, "sum")
        pending -= set(rest)
    return LaidOutTensor(slices, TensorLayout(cur), frozenset(pending))


def _move(ctx, x: LaidOutTensor, target: TensorLayout, sizes: list[int]) -> LaidOutTensor:
    cur = list(x.layout.axes)
    want = list(target.axes)
    slices = x.slices

    # 2. Drop axes, minor first; prefer moving an axis straight to the dim that wants it next.
    def removable():
        return [i for i in range(len(cur)) if tuple(cur[i]) != want[i][: len(cur[i])]]

    while todo := removable():
        choice = None
        for i in todo:
            m = cur[i][-1]
            for j in range(len(cur)):
                if j != i and _next_axis(tuple(cur[j]), want[j]) == m:
                    choice = (i, m, j)
                    break
            if choice:
                break
        i = choice[0] if choice else todo[0]
        m = cur[i][-1]
        keep = block_sizes(sizes[i], tuple(cur[i])[:-1], ctx.mesh_shape)[-1]  # (less, where the split padded)
        if choice:
            j = choice[2]
            slices = ctx.alltoall(slices, m, split_dim=j, concat_dim=i, keep=keep)
            cur[j] = (*tuple(cur[j]), m)
        else:
            slices = ctx.allgather(slices, m, i, keep=keep)
        cur[i] = tuple(cur[i])[:-1]

    # 3. Add axes: each instance keeps its own stripe.
    for i in range(len(cur)):
        for m in want[i][len(cur[i]) :]:
            slices = ctx.allsplit(slices, m, i)
        cur[i] = want[i]

    return LaidOutTensor(slices, target, x.pending)
