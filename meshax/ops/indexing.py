"""Index-based ops: one_hot, gather, top_k.

gather keeps a split table split: each device looks up only the rows it holds, writes zeros
for the rest, and owes a sum over the mesh dims that split the table's dim (the paper's
model-parallel embedding lookup).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from meshax.core.errors import GraphError, as_flag
from meshax.core.graph import Operation, Tensor, as_dtype
from meshax.core.shape import Dimension, Shape
from meshax.layout import ShardingRule, slice_shape
from meshax.ops import elementwise as ew
from meshax.ops._dtypes import gradient_dtype
from meshax.ops._util import also_accepts, dim_of, whole_number


def one_hot(indices: Tensor, output_dim: Dimension, on_value=1.0, off_value=0.0, dtype="float32", name=None) -> Tensor:
    """indices' dims + [output_dim]: on_value where the position equals the index."""
    from meshax.ops.inputs import constant
    from meshax.ops.inputs import range as mrange

    if not np.issubdtype(indices.dtype, np.integer):
        raise GraphError(f"one_hot needs integer indices, {indices.name} is {indices.dtype}")
    if output_dim in indices.shape:
        raise GraphError(f"one_hot: {indices.name} already has a dimension {output_dim.name!r}")
    hit = ew.equal(indices, mrange(indices.mesh, output_dim, indices.dtype))
    dtype = as_dtype(dtype)
    return ew.where(hit, constant(indices.mesh, on_value, [], dtype), constant(indices.mesh, off_value, [], dtype))


def _rows_held(ctx, shape: Shape, layout, dim: Dimension):
    """A table's looked-up dim on each device: (its axis, rows per slice, each device's first
    row, and how many of its rows are not padding)."""
    axis = shape.index(dim)
    n_local = slice_shape(shape, layout, ctx.mesh_shape)[axis]
    (begin,) = [b for d, b in zip(shape, ctx.slice_begins(shape, layout)) if d == dim]
    return axis, n_local, begin, ctx.valid_sizes(dim.size, layout.axes[axis])


