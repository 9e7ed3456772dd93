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

    def __init__(self, operations: list[Operation], rules: LayoutRules, mesh_shape: Shape):
        super().__init__()
        self.rules, self.mesh_shape = rules, mesh_shape
        self.propagation = Propagation(operations, rules, mesh_shape)
        for op in operations:
            for t in op.outputs:
                self[t] = self.propagation.layout(t)

    def __missing__(self, t: Tensor) -> TensorLayout:
        self[t] = layout = Propagation([t.operation], self.rules, self.mesh_shape).layout(t)
        return layout


def make_plan(operations: list[Operation], rules: LayoutRules, mesh_shape: Shape) -> Plan:
    """Every tensor's layout, validated now, so an illegal layout fails before anything runs."""
    return Plan(operations, rules, mesh_shape)
