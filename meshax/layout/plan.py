"""The per-tensor layout plan the lowering works from.

Rules give every dim they name its split; annotations (`mesh_split`, `shard`) fix their
tensor's dims; propagation (`meshax.layout.propagate`) completes every other tensor; what
nothing reaches is replicated. The plan keeps the propagation, so that `explain` can say where
each layout came from.
"""

from __future__ import annotations

from meshax.core.graph import Operation, Tensor
from meshax.core.shape import Shape
from meshax.layout.propagate import Propagation
from meshax.layout.rules import LayoutRules, TensorLayout


class Plan(dict):
    """tensor -> TensorLayout; tensors built after the plan was made are laid out on first use
    (by the rules and their own annotation; nothing propagates to them)."""

    def __init__(self, operations: list[Operation], rules: LayoutRules, mesh_shape: Shape, weight_rules=None):
        super().__init__()
        self.rules, self.mesh_shape = rules, mesh_shape
        self.weights = None
        if weight_rules is not None:  # (the weight shapes the weight rules lay out: all but those exempt)
            self.weights = (weight_rules, weight_shapes(operations) - getattr(weight_rules, "exempt", frozenset()))
        self.propagation = Propagation(operations, rules, mesh_shape, self.weights)
        for op in operations:
            for t in op.outputs:
                self[t] = self.propagation.layout(t)

    def __missing__(self, t: Tensor) -> TensorLayout:
        self[t] = layout = Propagation([t.operation], self.rules, self.mesh_shape, self.weights).layout(t)
        return layout


def weight_shapes(operations: list[Operation]) -> frozenset[frozenset[str]]:
    """The dim names of every variable: a tensor with exactly these is weight-shaped (a weight,
    its gradient, its optimizer slots and updates), and weight rules lay it out."""
    return frozenset(
        frozenset(t.shape.dimension_names) for op in operations if getattr(op, "is_variable", False) for t in op.outputs
    )


def make_plan(
    operations: list[Operation], rules: LayoutRules, mesh_shape: Shape, weight_rules: LayoutRules | None = None
) -> Plan:
    """Every tensor's layout, validated now, so an illegal layout fails before anything runs.
    With `weight_rules`, weight-shaped tensors (`weight_shapes`) follow those instead of `rules`
    (weights split one way, activations another, as GSPMD's 2D sharding does)."""
    return Plan(operations, rules, mesh_shape, weight_rules)
