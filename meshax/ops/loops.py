"""Loops in the IR: `scan` over a dim, lowered to one `lax.scan` inside the SPMD program.

A loop's body is a sub-graph: the ops `fn` builds while `scan` records, marked `in_loop`, so the
program's own lowering skips them and the `ScanOperation` lowers them once per iteration (once
in all, for the SIMD backend: `lax.scan` traces its body once, so the program's size and compile
time do not grow with the number of iterations). The body reads its carries and per-iteration
slices through `LoopVariableOperation`s bound at each step, and any tensor built outside it
(weights, say) directly. Collectives in the body are recorded once and counted `length` times;
an outside tensor the body reads in another layout than its own (a weight split FSDP-style,
gathered) is moved once, before the loop, and counted once, as XLA hoists such a move.

The gradient is another scan, run backwards: each iteration recomputes its forward body from
the carry it started with (kept by the forward loop, one per iteration) and then runs the
body's own gradient ops, so activation memory is one iteration's, not the whole loop's
(Mesh-TensorFlow's `recompute_grad` on every iteration). Gradients of the tensors the body reads
from outside are summed in the backward loop's carry. A loop of one trip runs its body once,
without `lax.scan`, and its backward loop goes on from that trip's values rather than recompute
them: XLA inlines such loops and merges the recomputation with the forward trip anyway.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import jax.numpy as jnp
import numpy as np

from meshax.core.errors import GraphError, as_flag
from meshax.core.graph import Graph, Mesh, Operation, Tensor, is_floating
from meshax.core.shape import Dimension, Shape
from meshax.layout.rules import TensorLayout, slice_shape


class LoopVariableOperation(Operation):
    """A loop body's input (a carry, or one iteration's slice of a scanned tensor): bound by the
    loop at every iteration; it has no value outside the loop."""

    in_loop = True

    def __init__(self, mesh: Mesh, shape: Shape, dtype, name: str):
        super().__init__([], mesh=mesh, name=name)
        self._add_output(shape, dtype)

    def lower(self, ctx):
        raise GraphError(f"{self.name} is a loop variable: it has a value only inside its loop's body")

    def gradient(self, grad_outputs):
        return []


@contextlib.contextmanager
def _recording(graph: Graph) -> Iterator[list[Operation]]:
    """Collects the ops built inside (variables, constants and placeholders aside: they stay the
    program's inputs) and marks them `in_loop`. Memoized computations built inside are forgotten
    after, so that no op outside the loop reuses a tensor of its body."""
    first, memo = len(graph.operations), dict(graph.memo)
    ops: list[Operation] = []
    try:
        yield ops
    finally:
        graph.memo = memo
        for op in graph.operations[first:]:
            if not (getattr(op, "is_variable", False) or getattr(op, "is_input", False)) and not isinstance(
                op, LoopVariableOperation
            ):
                op.in_loop = True
                ops.append(op)


def _needed(body: list[Operation], results: list[Tensor]) -> list[Operation]:
    """The ops of `body` that the results depend on, in order: a backward loop recomputes only
    the part of its forward body that its gradients read."""
    ops, need = set(body), {t.operation for t in results}
    for op in reversed(body):
        if op in need:
            need.update(t.operation for t in op.inputs if t.operation in ops)
    return [op for op in body if op in need]


def _captured(body: list[Operation], inside: set, results: list[Tensor]) -> list[Tensor]:
    """The tensors a body reads from outside it, in order of first use."""
    captured: dict[Tensor, None] = {}
    for op in body:
        captured.update((t, None) for t in op.inputs if t not in inside)
    captured.update((t, None) for t in results if t not in inside)
    return list(captured)


def _hoist(ctx, body: list[Operation]) -> dict:
    """The outside tensors the body's ops read in a layout other than their own (a weight an
    FSDP-split loop gathers), moved once before the loop: {(tensor, layout, False): (its value
    there, the collectives that moved it)}. XLA hoists such loop-invariant collectives out of
    the loop itself; moved inside, they were counted once per iteration. The body takes them
    from here (`LoweringContext.hoisted`); those it does not take are dropped, as XLA drops them."""
    from meshax.lower.context import source
    from meshax.lower.counters import Counters

    inside = {t for op in body for t in op.outputs}
    hoisted: dict = {}
    for op in body:
        if getattr(op, "captured", None) is not None or getattr(op, "is_rename", False):
            continue  # (a loop or branch in the body reads what it captures in a body of its own)
        for t, layout in zip(op.inputs, ctx.layouts(op).operands):
            t = source(t)
            v = ctx.values.get(t)
            key = (t, layout, False)
            if t in inside or v is None or v.pending or v.layout == layout or key in hoisted:
                continue
            if key in ctx._cache:  # (moved already, before the loop: the body takes that)
                hoisted[key] = (ctx._cache[key], None)
                continue
            recorded, saved = Counters(), (ctx.counters, ctx.op)
            ctx.counters, ctx.op = recorded, op  # (the moves are blamed on the op that reads)
            try:
                hoisted[key] = (ctx.get(t, layout), recorded)
            finally:
                ctx.counters, ctx.op = saved
    return hoisted


def _settle_hoisted(ctx, hoisted: dict, taken: set) -> None:
    """Count the hoisted moves the body took, once; forget the others (XLA drops them)."""
    for key, (_, recorded) in hoisted.items():
        if recorded is None:
            continue
        if key in taken:
            _add_counters(ctx, recorded)
        else:
            ctx._cache.pop(key, None)


def _run_body(
    ctx,
    counters,
    seed,
    bound: dict,
    ops: list[Operation],
    results: list[Tensor],
    moved=None,
    owner=None,
    values=None,
    hoisted=None,
):
    """A child of `ctx` with `bound` (loop variable -> slices) set and `ops` lowered in it: one
    iteration's values (`results` are read from it), its collectives recorded in `counters`.
    `moved` (variable -> outside tensor) binds variables to outside tensors moved to the
    variables' layouts in the child, so inside the body; `owner` (the op that binds them) is
    blamed for the moves. `values`: the outside values the body sees (default: ctx's).
    `hoisted`: outside tensors moved before the loop (`_hoist`), for the body to take."""
    from meshax.lower.context import LoweringContext, count_reads

    child = LoweringContext(ctx.impl, ctx.plan, counters, seed, count_reads(ops, results))
    child.values = dict(ctx.values if values is None else values)
    if hoisted is not None:
        child.hoisted = hoisted
    for v, slices in bound.items():
        child.set_output(v, slices, ctx.plan[v])
    child.op = owner
    for v, t in (moved or {}).items():
        child.set_output(v, child.get(t, ctx.plan[v]).slices, ctx.plan[v])
    for op in ops:
        child.op = op
        op.lower(child)
    child.op = None
    return child


def _go_on(ctx, trip, counters, seed, bound: dict, ops: list[Operation], results: list[Tensor]):
    """A child of `ctx` that goes on from `trip` (the child that lowered a forward loop's one
    trip): its values, its reshards and settled sums are this one's, `bound` is set where the
    trip had not set it, and `ops` (the backward body's own ops) are lowered in it."""
    from meshax.lower.context import LoweringContext, count_reads

    child = LoweringContext(ctx.impl, ctx.plan, counters, seed, count_reads(ops, results))
    child.values = {**ctx.values, **trip.values}
    child.adopt(trip)
    for v, slices in bound.items():
        if v not in trip.values:
            child.set_output(v, slices, ctx.plan[v])
    for op in ops:
        child.op = op
        op.lower(child)
    child.op = None
    return child


def _add_counters(ctx, recorded, times: int = 1) -> None:
    """A body's recorded collectives and FLOPs into ctx's counters, `times` times (its iterations)."""
    for site in recorded.sites():
        for _ in range(times):
            ctx.counters.add(site)
    for op_name, flops in recorded.flops.items():
        ctx.counters.add_flops(op_name, flops * times, recorded.op_types[op_name])


def _as_list(xs, what: str, loop: str = "scan") -> list[Tensor]:
    if isinstance(xs, Tensor) or not isinstance(xs, Iterable | None):  # (a number is named below, not iterated)
        xs = [xs]
    items = [] if xs is None else list(xs)
    for t in items:
        if not isinstance(t, Tensor):
            raise GraphError(f"{loop}: {what} must be meshax Tensors, got {t!r}")
    return items


def _check_carries(loop: str, new: list[Tensor], carry_vars: list[Tensor], what: str) -> None:
    """A loop's new carries must match its carries one for one, in shape and dtype."""
    if len(new) != len(carry_vars):
        raise GraphError(f"{loop}: {what} {len(new)} values for {len(carry_vars)} carries")
    for t, v in zip(new, carry_vars):
        if t.shape != v.shape or t.dtype != v.dtype:
            raise GraphError(
                f"{loop}: a carry must keep its shape and dtype; {v.shape} {v.dtype} came back as {t.shape} {t.dtype}"
            )


class ScanOperation(Operation):
    """`length` iterations of a recorded body. Inputs: the carries' initial values, the scanned
    tensors, then the outside tensors the body reads. Outputs: the final carries, the per-iteration
    results stacked on a leading `dim`, and each carry's value at the start of every iteration
    (`dim` first; what the gradient recomputes from)."""

    def __init__(
        self,
        dim: Dimension,
        init: list[Tensor],
        xs: list[Tensor],
        carry_vars: list[Tensor],
        x_vars: list[Tensor],
        carry_results: list[Tensor],
        y_results: list[Tensor],
        body: list[Operation],
        reverse: bool = False,
        rng_key: int | None = None,
        name: str | None = None,
        forward: ScanOperation | None = None,
    ):
        body = _needed(body, [*carry_results, *y_results])
        inside = {t for op in body for t in op.outputs} | set(carry_vars) | set(x_vars)
        captured = _captured(body, inside, [*carry_results, *y_results])
        mesh = carry_vars[0].mesh if carry_vars else x_vars[0].mesh
        super().__init__([*init, *xs, *captured], mesh=mesh, name=name or "scan")
        self.dim, self.reverse = dim, reverse
        self.forward = forward  # for a backward loop: the loop it differentiates (its body recomputes it)
        self.init, self.xs, self.captured = init, xs, captured
        self.carry_vars, self.x_vars = carry_vars, x_vars
        self.carry_results, self.y_results = carry_results, y_results
        self.body = body
        self.rng_key = len(self.graph.operations) if rng_key is None else rng_key
        self.whole_dims = (dim.name,)  # (the scanned dim is never split: see rule_of)
        out = self._add_output
        self.final = [out(v.shape, v.dtype, f"{self.name}/final_{i}") for i, v in enumerate(carry_vars)]
        self.ys = [out(Shape([dim, *y.shape]), y.dtype, f"{self.name}/y_{i}") for i, y in enumerate(y_results)]
        self.history = [out(Shape([dim, *v.shape]), v.dtype, f"{self.name}/hist_{i}") for i, v in enumerate(carry_vars)]

    def propagation_links(self) -> list[tuple[Tensor, Tensor, str]]:
        """(outside, inside, the loop's dim) tensor pairs that stand for one value across the
        loop's boundary, for sharding propagation: a carry's initial value, its variable, its
        new value and its final value; a scanned tensor and its slice; a result and its stack."""
        d = self.dim.name
        links = []
        for t, v, r, f in zip(self.init, self.carry_vars, self.carry_results, self.final):
            links += [(t, v, d), (v, r, d), (r, f, d)]
        links += [(t, v, d) for t, v in zip(self.xs, self.x_vars)]
        links += [(y, s, d) for y, s in zip(self.y_results, self.ys)]
        return links

    def lower(self, ctx):
        from meshax.lower.counters import Counters

        n, plan = self.dim.size, ctx.plan
        carry0 = [ctx.get(t, plan[v]).slices for t, v in zip(self.init, self.carry_vars)]
        # the scanned results something reads, and the body they and the carries need: XLA drops
        # the rest, so it is neither lowered nor counted
        read = [(r, t) for r, t in zip(self.y_results, self.ys) if ctx.reads.get(t, 0)]
        y_results = [r for r, _ in read]
        body = self.body if len(read) == len(self.ys) else _needed(self.body, [*self.carry_results, *y_results])
        # likewise the scanned tensors that body reads: one it does not read is not moved to the
        # loop's layout (a backward loop scans every history and forward input, read or not)
        used = {t for op in body for t in op.inputs} | {*self.carry_results, *y_results}
        x_vars = [v for v in self.x_vars if v in used]
        xs = []
        for t, v in zip(self.xs, self.x_vars):
            if v not in used:
                continue
            at = t.shape.index(self.dim)
            layout = TensorLayout([*plan[v].axes[:at], (), *plan[v].axes[at:]])
            xs.append(ctx.slicewise(lambda a, at=at: jnp.moveaxis(a, at, 0), ctx.get(t, layout).slices))
        steps = ctx.slicewise(lambda: jnp.arange(n, dtype=jnp.uint32))
        key = np.uint32(self.rng_key * 2654435761 % 2**32)
        recorded = Counters()
        calls = [0]
        # a loop of one trip, whose forward loop's trip this context lowered: its body goes on
        # from that trip's values instead of recomputing them (see `_one_trip`)
        trip = ctx.trips.get(self.forward) if n == 1 and self.forward is not None else None
        forward_ops = {op for op in self.forward.body if all(t in trip.values for t in op.outputs)} if trip else set()

        hoisted = _hoist(ctx, body) if n > 1 else None
        taken: set = set()

        def step(carry: list[list], x: list[list]):
            counters = recorded if calls[0] == 0 else Counters()  # (the placement backend calls n times)
            calls[0] += 1
            i, *x = x
            seed = ctx.slicewise(lambda s, i: (s ^ key) * np.uint32(0x9E3779B1) + i, ctx.rng_seed, i)
            bound = dict(zip([*self.carry_vars, *x_vars], [*carry, *x]))
            if trip is None:
                child = _run_body(ctx, counters, seed, bound, body, [*self.carry_results, *y_results], hoisted=hoisted)
                taken.update(child.taken)
            else:
                ops = [op for op in body if op not in forward_ops]
                child = _go_on(ctx, trip, counters, seed, bound, ops, [*self.carry_results, *y_results])
            if n == 1:
                ctx.trips[self] = child
            new = [child.get(r, plan[v]).slices for r, v in zip(self.carry_results, self.carry_vars)]
            return new, [child.get(r).slices for r in y_results] + [list(c) for c in carry]

        if n == 1:
            carry, ys = self._one_trip(ctx, step, carry0, [steps, *xs])
        else:
            carry, ys = ctx.impl.scan(step, carry0, [steps, *xs], n, self.reverse)
        _add_counters(ctx, recorded, n)
        if hoisted:
            _settle_hoisted(ctx, hoisted, taken)
        stacked = [plan[r] for r in y_results] + [plan[v] for v in self.carry_vars]
        for t, v, slices in zip(self.final, self.carry_vars, carry):
            ctx.set_output(t, slices, plan[v])
        for t, layout, slices in zip([*(t for _, t in read), *self.history], stacked, ys):
            ctx.set_output(t, slices, TensorLayout([(), *layout.axes]))

    @staticmethod
    def _one_trip(ctx, step: Callable, carry0: list, xs: list) -> tuple[list, list]:
        """A loop of one trip: its body once, on the first slice of each scanned tensor, without
        `lax.scan` (XLA inlines such a loop anyway). Its values stay in this program's trace, so
        that the backward loop of one trip can go on from them: recomputing them, as a backward
        loop of more trips does, repeated the forward trip's ops on the same values, which XLA
        merges (collectives included: meshax counted them twice)."""
        carry, ys = step(carry0, [ctx.slicewise(lambda a: a[0], x) for x in xs])
        return carry, [ctx.slicewise(lambda a: a[None], y) for y in ys]

    def gradient(self, grad_outputs):
        from meshax.autodiff import body_gradients
        from meshax.ops.einsum import einsum
        from meshax.ops.elementwise import cast
        from meshax.ops.inputs import zeros_like
        from meshax.ops.shape_ops import broadcast

        k, m = len(self.final), len(self.ys)
        g_final, g_ys, g_history = grad_outputs[:k], grad_outputs[k : k + m], grad_outputs[k + m :]
        if any(g is not None for g in g_history):
            raise GraphError(f"{self.name}: a loop's carry history is for its own gradient; it is not differentiable")
        # what no x of the gradient reaches (a table of constants the body reads) needs no
        # gradient: differentiating for it would only add dead work to the backward loop
        wanted = dict(zip(self.inputs, self.wanted or [True] * len(self.inputs)))
        x_kept = [is_floating(t.dtype) and wanted[t] for t in self.xs]
        captured = [t for t in self._float_captured if wanted[t]]
        x_vars = [v for v, kept in zip(self.x_vars, x_kept) if kept]
        floats = [t for t in self.carry_vars if is_floating(t.dtype)] + x_vars + captured
        mesh = self.mesh

        def var(t: Tensor, what: str) -> Tensor:
            return LoopVariableOperation(mesh, t.shape, t.dtype, f"{self.name}/{what}").outputs[0]

        g_carry = [var(v, "grad_carry") for v in self.carry_vars]
        acc = [var(t, "grad_sum") for t in captured]
        # a result's gradient that is the same at every step (a broadcast over the loop's dim: a
        # sum of the results into the loss) is made in the body, not scanned: XLA folds a gather
        # of its slices where it is a constant, and the counters would count one per step
        same = [self._same_each_step(g) for g in g_ys]
        g_y = [var(y, "grad_y") for y, s in zip(self.y_results, same) if s is None]
        with _recording(self.graph) as ops:
            made = iter(g_y)
            g_y = [
                next(made) if s is None else broadcast(cast(s, y.dtype), y.shape) for y, s in zip(self.y_results, same)
            ]
            grads = dict(
                zip(floats, body_gradients([*self.carry_results, *self.y_results], floats, [*g_carry, *g_y], self.body))
            )

            def grad(t: Tensor) -> Tensor:
                return grads.get(t) or zeros_like(t)

            new_carry = [cast(grad(v), v.dtype) for v in self.carry_vars]  # (mixed precision: sums may be wider)
            new_acc = [a + cast(grad(t), a.dtype) if grads.get(t) is not None else a for a, t in zip(acc, captured)]
            g_x = [grad(v) for v in x_vars]
        backward = ScanOperation(
            self.dim,
            [g or zeros_like(t) for g, t in zip(g_final, self.final)] + [zeros_like(t) for t in captured],
            [*self.history, *self.xs, *[g or zeros_like(y) for g, y, s in zip(g_ys, self.ys, same) if s is None]],
            [*g_carry, *acc],
            [*self.carry_vars, *self.x_vars, *[v for v, s in zip(g_y, same) if s is None]],
            [*new_carry, *new_acc],
            g_x,
            [*self.body, *ops],
            reverse=not self.reverse,
            rng_key=self.rng_key,
            name=f"{self.name}_grad",
            forward=self,
        )
        g_init = backward.final[:k]
        g_captured = dict(zip(captured, backward.final[k:]))
        g_ys = iter(backward.ys)
        g_xs = [next(g_ys) if kept else None for kept in x_kept]
        return [
            *[g if is_floating(t.dtype) else None for g, t in zip(g_init, self.init)],
            *[g if g is None or g.shape == t.shape else einsum(g, output_shape=t.shape) for g, t in zip(g_xs, self.xs)],
            *[g_captured.get(t) for t in self.captured],
        ]

    def _same_each_step(self, g: Tensor | None) -> Tensor | None:
        """What `g` (a gradient of a stacked result) broadcasts over the loop's dim, seen through
        annotations: its value at every step; None where g varies along the dim or is None."""
        from meshax.ops.layout_ops import ShardOperation
        from meshax.ops.shape_ops import BroadcastOperation

        op = g.operation if g is not None else None
        while isinstance(op, ShardOperation):
            op = op.inputs[0].operation
        if isinstance(op, BroadcastOperation) and self.dim.name not in op.inputs[0].shape.dimension_names:
            return op.inputs[0]
        return None

    @property
    def _float_captured(self) -> list[Tensor]:
        return [t for t in self.captured if is_floating(t.dtype)]


def scan(
    fn: Callable,
    init: Sequence[Tensor] | Tensor = (),
    xs: Sequence[Tensor] | Tensor = (),
    dim: Dimension | str | None = None,
    reverse: bool = False,
    name: str | None = None,
) -> tuple[list[Tensor], list[Tensor]]:
    """A loop over `dim`: `carry, y = fn(carry, x)` once per index of `dim`, as one `lax.scan`.

    `init`: the carries' first values. `xs`: tensors with `dim`; `fn` sees one index's slice of
    each (without `dim`). `fn(carry: list, x: list) -> (new carry: list, ys: list)`, the new
    carries of the carries' shapes and dtypes; tensors built outside can be read directly.
    Returns (final carries, ys stacked on a leading `dim`). `dim` (a Dimension, or the name of
    one of the xs' dims) sets the number of iterations; it is never split. Differentiable:
    the backward loop recomputes each iteration's body. A loop whose trip count the data decide
    is `while_loop` (not differentiable); random ops in the body draw new values at every iteration."""
    init, xs, reverse = _as_list(init, "init"), _as_list(xs, "xs"), as_flag(reverse, "scan: reverse", GraphError)
    if not init and not xs:
        raise GraphError("scan needs at least one carry (init) or one scanned tensor (xs)")
    graph = (init or xs)[0].graph
    mesh = (init or xs)[0].mesh
    if isinstance(dim, str):
        found = [t.shape.get_dim_by_name(dim) for t in xs if dim in t.shape.dimension_names]
        if not found:
            raise GraphError(f"scan: no scanned tensor has a dim {dim!r}; pass a Dimension to give the iteration count")
        dim = found[0]
    if not isinstance(dim, Dimension):
        raise GraphError("scan needs dim=: the Dimension to loop over (or the name of a dim of xs)")
    for t in xs:
        if dim not in t.shape:
            raise GraphError(f"scan over {dim}: scanned tensor {t.name} {t.shape} lacks it")
    what = name or "scan"
    carry_vars = [LoopVariableOperation(mesh, t.shape, t.dtype, f"{what}/carry").outputs[0] for t in init]
    x_vars = [
        LoopVariableOperation(mesh, Shape([d for d in t.shape if d != dim]), t.dtype, f"{what}/x").outputs[0]
        for t in xs
    ]
    with _recording(graph) as body:
        out = fn(list(carry_vars), list(x_vars))
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise GraphError("scan: fn must return (new carries, ys), two lists")
        new, ys = _as_list(out[0], "the new carries"), _as_list(out[1], "ys")
    _check_carries("scan", new, carry_vars, "fn returned")
    for y in ys:
        if dim in y.shape:
            raise GraphError(f"scan: ys are stacked on {dim.name!r}, so {y.name} {y.shape} cannot have it")
    op = ScanOperation(dim, init, xs, carry_vars, x_vars, new, ys, body, reverse, name=name)
    return op.final, op.ys


class WhileOperation(Operation):
    """A loop whose trip count the data decide: `carry = body(carry)` while `cond(carry)`, as one
    `lax.while_loop` in the SPMD program. Inputs: the carries' initial values, then the outside
    tensors the condition and body read. Outputs: the final carries, then the accumulators' sums
    (Mesh-TensorFlow's `has_accumulators`: more values of the body, summed over the iterations;
    a sum the body owes over some mesh dims is carried owed and settled once, after the loop).
    The condition is a scalar, so every device holds all of it and all devices stop together.
    Collectives in the condition and body are counted once (one iteration: the trip count is
    known only when it runs), as the compiled program holds them once."""

    def __init__(
        self,
        init: list[Tensor],
        carry_vars: list[Tensor],
        cond_result: Tensor,
        carry_results: list[Tensor],
        cond_ops: list[Operation],
        body_ops: list[Operation],
        name: str | None = None,
        accumulated: Sequence[Tensor] = (),
    ):
        results = [*carry_results, *accumulated]
        cond_ops, body_ops = _needed(cond_ops, [cond_result]), _needed(body_ops, results)
        inside = {t for op in [*cond_ops, *body_ops] for t in op.outputs} | set(carry_vars)
        captured = _captured([*cond_ops, *body_ops], inside, [cond_result, *results])
        super().__init__([*init, *captured], mesh=init[0].mesh, name=name or "while_loop")
        self.init, self.captured, self.carry_vars = init, captured, carry_vars
        self.cond_result, self.carry_results, self.accumulated = cond_result, carry_results, list(accumulated)
        self.cond_ops, self.body_ops = cond_ops, body_ops
        self.rng_key = len(self.graph.operations)
        self.final = [self._add_output(v.shape, v.dtype, f"{self.name}/final_{i}") for i, v in enumerate(carry_vars)]
        self.sums = [self._add_output(a.shape, a.dtype, f"{self.name}/sum_{i}") for i, a in enumerate(accumulated)]

    @property
    def results(self) -> list[Tensor]:
        """What the body computes each iteration: the new carries, then the accumulated values."""
        return [*self.carry_results, *self.accumulated]

    def propagation_links(self) -> list[tuple[Tensor, Tensor, str | None]]:
        """A carry's initial value, its variable, its new value and its final value stand for one
        value across the loop's boundary (`ScanOperation.propagation_links`), as an accumulated
        value and its sum do."""
        links: list[tuple[Tensor, Tensor, str | None]] = []
        for t, v, r, f in zip(self.init, self.carry_vars, self.carry_results, self.final):
            links += [(t, v, None), (v, r, None), (r, f, None)]
        return links + [(a, s, None) for a, s in zip(self.accumulated, self.sums)]

    def lower(self, ctx):
        from meshax.lower.counters import Counters

        plan = ctx.plan
        carry0 = [ctx.get(t, plan[v]).slices for t, v in zip(self.init, self.carry_vars)]
        key = np.uint32(self.rng_key * 2654435761 % 2**32)
        recorded, calls = Counters(), {"cond": 0, "body": 0}

        def counters(part: str) -> Counters:  # (the placement backend runs each part many times)
            calls[part] += 1
            return recorded if calls[part] == 1 else Counters()

        def cond(carry: list[list]) -> list:
            i, *carry = carry
            seed = ctx.slicewise(lambda s, i: (s ^ key) * np.uint32(0x9E3779B1) + i, ctx.rng_seed, i)
            bound = dict(zip(self.carry_vars, carry))
            child = _run_body(ctx, counters("cond"), seed, bound, self.cond_ops, [self.cond_result])
            return ctx.slicewise(lambda c: c.astype(bool), child.get(self.cond_result).slices)

        owed: dict[Tensor, frozenset] = {}  # (an accumulated value's sums owed, as the body's trace left them)

        def body(carry: list[list]) -> list[list]:
            i, *carry = carry
            carry, sums = carry[: len(self.carry_vars)], carry[len(self.carry_vars) :]
            seed = ctx.slicewise(lambda s, i: (s ^ ~key) * np.uint32(0x9E3779B1) + i, ctx.rng_seed, i)
            bound = dict(zip(self.carry_vars, carry))
            child = _run_body(ctx, counters("body"), seed, bound, self.body_ops, self.results)
            new = [child.get(r, plan[v]).slices for r, v in zip(self.carry_results, self.carry_vars)]
            for a, total in zip(self.accumulated, sums):
                value = child.get(a, plan[a], allow_partial=True)
                owed[a] = value.pending
                new.append(ctx.slicewise(jnp.add, total, value.slices))
            return [ctx.slicewise(lambda i: i + np.uint32(1), i), *new]

        start = ctx.slicewise(lambda: jnp.zeros((), jnp.uint32))  # the iteration: random ops' stream
        zeros = [
            ctx.slicewise(lambda a=a: jnp.zeros(slice_shape(a.shape, plan[a], ctx.mesh_shape), a.dtype))
            for a in self.accumulated
        ]
        _, *final = ctx.impl.while_loop(cond, body, [start, *carry0, *zeros])
        _add_counters(ctx, recorded)
        for t, v, slices in zip(self.final, self.carry_vars, final):
            ctx.set_output(t, slices, plan[v])
        for t, a, slices in zip(self.sums, self.accumulated, final[len(self.carry_vars) :]):
            # (settled once, when read; a loop that ran no trip on the placement backend, which
            # runs its body only while the condition holds, summed nothing: zeros, owing nothing)
            ctx.set_output(t, slices, plan[a], owed.get(a, frozenset()))

    def gradient(self, grad_outputs):
        if any(g is not None for g in grad_outputs):
            raise GraphError(
                f"{self.name}: a while loop is not differentiable (its trip count is known only when it runs, "
                "so nothing can be kept for a backward pass); for a fixed number of iterations use mx.scan"
            )
        return [None] * len(self.inputs)


def while_loop(
    cond_fn: Callable,
    body_fn: Callable,
    inputs: Sequence[Tensor],
    num_loop_vars: int | None = None,
    has_accumulators: bool = False,
    name: str | None = None,
) -> list[Tensor]:
    """Mesh-TensorFlow's `while_loop`: `inputs = body_fn(*inputs)` while `cond_fn(*inputs)`, as
    one `lax.while_loop` in the SPMD program. `cond_fn` returns a scalar (bool, or a number: true
    when not zero); `body_fn` returns new values of the inputs' shapes and dtypes. Tensors built
    outside can be read directly. Returns the final values (the first `num_loop_vars` of them
    when that is given; in meshax every input is a loop variable, so it changes nothing else).
    With `has_accumulators`, `body_fn` may return more values after the new inputs:
    accumulators, each summed over the iterations (from zero) and returned after the loop
    variables; a sum the body owes over mesh dims (a gradient split over the batch, say) is
    summed owed and settled once, after the loop, as Mesh-TensorFlow's delayed allreduce.
    Not differentiable (its trip count is known only when it runs); a loop with a fixed trip
    count is `mx.scan`, which is."""
    init = _as_list(inputs, "inputs", "while_loop")
    has_accumulators = as_flag(has_accumulators, "while_loop: has_accumulators", GraphError)
    if not init:
        raise GraphError("while_loop needs at least one input (a loop variable)")
    if num_loop_vars is not None and not 0 < num_loop_vars <= len(init):
        raise GraphError(f"while_loop: num_loop_vars={num_loop_vars} must be in 1..{len(init)} (the inputs)")
    what = name or "while_loop"
    mesh, graph = init[0].mesh, init[0].graph
    carry_vars = [LoopVariableOperation(mesh, t.shape, t.dtype, f"{what}/carry").outputs[0] for t in init]
    with _recording(graph) as cond_ops:
        flag = cond_fn(*carry_vars)
    if not isinstance(flag, Tensor) or flag.shape.rank != 0:
        got = f"{flag.shape}" if isinstance(flag, Tensor) else repr(flag)
        raise GraphError(f"while_loop: cond_fn must return a scalar meshax Tensor (shape []), got {got}")
    with _recording(graph) as body_ops:
        new = _as_list(body_fn(*carry_vars), "the values body_fn returns", "while_loop")
    new, accumulated = new[: len(init)], new[len(init) :]
    if accumulated and not has_accumulators:
        raise GraphError(
            f"while_loop: body_fn returned {len(init) + len(accumulated)} values for {len(init)} inputs; "
            "to sum the rest over the iterations, pass has_accumulators=True"
        )
    _check_carries("while_loop", new, carry_vars, "body_fn returned")
    op = WhileOperation(init, carry_vars, flag, new, cond_ops, body_ops, name=name, accumulated=accumulated)
    return [*(op.final[:num_loop_vars] if num_loop_vars is not None else op.final), *op.sums]
