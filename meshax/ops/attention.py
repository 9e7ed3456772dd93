"""Fused attention: softmax(q k^T / sqrt(d)) v as one `jax.nn.dot_product_attention` per device.

On a GPU that is cuDNN's fused kernel (no [length, memory_length] matrix in memory), elsewhere
XLA's. The op's sharding rule keeps the two sequence dims and the contracted dim whole (the
kernel needs them on one device; a layout that splits them is gathered first, as any whole
factor is) and passes every other dim: batch and heads may be split over any mesh dims, with no
communication. Masks stay masks: `causal` is the kernel's own flag, and a boolean `mask` (which
keys a query may see, e.g. [batch, memory_length] for padding) is broadcast per device, never
turned into a float bias over the whole [length, memory_length].

Where the graph differentiates it, the forward runs as `jax.vjp` of the kernel, and the gradient
op applies that pullback (cuDNN's saved softmax statistics, or XLA's probabilities) when it gets
the very same q, k, v slices in the same program; otherwise (resharded in between, or traced
apart) it runs `jax.vjp` again. XLA does not merge the two: cuDNN's forward is a different call
with and without the statistics. A graph without its gradient (decoding) runs the forward-only
kernel.

FLOPs are counted as the einsum attention counts its two matmuls (4 x queries x keys x d_kv per
head) and, for the gradient, its four; cuDNN's backward recomputes the softmax from its
statistics as flash attention does, which the count leaves out.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from meshax.core.errors import GraphError, as_flag
from meshax.core.graph import Tensor, is_floating
from meshax.core.shape import Dimension
from meshax.layout import ShardingRule
from meshax.ops._util import dim_of
from meshax.ops.slicewise import SlicewiseOperation


class _Dims:
    """Which dim of q, k, v is which: the query and key sequence dims, the contracted d_kv, the
    heads (or none), and the rest (batch-like, merged into the kernel's batch)."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, d_kv: Dimension, heads: Dimension | None, mask):
        if not is_floating(q.dtype) or len({q.dtype, k.dtype, v.dtype}) > 1:
            raise GraphError(
                f"fused attention needs float queries, keys and values of one dtype, got {q.dtype}, {k.dtype}, "
                f"{v.dtype}: cast them (mx.cast)"
            )
        if k.shape != v.shape:
            raise GraphError(f"fused attention: keys {k.shape} and values {v.shape} must have the same dims")
        self.d_kv, self.heads = d_kv.name, heads.name if heads is not None else None
        for t in (q, k):
            if d_kv not in t.shape or (heads is not None and heads not in t.shape):
                raise GraphError(f"fused attention: {t.name} {t.shape} needs the dims {d_kv} and {heads}")
        only_q = [d for d in q.shape if d not in k.shape]
        only_k = [d for d in k.shape if d not in q.shape]
        if len(only_q) != 1 or len(only_k) != 1:
            raise GraphError(
                f"fused attention: the queries {q.shape} and keys {k.shape} must differ in exactly one dim "
                "each (the query and key sequence dims, e.g. length and memory_length)"
            )
        self.length, self.memory_length = only_q[0].name, only_k[0].name
        kernel = {self.length, self.d_kv, self.heads}
        self.others = [d.name for d in q.shape if d.name not in kernel]
        if mask is not None:
            if mask.dtype != np.bool_:
                raise GraphError(f"fused attention: the mask {mask.name} must be bool (True: the key is seen)")
            stray = [d.name for d in mask.shape if d.name not in {*self.others, self.length, self.memory_length}]
            if stray:
                raise GraphError(f"fused attention: the mask {mask.name} {mask.shape} has dims {stray} q and k lack")

    @property
    def whole(self) -> set[str]:
        return {self.length, self.memory_length, self.d_kv}

    def to_kernel(self, a, names: list[str], seq: str):
        """A local slice -> [B, T, N, H] (the kernel's layout)."""
        order = [*self.others, seq, *([self.heads] if self.heads else []), self.d_kv]
        a = jnp.transpose(a, [names.index(n) for n in order])
        batch = math.prod(a.shape[: len(self.others)])
        return a.reshape(batch, a.shape[len(self.others)], a.shape[-2] if self.heads else 1, a.shape[-1])

    def from_kernel(self, a, names: list[str], like_shape):
        """[B, T, N, H] -> a local slice with `names` (the inverse of to_kernel)."""
        order = [*self.others, self.length, *([self.heads] if self.heads else []), self.d_kv]
        sizes = {n: like_shape[names.index(n)] for n in names}
        a = a.reshape([sizes[n] for n in order])
        return jnp.transpose(a, [order.index(n) for n in names])

    def mask_to_kernel(self, m, names: list[str], batch_sizes: dict[str, int]):
        """A local bool mask slice -> broadcastable to [B, N, T, S]."""
        full = [*self.others, self.length, self.memory_length]
        present = [n for n in full if n in names]
        m = jnp.transpose(m, [names.index(n) for n in present])
        m = m.reshape([m.shape[present.index(n)] if n in present else 1 for n in full])
        m = jnp.broadcast_to(m, [batch_sizes[n] for n in self.others] + list(m.shape[len(self.others) :]))
        return m.reshape(math.prod(m.shape[: len(self.others)]), 1, m.shape[-2], m.shape[-1])


def _kernel(dims: _Dims, names: list[list[str]], causal: bool, scale: float, implementation):
    """The per-device function of the platform of the devices it runs on (`MeshImpl.platform`) and the
    local q, k, v (and mask) slices -> the output slice."""
    qn, kn = names[0], names[1]

    def run(platform, q, k, v, mask=None):
        sizes = {n: q.shape[qn.index(n)] for n in dims.others}
        m = dims.mask_to_kernel(mask, names[3], sizes) if mask is not None else None
        out = _attend(
            dims.to_kernel(q, qn, dims.length),
            dims.to_kernel(k, kn, dims.memory_length),
            dims.to_kernel(v, kn, dims.memory_length),
            mask=m,
            scale=scale,
            is_causal=causal,
            implementation=implementation,
            platform=platform,
        )
        return dims.from_kernel(out, qn, q.shape)

    return run


def _path(dtype, implementation, platform: str) -> str:
    """How `_attend` runs attention of `dtype` inputs on `platform`'s devices: "cudnn" (asked
    for first, on a GPU, in 16 bits), "float32" (float16 on the CPU, widened: XLA's attention
    sums float16 products in float32, a matmul XLA:CPU does not run) or "as given" (JAX's
    choice, or the caller's `implementation`)."""
    if implementation is None and dtype in (jnp.bfloat16, jnp.float16) and platform == "gpu":
        return "cudnn"
    if dtype == jnp.float16 and implementation != "cudnn" and platform == "cpu":
        return "float32"
    return "as given"


def _attend(q, k, v, implementation, platform: str, **kw):
    """`jax.nn.dot_product_attention` on `platform`'s devices, choosing cuDNN on a GPU where JAX
    would not: with implementation=None, jax 0.11 runs XLA's attention (5x slower than cuDNN's on
    an H100, forward and backward at 125M). cuDNN takes 16-bit inputs; where it refuses these
    shapes, XLA's."""
    path = _path(q.dtype, implementation, platform)
    if path == "cudnn":
        try:
            return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **kw)
        except (ValueError, NotImplementedError):
            pass  # not for these shapes (e.g. a [batch, keys] padding mask, which cuDNN takes as a bias)
        except RuntimeError as err:  # no cuDNN; a failure of another kind (out of memory) is raised
            if "cudnn" not in str(err).lower():
                raise
    if path == "float32":
        wide = (t.astype(jnp.float32) for t in (q, k, v))
        return jax.nn.dot_product_attention(*wide, implementation=implementation, **kw).astype(q.dtype)
    return jax.nn.dot_product_attention(q, k, v, implementation=implementation, **kw)


