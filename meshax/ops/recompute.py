"""`recompute_grad`: rematerialization, Mesh-TensorFlow's name for it.

`recompute_grad(fn, explicit_inputs)` runs `fn` as usual in the forward pass but keeps only its
inputs and outputs for the backward pass: the gradient recomputes `fn`'s ops from the inputs
first, then runs their gradient ops, so a layer's internal activations live only while its own
gradient is computed. It is a loop of one iteration, built from the loop machinery
(`meshax.ops.loops`): `fn`'s ops are a recorded body, lowered by a `RecomputeOperation`.

XLA would merge the recomputation with the forward computation it repeats (common
subexpressions) and keep the activations after all; the backward op therefore passes its inputs
and upstream gradients through `jax.lax.optimization_barrier` together, as `jax.checkpoint`
does, which also holds the recomputation back until the gradient reaches it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

from meshax.core.errors import GraphError
from meshax.core.graph import Operation, Tensor, is_floating
from meshax.ops.loops import LoopVariableOperation, _as_list, _needed, _recording


class RecomputeOperation(Operation):
    """A recorded body run once: inputs are the tensors its variables (`vars`) are bound to,
    then the outside tensors the body reads; outputs are the body's `results`. With `barrier`,
    the bound values pass an optimization barrier first (the gradient's recomputation)."""

    def __init__(self, inputs, vars, results, body, barrier: bool = False, name: str | None = None):
        body = _needed(body, results)
        inside = {t for op in body for t in op.outputs} | set(vars)
        captured: dict[Tensor, None] = {}
        for op in body:
            captured.update((t, None) for t in op.inputs if t not in inside)
        captured.update((t, None) for t in results if t not in inside)
        super().__init__([*inputs, *captured], mesh=vars[0].mesh, name=name or "recompute")
        self.bound, self.vars, self.results, self.body = list(inputs), list(vars), list(results), body
        self.captured, self.barrier = list(captured), barrier
        for i, r in enumerate(results):
            self._add_output(r.shape, r.dtype, f"{self.name}/out_{i}")

    def propagation_links(self) -> list[tuple[Tensor, Tensor, str]]:
        """Each bound tensor and its variable, each result and its output: one value each."""
        return [
            *zip(self.bound, self.vars, [""] * len(self.vars)),
            *zip(self.results, self.outputs, [""] * len(self.results)),
        ]

    def lower(self, ctx):
        from meshax.lower.context import LoweringContext, count_reads

        plan = ctx.plan
        values = [ctx.get(t, plan[v]).slices for t, v in zip(self.bound, self.vars)]
        if self.barrier:
            values = list(ctx.slicewise(lambda *xs: tuple(jax.lax.optimization_barrier(xs)), *values))
        # only the results the program reads: a gradient no one asked for (an input's, say) is
        # not computed, nor its collectives run and counted (XLA drops them)
        read = [(t, r) for t, r in zip(self.outputs, self.results) if not ctx.reads or ctx.reads.get(t, 0)]
        results = [r for _, r in read]
        body = _needed(self.body, results)
        child = LoweringContext(ctx.impl, plan, ctx.counters, ctx.rng_seed, count_reads(body, results))
        child.values = dict(ctx.values)
        for v, slices in zip(self.vars, values):
            child.set_output(v, slices, plan[v])
        for op in body:
            child.op = op
            op.lower(child)
        child.op = None
        for t, r in read:
            ctx.set_output(t, child.get(r, plan[t]).slices, plan[t])

    def gradient(self, grad_outputs):
        from meshax.autodiff import body_gradients

        wrt = [t for t in [*self.vars, *self.captured] if is_floating(t.dtype)]
        pairs = [(r, g) for r, g in zip(self.results, grad_outputs) if g is not None and is_floating(r.dtype)]
        g_vars = [
            LoopVariableOperation(self.mesh, r.shape, g.dtype, f"{self.name}/grad_out").outputs[0] for r, g in pairs
        ]
        with _recording(self.graph) as ops:
            grads = body_gradients([r for r, _ in pairs], wrt, g_vars, self.body)
        found = [(t, g) for t, g in zip(wrt, grads) if g is not None]
        if not found:
            return [None] * len(self.inputs)
        backward = RecomputeOperation(
            [*self.bound, *[g for _, g in pairs]],
            [*self.vars, *g_vars],
            [g for _, g in found],
            [*self.body, *ops],
            barrier=True,
            name=f"{self.name}_grad",
        )
        by_tensor = dict(zip([t for t, _ in found], backward.outputs))
        return [by_tensor.get(v) for v in self.vars] + [by_tensor.get(t) for t in self.captured]


class CustomGradientOperation(RecomputeOperation):
    """`fn`'s ops run as one op whose gradient is the user's `grad_fn`, called as
    Mesh-TensorFlow calls it (see `custom_gradient`)."""

    def __init__(self, inputs, vars, results, body, grad_fn, name=None):
        super().__init__(inputs, vars, results, body, name=name or "custom_gradient")
        self.grad_fn = grad_fn

    def gradient(self, grad_outputs):
        external = [t for t in self.captured if is_floating(t.dtype)]
        all_inputs = [*self.bound, *external]
        grads = list(
            self.grad_fn(
                explicit_inputs=list(self.bound),
                all_inputs=all_inputs,
                forward_operations=list(self.body),
                outputs=list(self.outputs),
                output_grads=list(grad_outputs),
            )
        )
        if len(grads) == len(self.bound):  # (gradients of the explicit inputs alone: none for the rest)
            grads += [None] * len(external)
        if len(grads) != len(all_inputs):
            raise GraphError(
                f"custom_gradient {self.name}: grad_fn returned {len(grads)} gradients; give one per tensor of "
                f"all_inputs ({len(all_inputs)}: {', '.join(t.name for t in all_inputs)}) or per explicit input"
            )
        by_tensor = dict(zip(all_inputs, grads))
        return [by_tensor.get(t) for t in self.inputs]


def _record(fn: Callable, explicit_inputs, what: str):
    """fn called on stand-ins of its explicit inputs, its ops recorded: (inputs, stand-ins,
    results, recorded ops, whether fn returned one tensor)."""
    inputs = _as_list(explicit_inputs, "explicit_inputs")
    if not inputs:
        raise GraphError(f"{what} needs at least one explicit input (the tensors fn is computed from)")
    vars = [LoopVariableOperation(t.mesh, t.shape, t.dtype, f"{what}/input").outputs[0] for t in inputs]
    with _recording(inputs[0].graph) as body:
        out = fn(*vars)
    results = _as_list(out, "fn's results")
    if not results:
        raise GraphError(f"{what}: fn returned no tensors")
    passed = [r for r in results if r in vars]
    if passed:
        raise GraphError(f"{what}: fn returned its input {passed[0].name} unchanged; return a computed tensor")
    return inputs, vars, results, body, isinstance(out, Tensor)


def custom_gradient(fn: Callable, grad_fn: Callable, explicit_inputs: Sequence[Tensor] | Tensor):
    """`fn(*explicit_inputs)` with a gradient of the user's instead of its own (Mesh-TensorFlow's
    `custom_gradient`). `grad_fn` is called with the keywords `explicit_inputs`, `all_inputs`
    (the explicit inputs, then the outside float tensors fn read: its weights),
    `forward_operations` (fn's ops), `outputs` (fn's results) and `output_grads` (their
    gradients, None where none flows), and returns the gradients of `all_inputs` (or of the
    explicit inputs alone)."""
    inputs, vars, results, body, single = _record(fn, explicit_inputs, "custom_gradient")
    op = CustomGradientOperation(inputs, vars, results, body, grad_fn)
    return op.outputs[0] if single else list(op.outputs)


def recompute_grad(
    fn: Callable,
    explicit_inputs: Sequence[Tensor] | Tensor,
    control_dependencies=None,
    name: str | None = None,
):
    """`fn(*explicit_inputs)` whose activations are recomputed in the backward pass instead of
    kept (Mesh-TensorFlow's `recompute_grad`): the backward pass holds only the inputs and
    outputs, plus one call's internals while its gradient runs. `fn` may read other tensors
    (weights) directly and create variables; it returns a Tensor or a list of Tensors, which
    are returned the same way. Random ops inside draw the same values when recomputed.
    `control_dependencies` (Mesh-TensorFlow's ordering of TensorFlow side effects) is accepted
    and not needed: a meshax program runs in dataflow order, and its assignments come last."""
    inputs, vars, results, body, single = _record(fn, explicit_inputs, name or "recompute_grad")
    op = RecomputeOperation(inputs, vars, results, body, name=name)
    return op.outputs[0] if single else list(op.outputs)
