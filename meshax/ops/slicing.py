"""Ops along one dim: slice, pad, concat (and split, stack, unstack built on them), shift, cumsum.

slice, pad, concat and cumsum cannot work on a split dim, so that dim is gathered first and
split again afterwards. shift keeps its dim split when it can: each device sends the
`offset` values at its edge to its neighbour with one collective permute (a halo exchange).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from meshax.core.errors import GraphError, as_flag
from meshax.core.graph import Operation, Tensor
from meshax.core.shape import Dimension, Shape
from meshax.layout import slice_shape
from meshax.lower.halo import shift_sends, shifted
from meshax.ops._dtypes import result_type, sum_dtype
from meshax.ops._util import also_accepts, dim_of, whole_number
from meshax.ops.elementwise import cast, gradient_like


def _replace_dim(shape: Shape, name: str, size: int) -> Shape:
    return Shape([Dimension(name, size) if d.name == name else d for d in shape])


class _OneDimOperation(Operation):
    """An op along `dim_name`, which its rule keeps whole: its inputs are fetched as the rule
    says (the other dims split as planned, `dim_name` gathered)."""

    dim_name: str

    @property
    def whole_dims(self) -> tuple[str, ...]:
        return (self.dim_name,)

    def _inputs_unsplit(self, ctx, allow_partial=False):
        run = ctx.layouts(self)
        vals = [ctx.get(t, lay, allow_partial=allow_partial) for t, lay in zip(self.inputs, run.operands)]
        return run.results[0], vals


class SliceOperation(_OneDimOperation):
    def __init__(self, x: Tensor, begin: int, size: int, dim_name: str, name=None):
        super().__init__([x], name=name or "slice")
        d = dim_of(x, dim_name)
        dim_name = d.name  # (a Dimension given for it matched no dim's name: the shape kept the dim whole)
        if not (begin >= 0 and size >= 0 and begin + size <= d.size):
            raise GraphError(f"slice [{begin}:{begin + size}] is outside dimension {d} of {x.name}")
        self.begin, self.size, self.dim_name = begin, size, dim_name
        self._add_output(_replace_dim(x.shape, dim_name, size), x.dtype)

    def lower(self, ctx):
        layout, (v,) = self._inputs_unsplit(ctx, allow_partial=True)
        axis = self.inputs[0].shape.index(self.dim_name)
        ctx.set_output(
            self.outputs[0],
            ctx.slicewise(lambda a: jax.lax.slice_in_dim(a, self.begin, self.begin + self.size, axis=axis), v),
            layout,
            v.pending,
        )

    def gradient(self, grad_outputs):
        (g,) = grad_outputs
        if g is None:
            return [None]
        full = self.inputs[0].shape.get_dim_by_name(self.dim_name).size
        return [pad(g, [self.begin, full - self.begin - self.size], self.dim_name)]


class PadOperation(_OneDimOperation):
    def __init__(self, x: Tensor, paddings, dim_name: str, name=None):
        super().__init__([x], name=name or "pad")
        d = dim_of(x, dim_name)
        dim_name = d.name
        try:
            before, after = paddings
        except (TypeError, ValueError):
            raise GraphError(
                f"pad: paddings must be a pair [before, after] (the entries added at each end of {d}), got {paddings!r}"
            ) from None
        before, after = whole_number(before, "pad: paddings' before"), whole_number(after, "pad: paddings' after")
        if before < 0 or after < 0:
            raise GraphError(f"pad amounts must be >= 0, got {list(paddings)}")
        self.before, self.after, self.dim_name = before, after, dim_name
        self._add_output(_replace_dim(x.shape, dim_name, d.size + before + after), x.dtype)

    def lower(self, ctx):
        layout, (v,) = self._inputs_unsplit(ctx, allow_partial=True)
        axis = self.inputs[0].shape.index(self.dim_name)
        widths = [(0, 0)] * self.inputs[0].shape.rank
        widths[axis] = (self.before, self.after)
        ctx.set_output(self.outputs[0], ctx.slicewise(lambda a: jnp.pad(a, widths), v), layout, v.pending)

    def gradient(self, grad_outputs):
        (g,) = grad_outputs
        if g is None:
            return [None]
        size = self.inputs[0].shape.get_dim_by_name(self.dim_name).size
        return [slice(g, self.before, size, self.dim_name)]


class ConcatOperation(_OneDimOperation):
    def __init__(self, xs: list[Tensor], dim_name: str, name=None):
        super().__init__(xs, name=name or "concat")
        if isinstance(dim_name, Dimension):  # (by name: the pieces' sizes differ)
            dim_name = dim_name.name
        first = xs[0].shape
        for t in xs:
            dim_of(t, dim_name)
            if _replace_dim(t.shape, dim_name, 0) != _replace_dim(first, dim_name, 0):
                raise GraphError(f"concat along {dim_name!r}: {t.name} {t.shape} does not match {first} elsewhere")
        self.dim_name = dim_name
        total = sum(t.shape.get_dim_by_name(dim_name).size for t in xs)
        self._add_output(_replace_dim(first, dim_name, total), result_type(*[t.dtype for t in xs]))

    def lower(self, ctx):
        layout, vals = self._inputs_unsplit(ctx)
        axis = self.inputs[0].shape.index(self.dim_name)
        dtype = self.outputs[0].dtype
        ctx.set_output(
            self.outputs[0],
            ctx.slicewise(lambda *a: jnp.concatenate([x.astype(dtype) for x in a], axis=axis), *vals),
            layout,
        )

    def gradient(self, grad_outputs):
        (g,) = grad_outputs
        if g is None:
            return [None] * len(self.inputs)
        grads, begin = [], 0
        for t in self.inputs:  # (a bfloat16 piece of a float32 concat: its gradient is bfloat16)
            size = t.shape.get_dim_by_name(self.dim_name).size
            grads.append(gradient_like(slice(g, begin, size, self.dim_name), t))
            begin += size
        return grads


class CumsumOperation(_OneDimOperation):
    def __init__(self, x: Tensor, dim: Dimension, exclusive: bool, name=None):
        super().__init__([x], name=name or "cumsum")
        self.dim_name = dim.name
        self.exclusive = exclusive
        self._add_output(x.shape, sum_dtype(x.dtype))  # a running count for bools, as jnp.cumsum

    def lower(self, ctx):
        layout, (v,) = self._inputs_unsplit(ctx, allow_partial=True)
        axis = self.inputs[0].shape.index(self.dim_name)

        dtype = self.outputs[0].dtype

        def f(a):
            a = a.astype(dtype)
            c = jnp.cumsum(a, axis=axis, dtype=dtype)
            return c - a if self.exclusive else c

        ctx.add_flops(ctx.local_size(self.outputs[0], layout))
        ctx.set_output(self.outputs[0], ctx.slicewise(f, v), layout, v.pending)

    def gradient(self, grad_outputs):
        (g,) = grad_outputs
        if g is None:
            return [None]
        from meshax.ops.reduce import reduce_sum
        from meshax.ops.shape_ops import broadcast

        d = self.inputs[0].shape.get_dim_by_name(self.dim_name)
        total = broadcast(reduce_sum(g, reduced_dim=d), g.shape)
        # d/dx_i of sum_j y_j: the sum of g_j over j >= i (j > i when exclusive).
        return [total - cumsum(g, d, exclusive=not self.exclusive)]


class ShiftOperation(Operation):
    def __init__(self, x: Tensor, offset: int, dim: Dimension, wrap: bool, name=None):
        super().__init__([x], name=name or "shift")
        self.offset, self.dim, self.wrap = int(offset), dim, bool(wrap)
        # a halo of |offset| values (see ShardingRule); a shift by 0 is the identity: its dim passes
        self.windows = ((dim.name, abs(self.offset)),) if self.offset else ()
        self.cyclic = (dim.name,) if self.wrap and self.offset else ()
        self._add_output(x.shape, x.dtype)

    def halo_sends(self, layouts: list, mesh_shape: Shape) -> list[tuple[int, int]]:
        """(mesh axis, bytes) of each permute its halo exchange runs, its operand and result laid
        out as `layouts` (the search's estimate counts them so)."""
        x = self.inputs[0]
        axis = x.shape.index(self.dim)
        axes, (left, right) = layouts[1].axes[axis], self._halo()
        if not axes or not left + right or self._all_zeros():
            return []
        local = slice_shape(x.shape, layouts[0], mesh_shape)
        sent = shift_sends(local, axis, self.offset, mesh_shape[axes[0]].size, self.wrap)
        return [(axes[0], math.prod(s) * x.dtype.itemsize) for s in sent]

    def _all_zeros(self) -> bool:
        """A shift by the dim's size or more, without wrapping: every value shifted out."""
        return not self.wrap and abs(self.offset) >= self.dim.size

    @property
    def fill(self):
        """Where every value is shifted out, its zeros are made on each device in any layout a
        reader asks for, as a constant's are (`ConstantOperation.fill`): moving them would count a
        collective that XLA drops (it knows they are zeros). None otherwise."""
        return self._zeros if self._all_zeros() else None

    def _zeros(self, ctx, layout) -> list:
        out = self.outputs[0]
        local = slice_shape(out.shape, layout, ctx.mesh_shape)
        return ctx.slicewise(lambda: jnp.zeros(local, out.dtype))

    def _halo(self) -> tuple[int, int]:
        """The halo a split dim needs: (left, right) widths, |offset| values on the side shifted from."""
        k = min(abs(self.offset), self.dim.size)
        return (k, 0) if self.offset > 0 else (0, k)

    @staticmethod
    def _local_shift(a, offset, axis, wrap):
        if wrap:
            return jnp.roll(a, offset, axis=axis)
        n = a.shape[axis]
        k = min(abs(offset), n)
        widths = [(0, 0)] * a.ndim
        if offset >= 0:
            widths[axis] = (k, 0)
            return jax.lax.slice_in_dim(jnp.pad(a, widths), 0, n, axis=axis)
        widths[axis] = (0, k)
        return jax.lax.slice_in_dim(jnp.pad(a, widths), k, k + n, axis=axis)

    def lower(self, ctx):
        (x,), (out,) = self.inputs, self.outputs
        run = ctx.layouts(self)  # the dim stays split (a halo exchange) or is gathered, as the rule says
        (layout,) = run.results
        axis = x.shape.index(self.dim)
        axes = layout.axes[axis]
        left, right = self._halo()
        if self._all_zeros():  # (reads no value of x: fetching it would count a gather XLA drops)
            ctx.set_output(out, self._zeros(ctx, layout), layout)
            return
        v = ctx.get(x, run.operands[0], allow_partial=True)
        if not axes or not left + right:
            ctx.set_output(
                out, ctx.slicewise(lambda a: self._local_shift(a, self.offset, axis, self.wrap), v), layout, v.pending
            )
            return
        (m,) = axes
        v = ctx.masked(v, x.shape, [self.dim], 0)  # values beyond the dim are the zeros shifted in
        ctx.set_output(out, shifted(ctx, v.slices, m, axis, self.offset, self.wrap), layout, v.pending)

    def gradient(self, grad_outputs):
        (g,) = grad_outputs
        return [None if g is None else shift(g, -self.offset, self.dim, self.wrap)]


def _whole(t: Tensor, dim_name: str) -> Tensor:
    """Mark an internal size-1 piece so that the layout never splits its `dim_name`."""
    t.operation.replicated_dims = {dim_name}
    return t


@also_accepts(dim_name="slice_dim_name")
def slice(x: Tensor, begin: int, size: int, slice_dim_name: str, name=None) -> Tensor:
    """The `size` entries of dim `slice_dim_name` from `begin` on."""
    begin, size = whole_number(begin, "slice: begin"), whole_number(size, "slice: size")
    op = getattr(x, "operation", None)
    if isinstance(op, ConcatOperation) and begin >= 0 and size > 0 and op.dim_name == dim_of(x, slice_dim_name).name:
        slice_dim_name = op.dim_name  # (a Dimension given: its name, for the pieces of other sizes)
        # a slice of a concat reads only the pieces it covers, as XLA simplifies it: the others
        # (a halo it leaves out, say) are then not computed here either, nor their moves counted
        pieces: list[Tensor] = []
        start = first = 0
        for t in op.inputs:
            n = t.shape.get_dim_by_name(slice_dim_name).size
            if start < begin + size and begin < start + n:
                first = first if pieces else start
                pieces.append(t)
            start += n
        if pieces and len(pieces) < len(op.inputs) and begin + size <= start:
            part = concat(pieces, slice_dim_name)
            part = part if part.dtype == x.dtype else cast(part, x.dtype)
            return SliceOperation(part, begin - first, size, slice_dim_name, name).outputs[0]
    return SliceOperation(x, begin, size, slice_dim_name, name).outputs[0]


def pad(x: Tensor, paddings, dim_name: str, name=None) -> Tensor:
    """x with `paddings = [before, after]` zeros added along dim `dim_name`."""
    return PadOperation(x, paddings, dim_name, name).outputs[0]


@also_accepts(dim_name="concat_dim_name")
def concat(xs: list[Tensor], concat_dim_name: str, name=None) -> Tensor:
    """The tensors joined along dim `concat_dim_name` (they agree on every other dim)."""
    xs = list(xs)
    if not xs:
        raise GraphError("concat needs at least one tensor")
    return ConcatOperation(xs, concat_dim_name, name).outputs[0] if len(xs) > 1 else xs[0]


@also_accepts(dim="split_dim", sizes="num_or_size_splits")
def split(x: Tensor, split_dim, num_or_size_splits, name=None) -> list[Tensor]:
    """Split x along `split_dim` into pieces of the given sizes (an int n: n equal pieces)."""
    d, sizes = dim_of(x, split_dim), num_or_size_splits
    if not hasattr(sizes, "__iter__"):
        sizes = whole_number(sizes, "split: the number of pieces")
        if sizes < 1 or d.size % sizes:
            raise GraphError(f"cannot split {d} into {sizes} equal pieces")
        sizes = [d.size // sizes] * sizes
    if sum(sizes) != d.size:
        raise GraphError(f"split sizes {list(sizes)} add up to {sum(sizes)}, not {d.size} ({d})")
    out, begin = [], 0
    for s in sizes:
        out.append(slice(x, begin, s, d.name))
        begin += s
    return out


def stack(xs: list[Tensor], dim_name: str, axis: int = 0, name=None) -> Tensor:
    """Stack same-shaped tensors along a new dim of size len(xs), placed at position `axis` (of
    the first tensor's dims; the others' dims may come in any order)."""
    from meshax.ops.shape_ops import reshape, transpose

    xs = list(xs)
    if not xs:
        raise GraphError("stack needs at least one tensor")
    if isinstance(dim_name, Dimension):  # (the new dim itself: its size must be the number of tensors)
        if dim_name.size != len(xs):
            raise GraphError(f"stack: the new dim {dim_name} would have {len(xs)} entries, one per tensor")
        dim_name = dim_name.name
    axis = whole_number(axis, "stack: axis")
    dims = xs[0].shape.dims
    for t in xs[1:]:
        if set(t.shape.dims) != set(dims):
            raise GraphError(f"stack needs tensors of one shape: {xs[0].name} is {xs[0].shape}, {t.name} is {t.shape}")
    xs = [t if t.shape == xs[0].shape else transpose(t, xs[0].shape) for t in xs]  # (by name, as every op)
    if not 0 <= axis <= len(dims):
        raise GraphError(f"stack axis {axis} is outside 0..{len(dims)}")
    one = Shape([*dims[:axis], Dimension(dim_name, 1), *dims[axis:]])
    return concat([_whole(reshape(t, one), dim_name) for t in xs], dim_name, name=name)


def entry(x: Tensor, index: int, dim) -> Tensor:
    """The slice of x at `index` of `dim`, without that dim."""
    from meshax.ops.shape_ops import reshape

    d = dim_of(x, dim)
    return reshape(_whole(slice(x, index, 1, d.name), d.name), Shape([e for e in x.shape if e != d]))


def unstack(x: Tensor, dim, name=None) -> list[Tensor]:
    """The slices of x at each index of `dim`, without that dim."""
    d = dim_of(x, dim)
    return [entry(x, i, d) for i in range(d.size)]


def shift(x: Tensor, offset: int, dim, wrap: bool, name=None) -> Tensor:
    """out[i] = x[i - offset] along dim; wrap=True rolls, wrap=False fills with zeros."""
    d, offset, wrap = dim_of(x, dim), whole_number(offset, "shift: offset"), as_flag(wrap, "shift: wrap", GraphError)
    if wrap and offset % d.size == 0:  # (a roll by whole turns is x: XLA moves nothing for it)
        return x
    return ShiftOperation(x, offset, d, wrap, name).outputs[0]


def cumsum(x: Tensor, dim, exclusive: bool = False, name=None) -> Tensor:
    """The running sum along `dim` (exclusive: each entry leaves out its own value)."""
    return CumsumOperation(x, dim_of(x, dim), as_flag(exclusive, "cumsum: exclusive", GraphError), name).outputs[0]


def halo_exchange(x: Tensor, blocks_dim, block_size_dim, halo_size: int, wrap: bool = False) -> Tensor:
    """Each block (an index of `blocks_dim`) extended along `block_size_dim` by `halo_size`
    entries of its neighbours on both sides (zeros past the ends unless `wrap`); the block size
    grows by 2 * halo_size. Where `blocks_dim` is split, the halos come from the neighbouring
    devices (a shift over the mesh)."""
    return _halos(x, blocks_dim, block_size_dim, halo_size, wrap, right=True)


def left_halo_exchange(x: Tensor, blocks_dim, block_size_dim, halo_size: int, wrap: bool = False) -> Tensor:
    """`halo_exchange` from the left neighbour only: the block size grows by halo_size."""
    return _halos(x, blocks_dim, block_size_dim, halo_size, wrap, right=False)


def _halos(x: Tensor, blocks_dim, block_size_dim, halo_size: int, wrap: bool, right: bool) -> Tensor:
    blocks, size = dim_of(x, blocks_dim), dim_of(x, block_size_dim)
    halo_size, wrap = whole_number(halo_size, "halo_size"), as_flag(wrap, "halo_exchange: wrap", GraphError)
    if not 0 <= halo_size <= size.size:
        raise GraphError(f"halo_size {halo_size} must be within 0..{size.size}, the block size ({size})")
    if halo_size == 0:
        return x
    # (a halo as wide as the block is all of it, not a slice: both neighbours' shifts then read
    # x, which is gathered once where the shifts gather, not once per slice)
    whole = halo_size == size.size
    left = shift(x if whole else slice(x, size.size - halo_size, halo_size, size.name), 1, blocks, wrap)
    pieces = [left, x]
    if right:
        pieces.append(shift(x if whole else slice(x, 0, halo_size, size.name), -1, blocks, wrap))
    return concat(pieces, size.name)


def pool_tensor_1d(tensor: Tensor, pool_dim, reduce_fn, pool_size: int) -> Tensor:
    """`reduce_fn` (e.g. mx.reduce_max) over windows of `pool_size` along `pool_dim`, which
    shrinks to pool_dim.size // pool_size."""
    from meshax.ops.shape_ops import replace_dimensions

    d, pool_size = dim_of(tensor, pool_dim), whole_number(pool_size, "pool_size")
    if pool_size < 1 or d.size % pool_size:
        raise GraphError(f"pool_size {pool_size} does not divide {d}")
    window = Dimension(d.name + "_pool", pool_size)
    split = replace_dimensions(tensor, d, [Dimension(d.name, d.size // pool_size), window])
    return reduce_fn(split, reduced_dim=window)


def stride_tensor_1d(tensor: Tensor, pool_dim, pool_size: int) -> Tensor:
    """Every `pool_size`-th entry along `pool_dim` (from the first), which shrinks to
    pool_dim.size // pool_size."""
    from meshax.ops.shape_ops import replace_dimensions

    d, pool_size = dim_of(tensor, pool_dim), whole_number(pool_size, "pool_size")
    if pool_size < 1 or d.size % pool_size:
        raise GraphError(f"pool_size {pool_size} does not divide {d}")
    window = Dimension(d.name + "_stride", pool_size)
    return entry(replace_dimensions(tensor, d, [Dimension(d.name, d.size // pool_size), window]), 0, window)


def dynamic_shift(x: Tensor, offset: Tensor, dim, wrap: bool) -> Tensor:
    """`shift` by a tensor: out[i] = x[i - offset] along `dim`, with a different offset for each
    index of offset's dims (a subset of x's, without `dim`); wrap=True rolls, wrap=False fills
    with zeros. A product with a permutation matrix, as Mesh-TensorFlow's."""
    from meshax.ops import elementwise as ew
    from meshax.ops.einsum import einsum
    from meshax.ops.inputs import range as mrange
    from meshax.ops.shape_ops import replace_dimensions

    d = dim_of(x, dim)
    if d in offset.shape or any(e not in x.shape for e in offset.shape):
        raise GraphError(f"dynamic_shift: offset {offset.shape} must have dims of x {x.shape} only, not {d}")
    tmp = Dimension("dynamic_shift_tmp", d.size)
    moved = mrange(x.mesh, tmp, "int32") + offset
    if wrap:
        moved = ew.mod(moved, d.size)
    permutation = ew.cast(ew.equal(mrange(x.mesh, d, "int32"), moved), x.dtype)
    return einsum([replace_dimensions(x, d, tmp), permutation], output_shape=x.shape)