class AttentionOperation(SlicewiseOperation):
    """Fused attention of q, k, v (and a bool mask); output shaped like q."""

    def __init__(self, q, k, v, mask, dims: _Dims, causal: bool, scale: float, implementation, name=None):
        inputs = [q, k, v] + ([mask] if mask is not None else [])
        names = [list(t.shape.dimension_names) for t in inputs]
        rule = ShardingRule.by_name([t.shape for t in inputs], [q.shape], whole=dims.whole)
        kernel = _kernel(dims, names, causal, scale, implementation)
        keys = k.shape.get_dim_by_name(dims.memory_length).size
        super().__init__(
            inputs,
            kernel,  # (called with the devices' platform, not the local shapes: `_fn_slices`)
            [q.shape],
            [q.dtype],
            rule=rule,
            flops=lambda local: 4 * keys * int(np.prod(local[0], dtype=np.int64)),
            name=name or "attention",
        )
        self.differentiable = True
        self._kernel, self._dims = kernel, dims
        self._differentiated = False  # (set when the gradient op is built)

    def _fn_slices(self, ctx, local, vals):
        """The output; where the graph has this op's gradient, as `jax.vjp` of the kernel, its
        pullback kept for the gradient op (elsewhere, decoding say, the forward-only kernel)."""
        kernel = functools.partial(self._kernel, ctx.impl.platform)
        if not self._differentiated:
            return [ctx.slicewise(kernel, *vals)]

        def forward(q, k, v, *mask):
            return jax.vjp(lambda q, k, v: kernel(q, k, v, *mask), q, k, v)

        out, pulls = ctx.slicewise(forward, *vals)
        ctx.remember("attention", _slices(vals), pulls)
        return [out]

    def gradient(self, grad_outputs):
        (g,) = grad_outputs
        if g is None:
            return [None] * len(self.inputs)
        op = AttentionGradOperation(self, g)
        self._differentiated = True
        return [*op.outputs, *([None] if len(self.inputs) == 4 else [])]


