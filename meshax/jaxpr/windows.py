"""Convolutions and pooling of a jaxpr, and their gradients, as meshax's windowed ops: a spatial
axis split over a mesh dim stays split, and each device takes a halo from its neighbours.

JAX writes a convolution's gradients as convolutions too, so one `conv_general_dilated` is one
of three things, read from its params (`conv_window`):

- **forward**: no input dilation. The input's spatial axes are windowed onto the result's, the
  filter's are whole (`ConvOperation`).
- **input gradient**: input dilation (the forward strides) over the cotangent, with the filter
  reversed and its features swapped. It is the transpose of a forward convolution that the
  params give back (padding `extent - 1 - lo`), so the cotangent's spatial axes are windowed
  onto the result's (`ConvInputGradOperation`, which sums each halo back to its owner).
- **filter gradient**: the input convolved with the cotangent, whose spatial axes are larger
  than the result's: the "filter" is the cotangent, the result is the filter's size. The input's
  and the cotangent's spatial axes are split together and summed (`ConvFilterGradOperation`).
  A transposed convolution's (`conv_transpose`: input dilation) filter gradient dilates its
  input instead, the small one, and comes out flipped ("flipped filter").

Max, min and sum pooling (`reduce_window_*`) and max pooling's gradient (`select_and_scatter_add`)
become `PoolOperation` and `PoolGradOperation` (`pool_window`; a max's padding reads as -inf:
those ops set what a halo brings from beyond a dim's ends so). Sum and average pooling's
gradient, which JAX writes as an interior `pad` summed by a `reduce_window_sum` (`flatten`
fuses the pair), becomes `PoolTransposeOperation`. Anything else (grouped convolutions, strides
with input dilation, negative padding) runs with its spatial axes whole.

`roles` reads the same forms, so that the axes a form windows share one dim name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax.numpy as jnp

import meshax.ops as mops
from meshax.core.graph import Tensor
from meshax.core.shape import Shape
from meshax.layout import ShardingRule
from meshax.ops.conv import ConvFilterGradOperation, ConvInputGradOperation, ConvOperation, Window
from meshax.ops.pool import PoolGradOperation, PoolOperation, PoolTransposeOperation
from meshax.ops.slicewise import SlicewiseOperation


@dataclasses.dataclass(frozen=True)
class Form:
    """What a windowed equation computes: its kind, the windowed axes (of its first operand; of
    the pooled one for a pooling's gradient), and the forward window over them (meshax's
    `Window`, its dim names left to `named`)."""

    kind: str  # a convolution's "forward", "input", "filter", "flipped filter"; a pooling's "max", "min", "sum"
    axes: tuple[int, ...]
    window: Window
    grad: bool = False  # (pooling's gradient)

    def named(self, names) -> Window:
        return dataclasses.replace(self.window, names=tuple(names))


def _form(kind: str, axes, size, strides, dilations, padding, inputs, outputs, grad: bool = False) -> Form:
    return Form(kind, tuple(axes), Window((), *map(tuple, (size, strides, dilations, padding, inputs, outputs))), grad)


def _extent(size: int, dilation: int) -> int:
    return dilation * (size - 1) + 1


def _count(n: int, pad: tuple[int, int], extent: int, stride: int) -> int:
    """Outputs of a window `extent` wide at `stride` over n values padded by `pad`."""
    total = n + pad[0] + pad[1]
    return (total - extent) // stride + 1 if total >= extent else 0


class _Params(NamedTuple):
    """A convolution's spatial sizes and params per spatial dim: input, filter, result."""

    lsz: tuple[int, ...]
    rsz: tuple[int, ...]
    osz: tuple[int, ...]
    ws: tuple[int, ...]  # window strides
    ld: tuple[int, ...]  # input (lhs) dilation
    rd: tuple[int, ...]  # filter (rhs) dilation
    pads: tuple[tuple[int, int], ...]
    axes: tuple[int, ...]  # the input's spatial axes


def _forward(c: _Params) -> Form | None:
    if any(d != 1 for d in c.ld) or any(lo < 0 or hi < 0 for lo, hi in c.pads):
        return None
    return _form("forward", c.axes, c.rsz, c.ws, c.rd, c.pads, c.lsz, c.osz)


