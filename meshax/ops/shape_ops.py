"""Ops that rearrange dims: reshape (and rename/replace), transpose, broadcast.

reshape keeps a dim's split through the reshape where it is *aligned*: same size and the same
product of dims before it in both shapes, so row-major order maps its stripes onto themselves.
A dim merged from several (`[heads, d_kv] -> [(heads d_kv)]`, or split into several) and the
major dim it starts with are one *compound* factor (Shardy's term): with the same product of
dims before them, a split that divides both sizes gives each device the same contiguous run of
values in both shapes, so `heads` split over a mesh dim stays split as the merged dim. The
other dims are gathered first and split again afterwards (allsplit is free).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from meshax.core.errors import GraphError
from meshax.core.graph import Operation, Tensor
from meshax.core.shape import Dimension, Shape, anonymous_shape, convert_to_shape
from meshax.layout import ShardingRule, slice_shape
from meshax.ops._util import align, also_accepts, as_dims, dim_of, shape_of_names


def _prefixed(s: Shape) -> list[tuple[int, int]]:
    """Each dim's (product of the dims before it, size)."""
    out, p = [], 1
    for d in s:
        out.append((p, d.size))
        p *= d.size
    return out


def _aligned(a: Shape, b: Shape) -> dict[int, int]:
    """Positions i -> j of dims of `a` and `b` with equal size and equal prefix product, one to
    one: size-1 dims share their prefix product with their neighbours, so several may qualify,
    and a dim of `b` pairs with one of `a` (the same name first). Two dims of `a` paired with one
    of `b` made the other's split a factor of no result: the op kept it split and read each
    device's slice as the whole dim."""
    pa, pb = _prefixed(a), _prefixed(b)
    out: dict[int, int] = {}
    for same_name in (True, False):
        for i, key in enumerate(pa):
            js = [j for j, k in enumerate(pb) if k == key and j not in out.values()]
            js = [j for j in js if b[j].name == a[i].name] if same_name else js
            if i not in out and js:
                out[i] = js[0]
    return dict(sorted(out.items()))


def _compound(a: Shape, b: Shape, aligned: dict[int, int]) -> dict[int, int]:
    """Positions i -> j of dims of `a` and `b` that are not aligned, have sizes above 1 sharing
    a divisor above 1, and the same product of dims before them: a merged dim and the major
    dim of the ones it merges (or two dims whose runs of values start at the same place)."""

    def starts(s: Shape, skip) -> dict[int, int]:
        out: dict[int, int] = {}
        p = 1
        for i, d in enumerate(s):
            if i not in skip and d.size > 1:
                out.setdefault(p, i)
            p *= d.size
        return out

    sa, sb = starts(a, aligned), starts(b, set(aligned.values()))
    return {i: sb[p] for p, i in sa.items() if p in sb and math.gcd(a[i].size, b[sb[p]].size) > 1}


class ReshapeOperation(Operation):
    def __init__(self, x: Tensor, new_shape: Shape, name=None):
        super().__init__([x], name=name or "reshape")
        if new_shape.size != x.shape.size:
            raise GraphError(
                f"reshape of {x.name} {x.shape} ({x.shape.size} elements) to {new_shape} "
                f"({new_shape.size} elements): sizes differ"
            )
        self._add_output(new_shape, x.dtype)

    def sharding_rule(self) -> ShardingRule:
        """Aligned dims (see `_aligned`) are one factor, named after the input's dim (a rename
        keeps its split); so are a compound pair (`_compound`), split only where the split
        divides both sizes; the others belong to no factor."""
        (x,), (out,) = self.inputs, self.outputs
        pairs = _aligned(x.shape, out.shape)
        compound = _compound(x.shape, out.shape, pairs)
        pairs.update(compound)
        back = {j: i for i, j in pairs.items()}
        return ShardingRule(
            (tuple(d.name if i in pairs else None for i, d in enumerate(x.shape)),),
            (tuple(x.shape[back[j]].name if j in back else None for j in range(out.shape.rank)),),
            divides=tuple((x.shape[i].name, math.gcd(x.shape[i].size, out.shape[j].size)) for i, j in compound.items()),
        )

    def lower(self, ctx):
        (x,), (out,) = self.inputs, self.outputs
        run = ctx.layouts(self)  # aligned dims keep a split; the rest are gathered
        (in_layout,), (out_layout,) = run.operands, run.results
        v = ctx.get(x, in_layout, allow_partial=True)
        local = slice_shape(out.shape, out_layout, ctx.mesh_shape)
        ctx.set_output(out, ctx.slicewise(lambda a: jnp.reshape(a, local), v), out_layout, v.pending)

    def gradient(self, grad_outputs):
        (g,) = grad_outputs
        return [None if g is None else reshape(g, self.inputs[0].shape)]


def reshape(x: Tensor, new_shape, name=None) -> Tensor:
    """x with `new_shape` (same number of elements, row-major order); dims that line up keep their split.
    A name without a size in `new_shape` ("batch", or "batch;hidden") is x's dim of that name."""
    new_shape = shape_of_names(new_shape, [x])
    if new_shape == x.shape:
        return x
    return ReshapeOperation(x, new_shape, name).outputs[0]


