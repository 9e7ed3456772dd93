"""Where a decoder-LM training step's time goes on a GPU: `python -m benchmarks.gpu_parts [--size 125M]`.

Section 6 says how fast meshax's step is beside its plain-JAX twin; this says why both are where
they are. It times the twin's parts, each jitted alone at the size's shapes: one layer's attention
(JAX's default implementation, cuDNN's and XLA's; and over a padded batch, as a [batch, keys] mask
and as cuDNN's key lengths), one layer's matmuls, the logits and loss (the gradient's matmuls in
bfloat16 as the twin and meshax run them, in float32 as jax.grad of the einsum would, and with a
one-pass logsumexp), the embedding lookup (with distinct ids, and with text's repeated ids),
Adam's update, and the whole gradient. A part that cannot run here (cuDNN on a CPU) says why.
Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from benchmarks import gpu
from benchmarks.timing import first_then_median
from meshax.lower.mesh_impl import jit_for_platform


def _timed(fn, *args, reps: int = 10) -> dict:
    """Median ms of `fn`, jitted with the XLA options meshax compiles with, over `reps` calls
    after two warm ones; the first call's seconds (compile); or the error that stopped it."""
    import jax

    try:
        f = jit_for_platform(fn)
        _, compile_s, s = first_then_median(lambda: jax.block_until_ready(f(*args)), reps, 2)
        return {"ms": 1e3 * s, "compile_s": compile_s}
    except Exception as err:  # a part that cannot run here (cuDNN without a GPU) says why
        return {"ms": None, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}


