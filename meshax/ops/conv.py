"""Convolutions and pooling over named spatial dims, with spatial dims split by halo exchange.

`conv2d(x, conv_filter, strides, padding)` as in Mesh-TensorFlow: x is [..., h, w, in] (the
spatial dims are the ones before the last, the channels), the filter [fh, fw, in, out]; the
output keeps x's dim names, the spatial ones with their new sizes. Padding "SAME", "VALID" or
explicit (lo, hi) pairs; strides and dilations per spatial dim.

Lowering (GSPMD section 4.3): batch dims and `out` split freely; a split `in` leaves partial
sums; a split spatial dim stays split: each device takes from its neighbours the halo its
output block reads (`ctx.halo`, several hops where wider than a slice; where output and input
blocks differ in size, as with strides, the window's start moves per device and the halo is
the widest any device needs), and runs a VALID convolution on that window. Uneven splits: the
input's padding is zeroed first, so it reads as the convolution's own zero padding. The input
and filter gradients are two ops of their own, lowered the same way: the input gradient
sends each halo back to its owner and adds it (`ctx.halo_transpose`), the filter gradient owes
a sum over the mesh dims that split batch and spatial dims. `conv2d_transpose` is the input
gradient of a strided convolution. Pooling (`meshax.ops.pool`) uses the same windows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from meshax.core.errors import GraphError
from meshax.core.graph import Operation, Tensor
from meshax.core.shape import Dimension, Shape
from meshax.layout import ShardingRule, slice_shape
from meshax.layout.sharding_rule import Run
from meshax.lower.halo import halo_sends
from meshax.ops._dtypes import result_type
from meshax.ops.elementwise import cast


@dataclasses.dataclass(frozen=True)
class Window:
    """A window over k spatial dims: its size, strides, dilations, (lo, hi) zero padding, and
    the input and output sizes per dim."""

    names: tuple[str, ...]
    size: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]

    def extent(self, i: int) -> int:
        """Input values one output value reads along spatial dim i (the dilated window)."""
        return self.dilations[i] * (self.size[i] - 1) + 1


def _tuple(what: str, value, k: int, op: str, four: bool = False) -> tuple[int, ...]:
    """k positive ints from an int, a k-sequence, or (for strides) tf.nn's [1, ..., 1] form."""
    if isinstance(value, int | np.integer):
        value = [int(value)] * k
    value = list(value)
    if four and len(value) == k + 2 and value[0] == value[-1] == 1:
        value = value[1:-1]
    if len(value) != k or any(not isinstance(v, int | np.integer) or v < 1 for v in value):
        raise GraphError(
            f"{op}: {what} must be {k} positive ints (one per spatial dim){' or [1, ..., 1]' if four else ''}, "
            f"got {value!r}"
        )
    return tuple(int(v) for v in value)


