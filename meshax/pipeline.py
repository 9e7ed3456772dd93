"""Pipeline parallelism as the sharding of a stage dim (GSPMD section 3.3).

Every per-stage tensor, weights included, has a leading stage dim, and the stages compute in
parallel on it: layer code written for one stage runs unchanged, since named-dim ops carry the
extra dim through. A shifting buffer `state [stage, ...]` moves each stage's result to the next
stage once per iteration (`shift` along the stage dim); the batch is cut into microbatches that
enter stage 0 one per iteration. Split the stage dim over a mesh dim and the shift becomes a
collective permute; split other dims over other mesh dims for data and model parallelism inside
the stages. The loop is one `scan`, so the program does not grow with the microbatches.

Schedules: GPipe runs M microbatches through S stages in M + S - 1 iterations; circular with R
repeats gives stage s the layers s, s + S, s + 2S, ... and sends each microbatch round the
stages R times, in R*M + S - 1 iterations, which shrinks the bubble from (S-1)/(M+S-1) to
(S-1)/(R*M+S-1). Idle stages compute on zeros that never reach an output.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from meshax.core.errors import GraphError
from meshax.core.graph import Tensor, is_floating
from meshax.core.shape import Dimension, Shape
from meshax.ops.einsum import einsum
from meshax.ops.elementwise import cast
from meshax.ops.inputs import import_tensor, zeros
from meshax.ops.loops import scan
from meshax.ops.reduce import reduce_sum
from meshax.ops.shape_ops import rename_dimension, reshape, transpose
from meshax.ops.slicing import pad, shift
from meshax.ops.slicing import slice as mslice
from meshax.ops.variables import stacked_variables

SCHEDULES = ("gpipe", "circular")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Which work item each stage runs at each iteration. Item k = r*M + m is microbatch m's
    pass r through the stages; stage s runs item t - s at iteration t, when that is one."""

    stages: int
    microbatches: int
    repeats: int = 1

    @property
    def iterations(self) -> int:
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def items(self) -> np.ndarray:
        """[iterations, stages]: the work item each stage runs, -1 where it is idle (a bubble)."""
        k = np.arange(self.iterations)[:, None] - np.arange(self.stages)[None, :]
        return np.where((k >= 0) & (k < self.repeats * self.microbatches), k, -1)

    @property
    def bubble_fraction(self) -> float:
        """The share of stage-iterations spent idle, counted from the schedule itself."""
        return float((self.items < 0).mean())

    def one_hot(self, what: str) -> np.ndarray:
        """The per-iteration tables the loop reads (float32 one-hots):
        "micro" [iterations, stages, microbatches]: the microbatch each stage holds;
        "repeat" [iterations, stages, repeats]: the pass each stage is on (its weights);
        "read" / "write" [iterations, microbatches]: the microbatch stage 0 takes in / the last
        stage puts out."""
        items, m, r = self.items, self.microbatches, self.repeats
        if what in ("micro", "repeat"):
            index, size = (items % m, m) if what == "micro" else (items // m, r)
            return ((index[..., None] == np.arange(size)) & (items[..., None] >= 0)).astype(np.float32)
        column = items[:, 0 if what == "read" else -1]
        return ((column[:, None] % m == np.arange(m)) & (column[:, None] >= 0)).astype(np.float32)


def _split_batch(t: Tensor, batch: str, micro: Dimension) -> Tensor:
    """t with dim `batch` (size B) cut into [batch (B/M), microbatch (M)]: row b is row b // M
    of microbatch b % M, so a split batch needs no communication."""
    i = t.shape.index(batch)
    rows = Dimension(batch, t.shape[i].size // micro.size)
    return reshape(t, Shape([*t.shape.dims[:i], rows, micro, *t.shape.dims[i + 1 :]]))


def _pick(side: Tensor, where: Tensor, shape: list[Dimension]) -> Tensor:
    """Each stage's microbatch of a side input (`where`: the float32 one-hot [stage, microbatch]),
    in the side input's own dtype: an integer one stays integer, exactly (selected by a float32
    table it reached the stages as float32, ids past 2**24 rounded), and a bool one bool."""
    if is_floating(side.dtype):
        return einsum(side, cast(where, side.dtype), output_shape=shape)
    whole = side.dtype if side.dtype != np.bool_ else np.dtype(np.int32)  # (an einsum takes no bools)
    picked = einsum(cast(side, whole), cast(where, whole), output_shape=shape)
    return picked if picked.dtype == side.dtype else cast(picked, side.dtype)


def pipeline(
    stage_fn: Callable[..., Tensor],
    inputs: Tensor | Sequence[Tensor],
    stage_dim: Dimension,
    num_microbatches: int,
    schedule: str = "gpipe",
    repeats: int = 1,
    batch_dim: str | None = None,
    name: str = "pipeline",
) -> Tensor:
    """Run `stage_fn` as a pipeline of `stage_dim.size` stages over `num_microbatches`.

    `inputs`: the activation (a float tensor; its batch dim, `batch_dim` or its first, is cut
    into microbatches), then any side inputs with the same batch dim (an encoder's output, say):
    `stage_fn(x, *sides)` gets each with a leading stage dim, every stage its own microbatch,
    and returns the next x (same shape and dtype). Variables that `stage_fn` makes get the stage
    dim in front (and `repeats` before it, for the circular schedule): one set of weights per
    stage and pass. Returns stage_fn applied S*R times, in order, to the activation."""
    xs = [inputs] if isinstance(inputs, Tensor) else list(inputs)
    if not xs or not all(isinstance(t, Tensor) for t in xs):
        raise GraphError(
            f"pipeline: inputs must be the activation x (a Tensor), then any side inputs (Tensors), got {inputs!r:.80}"
        )
    if not isinstance(stage_dim, Dimension):
        raise GraphError(
            f"pipeline: stage_dim must be a Dimension (its name and the number of stages, e.g. "
            f"mx.Dimension('stage', 4)), got {type(stage_dim).__name__} {stage_dim!r}"
        )
    if stage_dim.size < 1:  # (was a pad's error: "pad amounts must be >= 0, got [0, -1]")
        raise GraphError(f"pipeline: the stage dim {stage_dim} has no stages; give it a size of at least 1")
    x, sides = xs[0], xs[1:]
    if not is_floating(x.dtype):
        raise GraphError(
            f"pipeline: the activation {x.name} is {x.dtype}, but the stages carry a float tensor; "
            "cast it to a float dtype (integer data can come in as a side input)"
        )
    for what, n in (("num_microbatches", num_microbatches), ("repeats", repeats)):
        if isinstance(n, bool) or int(n) != n:  # (True was taken for 1)
            raise GraphError(f"pipeline: {what}={n!r} is not a whole number; give an int")
    S, M, R = stage_dim.size, int(num_microbatches), int(repeats)
    if not batch_dim and not x.shape.dims:  # (x.shape[0] was an IndexError)
        raise GraphError(f"pipeline: the activation {x.name} is a scalar; it needs a batch dim to cut in microbatches")
    batch = batch_dim or x.shape[0].name
    if schedule not in SCHEDULES:
        raise GraphError(f"pipeline schedule {schedule!r}: choose one of {SCHEDULES}")
    if schedule == "gpipe" and R != 1:
        raise GraphError(f"pipeline: repeats={R} needs schedule='circular' (GPipe passes through the stages once)")
    if R < 1 or M < 1:
        raise GraphError(f"pipeline: num_microbatches ({M}) and repeats ({R}) must be at least 1")
    if R > 1 and M < S:
        raise GraphError(
            f"pipeline: the circular schedule needs at least as many microbatches as stages ({M} < {S}): "
            "a microbatch re-enters stage 0 only after leaving the last stage"
        )
    own = ["microbatch", f"{name}_iteration", *(["repeat"] if R > 1 else [])]  # the dims the pipeline adds
    if stage_dim.name in own:
        raise GraphError(
            f"pipeline: the stage dim {stage_dim} has a name the pipeline gives its own dims {own}; rename it"
        )
    for t in xs:
        for taken in own[:2]:
            if taken in t.shape:
                raise GraphError(
                    f"pipeline: input {t.name} {t.shape} has a dim {taken!r}, a name the pipeline gives its own "
                    "dim; rename that dim (mx.rename_dimension)"
                )
        if batch not in t.shape:
            raise GraphError(f"pipeline: input {t.name} {t.shape} has no batch dim {batch!r} (pass batch_dim=)")
        if stage_dim.name in t.shape:
            raise GraphError(f"pipeline: input {t.name} {t.shape} already has the stage dim {stage_dim.name!r}")
        if t.shape.get_dim_by_name(batch).size != x.shape.get_dim_by_name(batch).size:
            raise GraphError(
                f"pipeline: side input {t.name}'s batch dim {t.shape.get_dim_by_name(batch)} differs from "
                f"{x.name}'s {x.shape.get_dim_by_name(batch)}: each row of a side input goes with that row of x"
            )
        if t.shape.get_dim_by_name(batch).size % M:
            raise GraphError(
                f"pipeline: {M} microbatches do not divide {t.name}'s batch dim "
                f"{t.shape.get_dim_by_name(batch)}; choose a divisor of its size"
            )
    mesh, plan = x.mesh, Schedule(S, M, R)
    micro = Dimension("microbatch", M)
    steps = Dimension(f"{name}_iteration", plan.iterations)
    repeat = Dimension("repeat", R)

    def table(what: str, dims: list[Dimension]) -> Tensor:
        return import_tensor(mesh, plan.one_hot(what), [steps, *dims], name=f"{name}_{what}")

    def like(one_hot: Tensor, dtype) -> Tensor:
        """A float32 one-hot table in a float `dtype` (exactly), so that what it selects from or
        multiplies keeps its dtype: a bfloat16 state stays bfloat16."""
        return cast(one_hot, dtype) if is_floating(dtype) else one_hot

    def ends(index: int) -> Tensor:
        at = import_tensor(mesh, (np.arange(S) == index).astype(np.float32), [stage_dim], name=f"{name}_stage{index}")
        return like(at, x.dtype)

    xm = _split_batch(x, batch, micro)
    side_m = [_split_batch(t, batch, micro) for t in sides]
    one = Shape([d for d in xm.shape if d != micro])
    state0 = zeros(mesh, Shape([stage_dim, *one]), x.dtype)
    first, last = ends(0), ends(S - 1)
    per_step = [table("micro", [stage_dim, micro])] if sides else []
    if R > 1:
        per_step += [table("read", [micro]), table("write", [micro]), table("repeat", [stage_dim, repeat])]
        carry = [state0, xm]  # the queue: microbatches waiting for their next pass, then the outputs
    else:
        first_in = rename_dimension(pad(xm, [0, S - 1], micro.name), micro.name, steps.name)
        per_step = [first_in, *per_step]
        carry = [state0]

    def body(c: list[Tensor], t: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        state, queue = c[0], (c[1] if R > 1 else None)
        t = list(t)
        entering = t.pop(0) if R == 1 else None
        where = t.pop(0) if sides else None
        if R > 1:
            read, write, which = t
            entering = einsum(queue, like(read, x.dtype), output_shape=one)
        state = shift(state, 1, stage_dim, wrap=False) + first * entering
        side_now = []
        if where is not None:  # (the microbatches' table, where there are side inputs)
            kept = [[d for d in s.shape if d != micro] for s in side_m]
            side_now = [_pick(s, where, [stage_dim, *k]) for s, k in zip(side_m, kept)]
        if R > 1:
            lead, select = [repeat, stage_dim], lambda v: einsum(v, which, output_shape=[stage_dim, *v.shape[2:]])
        else:
            lead, select = [stage_dim], lambda v: v
        with stacked_variables(lead, select):
            out = stage_fn(state, *side_now)
        if not isinstance(out, Tensor) or (out.shape, out.dtype) != (state.shape, state.dtype):
            got = f"{out.shape} {out.dtype}" if isinstance(out, Tensor) else type(out).__name__
            raise GraphError(
                f"pipeline: stage_fn must return a tensor of its input's shape and dtype {state.shape} "
                f"{state.dtype}, got {got}"
            )
        if R == 1:
            return [out], [out * last]
        done = einsum(out, last, output_shape=one)
        return [out, queue + like(write, x.dtype) * (done - queue)], []

    finals, ys = scan(body, carry, per_step, dim=steps, name=name)
    finals[0].operation.info = {"pipeline": name, "schedule": plan}
    if R > 1:
        result = finals[1]
    else:
        outs = reduce_sum(mslice(ys[0], S - 1, M, steps.name), reduced_dim=stage_dim)
        result = transpose(rename_dimension(outs, steps.name, micro.name), xm.shape)
    return reshape(result, x.shape)
