"""Max and average pooling over named spatial dims, with spatial dims split by halo exchange:
the windows, halos and lowering of `meshax.ops.conv`, over a reduction instead of a filter."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from meshax.core.errors import GraphError
from meshax.core.graph import Tensor
from meshax.core.shape import Shape
from meshax.layout import ShardingRule, slice_shape
from meshax.ops._dtypes import inexact
from meshax.ops.conv import Halo, Window, Windowed, extend, make_window, out_shape, spatial_dims, unextend, window_of
from meshax.ops.elementwise import cast
from meshax.ops.reduce import identity


class PoolOperation(Windowed):
    exchanges = ((0, 1, 1),)

    def __init__(self, x: Tensor, window: Window, kind: str, name=None):
        super().__init__([x], name=name or f"{kind}_pool")
        self.window, self.kind = window, kind
        self._add_output(out_shape(x, window, None), x.dtype)

    def sharding_rule(self) -> ShardingRule:
        """By name; spatial dims windowed."""
        return self._windowed_rule(None)

    def lower(self, ctx):
        (x,), (y,) = self.inputs, self.outputs
        _, (xl, yl), (xv,), halos, pads = self._prepare(ctx, data=0, windowed=1)
        ext = _pool_input(ctx, self.kind, x.shape, xl, xv.slices, halos)
        result = ctx.slicewise(
            lambda e, *starts: _pool(window_of(e, starts, halos), self.window, pads, self.kind, x.shape.rank),
            ext,
            *[h.start for h in halos],
        )
        ctx.add_flops(ctx.local_size(y, yl) * math.prod(self.window.size))
        ctx.set_output(y, result, yl)

    def gradient(self, grad_outputs):
        (g,), (x,) = grad_outputs, self.inputs
        if g is None:
            return [None]
        if self.kind in ("sum", "avg"):  # linear: the transpose of a sum pooling, which reads no x
            scale = 1 if self.kind == "sum" else math.prod(self.window.size)
            return [PoolTransposeOperation(g if scale == 1 else g / scale, x.shape, self.window).outputs[0]]
        return [PoolGradOperation(x, g, self.window, self.kind).outputs[0]]


class PoolGradOperation(Windowed):
    """The gradient of a pooling op with respect to its input."""

    exchanges = ((0, 1, 1),)  # (the gradient summed back; x's halo is its pooling's, extended once)

    def __init__(self, x: Tensor, g: Tensor, window: Window, kind: str, name=None):
        super().__init__([x, g], name=name or f"{kind}_pool_grad")
        self.window, self.kind = window, kind
        self._add_output(x.shape, g.dtype)

    def sharding_rule(self) -> ShardingRule:
        """By name; spatial dims windowed."""
        return self._windowed_rule(None)

    def lower(self, ctx):
        (x, g), (dx,) = self.inputs, self.outputs
        _, (xl, gl, dxl), (xv, gv), halos, pads = self._prepare(ctx, data=0, windowed=1)

        def vjp(e, gk, *starts):
            pool = lambda a: _pool(window_of(a, starts, halos), self.window, pads, self.kind, x.shape.rank)  # noqa: E731
            return jax.vjp(pool, e)[1](gk)[0]

        ext = ctx.slicewise(
            vjp, _pool_input(ctx, self.kind, x.shape, xl, xv.slices, halos), gv, *[h.start for h in halos]
        )
        ctx.add_flops(ctx.local_size(g, gl) * math.prod(self.window.size))
        ctx.set_output(dx, unextend(ctx, ext, halos), dxl)


class PoolTransposeOperation(Windowed):
    """The transpose of a sum pooling (its input gradient; average pooling's, before the
    division): each device's cotangent block spread over its extended input window, the halos
    sent back to their owners and added there. It reads no input values, so moves none."""

    exchanges = ((1, 0, 1),)  # (the result extended, summed back)

    def __init__(self, g: Tensor, x_shape: Shape, window: Window, name=None):
        super().__init__([g], name=name or "sum_pool_transpose")
        self.window = window
        self._add_output(x_shape, g.dtype)

    def sharding_rule(self) -> ShardingRule:
        """By name; spatial dims windowed."""
        return self._windowed_rule(None)

    def lower(self, ctx):
        (g,), (dx,) = self.inputs, self.outputs
        run, (gl, dxl), (gv,), halos, pads = self._prepare(ctx, data=1, windowed=0)
        local = slice_shape(dx.shape, dxl, ctx.mesh_shape)
        for h in halos:
            local[h.dim] += h.left + h.right

        def transpose(gk, *starts):
            ext = jax.ShapeDtypeStruct(tuple(local), gk.dtype)
            pool = lambda e: _pool(window_of(e, starts, halos), self.window, pads, "sum", dx.shape.rank)  # noqa: E731
            return jax.linear_transpose(pool, ext)(gk)[0]

        ext = ctx.slicewise(transpose, gv, *[h.start for h in halos])
        ctx.add_flops(ctx.local_size(g, gl) * math.prod(self.window.size))
        ctx.set_output(dx, unextend(ctx, ext, halos), dxl, run.pending)

    def gradient(self, grad_outputs):
        (c,) = grad_outputs
        return [None if c is None else PoolOperation(c, self.window, "sum").outputs[0]]


def _pool_input(ctx, kind: str, x_shape: Shape, x_layout, slices: list, halos: list[Halo]) -> list:
    """x's slices extended by their halos; for a max or min, the values beyond the ends of a
    split dim (the zeros a halo brings from no neighbour, an uneven split's padding) set to
    the identity, as the op's own padding reads."""
    ext = extend(ctx, slices, halos)
    if kind not in ("max", "min"):
        return ext
    begins = ctx.slice_begins(x_shape, x_layout)
    fill = np.array(identity(kind, ext[0].dtype), ext[0].dtype)
    for h in halos:

        def mask(e, begin, h=h, n=x_shape[h.dim].size):
            index = begin - h.left + jnp.arange(e.shape[h.dim])
            inside = ((index >= 0) & (index < n)).reshape([-1 if i == h.dim else 1 for i in range(e.ndim)])
            return jnp.where(inside, e, fill)

        ext = ctx.slicewise(mask, ext, begins[h.dim])
    return ext


def _pool(x, w: Window, pads, kind: str, rank: int):
    """The local pooling of x [..., spatial..., channel] (`kind`: max, min, avg or sum) over
    windows of w, with `pads` padding per spatial dim (read as the kind's identity)."""
    k = len(w.names)
    dims = (1,) * (rank - k - 1) + w.size + (1,)
    strides = (1,) * (rank - k - 1) + w.strides + (1,)
    dil = (1,) * (rank - k - 1) + w.dilations + (1,)
    padding = [(0, 0)] * (rank - k - 1) + list(pads) + [(0, 0)]
    if kind in ("max", "min"):
        # (a concrete init value, so that JAX knows the monoid and can differentiate it)
        fn = jax.lax.max if kind == "max" else jax.lax.min
        init = np.array(identity(kind, x.dtype), x.dtype)
        return jax.lax.reduce_window(x, init, fn, dims, strides, padding, None, dil)
    total = jax.lax.reduce_window(x, np.zeros((), x.dtype), jax.lax.add, dims, strides, padding, None, dil)
    return total if kind == "sum" else total / math.prod(w.size)


def _pool_nd(op: str, kind: str, k: int, x: Tensor, ksize, name) -> Tensor:
    window = make_window(op, spatial_dims(op, x, k), ksize, ksize, 1, "VALID")
    if x.dtype == np.bool_:
        raise GraphError(f"{op} of bool tensor {x.name}: cast it to int32 or a float first")
    if kind == "avg":  # a mean: a float for integer inputs, as jnp.mean
        x = cast(x, inexact(x.dtype))
    return PoolOperation(x, window, kind, name or op).outputs[0]


def max_pool1d(x: Tensor, ksize=2, name=None) -> Tensor:
    """Max over windows of `ksize` along the dim before the last, stride ksize (VALID)."""
    return _pool_nd("max_pool1d", "max", 1, x, ksize, name)


def max_pool2d(x: Tensor, ksize=(2, 2), name=None) -> Tensor:
    """Mesh-TensorFlow's max_pool2d: x [..., h, w, channels], windows ksize, stride ksize."""
    return _pool_nd("max_pool2d", "max", 2, x, ksize, name)


def max_pool3d(x: Tensor, ksize=(2, 2, 2), name=None) -> Tensor:
    """Max over [..., d, h, w, channels] windows of ksize, stride ksize."""
    return _pool_nd("max_pool3d", "max", 3, x, ksize, name)


def avg_pool1d(x: Tensor, ksize=2, name=None) -> Tensor:
    """Mean over windows of `ksize` along the dim before the last, stride ksize (VALID)."""
    return _pool_nd("avg_pool1d", "avg", 1, x, ksize, name)


def avg_pool2d(x: Tensor, ksize=(2, 2), name=None) -> Tensor:
    """Mesh-TensorFlow's avg_pool2d: x [..., h, w, channels], windows ksize, stride ksize."""
    return _pool_nd("avg_pool2d", "avg", 2, x, ksize, name)


def avg_pool3d(x: Tensor, ksize=(2, 2, 2), name=None) -> Tensor:
    """Mean over [..., d, h, w, channels] windows of ksize, stride ksize."""
    return _pool_nd("avg_pool3d", "avg", 3, x, ksize, name)