class GatherOperation(Operation):
    """weights looked up at `indices` along `dim`. With `batched`, the dims weights and indices
    share are batch dims (`jnp.take_along_axis`: row i looked up in slice i): each index looks
    up in its own slice of them."""

    def __init__(self, weights: Tensor, indices: Tensor, dim: Dimension, name=None, batched: bool = False):
        super().__init__([weights, indices], name=name or "gather")
        if not np.issubdtype(indices.dtype, np.integer):
            raise GraphError(f"gather needs integer indices, {indices.name} is {indices.dtype}")
        rest = [d for d in weights.shape if d != dim]
        clash = [d for d in rest if d.name in indices.shape]
        if clash and not batched:
            names = [d.name for d in clash]
            raise GraphError(f"gather: dims {names} are in both {weights.name} and the indices {indices.name}")
        self.dim, self.batch = dim, clash
        self._add_output(Shape(indices.shape.dims + [d for d in rest if d not in clash]), weights.dtype)

    def sharding_rule(self) -> ShardingRule:
        """By name, except the table's looked-up dim: a reduced factor of its own (each device
        looks up the rows it holds and owes a sum over the mesh dims that split them), even
        when the indices have a dim of the same name (ids over a "vocab" dim: then the output's
        "vocab" is the indices')."""
        (w, idx), (out,) = self.inputs, self.outputs
        rows = f"{self.dim.name} (table rows)"
        return ShardingRule(
            (tuple(rows if d == self.dim else d.name for d in w.shape), tuple(idx.shape.dimension_names)),
            (tuple(out.shape.dimension_names),),
        )

    def lower(self, ctx):
        (w, idx), (out,) = self.inputs, self.outputs
        run = ctx.layouts(self)
        (wl, il), (out_layout,) = run.operands, run.results
        wv, iv = ctx.get(w, wl), ctx.get(idx, il)
        axis, n_local, begin, valid = _rows_held(ctx, w.shape, wl, self.dim)
        k = idx.shape.rank
        if self.batch:
            self._lower_batched(ctx, wv, iv, n_local, begin, valid, out_layout, run.pending)
            return

        def f(table, ids, b, held):
            local = ids - b
            inside = (local >= 0) & (local < held)
            got = jnp.take(table, jnp.clip(local, 0, n_local - 1), axis=axis, mode="clip")
            # jnp.take puts the index dims at `axis`: move them to the front
            perm = list(range(axis, axis + k)) + list(range(axis)) + list(range(axis + k, got.ndim))
            got = jnp.transpose(got, perm)
            mask = inside.reshape(inside.shape + (1,) * (got.ndim - k))
            return jnp.where(mask, got, jnp.zeros((), got.dtype))

        ctx.set_output(out, ctx.slicewise(f, wv, iv, begin, valid), out_layout, run.pending)

    def _lower_batched(self, ctx, wv, iv, n_local, begin, valid, out_layout, pending) -> None:
        """Each device's slices, their batch dims first and vmapped over: its rows of the looked-up
        dim taken at each index of the same batch position, zeros where it holds none."""
        (w, idx), (out,) = self.inputs, self.outputs
        batch = [d for d in idx.shape if d in self.batch]
        w_order = [*batch, *(d for d in w.shape if d not in self.batch)]
        i_order = [*batch, *(d for d in idx.shape if d not in self.batch)]
        got_order = [*i_order, *(d for d in w.shape if d != self.dim and d not in self.batch)]
        axis, k, nb = w_order.index(self.dim) - len(batch), idx.shape.rank - len(batch), len(batch)

        def take(table, ids, b, held):
            local = ids - b
            inside = (local >= 0) & (local < held)
            got = jnp.moveaxis(
                jnp.take(table, jnp.clip(local, 0, n_local - 1), axis=axis, mode="clip"),
                range(axis, axis + k),
                range(k),
            )
            return jnp.where(inside.reshape(inside.shape + (1,) * (got.ndim - k)), got, jnp.zeros((), got.dtype))

        for _ in range(nb):
            take = jax.vmap(take, in_axes=(0, 0, None, None))

        def f(table, ids, b, held):
            table = jnp.transpose(table, [w.shape.index(d) for d in w_order])
            ids = jnp.transpose(ids, [idx.shape.index(d) for d in i_order])
            return jnp.transpose(take(table, ids, b, held), [got_order.index(d) for d in out.shape])

        ctx.set_output(out, ctx.slicewise(f, wv, iv, begin, valid), out_layout, pending)

    def gradient(self, grad_outputs):
        (g,) = grad_outputs
        if g is None:
            return [None, None]
        if self.batch:
            raise GraphError(f"{self.name}: a batched gather has no gradient in meshax's autodiff")
        return [GatherGradOperation(self, g).outputs[0], None]


class GatherGradOperation(Operation):
    """The table's gradient: the upstream gradient's rows added into a table of zeros at their
    indices (a scatter-add, as JAX's gather transposes; no [indices, table rows] one-hot). A
    split table keeps its split: each device adds the rows it holds; split index dims leave a
    sum owed over their mesh dims, as an einsum over them would. Summed in the table's master
    dtype (a bfloat16 copy of a float32 table: float32)."""

    def __init__(self, gather: GatherOperation, g: Tensor):
        w, idx = gather.inputs
        super().__init__([g, idx], name=f"{gather.name}_grad")
        self.dim, self.table_shape = gather.dim, w.shape
        self._add_output(w.shape, gradient_dtype(w))

    def sharding_rule(self) -> ShardingRule:
        """The table's rows a factor of their own (passed: a split table's gradient stays split);
        the indices' dims reduced; the other table dims passed."""
        g, idx = self.inputs
        rows = f"{self.dim.name} (table rows)"
        ids = {d.name: f"{d.name} (indices)" for d in idx.shape}
        return ShardingRule(
            (
                tuple(ids.get(d.name, d.name) if i < idx.shape.rank else d.name for i, d in enumerate(g.shape)),
                tuple(ids.values()),
            ),
            (tuple(rows if d == self.dim else d.name for d in self.table_shape),),
        )

    def flops_factors(self) -> set[str]:
        """The factors its FLOPs divide by (for the search's estimate): the upstream gradient's,
        whose local rows each device adds (`lower`); a split table's rows divide none of them."""
        return {f for f in self.sharding_rule().operands[0] if f is not None}

    def lower(self, ctx):
        (g, idx), (out,) = self.inputs, self.outputs
        run = ctx.layouts(self)
        (gl, il), (wl,) = run.operands, run.results
        gv = ctx.masked(ctx.get(g, gl), g.shape, idx.shape.dimension_names, 0)  # (padding adds nothing)
        iv = ctx.get(idx, il)
        axis, n_local, begin, valid = _rows_held(ctx, self.table_shape, wl, self.dim)
        k = idx.shape.rank
        ctx.add_flops(ctx.local_size(g, gl))

        def f(gs, ids, b, held):
            local = ids - b
            rows = jnp.where((local >= 0) & (local < held), local, n_local).reshape(-1)  # (n_local: dropped)
            values = gs.reshape((-1, *gs.shape[k:])).astype(out.dtype)
            table = jnp.zeros((n_local, *gs.shape[k:]), out.dtype).at[rows].add(values, mode="drop")
            return jnp.moveaxis(table, 0, axis)

        ctx.set_output(out, ctx.slicewise(f, gv, iv, begin, valid), wl, run.pending)