def _transposed(pads, ext, strides, full, windowed) -> tuple | None:
    """The forward padding of a window (extents `ext`, `strides`) over `full` values giving
    `windowed` outputs whose transpose pads its input by `pads`: extent - 1 - the given, or None
    where there is none (a negative hi crops inputs no window reaches where the stride leaves a
    remainder; so does no padding)."""
    fwd = tuple((x - 1 - lo, max(0, x - 1 - hi)) for x, (lo, hi) in zip(ext, pads))
    counts = [_count(n, pad, x, s) for n, pad, x, s in zip(full, fwd, ext, strides)]
    return None if any(lo < 0 for lo, _ in fwd) or counts != list(windowed) else fwd


def _input(c: _Params) -> Form | None:
    """The transpose of a convolution strided by ld over the result."""
    if any(s != 1 for s in c.ws):
        return None
    fwd = _transposed(c.pads, [_extent(r, d) for r, d in zip(c.rsz, c.rd)], c.ld, c.osz, c.lsz)
    return None if fwd is None else _form("input", c.axes, c.rsz, c.ld, c.rd, fwd, c.osz, c.lsz)


def _filter(c: _Params) -> Form | None:
    """The filter gradient of a convolution (window: the result's size) of the input, whose
    output is the filter here (the cotangent)."""
    if any(d != 1 for d in c.ld) or any(lo < 0 for lo, _ in c.pads):
        return None
    ext = [_extent(o, s) for o, s in zip(c.osz, c.ws)]
    # (the forward's hi: the padding its last window reaches, if any; the given one differs)
    his = [max(0, (r - 1) * d + x - n - lo) for r, d, x, n, (lo, _) in zip(c.rsz, c.rd, ext, c.lsz, c.pads)]
    fwd = tuple((lo, hi) for (lo, _), hi in zip(c.pads, his))
    if any(_count(n, pad, x, d) != r for n, pad, x, d, r in zip(c.lsz, fwd, ext, c.rd, c.rsz)):
        return None
    return _form("filter", c.axes, c.osz, c.rd, c.ws, fwd, c.lsz, c.rsz)


def _flipped_filter(c: _Params) -> Form | None:
    """The filter gradient, flipped, of a convolution strided by ld over the filter (here: the
    cotangent of a transposed convolution) whose output is the input (dilated here)."""
    if any(d != 1 for d in c.rd):
        return None
    ext = [_extent(o, s) for o, s in zip(c.osz, c.ws)]
    los = [x - 1 - lo for x, (lo, _) in zip(ext, c.pads)]
    his = [max(0, (m - 1) * s + x - n - lo) for m, s, x, n, lo in zip(c.lsz, c.ld, ext, c.rsz, los)]
    fwd = tuple(zip(los, his))
    if any(lo < 0 for lo in los) or any(
        _count(n, pad, x, s) != m for n, pad, x, s, m in zip(c.rsz, fwd, ext, c.ld, c.lsz)
    ):
        return None
    return _form("flipped filter", c.axes, c.osz, c.ld, c.ws, fwd, c.rsz, c.lsz)


def conv_window(e) -> Form | None:
    """The form of a conv_general_dilated (see the module), or None where it runs whole. Where
    the filter operand is larger than the result, it is a filter gradient's cotangent."""
    p = e.params
    lhs, rhs = e.ins
    out = e.outs[0]
    if p["feature_group_count"] != 1 or p["batch_group_count"] != 1:
        return None
    if not (lhs.aval.dtype == rhs.aval.dtype == out.aval.dtype):
        return None
    lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
    if not 1 <= len(lhs_spec) - 2 <= 3:
        return None
    c = _Params(
        tuple(int(lhs.aval.shape[i]) for i in lhs_spec[2:]),
        tuple(int(rhs.aval.shape[i]) for i in rhs_spec[2:]),
        tuple(int(out.aval.shape[i]) for i in out_spec[2:]),
        tuple(p["window_strides"]),
        tuple(p["lhs_dilation"]),
        tuple(p["rhs_dilation"]),
        tuple((int(lo), int(hi)) for lo, hi in p["padding"]),
        tuple(lhs_spec[2:]),
    )
    if not jnp.issubdtype(out.aval.dtype, jnp.inexact):  # (the gradient forms lower by linear_transpose)
        return _forward(c)
    # The filter is the smaller window: the filter operand's extent against the result's as one
    # (a patchify convolution, kernel = stride, has a kernel larger than its output)
    gradient = math.prod(map(_extent, c.rsz, c.rd)) > math.prod(map(_extent, c.osz, c.ws))
    dilated = any(d != 1 for d in c.ld)
    forms = {
        (False, False): [_forward, _filter],
        (False, True): [_filter, _forward],
        (True, False): [_input, _flipped_filter],
        (True, True): [_flipped_filter, _input],
    }[(dilated, gradient)]
    return next((f for f in map(lambda form: form(c), forms) if f is not None), None)