def _params(size: gpu.Lm, rng) -> dict:
    """Random weights named as meshax's Transformer names them (what `gpu.twin_loss` reads)."""
    m, n, h, f = size.d_model, size.heads, size.d_kv, size.d_ff

    def w(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    p = "transformer"
    params = {
        f"{p}/embedding": w(size.vocab, m),
        f"{p}/decoder/final_norm/scale": np.ones(m, np.float32),
        f"{p}/decoder/final_norm/bias": np.zeros(m, np.float32),
    }
    for i in range(size.layers):
        d = f"{p}/decoder/{i}/"
        for norm in ("self_attention_norm", "ffn_norm"):
            params[d + f"{norm}/scale"], params[d + f"{norm}/bias"] = np.ones(m, np.float32), np.zeros(m, np.float32)
        for x in "qkv":
            params[d + f"self_attention/{x}"] = w(m, n, h)
        params[d + "self_attention/o"] = w(n, h, m)
        params[d + "ffn/wi/kernel"], params[d + "ffn/wi/bias"] = w(m, f), np.zeros(f, np.float32)
        params[d + "ffn/wo/kernel"], params[d + "ffn/wo/bias"] = w(f, m), np.zeros(m, np.float32)
    return params


def one_pass_logsumexp():
    """logsumexp over the last axis in one pass over x: a variadic reduce of (running max, sum of
    exp(x - running max)), where the usual form reads x twice (its max, then its sum). The
    gradient is softmax times the incoming one. A candidate for meshax's float32 loss, timed
    here first."""
    import jax
    import jax.numpy as jnp

    def combine(a, b):
        (ma, sa), (mb, sb) = a, b
        m = jnp.maximum(ma, mb)
        # where both maxima are -inf (two empty partial sums), exp(ma - m) would be nan
        return m, jnp.where(ma == m, sa, sa * jnp.exp(ma - m)) + jnp.where(mb == m, sb, sb * jnp.exp(mb - m))

    def forward(x):
        init = (jnp.array(-jnp.inf, x.dtype), jnp.array(0, x.dtype))
        m, total = jax.lax.reduce((x, jnp.ones_like(x)), init, combine, (x.ndim - 1,))
        return m + jnp.log(total)

    def with_residual(x):
        lse = forward(x)
        return lse, (x, lse)

    def backward(saved, g):
        x, lse = saved
        return (g[..., None] * jnp.exp(x - lse[..., None]),)

    rule = jax.custom_vjp(forward)
    rule.defvjp(with_residual, backward)
    return rule


def parts(size: gpu.Lm, reps: int = 10, only: str | None = None) -> list[dict]:
    """Each part's time, one record per part, for `size`; only the parts whose names contain
    `only`, where given."""
    import jax
    import jax.numpy as jnp
    import optax

    bf, f32 = jnp.bfloat16, jnp.float32
    b, t, m, v = size.batch, size.length, size.d_model, size.vocab
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)  # distinct ids, mostly
    text_ids = jnp.asarray(rng.integers(10, 106, (b, t)), jnp.int32)  # ~96 distinct, as bytes of text
    weights = jnp.ones((b, t), f32)
    qkv = [jnp.asarray(rng.standard_normal((b, t, size.heads, size.d_kv)), bf) for _ in range(3)]
    y = jnp.asarray(rng.standard_normal((b, t, m)), bf)
    params = jax.tree.map(jnp.asarray, _params(size, rng))
    table = params["transformer/embedding"]

    def attention(implementation, **kw):
        def loss(q, k, v):
            out = jax.nn.dot_product_attention(q, k, v, scale=1.0, is_causal=True, implementation=implementation, **kw)
            return jnp.sum(out.astype(f32))

        return jax.grad(loss, argnums=(0, 1, 2))

    # a padded batch: each sequence's last tenth is padding. As a [batch, keys] mask (meshax's
    # padding mask) cuDNN refuses it and XLA's kernel runs; as key lengths, cuDNN takes it.
    lengths = jnp.full((b,), t - t // 10, jnp.int32)
    padding = (jnp.arange(t)[None, :] < lengths[:, None])[:, None, None, :]

    def head(narrow_gradient: bool, logsumexp=jax.nn.logsumexp):
        def loss(y, table):
            # the twin's (and meshax's) logits, bfloat16 gradient matmuls; or jax.grad's, float32 ones
            logits = (gpu.narrow_gradient_logits() if narrow_gradient else gpu.wide_logits)(y, table)
            xent = logsumexp(logits, -1) - jnp.take_along_axis(logits, ids[..., None], -1)[..., 0]
            return jnp.sum(xent * weights) / jnp.sum(weights)

        return jax.grad(loss, argnums=(0, 1))

    def matmuls(y, *ws):
        wq, wo, wi, wout = (w.astype(bf) for w in ws)
        x = y + jnp.einsum("btnh,nhm->btm", jnp.einsum("btm,mnh->btnh", y, wq), wo)
        return jnp.sum((x + jax.nn.relu(x @ wi) @ wout).astype(f32))

    def lookup(ids):
        return jax.grad(lambda tb: jnp.sum(tb[ids].astype(bf).astype(f32) ** 2))

    layer = "transformer/decoder/0/"
    layer_ws = [params[layer + k] for k in ("self_attention/q", "self_attention/o", "ffn/wi/kernel", "ffn/wo/kernel")]
    optimizer = gpu.optimizers("adam", 1e-4)[1]  # the twin's
    state = optimizer.init(params)

    def adam(g, s, p):
        updates, _ = optimizer.update(g, s, p)
        return optax.apply_updates(p, updates)

    def whole(ids):
        return jax.grad(lambda p: gpu.twin_loss(p, ids, ids, weights, size, gpu.TWIN_ATTENTION))

    cases = [
        (f"attention, one layer, {impl or 'JAX default'}", attention(impl), qkv) for impl in (None, "cudnn", "xla")
    ] + [
        ("attention, one layer, a padding mask, JAX default", attention(None, mask=padding), qkv),
        ("attention, one layer, padding as key lengths, cudnn", attention("cudnn", key_value_seq_lengths=lengths), qkv),
        ("matmuls, one layer (q, o, wi, wo)", jax.grad(matmuls, argnums=tuple(range(5))), [y, *layer_ws]),
        ("logits and loss (float32), bfloat16 gradient matmuls", head(True), [y, table]),
        ("logits and loss (float32), float32 gradient matmuls", head(False), [y, table]),
        (
            "logits and loss (float32), logsumexp in one pass",
            head(True, lambda x, _: one_pass_logsumexp()(x)),
            [y, table],
        ),
        ("embedding lookup, distinct ids", lookup(ids), [table]),
        ("embedding lookup, text's repeated ids", lookup(text_ids), [table]),
        ("Adam update", adam, [params, state, params]),
        ("whole gradient, distinct ids", whole(ids), [params]),
        ("whole gradient, text's repeated ids", whole(text_ids), [params]),
    ]
    records = []
    for name, fn, args in [c for c in cases if only is None or only in c[0]]:
        r = _timed(fn, *args, reps=reps)
        records.append({"part": name, "size": size.name, **r})
        shown = f"{r['ms']:.2f} ms (compile {r['compile_s']:.1f} s)" if r["ms"] is not None else r["error"]
        print(f"{size.name}: {name}: {shown}", flush=True)
    return records


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_parts", description=__doc__.splitlines()[0])
    sizes = {s.name: s for s in gpu.SIZES + gpu.LARGER}
    p.add_argument("--size", default="125M", choices=sizes, help="the model size (default: 125M)")
    p.add_argument("--only", default=None, help="time only the parts whose names contain this")
    p.add_argument("--out", default="benchmarks/out/gpu_parts.json", help="the JSON written")
    args = p.parse_args(argv)
    import jax

    size = sizes[args.size]
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {size}", flush=True)
    records = parts(size, only=args.only)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "flops": size.flops(), "parts": records}, f, indent=1)
    return records


if __name__ == "__main__":
    main()
