"""The per-tensor layout plan the lowering works from.

Rules give every tensor its default layout; an op that carries a `layout_override` (the `shard`
annotation) fixes its output's layout instead; an op's `replicated_dims` keeps those dims of
its outputs whole (for internal pieces of size 1). Later, sharding propagation fills in tensors
that neither covers; this module is that seam.
"""

from __future__ import annotations

from meshax.core.graph import Operation, Tensor
from meshax.core.shape import Shape
from meshax.layout.rules import LayoutRules, TensorLayout, convert_to_layout_rules, tensor_layout


def layout_for(t: Tensor, rules: LayoutRules, mesh_shape: Shape) -> TensorLayout:
    override = getattr(t.operation, "layout_override", None)
    if override is not None:
        override = convert_to_layout_rules(override)
        unknown = [d for d in override.tensor_dim_names if d not in t.shape]
        if unknown:
            raise ValueError(
                f"layout {str(override)!r} for tensor {t.name!r} names dim(s) {unknown} that it does not have "
                f"(its dims: {t.shape.dimension_names})"
            )
        return tensor_layout(t.shape, override, mesh_shape, t.name)
    whole = getattr(t.operation, "replicated_dims", ())
    if whole:  # an op's internal size-1 pieces (stack, unstack) are never split
        rules = LayoutRules([(d, m) for d, m in rules if d not in whole])
    return tensor_layout(t.shape, rules, mesh_shape, t.name)


class Plan(dict):
    """tensor -> TensorLayout; tensors built after the plan was made are laid out on first use."""

    def __init__(self, operations: list[Operation], rules: LayoutRules, mesh_shape: Shape):
        super().__init__()
        self.rules, self.mesh_shape = rules, mesh_shape
        for op in operations:
            for t in op.outputs:
                self[t] = layout_for(t, rules, mesh_shape)

    def __missing__(self, t: Tensor) -> TensorLayout:
        self[t] = layout = layout_for(t, self.rules, self.mesh_shape)
        return layout


def make_plan(operations: list[Operation], rules: LayoutRules, mesh_shape: Shape) -> Plan:
    """Every tensor's layout, validated now, so an illegal layout fails before anything runs."""
    return Plan(operations, rules, mesh_shape)