_POOLS = {"reduce_window_max": "max", "reduce_window_min": "min", "reduce_window_sum": "sum"}
POOLS = (*_POOLS, "select_and_scatter_add", "sum_pool_transpose")  # (the primitives `pool` maps)


def _sum_pool_transpose(e) -> Form | None:
    """The window of a sum pooling whose transpose `flatten` fused (a `pad` of the cotangent, its
    interior padding the strides, summed by a stride-1 `reduce_window_sum`): the pad's padding
    is `extent - 1 - lo`, as for a convolution's input gradient."""
    p = e.params
    (g,), out = e.ins, e.outs[0]
    if not jnp.issubdtype(g.aval.dtype, jnp.inexact):  # (it lowers by linear_transpose)
        return None
    n = len(g.aval.shape)
    config, dims, dil = p["padding_config"], p["window_dimensions"], p.get("window_dilation") or (1,) * n
    if any(s != 1 for s in p["window_strides"]) or any(tuple(q) != (0, 0) for q in p["padding"]):
        return None
    if any(d != 1 for d in p.get("base_dilation") or ()) or any(lo < 0 or hi < 0 for lo, hi, _ in config):
        return None
    axes = tuple(i for i in range(n) if (tuple(config[i]), dims[i], dil[i]) != ((0, 0, 0), 1, 1))
    if not axes or len(axes) == n or len(axes) > 3:
        return None
    size = tuple(int(dims[i]) for i in axes)
    ext = [_extent(k, int(dil[i])) for k, i in zip(size, axes)]
    strides = tuple(int(config[i][2]) + 1 for i in axes)
    inputs = tuple(int(out.aval.shape[i]) for i in axes)
    outputs = tuple(int(g.aval.shape[i]) for i in axes)
    pads = _transposed([(int(config[i][0]), int(config[i][1])) for i in axes], ext, strides, inputs, outputs)
    if pads is None:
        return None
    return _form("sum", axes, size, strides, tuple(int(dil[i]) for i in axes), pads, inputs, outputs, grad=True)


def pool_window(e) -> Form | None:
    """The form of a pooling equation (see the module), or None where it runs whole."""
    p = e.params
    if e.name == "sum_pool_transpose":
        return _sum_pool_transpose(e)
    if e.name == "select_and_scatter_add":
        kind = {"ge": "max", "le": "min"}.get(getattr(p["select_prim"], "name", ""))
        kind = kind if jnp.issubdtype(e.ins[0].aval.dtype, jnp.inexact) else None  # (lowered by jax.vjp)
        out, x = e.ins  # (the cotangent, at the pooling's output size, and the pooled operand)
    elif e.name in _POOLS:
        kind, x, out = _POOLS[e.name], e.ins[0], e.outs[0]
    else:
        return None
    if kind is None or x.aval.dtype == bool or any(d != 1 for d in p.get("base_dilation") or ()):
        return None
    n = len(x.aval.shape)
    dims, strides, pads = p["window_dimensions"], p["window_strides"], p["padding"]
    dil = p.get("window_dilation") or (1,) * n
    axes = tuple(i for i in range(n) if (dims[i], strides[i], tuple(pads[i]), dil[i]) != (1, 1, (0, 0), 1))
    if not axes or len(axes) == n or len(axes) > 3:  # (the ops need a channel axis)
        return None
    return _form(
        kind,
        axes,
        tuple(int(dims[i]) for i in axes),
        tuple(int(strides[i]) for i in axes),
        tuple(int(dil[i]) for i in axes),
        tuple((int(pads[i][0]), int(pads[i][1])) for i in axes),
        tuple(int(x.aval.shape[i]) for i in axes),
        tuple(int(out.aval.shape[i]) for i in axes),
        grad=e.name == "select_and_scatter_add",
    )


def spatial_role(axis: int) -> tuple[str, int]:
    """The role (`roles`) tying a windowed axis of the operand to its windowed counterpart."""
    return ("spatial", axis)


