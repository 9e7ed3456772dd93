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

import jax
import numpy as np

from meshax.core.errors import GraphError
from meshax.core.graph import Mesh, Operation, Tensor, as_dtype, is_floating
from meshax.core.shape import Shape, convert_to_shape
from meshax.layout import ShardingRule, slice_shape
from meshax.ops._util import also_accepts


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
        mesh: Mesh | None = None,
    ):
        super().__init__(list(inputs), mesh=mesh, name=name or "slicewise")
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


class UserSlicewiseOperation(SlicewiseOperation):
    """A user's `slicewise` function: differentiated per slice with `jax.vjp` (right where the
    split dims are ones the function works on slice by slice, as `splittable_dims` promises), or
    by the user's `grad_function(op, *grad_ys)`."""

    def __init__(self, xs, fn, shape, dtype, rule, grad_function, name):
        super().__init__(xs, lambda local, *a: self._checked(fn(*a), local[0]), [shape], [dtype], rule=rule, name=name)
        self.user_fn, self.grad_function = fn, grad_function
        self.differentiable = grad_function != 0 and is_floating(self.outputs[0].dtype)

    def _checked(self, out, local: tuple):
        """The function's slice, where it is one of the output's slices; a GraphError naming the
        function otherwise (a slice of another shape was an error from inside shard_map, or, split
        along the dims the function may keep split, an output of another size, silently; one of
        another dtype was an 'internal error')."""
        t = self.outputs[0]
        if isinstance(out, list | tuple) and len(out) == 1:  # (a one-tuple: the slice in it)
            out = out[0]
        shape, dtype = tuple(getattr(out, "shape", ())), getattr(out, "dtype", None)
        if shape != tuple(local) or dtype != t.dtype:
            fn = getattr(self.user_fn, "__name__", repr(self.user_fn))
            raise GraphError(
                f"{self.name} (created at {self.source}): the function {fn} returned a slice of shape "
                f"{list(shape)} ({dtype}), but the output {t.shape} {t.dtype} has slices of {list(local)} here: "
                "give output_shape and output_dtype the function's result has (a slice of them, where it "
                "keeps dims split)"
            )
        return out

    def gradient(self, grad_outputs):
        (g,) = grad_outputs
        if g is None:
            return [None] * len(self.inputs)
        if callable(self.grad_function):
            grads = list(self.grad_function(self, g))  # (Mesh-TensorFlow's call: op, *grad_ys)
            if len(grads) != len(self.inputs):
                raise GraphError(
                    f"slicewise op {self.name}: grad_function returned {len(grads)} gradients for "
                    f"{len(self.inputs)} inputs"
                )
            return grads
        floating = [i for i, t in enumerate(self.inputs) if is_floating(t.dtype)]
        fn, n = self.user_fn, len(self.inputs)

        def vjp(_local, *a):
            _, pull = jax.vjp(fn, *a[:n])
            grads = pull(a[n].astype(self.outputs[0].dtype))
            return tuple(grads[i] for i in floating)

        names = {d.name for t in [*self.inputs, g] for d in t.shape}
        split = {d.name for d in self.outputs[0].shape} - self.sharding_rule().whole
        shapes = [t.shape for t in [*self.inputs, g]]
        outs = [self.inputs[i] for i in floating]
        rule = ShardingRule.by_name(shapes, [t.shape for t in outs], whole=names - split)
        op = SlicewiseOperation(
            [*self.inputs, g],
            vjp,
            [t.shape for t in outs],
            [t.dtype for t in outs],
            rule=rule,
            name=f"{self.name}_grad",
        )
        found = dict(zip(floating, op.outputs))
        return [found.get(i) for i in range(n)]


@also_accepts(fn="tf_fn")
def slicewise(
    tf_fn: Callable,
    xs,
    output_shape=None,
    output_dtype=None,
    splittable_dims=None,
    grad_function=None,
    name=None,
) -> Tensor:
    """`tf_fn` (a JAX function of the slices of `xs`, in their dims' order; Mesh-TensorFlow's
    name) as an op whose output has `output_shape` (default: the first input's) and
    `output_dtype` (default: the first input's). Dims named in `splittable_dims` may stay split
    (the function must then be right on any slice of them, as an elementwise function is); all
    others are gathered first. Its gradient is the function's own, slice by slice (`jax.vjp`);
    `grad_function(op, *grad_ys)` gives one instead (the gradients of `op.inputs`), 0: none."""
    fn = tf_fn
    if not callable(fn):  # (was a TypeError at the first run)
        raise GraphError(f"slicewise needs a function of the slices, got {fn!r}")
    xs = [xs] if isinstance(xs, Tensor) else list(xs)
    if not xs or not all(isinstance(x, Tensor) for x in xs):
        raise GraphError(f"slicewise needs a list of meshax Tensors, got {xs!r}")
    shape = convert_to_shape(output_shape) if output_shape is not None else xs[0].shape
    # a splittable dim that the output lacks would leave partial results: it is gathered too
    splittable = {getattr(d, "name", d) for d in (splittable_dims or ())} & set(shape.dimension_names)
    shapes = [x.shape for x in xs]
    names = {d.name for s in [*shapes, shape] for d in s}
    rule = ShardingRule.by_name(shapes, [shape], whole=names - splittable)
    op = UserSlicewiseOperation(xs, fn, shape, output_dtype or xs[0].dtype, rule, grad_function, name or "slicewise")
    return op.outputs[0]


def cwise(tf_fn: Callable, xs, output_dtype=None, grad_function=None, name=None) -> Tensor:
    """An elementwise JAX function of same-shaped tensors (`slicewise` with every dim splittable)."""
    xs = [xs] if isinstance(xs, Tensor) else list(xs)
    return slicewise(tf_fn, xs, xs[0].shape, output_dtype, xs[0].shape.dims, grad_function, name or "cwise")
