"""Reverse-mode differentiation on the meshax graph.

Gradients are built as ordinary graph operations by each op's `gradient`, so they are laid out
and lowered like everything else: the data-parallel allreduce of a parameter gradient is just
the einsum over a split `batch` dim in the backward pass, not a special case.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextvars import ContextVar
from typing import overload

from meshax.core.errors import GraphError
from meshax.core.graph import Operation, Tensor, is_floating

_SCALE: ContextVar[Tensor | None] = ContextVar("meshax_loss_scale", default=None)


def loss_scale() -> Tensor | None:
    """While `gradients` builds the gradients of a scaled loss (`LossScaleOptimizer.scale_loss`),
    its scale: they carry it, and a gradient function comparing them with a threshold (clipping)
    compares the unscaled ones; None otherwise."""
    return _SCALE.get()


def _between(ops: list[Operation], xs: Sequence[Tensor], ys: Sequence[Tensor]) -> tuple[set[Operation], set[Tensor]]:
    """Ops on some path from an x to a y, and the tensors an x reaches."""
    from_x: set[Tensor] = set(xs)
    forward: set[Operation] = set()
    for op in ops:
        if any(t in from_x for t in op.inputs):
            forward.add(op)
            from_x.update(op.outputs)
    to_y: set[Tensor] = set(ys)
    between: set[Operation] = set()
    for op in reversed(ops):
        if any(t in to_y for t in op.outputs):
            if op in forward:
                between.add(op)
            to_y.update(op.inputs)
    return between, from_x


def _as_x(x) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if getattr(x, "is_variable", False):  # a variable op: its value
        return x.outputs[0]
    raise GraphError(f"gradients: {x!r} is not a Tensor or a variable; pass tensors (e.g. a variable's .value)")


@overload
def gradients(ys, xs: Tensor, grad_ys=None, operations=None) -> Tensor | None: ...


@overload
def gradients(ys, xs: Sequence[Tensor], grad_ys=None, operations=None) -> list[Tensor | None]: ...


def gradients(ys, xs, grad_ys=None, operations=None):
    """d(sum of ys)/d(each x), as new graph tensors; None where no path connects them, and an
    error where none of the xs has one (nothing would train).

    ys: a Tensor or a list; xs: a list of Tensors (variables' values, placeholders, any tensor)
    or variables (`graph.trainable_variables`: each stands for its value, as Mesh-TensorFlow's
    `v.outputs[0]`); grad_ys: upstream gradients for ys (default: ones, so a scalar loss gives
    its gradient); operations: the forward ops to differentiate through (default: all)."""
    ys = [ys] if isinstance(ys, Tensor | str) or not isinstance(ys, Iterable) else list(ys)
    for y in ys:
        if not isinstance(y, Tensor):
            raise GraphError(f"gradients: ys are meshax Tensors (the loss), got {type(y).__name__} {y!r:.80}")
    single = isinstance(xs, Tensor | Operation)
    xs = [_as_x(x) for x in ([xs] if single else list(xs))]
    if not ys:
        raise GraphError("gradients needs at least one y")
    if grad_ys is None:
        grad_ys = [None] * len(ys)
    grad_ys = [grad_ys] if isinstance(grad_ys, Tensor) else list(grad_ys)
    if len(grad_ys) != len(ys):
        raise GraphError(f"gradients got {len(ys)} ys but {len(grad_ys)} grad_ys")
    for y, g in zip(ys, grad_ys):  # (one of another shape was broadcast into the gradients, silently)
        if g is not None and not (isinstance(g, Tensor) and set(g.shape.dims) == set(y.shape.dims)):
            got = f"{g.name} {g.shape}" if isinstance(g, Tensor) else f"{type(g).__name__} {g!r:.80}"
            raise GraphError(f"gradients: the grad_ys of {y.name} {y.shape} must be a Tensor of its shape, got {got}")
    graph = ys[0].graph
    for t in (*ys, *grad_ys, *xs):  # (an x of another graph was given a None gradient, silently)
        if t is not None and t.graph is not graph:
            raise GraphError(
                f"gradients: {t.name} belongs to another mx.Graph than {ys[0].name}; build the loss and what it is "
                "differentiated with respect to in one graph"
            )
    ops = [op for op in (graph.operations if operations is None else operations) if not op.in_loop]
    scales = {graph.loss_scales.get(y) for y in ys}
    token = _SCALE.set(scales.pop() if len(scales) == 1 else None)  # (ys scaled differently: none)
    try:
        grads = _backward(graph, ops, ys, xs, grad_ys, False)  # (the gradient ops appended are not walked)
    finally:
        _SCALE.reset(token)
    if xs and all(g is None for g in grads):
        names = ", ".join(x.name for x in xs[:5]) + (f" and {len(xs) - 5} more" if len(xs) > 5 else "")
        raise GraphError(
            f"gradients: no gradient flows from {', '.join(y.name for y in ys)} back to any of {names} (no path, or "
            "only through stop_gradient or integer values), so every gradient is None and nothing would train; "
            "pass the tensors the loss is computed from: the variables' values "
            "(v.value, v.outputs[0]) or the variables themselves (graph.trainable_variables)"
        )
    return grads[0] if single else grads


def body_gradients(ys: list[Tensor], xs: list[Tensor], grad_ys: list[Tensor], ops: list[Operation]) -> list:
    """d(ys)/d(each x) through `ops` alone (a loop's body: `meshax.ops.loops`), with upstream
    gradients `grad_ys`; None where no path connects them."""
    pairs = [(y, g) for y, g in zip(ys, grad_ys) if is_floating(y.dtype)]
    if not pairs:
        return [None] * len(xs)
    return _backward(pairs[0][0].graph, ops, [y for y, _ in pairs], xs, [g for _, g in pairs], False)


def _backward(graph, ops: list[Operation], ys: list[Tensor], xs: list[Tensor], grad_ys: list, single: bool):
    from meshax.ops.inputs import ones_like

    relevant, reached = _between(ops, xs, ys)
    pieces: dict[Tensor, list[Tensor]] = {}
    for y, gy in zip(ys, grad_ys):
        if not is_floating(y.dtype):
            raise GraphError(f"cannot differentiate {y.name}: its dtype {y.dtype} is not floating point")
        pieces.setdefault(y, []).append(ones_like(y) if gy is None else gy)

    def total(t: Tensor) -> Tensor | None:
        parts = pieces.get(t)
        if not parts:
            return None
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        pieces[t] = [out]
        return out

    for op in reversed(ops):
        if op not in relevant or not op.differentiable:
            continue
        grad_outputs = [total(t) for t in op.outputs]
        if all(g is None for g in grad_outputs):
            continue
        first_new = len(graph.operations)
        op.wanted = [t in reached for t in op.inputs]
        grad_inputs = op.gradient(grad_outputs)
        for new in graph.operations[first_new:]:  # the cost report names the forward op
            if new.grad_of is None:  # (a loop's gradient names its body's ops itself)
                new.grad_of, new.source = op, op.source
        if len(grad_inputs) != len(op.inputs):
            raise GraphError(
                f"{type(op).__name__}.gradient returned {len(grad_inputs)} grads for {len(op.inputs)} inputs"
            )
        for t, g in zip(op.inputs, grad_inputs):
            if g is None or not is_floating(t.dtype):
                continue
            if g.shape != t.shape:
                raise GraphError(f"gradient of {t.name} from {op.name} has shape {g.shape}, expected {t.shape}")
            whole = getattr(t.operation, "replicated_dims", None)
            if whole and g.operation in graph.operations[first_new:]:
                g.operation.replicated_dims = whole  # a gradient is laid out like its tensor
            pieces.setdefault(t, []).append(g)
    grads = [total(x) for x in xs]
    return grads[0] if single else grads