def is_spatial(role) -> bool:
    return isinstance(role, tuple) and role[:1] == ("spatial",)


# ---- emission ------------------------------------------------------------------------------------
def _ordered(t: Tensor, axes) -> Tensor:
    """t transposed to its axes in the order `axes`: one op per tensor and order, so that a
    convolution and its filter gradient extend the same slices by one halo exchange."""
    key = ("ordered", t, tuple(axes))
    if key not in t.graph.memo:
        t.graph.memo[key] = mops.transpose(t, _shape(t.shape, axes))
    return t.graph.memo[key]


def _shape(s: Shape, axes) -> Shape:
    return Shape([s.dims[i] for i in axes])


def _flip(f: Tensor, k: int) -> Tensor:
    """f reversed along its first k dims (a filter's window, whole on every device)."""
    rule = ShardingRule.by_name([f.shape], [f.shape], whole=f.shape.dimension_names[:k])
    op = SlicewiseOperation(
        [f], lambda local, a: jnp.flip(a, tuple(range(k))), [f.shape], [f.dtype], rule=rule, name="rev"
    )
    return op.outputs[0]


def conv(e, ins: list[Tensor], outs: list[Shape]) -> list[Tensor] | None:
    """conv_general_dilated as a meshax windowed op, in meshax's order ([batch, spatial...,
    features], filter [spatial..., in, out]); None where it runs whole."""
    form = conv_window(e)
    if form is None:
        return None
    lhs_spec, rhs_spec, out_spec = e.params["dimension_numbers"]
    sp, k = lhs_spec[2:], len(lhs_spec) - 2
    a, b = ins
    names = [a.shape.dims[i].name for i in sp]
    window = form.named(names)
    if form.kind == "forward":
        x, f = _ordered(a, (lhs_spec[0], *sp, lhs_spec[1])), _ordered(b, (*rhs_spec[2:], rhs_spec[1], rhs_spec[0]))
        return ConvOperation(x, f, window, name="conv_general_dilated").outputs
    if form.kind == "input":
        g = _ordered(a, (lhs_spec[0], *sp, lhs_spec[1]))
        f = _flip(_ordered(b, (*rhs_spec[2:], rhs_spec[0], rhs_spec[1])), k)
        x_shape = _shape(outs[0], (out_spec[0], *out_spec[2:], out_spec[1]))
        return ConvInputGradOperation(f, g, x_shape, window, name="conv_general_dilated").outputs
    x = _ordered(a, (lhs_spec[1], *sp, lhs_spec[0]))  # (batch and features swapped: N is summed)
    g = _ordered(b, (rhs_spec[1], *rhs_spec[2:], rhs_spec[0]))
    f_order = (*out_spec[2:], out_spec[0], out_spec[1])
    if form.kind == "flipped filter":  # (the full-resolution tensor is the filter operand here)
        x, g, f_order = g, x, (*out_spec[2:], out_spec[1], out_spec[0])
    f_shape = _shape(outs[0], f_order)
    if set(f_shape.dimension_names[:k]) & set(x.shape.dimension_names):
        return None  # (the filter's window shares a name with the input: keep it whole)
    df = ConvFilterGradOperation(x, g, f_shape, window, name="conv_general_dilated").outputs[0]
    return [_flip(df, k) if form.kind == "flipped filter" else df]


def pool(e, ins: list[Tensor], outs: list[Shape]) -> list[Tensor] | None:
    """A pooling equation as a meshax windowed op, its windowed axes moved before one channel
    axis; None where it runs whole."""
    form = pool_window(e)
    if form is None:
        return None
    x = ins[-1]  # (select_and_scatter_add's operand follows the cotangent)
    rest = [i for i in range(x.shape.rank) if i not in form.axes]
    order = (*rest[:-1], *form.axes, rest[-1])
    xo = _ordered(x, order)
    window = form.named([x.shape.dims[i].name for i in form.axes])
    if e.name == "sum_pool_transpose":  # (x is the cotangent: the result is the full resolution)
        return PoolTransposeOperation(xo, _shape(outs[0], order), window, name=e.name).outputs
    if form.grad:
        return PoolGradOperation(xo, _ordered(ins[0], order), window, form.kind, name=e.name).outputs
    return PoolOperation(xo, window, form.kind, name=e.name).outputs