class AttentionGradOperation(SlicewiseOperation):
    """The gradients of q, k and v: `jax.vjp` of the forward's kernel, per device."""

    def __init__(self, forward: AttentionOperation, g: Tensor):
        q, k, v, *mask = forward.inputs
        kernel, dims = forward._kernel, forward._dims
        inputs = [q, k, v, g, *mask]
        rule = ShardingRule.by_name([t.shape for t in inputs], [q.shape, k.shape, v.shape], whole=dims.whole)
        keys = k.shape.get_dim_by_name(dims.memory_length).size

        def grads(platform, q, k, v, g, *mask):
            _, vjp = jax.vjp(lambda q, k, v: kernel(platform, q, k, v, *mask), q, k, v)
            return vjp(g)

        super().__init__(
            inputs,
            grads,  # (called with the devices' platform, not the local shapes: `_fn_slices`)
            [q.shape, k.shape, v.shape],
            [q.dtype, k.dtype, v.dtype],
            rule=rule,
            flops=lambda local: 8 * keys * int(np.prod(local[0], dtype=np.int64)),
            name=f"{forward.name}_grad",
        )

    def _fn_slices(self, ctx, local, vals):
        q, k, v, g, *mask = vals
        pulls = ctx.recall("attention", _slices([q, k, v, *mask]))
        if pulls is None:  # not the forward's slices: its kernel runs again
            return list(ctx.slicewise(functools.partial(self._fn, ctx.impl.platform), *vals))
        return list(ctx.slicewise(lambda pull, g: tuple(pull(g)), pulls, g))


def _slices(vals) -> list:
    return [s for v in vals for s in v.slices]


def fused_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    d_kv,
    heads=None,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    implementation: str | None = None,
    name: str | None = None,
) -> Tensor:
    """softmax(q . k / sqrt(d_kv)) . v over the key dim, as one fused kernel per device.

    q [..., length, heads, d_kv] and k, v [..., memory_length, heads, d_kv] (any dim order;
    the sequence dims are the one dim each that the other lacks). `mask`: bool, True where a
    query may see a key, with dims among the batch-like dims, length and memory_length.
    `causal`: query i sees keys 0..i (length and memory_length the same size). `scale`:
    default 1 / sqrt(d_kv). `implementation`: jax.nn.dot_product_attention's ("cudnn", "xla"
    or None: cuDNN where it can). The sequence dims and d_kv run whole on each device; batch
    and heads may be split. Differentiable."""
    for t in (q, k, v):
        if not isinstance(t, Tensor):
            raise GraphError(f"fused_attention needs meshax Tensors, got {t!r}")
    d = dim_of(q, d_kv)
    h = dim_of(q, heads) if heads is not None else None
    dims, causal = _Dims(q, k, v, d, h, mask), as_flag(causal, "fused_attention: causal", GraphError)
    if causal and q.shape.get_dim_by_name(dims.length).size != k.shape.get_dim_by_name(dims.memory_length).size:
        raise GraphError(f"fused attention: causal needs as many queries as keys ({dims.length}, {dims.memory_length})")
    scale = 1.0 / math.sqrt(d.size) if scale is None else float(scale)
    return AttentionOperation(q, k, v, mask, dims, causal, scale, implementation, name).outputs[0]