class TopKOperation(Operation):
    def __init__(self, x: Tensor, dim: Dimension, k_dim: Dimension, name=None):
        super().__init__([x], name=name or "top_k")
        if k_dim.size > dim.size:
            raise GraphError(f"top_k: k={k_dim.size} is larger than {dim}")
        self.dim, self.k_dim = dim, k_dim
        self.whole_dims = (dim.name, k_dim.name)
        shape = Shape([k_dim if d == dim else d for d in x.shape])
        self._add_output(shape, x.dtype)
        self._add_output(shape, "int32")

    def lower(self, ctx):
        (x,), (values, indices) = self.inputs, self.outputs
        run = ctx.layouts(self)
        v = ctx.get(x, run.operands[0])
        axis = x.shape.index(self.dim)

        def f(a):
            vals, ids = jax.lax.top_k(jnp.moveaxis(a, axis, -1), self.k_dim.size)
            return jnp.moveaxis(vals, -1, axis), jnp.moveaxis(ids, -1, axis).astype(jnp.int32)

        vals, ids = ctx.slicewise(f, v)
        ctx.set_output(values, vals, run.results[0])
        ctx.set_output(indices, ids, run.results[1])

    def gradient(self, grad_outputs):
        g, _ = grad_outputs
        if g is None:
            return [None]
        from meshax.ops.einsum import einsum

        x = self.inputs[0]
        hot = one_hot(self.outputs[1], self.dim, dtype=g.dtype)
        return [einsum([hot, g], output_shape=x.shape)]


def gather(weights: Tensor, indices: Tensor, dim, output_shape=None, name=None, batched: bool = False) -> Tensor:
    """weights looked up at `indices` along `dim`: indices' dims followed by weights' other dims
    (in `output_shape`'s order, where given); with `batched`, the dims both have are batch dims,
    each index looked up in its own slice of them (`jnp.take_along_axis`).

    An index outside [0, dim.size) gives zeros. The lookup of a split table sums each device's
    rows (zeros where it holds none), so a bool table is looked up as int32 and cast back."""
    batched = as_flag(batched, "gather: batched", GraphError)
    if weights.dtype == np.bool_:
        return ew.cast(gather(ew.cast(weights, "int32"), indices, dim, output_shape, name, batched), bool)
    out = GatherOperation(weights, indices, dim_of(weights, dim), name, batched).outputs[0]
    return ew.to_output_shape(out, output_shape)


@also_accepts(k="k_dim")
def top_k(x: Tensor, reduced_dim, k_dim, name=None) -> tuple[Tensor, Tensor]:
    """The k largest values along reduced_dim, descending, and their int32 indices.

    The new dim is `k_dim` (a Dimension), in reduced_dim's place; an int k names it
    reduced_dim.name + "_topk"."""
    d = dim_of(x, reduced_dim)
    k_dim = k_dim if isinstance(k_dim, Dimension) else Dimension(d.name + "_topk", whole_number(k_dim, "top_k: k"))
    op = TopKOperation(x, d, k_dim, name)
    return op.outputs[0], op.outputs[1]
