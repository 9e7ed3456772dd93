"""Plain single-device JAX training steps (jax.numpy, jax.grad, optax Adam) with GSPMD Table 1's
annotations, for `mx.partition` against `jax.jit` (tests and benchmark section 9).

Notation as in the GSPMD paper: B batch, S length, M d_model, H d_ff, N heads, D d_kv, V vocab,
on a mesh (X, Y) with dims "x" and "y". `SHARDINGS` holds Table 1's three configurations: the
six weights' annotations (the same in all three) and those of the activations BSM (each layer's
input), BSND (q, k, v) and BSH (the feed-forward hidden layer).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

_WEIGHTS = {
    "wq": P("x", "y", None),
    "wk": P("x", "y", None),
    "wv": P("x", "y", None),
    "wo": P("y", None, "x"),
    "win": P("x", "y"),
    "wout": P("y", "x"),
}
SHARDINGS = {
    "attempt1": {"BSM": P(None, None, "x"), "BSND": P(None, None, "y", None), "BSH": P(None, None, "y")},
    "attempt2": {"BSM": P("x", None, None), "BSND": P("x", None, "y", None), "BSH": P("x", None, "y")},
    "finalized": {"BSM": P("x", None, "y"), "BSND": P("x", None, "y", None), "BSH": P("x", None, "y")},
}


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 64
    d_model: int = 32
    d_ff: int = 64
    heads: int = 4
    d_kv: int = 8
    layers: int = 2
    batch: int = 8
    length: int = 16


def _constrain(x, spec):
    return x if spec is None else jax.lax.with_sharding_constraint(x, spec)


# ---- an MLP: Table 1's feed-forward block, x [B, S, M] -> relu(x W_in) W_out, squared error ------
def mlp_params(key, d_model: int = 16, d_ff: int = 32):
    k1, k2 = jax.random.split(key)
    return {
        "win": jax.random.normal(k1, (d_model, d_ff), jnp.float32) / jnp.sqrt(d_model),
        "bin": jnp.zeros((d_ff,), jnp.float32),
        "wout": jax.random.normal(k2, (d_ff, d_model), jnp.float32) / jnp.sqrt(d_ff),
    }


def mlp_loss(params, x, y, sharding: str | None = None):
    acts = SHARDINGS[sharding] if sharding else {}
    x = _constrain(x, acts.get("BSM"))
    hidden = _constrain(jax.nn.relu(x @ params["win"] + params["bin"]), acts.get("BSH"))
    out = _constrain(hidden @ params["wout"], acts.get("BSM"))
    return jnp.mean((out - y) ** 2)


# ---- a decoder-only Transformer LM ----------------------------------------------------------
def transformer_params(key, c: Config):
    def normal(k, shape, fan_in):
        return jax.random.normal(k, shape, jnp.float32) / jnp.sqrt(fan_in)

    keys = iter(jax.random.split(key, 1 + 6 * c.layers))
    M, H, N, D = c.d_model, c.d_ff, c.heads, c.d_kv
    layers = []
    for _ in range(c.layers):
        layers.append(
            {
                "ln1": jnp.ones((M,), jnp.float32),
                "wq": normal(next(keys), (M, N, D), M),
                "wk": normal(next(keys), (M, N, D), M),
                "wv": normal(next(keys), (M, N, D), M),
                "wo": normal(next(keys), (N, D, M), N * D),
                "ln2": jnp.ones((M,), jnp.float32),
                "win": normal(next(keys), (M, H), M),
                "wout": normal(next(keys), (H, M), H),
            }
        )
    return {"embed": normal(next(keys), (c.vocab, M), 1.0), "layers": layers, "ln_f": jnp.ones((M,), jnp.float32)}


def _norm(x, scale):
    x = x - x.mean(-1, keepdims=True)
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * scale


def transformer_loss(params, ids, targets, sharding: str | None = None):
    acts = SHARDINGS[sharding] if sharding else {}
    x = params["embed"][ids]
    S = ids.shape[1]
    causal = jnp.tril(jnp.ones((S, S), bool))
    for layer in params["layers"]:
        x = _constrain(x, acts.get("BSM"))
        h = _norm(x, layer["ln1"])
        q, k, v = (_constrain(jnp.einsum("bsm,mnd->bsnd", h, layer[w]), acts.get("BSND")) for w in ("wq", "wk", "wv"))
        scores = jnp.einsum("bsnd,btnd->bnst", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        attended = jnp.einsum("bnst,btnd->bsnd", probs, v)
        x = x + jnp.einsum("bsnd,ndm->bsm", attended, layer["wo"])
        h = _norm(x, layer["ln2"])
        hidden = _constrain(jax.nn.relu(h @ layer["win"]), acts.get("BSH"))
        x = x + hidden @ layer["wout"]
    logits = _norm(x, params["ln_f"]) @ params["embed"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


#: in_shardings by argument path: Table 1's weights (every layer's), everything else propagated.
# ---- a CNN split in space (GSPMD section 4.3): images [B, h, w, C], h over x and w over y -------
SPATIAL = P(None, "x", "y")


def cnn_params(key, channels: int = 8, in_channels: int = 3):
    """Three 3x3 filters: in -> C, C -> 2C (stride 2), 2C -> 2C."""
    c = channels
    shapes = [(3, 3, in_channels, c), (3, 3, c, 2 * c), (3, 3, 2 * c, 2 * c)]
    keys = jax.random.split(key, len(shapes))
    return {
        f"conv{i}": jax.random.normal(k, s, jnp.float32) / (3 * s[2] ** 0.5)
        for i, (k, s) in enumerate(zip(keys, shapes))
    }


def cnn_loss(params, x, y, sharding: str | None = None):
    """conv, relu, strided conv, relu, 2x2 max pooling, conv; squared error against y
    [B, h/4, w/4, 2C]. With a sharding, the images are annotated `SPATIAL` (nothing else is)."""

    def conv(h, w, stride):
        return jax.lax.conv_general_dilated(h, w, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    h = jax.nn.relu(conv(_constrain(x, SPATIAL if sharding else None), params["conv0"], 1))
    h = jax.nn.relu(conv(h, params["conv1"], 2))
    h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    return jnp.mean((conv(h, params["conv2"], 1) - y) ** 2)


TRANSFORMER_WEIGHTS = {f"params/layers/*/{w}": spec for w, spec in _WEIGHTS.items()}
MLP_WEIGHTS = {"params/win": _WEIGHTS["win"], "params/wout": _WEIGHTS["wout"]}


def train_step(loss_fn, optimizer, **loss_kwargs):
    """(params, opt_state, *batch) -> (params, opt_state, loss): one optax step of `loss_fn`."""

    def step(params, opt_state, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch, **loss_kwargs)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step