def make_window(op: str, spatial: Sequence[Dimension], size, strides, dilations, padding) -> Window:
    """The window of an op over `spatial` dims, validated; output sizes as tf.nn computes them."""
    k = len(spatial)
    size = _tuple("the window size", size, k, op)
    strides = _tuple("strides", strides, k, op, four=True)
    dilations = _tuple("dilations", dilations, k, op, four=True)
    n = [d.size for d in spatial]
    extents = [dl * (f - 1) + 1 for f, dl in zip(size, dilations)]
    if isinstance(padding, str) and padding.upper() in ("SAME", "VALID"):
        if padding.upper() == "VALID":
            pads = [(0, 0)] * k
        else:
            pads = []
            for ni, e, s in zip(n, extents, strides):
                total = max((-(-ni // s) - 1) * s + e - ni, 0)
                pads.append((total // 2, total - total // 2))
    else:
        try:
            pads = [(int(lo), int(hi)) for lo, hi in padding]
        except (TypeError, ValueError):
            pads = []
        if len(pads) != k or any(lo < 0 or hi < 0 for lo, hi in pads):
            raise GraphError(
                f"{op}: padding must be 'SAME', 'VALID' or {k} (lo, hi) pairs of non-negative ints, got {padding!r}"
            )
    outputs = []
    for d, ni, e, s, (lo, hi) in zip(spatial, n, extents, strides, pads):
        if ni + lo + hi < e:
            raise GraphError(
                f"{op}: the window spans {e} values of {d.name} but the padded input has {ni + lo + hi} "
                f"({d.name}={ni}, padding ({lo}, {hi})); use a smaller window"
                + ("" if "pool" in op else " or dilation, or more padding")
            )
        outputs.append((ni + lo + hi - e) // s + 1)
    return Window(tuple(d.name for d in spatial), size, strides, dilations, tuple(pads), tuple(n), tuple(outputs))


# ---- the windowed lowering, shared by every op here ----------------------------------------
@dataclasses.dataclass
class Halo:
    """One split spatial dim: its position in the input, mesh axis, halo widths, each device's
    window start in the extended slice, and the window's length."""

    dim: int
    axis: int
    left: int
    right: int
    start: list
    length: int


def _widths(w: Window, x_shape: Shape, x_layout, y_shape: Shape, y_layout, mesh_shape: Shape) -> list[tuple]:
    """The halo exchange each split spatial dim needs for output slices laid out as `y_layout`,
    without each device's window start (`_halos`), and what that start is computed from."""
    out = []
    x_blocks = slice_shape(x_shape, x_layout, mesh_shape)
    y_blocks = slice_shape(y_shape, y_layout, mesh_shape)
    for i, name in enumerate(w.names):
        dx = x_shape.index(x_shape.get_dim_by_name(name))
        axes = x_layout.axes[dx]
        if not axes:
            continue
        (m,) = axes
        bi, bo = x_blocks[dx], y_blocks[y_shape.index(y_shape.get_dim_by_name(name))]
        s, lo, parts = w.strides[i], w.padding[i][0], mesh_shape[m].size
        length = (bo - 1) * s + w.extent(i)
        # device c reads input [c*bo*s - lo, ... + length) and holds [c*bi, (c+1)*bi)
        lefts = [c * bi - (c * bo * s - lo) for c in range(parts)]
        left = max(0, *lefts)
        right = max(0, *[length - lc - bi for lc in lefts])
        out.append((Halo(dx, m, left, right, [], length), (bi, bo, s, lo)))
    return out


def _halos(ctx, w: Window, x_shape: Shape, x_layout, y_shape: Shape, y_layout) -> list[Halo]:
    """`_widths`, with each device's window start in its extended slice (traced)."""
    out = []
    for h, (bi, bo, s, lo) in _widths(w, x_shape, x_layout, y_shape, y_layout, ctx.mesh_shape):
        start = ctx.slicewise(
            lambda c, bi=bi, bo=bo, s=s, lo=lo, left=h.left: left - (c * bi - (c * bo * s - lo)), ctx.pcoord(h.axis)
        )
        out.append(dataclasses.replace(h, start=start))
    return out


def _operand(ctx, t: Tensor, layout, out: Shape, window: Window):
    """t fetched in `layout`, its padding zeroed along the spatial dims (it would read as data)
    and along the dims the op sums over (those `out` lacks: channels contracted, batch summed)."""
    summed = [d.name for d in t.shape if d.name not in out.dimension_names]
    return ctx.masked(ctx.get(t, layout), t.shape, [*window.names, *summed], 0)


def extend(ctx, slices: list, halos: list[Halo]) -> list:
    for h in halos:
        slices = ctx.halo(slices, h.axis, h.dim, h.left, h.right)
    return slices


def unextend(ctx, slices: list, halos: list[Halo]) -> list:
    for h in reversed(halos):
        slices = ctx.halo_transpose(slices, h.axis, h.dim, h.left, h.right)
    return slices


def window_of(ext, starts, halos: list[Halo]):
    """The part of the extended slice the device's outputs read (traced starts)."""
    for h, start in zip(halos, starts):
        ext = jax.lax.dynamic_slice_in_dim(ext, start, h.length, axis=h.dim)
    return ext


def _local_padding(w: Window, halos: list[Halo], x_shape: Shape) -> list[tuple[int, int]]:
    """Per spatial dim, the zero padding the local op adds: none where a halo brought it."""
    split = {h.dim for h in halos}
    return [
        (0, 0) if x_shape.index(x_shape.get_dim_by_name(n)) in split else w.padding[i] for i, n in enumerate(w.names)
    ]


def out_shape(x: Tensor, w: Window, channel: Dimension | None) -> Shape:
    sizes = dict(zip(w.names, w.outputs))
    dims = [Dimension(d.name, sizes[d.name]) if d.name in sizes else d for d in x.shape]
    if channel is not None:
        dims[-1] = channel
    return Shape(dims)


def _dimension_numbers(k: int) -> tuple[str, str, str]:
    """conv_general_dilated's dimension numbers for [batch, spatial..., channel] (the leading
    dims flattened into one batch dim) and a filter [spatial..., in, out]."""
    sp = "DHW"[-k:]
    return (f"N{sp}C", f"{sp}IO", f"N{sp}C")


def _conv(x, f, w: Window, pads, k: int):
    """The local convolution: x [batch..., spatial..., in], f [spatial..., in, out]."""
    lead = x.shape[: x.ndim - k - 1]
    flat = x.reshape((math.prod(lead), *x.shape[x.ndim - k - 1 :]))
    y = jax.lax.conv_general_dilated(
        flat,
        f,
        window_strides=w.strides,
        padding=pads,
        rhs_dilation=w.dilations,
        dimension_numbers=_dimension_numbers(k),
        preferred_element_type=x.dtype,
    )
    return y.reshape(lead + y.shape[1:])


class Windowed(Operation):
    """Base of the ops here: by-name rules whose spatial dims are windowed and whose filter's
    window dims (the first k of the filter, or of the filter gradient) are whole."""

    window: Window
    # the halo exchanges its lowering runs: (the full-resolution tensor's position in inputs +
    # outputs, the windowed one's, how many times: an exchange and its transpose are two)
    exchanges: tuple[tuple[int, int, int], ...]

    def halo_sends(self, layouts: list, mesh_shape: Shape) -> list[tuple[int, int]]:
        """(mesh axis, bytes) of each permute its halo exchanges run, with its operands and then
        its results laid out as `layouts` (the search's estimate counts them so)."""
        tensors = [*self.inputs, *self.outputs]
        out = []
        for data, windowed, times in self.exchanges:
            x, y = tensors[data], tensors[windowed]
            local = list(slice_shape(x.shape, layouts[data], mesh_shape))
            for h, _ in _widths(self.window, x.shape, layouts[data], y.shape, layouts[windowed], mesh_shape):
                sent = halo_sends(local, h.dim, h.left, h.right, mesh_shape[h.axis].size)
                out += [(h.axis, math.prod(s) * x.dtype.itemsize) for s in sent] * times
                local[h.dim] += h.left + h.right
        return out

    def _windowed_rule(self, filter_shape: Shape | None) -> ShardingRule:
        k = len(self.window.names)
        return ShardingRule.by_name(
            [t.shape for t in self.inputs],
            [t.shape for t in self.outputs],
            whole=filter_shape.dimension_names[:k] if filter_shape is not None else (),
            # (the halo a device's block needs, both sides: the window's extent less its stride,
            # as consecutive output blocks read input blocks that far apart)
            windows=[
                (n, max(self.window.extent(i) - self.window.strides[i], 0)) for i, n in enumerate(self.window.names)
            ],
        )

    def _prepare(self, ctx, data: int, windowed: int) -> _Prepared:
        """What every lowering here starts with: how the op runs, its operands fetched and
        masked (`_operand`), and the halos that the full-resolution tensor (position `data`
        in inputs + outputs) needs for the blocks of the windowed one (position `windowed`)."""
        run = ctx.layouts(self)
        tensors, layouts = [*self.inputs, *self.outputs], [*run.operands, *run.results]
        out = self.outputs[0].shape
        values = [_operand(ctx, t, lay, out, self.window) for t, lay in zip(self.inputs, run.operands)]
        x, y = tensors[data], tensors[windowed]
        halos = _halos(ctx, self.window, x.shape, layouts[data], y.shape, layouts[windowed])
        return _Prepared(run, layouts, values, halos, _local_padding(self.window, halos, x.shape))


class _Prepared(NamedTuple):
    run: Run
    layouts: list  # of the operands, then the results
    values: list  # the operands' LaidOutTensors
    halos: list[Halo]
    pads: list[tuple[int, int]]  # the local op's zero padding per spatial dim


class ConvOperation(Windowed):
    exchanges = ((0, 2, 1),)  # (x extended)

    def __init__(self, x: Tensor, kernel: Tensor, window: Window, name=None):
        super().__init__([x, kernel], name=name or "conv")
        self.window = window
        self._add_output(out_shape(x, window, kernel.shape[-1]), x.dtype)

    def sharding_rule(self) -> ShardingRule:
        """By name; spatial dims windowed, the filter's window dims whole, `in` reduced."""
        return self._windowed_rule(self.inputs[1].shape)

    def lower(self, ctx):
        (_, f), (y,) = self.inputs, self.outputs
        run, (_, fl, yl), (xv, fv), halos, pads = self._prepare(ctx, data=0, windowed=2)
        k = len(self.window.names)
        ext = extend(ctx, xv.slices, halos)
        result = ctx.slicewise(
            lambda e, fk, *starts: _conv(window_of(e, starts, halos), fk, self.window, pads, k),
            ext,
            fv,
            *[h.start for h in halos],
        )
        ctx.add_flops(
            2 * ctx.local_size(y, yl) * math.prod(self.window.size) * slice_shape(f.shape, fl, ctx.mesh_shape)[-2]
        )
        ctx.set_output(y, result, yl, run.pending)

    def gradient(self, grad_outputs):
        (g,), (x, f) = grad_outputs, self.inputs
        if g is None:
            return [None, None]
        return [
            ConvInputGradOperation(f, g, x.shape, self.window).outputs[0],
            ConvFilterGradOperation(x, g, f.shape, self.window).outputs[0],
        ]


class ConvInputGradOperation(Windowed):
    """The gradient of a convolution with respect to its input x (also conv_transpose)."""

    exchanges = ((2, 1, 1),)  # (the gradient over the extended x, summed back)

    def __init__(self, kernel: Tensor, g: Tensor, x_shape: Shape, window: Window, name=None):
        super().__init__([kernel, g], name=name or "conv_input_grad")
        self.window = window
        self._add_output(x_shape, g.dtype)

    def sharding_rule(self) -> ShardingRule:
        """By name; spatial dims windowed, the filter's window dims whole, `out` reduced."""
        return self._windowed_rule(self.inputs[0].shape)

    def lower(self, ctx):
        (f, g), (dx,) = self.inputs, self.outputs
        run, (fl, gl, dxl), (fv, gv), halos, pads = self._prepare(ctx, data=2, windowed=1)
        k = len(self.window.names)
        local = slice_shape(dx.shape, dxl, ctx.mesh_shape)
        for h in halos:
            local[h.dim] += h.left + h.right

        def transpose(fk, gk, *starts):
            ext = jax.ShapeDtypeStruct(tuple(local), gk.dtype)
            conv = jax.linear_transpose(lambda e: _conv(window_of(e, starts, halos), fk, self.window, pads, k), ext)
            return conv(gk)[0]

        ext = ctx.slicewise(transpose, fv, gv, *[h.start for h in halos])
        ctx.add_flops(
            2 * ctx.local_size(g, gl) * math.prod(self.window.size) * slice_shape(f.shape, fl, ctx.mesh_shape)[-2]
        )
        ctx.set_output(dx, unextend(ctx, ext, halos), dxl, run.pending)

    def gradient(self, grad_outputs):
        (c,), (f, g) = grad_outputs, self.inputs
        if c is None:
            return [None, None]
        return [
            ConvFilterGradOperation(c, g, f.shape, self.window).outputs[0],
            ConvOperation(c, f, self.window).outputs[0],
        ]


class ConvFilterGradOperation(Windowed):
    """The gradient of a convolution with respect to its filter: a sum over batch and space."""

    exchanges = ()  # (x's halo is its convolution's: the lowering extends the same slices once)

    def __init__(self, x: Tensor, g: Tensor, f_shape: Shape, window: Window, name=None):
        super().__init__([x, g], name=name or "conv_filter_grad")
        self.window = window
        self._add_output(f_shape, g.dtype)

    def sharding_rule(self) -> ShardingRule:
        """By name; spatial dims windowed (and summed: see `lower`), batch dims reduced."""
        return self._windowed_rule(self.outputs[0].shape)

    def lower(self, ctx):
        (_, g), (df,) = self.inputs, self.outputs
        run, (_, gl, dfl), (xv, gv), halos, pads = self._prepare(ctx, data=0, windowed=1)
        k = len(self.window.names)
        local = tuple(slice_shape(df.shape, dfl, ctx.mesh_shape))
        ext = extend(ctx, xv.slices, halos)

        def transpose(e, gk, *starts):
            win = window_of(e, starts, halos)
            conv = jax.linear_transpose(
                lambda fk: _conv(win, fk, self.window, pads, k), jax.ShapeDtypeStruct(local, gk.dtype)
            )
            return conv(gk)[0]

        result = ctx.slicewise(transpose, ext, gv, *[h.start for h in halos])
        ctx.add_flops(2 * ctx.local_size(g, gl) * math.prod(self.window.size) * local[-2])
        ctx.set_output(df, result, dfl, self.owed(run))

    def owed(self, run: Run) -> frozenset[int]:
        """The mesh axes its result is a partial sum over: the rule's, and the split spatial dims'
        (windowed, not reduced, in the rule; the search's estimate asks this too)."""
        return run.pending | {m for n in self.window.names for m in run.assign.get(n, ())}

    def gradient(self, grad_outputs):
        (c,), (x, g) = grad_outputs, self.inputs
        if c is None:
            return [None, None]
        return [
            ConvInputGradOperation(c, g, x.shape, self.window).outputs[0],
            ConvOperation(x, c, self.window).outputs[0],
        ]


# ---- the public functions: Mesh-TensorFlow's names and argument order ------------------------
def spatial_dims(op: str, x: Tensor, k: int) -> list[Dimension]:
    """The k dims before x's last (channel) dim."""
    if x.shape.rank < k + 1:
        raise GraphError(f"{op}: {x.name} {x.shape} needs at least {k + 1} dims: [..., {k} spatial dims, channels]")
    return list(x.shape.dims[-k - 1 : -1])


def _same_dtype(op: str, x: Tensor, f: Tensor) -> tuple[Tensor, Tensor]:
    """x and the filter in one dtype (JAX's promotion of the two), bools refused."""
    bools = [t.name for t in (x, f) if t.dtype == np.bool_]
    if bools:
        raise GraphError(f"{op} sums products, and {bools} are bool: cast them to int32 or a float first")
    dtype = result_type(x.dtype, f.dtype)
    return cast(x, dtype), cast(f, dtype)


def _check_filter(op: str, x: Tensor, f: Tensor, k: int, form: str, channels_at: int) -> None:
    """A filter [`form`] (rank k + 2) whose dim at `channels_at` (in for a convolution, the last
    for a transpose) is x's channels, and whose other dims are not x's (a dim names one thing)."""
    if f.shape.rank != k + 2:
        raise GraphError(f"{op}: the filter must be [{form}], got {f.name} {f.shape}")
    x_channels = f.shape[channels_at]
    if x_channels != x.shape[-1]:
        raise GraphError(
            f"{op}: the filter's input channels {x_channels.name}={x_channels.size} must be x's last dim "
            f"{x.shape[-1].name}={x.shape[-1].size} ({x.name} {x.shape})"
        )
    clash = [d.name for d in f.shape if d != x_channels and d.name in x.shape.dimension_names]
    if clash:
        raise GraphError(f"{op}: filter dims {clash} are also dims of {x.name} {x.shape}; give them other names")


def _conv_nd(op: str, k: int, x: Tensor, conv_filter: Tensor, strides, padding, dilations, name) -> Tensor:
    spatial = spatial_dims(op, x, k)
    _check_filter(op, x, conv_filter, k, f"{k} window dims, in, out", -2)
    x, f = _same_dtype(op, x, conv_filter)
    window = make_window(op, spatial, [d.size for d in f.shape.dims[:k]], strides, dilations, padding)
    return ConvOperation(x, f, window, name or op).outputs[0]


def conv1d(x: Tensor, conv_filter: Tensor, stride=1, padding="SAME", name=None, dilations=1) -> Tensor:
    """1-D convolution: x [..., length, in], filter [fl, in, out] -> [..., length', out]."""
    return _conv_nd("conv1d", 1, x, conv_filter, stride, padding, dilations, name)


def conv2d(x: Tensor, conv_filter: Tensor, strides=(1, 1), padding="SAME", name=None, dilations=1) -> Tensor:
    """2-D convolution as Mesh-TensorFlow's (and tf.nn's): x [..., h, w, in], filter [fh, fw,
    in, out] -> [..., h', w', out]; strides (sh, sw) or [1, sh, sw, 1]; padding "SAME",
    "VALID" or ((lo, hi), (lo, hi)). Split h and w over mesh dims: halos are exchanged."""
    return _conv_nd("conv2d", 2, x, conv_filter, strides, padding, dilations, name)


def conv3d(x: Tensor, conv_filter: Tensor, strides=(1, 1, 1), padding="SAME", name=None, dilations=1) -> Tensor:
    """3-D convolution: x [..., d, h, w, in], filter [fd, fh, fw, in, out]."""
    return _conv_nd("conv3d", 3, x, conv_filter, strides, padding, dilations, name)


def _conv_transpose_nd(op: str, k: int, x: Tensor, conv_filter: Tensor, strides, padding, name) -> Tensor:
    spatial = spatial_dims(op, x, k)
    _check_filter(op, x, conv_filter, k, f"{k} window dims, out, in", -1)
    x, f = _same_dtype(op, x, conv_filter)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        raise GraphError(f"{op} is the gradient of a convolution, taken in floats: cast {x.name} to a float first")
    size = [d.size for d in f.shape.dims[:k]]
    st = _tuple("strides", strides, k, op, four=True)
    if not (isinstance(padding, str) and padding.upper() in ("SAME", "VALID")):
        raise GraphError(f"{op}: padding must be 'SAME' or 'VALID', got {padding!r}")
    same = padding.upper() == "SAME"
    out = [Dimension(d.name, d.size * s if same else (d.size - 1) * s + f_) for d, s, f_ in zip(spatial, st, size)]
    window = make_window(op, out, size, st, 1, padding)
    dx_shape = Shape(list(x.shape.dims[: -k - 1]) + out + [f.shape[-2]])
    return ConvInputGradOperation(f, x, dx_shape, window, name or op).outputs[0]


def conv2d_transpose(x: Tensor, conv_filter: Tensor, strides=(1, 1), padding="SAME", name=None) -> Tensor:
    """The transpose (gradient) of conv2d, as Mesh-TensorFlow's: x [..., h, w, in], filter
    [fh, fw, out, in] -> [..., h*sh, w*sw, out] ("SAME") or [..., (h-1)*sh + fh, ...] ("VALID")."""
    return _conv_transpose_nd("conv2d_transpose", 2, x, conv_filter, strides, padding, name)


def conv3d_transpose(x: Tensor, conv_filter: Tensor, strides=(1, 1, 1), padding="SAME", name=None) -> Tensor:
    """The transpose of conv3d: x [..., d, h, w, in], filter [fd, fh, fw, out, in]."""
    return _conv_transpose_nd("conv3d_transpose", 3, x, conv_filter, strides, padding, name)
