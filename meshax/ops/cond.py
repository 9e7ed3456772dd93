"""Branches in the IR: `cond` and `switch`, lowered to one `lax.switch` inside the SPMD program.

Each branch is a recorded sub-graph, as a loop's body is (`meshax.ops.loops`): its ops are marked
`in_loop`, read the operands through variables of their own and any tensor built outside
directly. The index is a scalar, so every device holds all of it and all take the same branch:
a branch's collectives run on every device or on none, as SPMD needs. Only the branch taken
runs; the compiled program holds every branch, so the cost report counts each branch's
collectives and FLOPs once, as it does a while loop's (an upper bound on one run's).

A branch's operands are moved to the layouts its own variables have inside the branch, so a
branch that reads an operand in another layout pays for the move only when it runs (an operand
it does not read is not moved). A sum an operand still owes is settled once, before the branch
is chosen, not in each branch. The results leave every branch in one layout, the output's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from meshax.core.errors import GraphError
from meshax.core.graph import Operation, Tensor, is_floating
from meshax.ops.loops import (
    LoopVariableOperation,
    _add_counters,
    _as_list,
    _captured,
    _needed,
    _recording,
    _run_body,
)


def _read_by(ops: list[Operation], results: list[Tensor]) -> set[Tensor]:
    """The tensors a branch's ops read (those a loop or branch inside it captures too: its body
    reads them) or it returns, seen through relabelling."""
    from meshax.lower.context import source

    return {source(t) for op in ops if not getattr(op, "is_rename", False) for t in op.inputs} | {
        source(r) for r in results
    }


class CondOperation(Operation):
    """Runs one of its branches, the one `index` picks (clamped to the branches, as `lax.switch`
    clamps; with `truth`, branch 0 where `index` is not zero and branch 1 where it is: true, false). Inputs:
    the index, the operands, then the outside tensors the branches read. Outputs: the branches'
    results, which match one for one in shape and dtype."""

    boundary = "branch"  # (propagation's explanations: "the branch boundary of ...")

    def __init__(
        self,
        index: Tensor,
        operands: list[Tensor],
        branches: list[tuple[list[Tensor], list[Tensor], list[Operation]]],
        truth: bool = False,
        rng_key: int | None = None,
        name: str | None = None,
    ):
        branches = [(vars, results, _needed(ops, results)) for vars, results, ops in branches]
        inside = {t for vars, _, ops in branches for t in [*vars, *(o for op in ops for o in op.outputs)]}
        captured = _captured(
            [op for _, _, ops in branches for op in ops], inside, [r for _, rs, _ in branches for r in rs]
        )
        super().__init__([index, *operands, *captured], mesh=index.mesh, name=name or "cond")
        self.index, self.operands, self.captured, self.truth = index, list(operands), captured, truth
        self.branches = branches
        self.rng_key = len(self.graph.operations) if rng_key is None else rng_key
        for i, r in enumerate(branches[0][1]):
            self._add_output(r.shape, r.dtype, f"{self.name}/out_{i}")

    def propagation_links(self) -> list[tuple[Tensor, Tensor, str | None]]:
        """Each operand and its variable in every branch, and each branch's result and the
        output: one value each."""
        links: list[tuple[Tensor, Tensor, str | None]] = []
        for vars, results, _ in self.branches:
            links += [(t, v, None) for t, v in zip(self.operands, vars)]
            links += [(r, out, None) for r, out in zip(results, self.outputs)]
        return links

    def lower(self, ctx):
        from meshax.lower.context import source
        from meshax.lower.counters import Counters

        plan, n = ctx.plan, len(self.branches)
        truth = self.truth

        def pick(i):
            return jnp.where(i != 0, 0, 1) if truth else jnp.clip(i.astype(jnp.int32), 0, n - 1)

        index = ctx.slicewise(pick, ctx.get(self.index).slices)
        # what each branch reads of its operands (an operand it does not read is not moved: XLA
        # would drop the move); an operand's sum still owed is settled here, once, not in each
        # branch that moves it (a tensor a branch captures, its ops read, as a loop body's do)
        read = [
            {t for t, v in zip(self.operands, vars) if v in _read_by(ops, results)}
            for vars, results, ops in self.branches
        ]
        values = dict(ctx.values)
        values.update((t, ctx.get(t)) for t in {source(t) for r in read for t in r} if ctx.values[t].pending)
        recorded = [Counters() for _ in self.branches]
        key = np.uint32(self.rng_key * 2654435761 % 2**32)

        def branch(b: int) -> Callable[[], list[list]]:
            vars, results, ops = self.branches[b]

            def run() -> list[list]:
                seed = ctx.slicewise(lambda s: (s ^ key) * np.uint32(0x9E3779B1) + np.uint32(b), ctx.rng_seed)
                moved = {v: t for t, v in zip(self.operands, vars) if t in read[b]}
                child = _run_body(ctx, recorded[b], seed, {}, ops, results, moved, self, values)
                return [child.get(r, plan[out]).slices for r, out in zip(results, self.outputs)]

            return run

        outs = ctx.impl.switch(index, [branch(b) for b in range(n)])
        for counters in recorded:
            _add_counters(ctx, counters)
        for t, slices in zip(self.outputs, outs):
            ctx.set_output(t, slices, plan[t])

    def gradient(self, grad_outputs):
        """Another branch op on the same index: each branch recomputes its forward ops from the
        operands and runs their gradient ops; what a branch does not reach gets zeros."""
        from meshax.autodiff import body_gradients
        from meshax.ops.elementwise import cast
        from meshax.ops.inputs import zeros_like

        # the operands, then the captured, that an x of the gradient reaches: the branches would
        # compute the rest's gradients (a table of constants they read, say), collectives and all, for no one
        wanted = self.wanted or [True] * len(self.inputs)
        wrt = [k for k, t in enumerate(self.inputs[1:]) if is_floating(t.dtype) and wanted[1 + k]]
        pairs = [(i, g) for i, g in enumerate(grad_outputs) if g is not None and is_floating(self.outputs[i].dtype)]
        if not wrt or not pairs:
            return [None] * len(self.inputs)
        branches = []
        for vars, results, ops in self.branches:
            g_vars = [
                LoopVariableOperation(self.mesh, self.outputs[i].shape, g.dtype, f"{self.name}/grad_out").outputs[0]
                for i, g in pairs
            ]
            inner = [*vars, *self.captured]  # (what the branch reads for each input)
            with _recording(self.graph) as grad_ops:
                grads = body_gradients([results[i] for i, _ in pairs], [inner[k] for k in wrt], g_vars, ops)
                t_of = [self.inputs[1 + k] for k in wrt]
                grads = [zeros_like(t) if g is None else cast(g, t.dtype) for g, t in zip(grads, t_of)]
            branches.append(([*vars, *g_vars], grads, [*ops, *grad_ops]))
        backward = CondOperation(
            self.index,
            [*self.operands, *(g for _, g in pairs)],
            branches,
            truth=self.truth,
            rng_key=self.rng_key,
            name=f"{self.name}_grad",
        )
        out: list = [None] * len(self.inputs)
        for k, g in zip(wrt, backward.outputs):
            out[1 + k] = g
        return out


def switch(
    index: Tensor, branches: Sequence[Callable], operands: Sequence[Tensor] | Tensor = (), name: str | None = None
):
    """`branches[index](*operands)`, as one `lax.switch` in the SPMD program: every device takes
    the same branch, and only that branch runs. `index` is a scalar meshax Tensor (an integer,
    clamped to the branches as `lax.switch` clamps it). Each branch takes the operands and
    returns a Tensor or a list of Tensors, the same shapes and dtypes from every branch; tensors
    built outside can be read directly. Returns the result(s) as the branches return them.
    Differentiable (with respect to the operands and the tensors the branches read)."""
    return _build("switch", index, list(branches), operands, False, name)


def cond(
    pred: Tensor,
    true_fn: Callable,
    false_fn: Callable,
    operands: Sequence[Tensor] | Tensor = (),
    name: str | None = None,
):
    """`true_fn(*operands)` if `pred` else `false_fn(*operands)`, as one `lax.cond` in the SPMD
    program (see `switch`). `pred` is a scalar meshax Tensor: bool, or a number (true when not
    zero). Differentiable."""
    return _build("cond", pred, [true_fn, false_fn], operands, True, name)


def _build(what: str, index, fns: list, operands, truth: bool, name: str | None):
    if not isinstance(index, Tensor) or index.shape.rank != 0:
        got = f"a tensor of shape {index.shape}" if isinstance(index, Tensor) else repr(index)
        raise GraphError(f"{what}: the {'predicate' if truth else 'index'} must be a scalar meshax Tensor, got {got}")
    kind = np.dtype(index.dtype).kind
    if kind not in ("b", "i", "u") + (("f",) if truth else ()):
        raise GraphError(f"{what}: the index must be an integer scalar, got dtype {index.dtype}")
    if not fns or not all(callable(f) for f in fns):
        raise GraphError(f"{what}: the branches must be a non-empty list of functions, got {fns!r}")
    ops_in = _as_list(operands, "operands", what)
    mesh, graph = index.mesh, index.graph
    branches, single = [], []
    for k, fn in enumerate(fns):
        vars = [LoopVariableOperation(mesh, t.shape, t.dtype, f"{name or what}/operand").outputs[0] for t in ops_in]
        with _recording(graph) as ops:
            out = fn(*vars)
        results = _as_list(out, "the values a branch returns", what)
        if not results:
            raise GraphError(f"{what}: branch {_which(truth, k)} returned no tensors")
        branches.append((vars, results, ops))
        single.append(isinstance(out, Tensor))
    first = branches[0][1]
    for k, (_, results, _) in enumerate(branches[1:], 1):
        if [(r.shape, r.dtype) for r in results] != [(r.shape, r.dtype) for r in first] or single[k] != single[0]:
            raise GraphError(
                f"{what}: every branch must return the same shapes and dtypes; branch {_which(truth, 0)} returned "
                f"{_shapes(first, single[0])}, branch {_which(truth, k)} {_shapes(results, single[k])}"
            )
    op = CondOperation(index, ops_in, branches, truth=truth, name=name or what)
    return op.outputs[0] if single[0] else list(op.outputs)


def _which(truth: bool, k: int) -> str:
    return ("true_fn", "false_fn")[k] if truth else str(k)


def _shapes(results: list[Tensor], single: bool) -> str:
    text = ", ".join(f"{r.shape} {r.dtype}" for r in results)
    return text if single else f"[{text}]"