def rename_dimension(x: Tensor, old_name: str, new_name: str, name=None) -> Tensor:
    """x with dim `old_name` called `new_name` (a free relabel; the split follows the dim)."""
    if isinstance(old_name, Dimension):  # (was in x.shape, but matched no dim's name: nothing renamed)
        old_name = dim_of(x, old_name).name
    if isinstance(new_name, Dimension):
        if old_name in x.shape and new_name.size != x.shape.get_dim_by_name(old_name).size:
            raise GraphError(
                f"rename_dimension: {new_name} is not the size of {x.shape.get_dim_by_name(old_name)} "
                "(a rename keeps the size: to change it, mx.reshape)"
            )
        new_name = new_name.name
    if old_name not in x.shape:
        raise GraphError(f"rename_dimension: {x.name} {x.shape} has no dimension {old_name!r}")
    dims = [d._replace(name=new_name) if d.name == old_name else d for d in x.shape]
    return reshape(x, Shape(dims), name=name or "rename_dimension")


@also_accepts(x="tensor_or_shape", old_dims="old_dim_or_dims", new_dims="new_dim_or_dims")
def replace_dimensions(tensor_or_shape, old_dim_or_dims, new_dim_or_dims, name=None):
    """Replace dim(s) `old_dim_or_dims` (adjacent) with `new_dim_or_dims` of the same total
    size: in a tensor (a reshape), or in a Shape (the new Shape)."""
    old, new = as_dims(old_dim_or_dims), as_dims(new_dim_or_dims)
    x = tensor_or_shape
    shape = x.shape if isinstance(x, Tensor) else convert_to_shape(x)
    names = shape.dimension_names
    for d in old:
        if d not in shape:
            raise GraphError(f"replace_dimensions: {shape} has no {d}")
    positions = sorted(names.index(d.name) for d in old)
    if positions != list(range(positions[0], positions[0] + len(old))):
        raise GraphError(f"replace_dimensions: {[d.name for d in old]} are not adjacent in {shape}; transpose first")
    dims = shape.dims
    new_shape = Shape(dims[: positions[0]] + new + dims[positions[-1] + 1 :])
    if not isinstance(x, Tensor):
        return new_shape
    return reshape(x, new_shape, name=name or "replace_dimensions")


class TransposeOperation(Operation):
    def __init__(self, x: Tensor, new_shape: Shape, name=None):
        super().__init__([x], name=name or "transpose")
        if sorted(new_shape.dims) != sorted(x.shape.dims):
            raise GraphError(f"transpose of {x.name} {x.shape} to {new_shape}: the dims must be the same")
        self._add_output(new_shape, x.dtype)

    def lower(self, ctx):
        (x,), (out,) = self.inputs, self.outputs
        run = ctx.layouts(self)
        (layout,) = run.results
        v = ctx.get(x, run.operands[0], allow_partial=True)
        perm = [x.shape.index(d) for d in out.shape]
        ctx.set_output(out, ctx.slicewise(lambda a: jnp.transpose(a, perm), v), layout, v.pending)

    def gradient(self, grad_outputs):
        (g,) = grad_outputs
        return [None if g is None else transpose(g, self.inputs[0].shape)]


def transpose(x: Tensor, new_shape, name=None) -> Tensor:
    """x with its dims reordered to `new_shape` (the same dims, or their names: "d;b", ["d", "b"])."""
    new_shape = shape_of_names(new_shape, [x])
    if new_shape == x.shape:
        return x
    return TransposeOperation(x, new_shape, name).outputs[0]


class BroadcastOperation(Operation):
    def __init__(self, x: Tensor, new_shape: Shape, name=None):
        super().__init__([x], name=name or "broadcast")
        missing = [d for d in x.shape if d not in new_shape]
        if missing:
            raise GraphError(f"broadcast of {x.name} {x.shape} to {new_shape}: dims {missing} would be lost")
        self._add_output(new_shape, x.dtype)

    def lower(self, ctx):
        (x,), (out,) = self.inputs, self.outputs
        run = ctx.layouts(self)
        (layout,) = run.results
        v = ctx.get(x, run.operands[0])
        local = slice_shape(out.shape, layout, ctx.mesh_shape)
        ctx.set_output(out, ctx.slicewise(lambda a: jnp.broadcast_to(align(a, x.shape, out.shape), local), v), layout)

    def remade(self, ctx, layout) -> list | None:
        """Its slices in `layout` made again from its input where the input is laid out there as
        it already is (a reader that wants the dims it adds laid out otherwise: the gradient of a
        mean, 1/n broadcast, read by a contraction): nothing moves, as XLA simplifies a gather of
        a broadcast. None where the input would have to move too."""
        (x,), (out,) = self.inputs, self.outputs
        v = ctx.values.get(x)
        axes = dict(zip(out.shape.dims, layout.axes))
        if v is None or v.pending or v.layout.axes != tuple(axes[d] for d in x.shape.dims):
            return None
        local = slice_shape(out.shape, layout, ctx.mesh_shape)
        return ctx.slicewise(lambda a: jnp.broadcast_to(align(a, x.shape, out.shape), local), v)

    def gradient(self, grad_outputs):
        (g,) = grad_outputs
        if g is None:
            return [None]
        from meshax.ops.elementwise import _sum_to

        return [_sum_to(g, self.inputs[0])]


def broadcast(x: Tensor, new_shape, name=None) -> Tensor:
    """x repeated over the dims of `new_shape` it lacks (it must have no dim `new_shape` lacks);
    a name without a size in `new_shape` is x's dim of that name."""
    new_shape = shape_of_names(new_shape, [x])
    if new_shape == x.shape:
        return x
    return BroadcastOperation(x, new_shape, name).outputs[0]


def anonymize(x: Tensor) -> Tensor:
    """x with anonymous dims (`anonymous_shape`): replicated, whatever the layout of x."""
    return reshape(x, anonymous_shape(x.shape), name="anonymize")
