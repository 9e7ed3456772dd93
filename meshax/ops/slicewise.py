"""`slicewise`: a JAX function run on each device's slices, with its sharding rule given as data.

Mesh-TensorFlow's escape hatch: any per-slice function is an op, as long as the caller says
which dims it may split (`splittable_dims`, Mesh-TensorFlow's name) or, fully, its sharding
rule (`ShardingRule`: factors per operand and result dim, the whole ones, and reduced factors
whose split leaves partial sums). Dims the function cannot work on split are gathered first;
a reduced factor's split leaves the results owing a sum, settled lazily like an einsum's. The
jaxpr front end (`meshax.jaxpr`) lowers most JAX primitives through this one op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from meshax.core.errors import GraphError
from meshax.core.graph import Operation, Tensor, as_dtype
from meshax.core.shape import Shape, convert_to_shape
from meshax.layout import ShardingRule, slice_shape


class SlicewiseOperation(Operation):
    """Runs `fn(local_output_shapes, *slices) -> tuple of slices` on every device.

    `rule` relates the dims (default: by name, every dim whole unless in `splittable`).
    `linear`: fn is linear in each input (add, subtract, negate), so partial sums pass
    through it. `flops`: FLOPs per output value, for the cost report (or a function of the
    outputs' local shapes giving the FLOPs of one device)."""

    def __init__(
        self,
        inputs: Sequence[Tensor],
        fn: Callable,
        output_shapes: Sequence[Shape],
        output_dtypes: Sequence,
        rule: ShardingRule | None = None,
        linear: bool = False,
        flops: int | Callable = 0,
        name: str | None = None,
    ):
        super().__init__(list(inputs), name=name or "slicewise")
        self._fn = fn
        self._rule = rule
        self.linear = linear
        self.flops = flops
        self.differentiable = False
        for shape, dtype in zip(output_shapes, output_dtypes):
            self._add_output(convert_to_shape(shape), as_dtype(dtype))

    def sharding_rule(self) -> ShardingRule:
        if self._rule is not None:
            return self._rule
        return ShardingRule.by_name([t.shape for t in self.inputs], [t.shape for t in self.outputs])

    def lower(self, ctx):
        run = ctx.layouts(self)
        rule = self.sharding_rule()
        vals = [ctx.get(t, lay, allow_partial=self.linear) for t, lay in zip(self.inputs, run.operands)]
        if len({v.pending for v in vals}) > 1:  # sums owed over different axes: settle them first
            vals = [ctx.get(t, lay) for t, lay in zip(self.inputs, run.operands)]
        if run.pending:  # reduced factors are split: padding must add nothing to the partial sums
            vals = [
                ctx.masked(v, t.shape, [d for d, f in zip(t.shape, fs) if f and rule.kind(f) == "reduced"], 0)
                for t, v, fs in zip(self.inputs, vals, rule.operands)
            ]
        local = [tuple(slice_shape(t.shape, lay, ctx.mesh_shape)) for t, lay in zip(self.outputs, run.results)]
        if callable(self.flops):
            ctx.add_flops(self.flops(local))
        elif self.flops:
            ctx.add_flops(self.flops * sum(int(np.prod(s, dtype=np.int64)) for s in local))
        outs = self._fn_slices(ctx, local, vals)
        pending = run.pending | (vals[0].pending if vals else frozenset())
        for t, slices, layout in zip(self.outputs, outs, run.results):
            ctx.set_output(t, slices, layout, pending)

    def _fn_slices(self, ctx, local, vals) -> list[list]:
        def call(*xs):
            out = self._fn(local, *xs)
            return tuple(out) if isinstance(out, list | tuple) else (out,)

        return list(ctx.slicewise(call, *vals))  # (a tuple of slice lists, one per output)

    def gradient(self, grad_outputs):
        raise GraphError(
            f"slicewise op {self.name} (created at {self.source}) has no gradient: differentiate the "
            "function before it is imported (mx.partition takes a whole training step), or build "
            "the op from meshax ops that have gradients"
        )


def slicewise(fn: Callable, xs, output_shape=None, output_dtype=None, splittable_dims=None, name=None) -> Tensor:
    """`fn` (a JAX function of the slices of `xs`, in their dims' order) as an op whose output has
    `output_shape` (default: the first input's) and `output_dtype` (default: the first input's).
    Dims named in `splittable_dims` may stay split (fn must then be right on any slice of them,
    as an elementwise function is); all others are gathered first. No gradient."""
    xs = [xs] if isinstance(xs, Tensor) else list(xs)
    if not xs or not all(isinstance(x, Tensor) for x in xs):
        raise GraphError(f"slicewise needs a list of meshax Tensors, got {xs!r}")
    shape = convert_to_shape(output_shape) if output_shape is not None else xs[0].shape
    # a splittable dim that the output lacks would leave partial results: it is gathered too
    splittable = {getattr(d, "name", d) for d in (splittable_dims or ())} & set(shape.dimension_names)
    shapes = [x.shape for x in xs]
    names = {d.name for s in [*shapes, shape] for d in s}
    rule = ShardingRule.by_name(shapes, [shape], whole=names - splittable)
    op = SlicewiseOperation(
        xs, lambda _local, *a: fn(*a), [shape], [output_dtype or xs[0].dtype], rule=rule, name=name or "slicewise"
    )
    return op.outputs[0]
