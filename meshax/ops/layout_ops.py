"""Layout annotations: `shard` (GSPMD's mesh_split), the per-tensor override of the rules."""

from __future__ import annotations

from meshax.core.graph import Operation, Tensor
from meshax.layout import convert_to_layout_rules


class ShardOperation(Operation):
    """Identity whose output has the given layout, whatever the rules say."""

    def __init__(self, x: Tensor, layout, name=None):
        super().__init__([x], name=name or "shard")
        self.layout_override = convert_to_layout_rules(layout)
        self._add_output(x.shape, x.dtype)

    def lower(self, ctx):
        (x,), (out,) = self.inputs, self.outputs
        v = ctx.get(x, ctx.layout(out), allow_partial=True)
        ctx.set_output(out, v.slices, v.layout, v.pending)

    def gradient(self, grad_outputs):
        (g,) = grad_outputs
        return [None if g is None else shard(g, self.layout_override)]


def shard(x: Tensor, layout, name=None) -> Tensor:
    """x, laid out as `layout` (e.g. "batch:cols"; "" = replicated), overriding the rules."""
    return ShardOperation(x, layout, name).outputs[0]
