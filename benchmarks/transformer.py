"""The Transformer language model's training step, in meshax and in plain JAX.

meshax's side is the library's own: `LmTask` (decoder-only LM on a Markov chain over 256
tokens, so vocab splits 8 ways) built by `meshax.train.loop.build` with
`AdamWeightDecayOptimizer(1e-3)`; one step is `program.train_fn(feeds, seed=step)`, which
returns the loss and updates the variables in place (the metrics are the evaluation's).

The plain-JAX twin is the same mathematics in jnp on a pytree of parameters, started from
meshax's initial values (`variable_value`), with the same Adam slots and float global step,
jitted with the `NamedSharding`s meshax's plan gives every variable and placeholder, the state
donated, and the loss fetched to the host. What meshax computes
(meshax/models/transformer.py, meshax/train/tasks.py, meshax/layers/, meshax/optimize/):

  x = table[ids] * sqrt(d_model) + sinusoid            (tied embedding, sin | cos positions)
  per layer:  x += attention(layer_norm(x))            (q scaled at init, causal bias -1e9)
              x += relu(layer_norm(x) wi + bi) wo + bo
  logits = layer_norm(x) table^T
  xent = -sum_vocab one_hot(targets) * log_softmax(logits)
  loss = sum(xent * weights) / max(sum(weights), 1); Adam on d loss; global_step += 1.
"""

from __future__ import annotations

import math

import numpy as np

from meshax.lower.mesh_impl import jit_for_platform

LR = 1e-3
B1, B2, EPS = 0.9, 0.999, 1e-8
BATCH, LENGTH, VOCAB = 16, 64, 256

# (mesh, layout) of the paper's Transformer layouts (plus none), on 8 devices.
LAYOUTS = [
    ("all:8", ""),
    ("all:8", "batch:all"),
    ("all:8", "vocab:all;d_ff:all;heads:all"),
    ("rows:2;cols:4", "batch:rows;vocab:cols;d_ff:cols;heads:cols"),
]
OUTPUTS = ("loss",)
# the letters `loss` names its arrays' dims with, as meshax's Transformer names them
_DIMS = {"b": "batch", "l": "length", "m": "memory_length", "d": "d_model", "h": "heads", "k": "d_kv", "f": "d_ff"}


def task(preset: str, sharding: str = ""):
    from meshax.train import LmTask

    # (a first-order chain: the tokens' statistics do not matter to a step's time, and a second-order
    # one over 256 tokens has 65,536 contexts, seconds to draw each time a task is made)
    return LmTask(
        model=preset,
        source="markov",
        markov_vocab=VOCAB,
        markov_order=1,
        batch_size=BATCH,
        length=LENGTH,
        sharding=sharding,
    )


def layout_problem(preset: str, mesh_shape: str, layout: str) -> str | None:
    """Why the preset cannot be laid out so (e.g. 4 heads over 8 devices), or None."""
    from meshax.core.errors import LayoutError
    from meshax.train.loop import build

    try:
        build(task(preset), mesh_shape, layout, "simd", compile=False)
    except LayoutError as e:
        return str(e)
    return None


class MeshaxLm:
    """The task's training program on one mesh and layout; its compiled HLO text is kept."""

    def __init__(self, preset: str, mesh_shape: str, layout: str, sharding: str = ""):
        from meshax.optimize import AdamWeightDecayOptimizer
        from meshax.train.loop import build

        self.preset, self.mesh_shape, self.layout = preset, mesh_shape, layout
        self.task = task(preset, sharding)
        self.program = build(self.task, mesh_shape, layout, "simd", AdamWeightDecayOptimizer(LR))
        self.lowering = self.program.lowering
        self.fn = self.program.train_fn
        self.feeds = self.task.train_batch(0)
        self._hlo: str | None = None
        self.steps_run = 0
        self._has_values = False  # whether the variables hold values (meshax's own, or zeros)

    @property
    def counters(self):
        return self.fn.counters

    def variables(self) -> dict:
        """{name: variable op} of every variable (parameters, Adam slots, global_step)."""
        return {v.name: v for v in self.lowering.graph.all_variables}

    def trainable_names(self) -> list[str]:
        return [v.name for v in self.lowering.graph.trainable_variables]

    def values(self) -> dict[str, np.ndarray]:
        self._has_values = True
        return {n: self.lowering.variable_value(v) for n, v in self.variables().items()}

    def zeros_unless_initialized(self) -> None:
        """Zeros in every variable that has no value yet. For a program that is only compiled
        (section 5 reads its HLO, which does not depend on the values), this saves meshax's
        initializer compiles (one per shape and sharding); never used on a timed model."""
        if not self._has_values:
            for v in self.variables().values():
                self.lowering.set_variable_value(v, np.zeros(v.outputs[0].shape.to_integer_list, v.outputs[0].dtype))
            self._has_values = True

    def sharding(self, t):
        return self.lowering.impl.global_sharding(t.shape, self.lowering.plan[t])  # (replicated where uneven)

    def var_shardings(self) -> dict:
        return {n: self.sharding(v.outputs[0]) for n, v in self.variables().items()}

    def feed_shardings(self) -> dict:
        return {t.name: self.sharding(t) for t in self.fn.placeholders}

    def sinusoid(self) -> np.ndarray:
        (t,) = [t for t in self.fn.inputs if t.name == "sinusoid"]
        return np.asarray(t.operation.value)

    def step(self, feeds=None) -> list[float]:
        self._has_values = True
        outs = self.fn(self.feeds if feeds is None else feeds, seed=self.steps_run)
        self.steps_run += 1
        return [float(o) for o in outs]

    def compiled_text(self) -> str:
        if self._hlo is None:
            self._hlo = self.fn.compiled_text()
        return self._hlo


def _layer_norm(x, scale, bias, eps):
    import jax.numpy as jnp
    from jax import lax

    mean = jnp.mean(x, axis=-1, keepdims=True)
    centered = x - mean
    var = jnp.mean(jnp.square(centered), axis=-1, keepdims=True)
    return centered * lax.rsqrt(var + eps) * scale + bias


def _no_constraint(a, kind: str, dims: str):
    return a


def loss(params: dict, ids, targets, weights, *, sinusoid, config, prefix="transformer", constrain=_no_constraint):
    """The loss of the decoder-only LM, in jnp on `params` by name.

    `constrain(array, kind, dims)` is applied where meshax's Transformer annotates a GSPMD
    sharding (kind: weights, BSM, BSND, BSH; dims: the array's dims as letters of `_DIMS`)."""
    import jax
    import jax.numpy as jnp

    p = lambda n: params[f"{prefix}/{n}"]  # noqa: E731
    c = constrain
    eps = config.layer_norm_epsilon
    table = p("embedding")
    x = jnp.take(table, ids, axis=0) * math.sqrt(config.d_model) + sinusoid
    n = ids.shape[1]
    future = np.arange(n)[None, :] > np.arange(n)[:, None]  # [query, key]: key after query
    causal = jnp.asarray(np.where(future, -1e9, 0.0).astype(np.float32))
    for i in range(config.num_layers):
        pre = f"decoder/{i}"
        x = c(x, "BSM", "bld")
        y = _layer_norm(x, p(f"{pre}/self_attention_norm/scale"), p(f"{pre}/self_attention_norm/bias"), eps)
        q = c(jnp.einsum("bld,dhk->blhk", y, c(p(f"{pre}/self_attention/q"), "weights", "dhk")), "BSND", "blhk")
        k = c(jnp.einsum("bmd,dhk->bmhk", y, c(p(f"{pre}/self_attention/k"), "weights", "dhk")), "BSND", "bmhk")
        v = c(jnp.einsum("bmd,dhk->bmhk", y, c(p(f"{pre}/self_attention/v"), "weights", "dhk")), "BSND", "bmhk")
        logits = jnp.einsum("blhk,bmhk->bhlm", q, k) + causal
        w = jax.nn.softmax(logits, axis=-1)
        att = jnp.einsum("bhlm,bmhk->blhk", w, v)
        x = x + jnp.einsum("blhk,hkd->bld", att, c(p(f"{pre}/self_attention/o"), "weights", "hkd"))
        y = _layer_norm(x, p(f"{pre}/ffn_norm/scale"), p(f"{pre}/ffn_norm/bias"), eps)
        h = c(jax.nn.relu(y @ c(p(f"{pre}/ffn/wi/kernel"), "weights", "df") + p(f"{pre}/ffn/wi/bias")), "BSH", "blf")
        x = x + h @ c(p(f"{pre}/ffn/wo/kernel"), "weights", "fd") + p(f"{pre}/ffn/wo/bias")
    x = _layer_norm(x, p("decoder/final_norm/scale"), p("decoder/final_norm/bias"), eps)
    logits = jnp.einsum("bld,vd->blv", x, table)
    logp = jax.nn.log_softmax(logits, axis=-1)
    xent = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(xent * weights) / jnp.maximum(jnp.sum(weights), 1.0)


class JaxLm:
    """The same training step in plain JAX, jitted with meshax's shardings; state donated."""

    def __init__(self, m: MeshaxLm, values: dict[str, np.ndarray] | None = None):
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec

        from meshax.models.transformer import GSPMD_SHARDINGS

        values = m.values() if values is None else values
        names = m.trainable_names()
        config = m.task.config
        sinusoid = m.sinusoid()
        var_sh = m.var_shardings()
        self._feed_sh = m.feed_shardings()
        jax_mesh = m.lowering.impl.jax_mesh
        scalar = NamedSharding(jax_mesh, PartitionSpec())
        self.names = names
        spec = GSPMD_SHARDINGS.get(config.sharding)

        def constrain(a, kind, dims):  # the same annotations as meshax's, as XLA sharding constraints
            if spec is None:
                return a
            return jax.lax.with_sharding_constraint(
                a, NamedSharding(jax_mesh, PartitionSpec(*[spec[kind].get(_DIMS[d]) for d in dims]))
            )

        def step(state, ids, targets, weights):
            params, adam_m, adam_v, gstep = state
            value, grads = jax.value_and_grad(loss)(
                params, ids, targets, weights, sinusoid=sinusoid, config=config, constrain=constrain
            )
            t = gstep + 1.0
            c1, c2 = 1.0 - jnp.power(B1, t), 1.0 - jnp.power(B2, t)
            new_p, new_m, new_v = {}, {}, {}
            for n in params:
                g = grads[n]
                new_m[n] = adam_m[n] * B1 + g * (1.0 - B1)
                new_v[n] = adam_v[n] * B2 + jnp.square(g) * (1.0 - B2)
                update = (new_m[n] / c1) / (jnp.sqrt(new_v[n] / c2) + EPS)
                new_p[n] = params[n] - update * LR
            return (value,), (new_p, new_m, new_v, gstep + 1.0)

        p_sh = {n: var_sh[n] for n in names}
        m_sh = {n: var_sh[f"{n}/adam_m"] for n in names}
        v_sh = {n: var_sh[f"{n}/adam_v"] for n in names}
        state_sh = (p_sh, m_sh, v_sh, var_sh["global_step"])
        f_sh = tuple(self._feed_sh[k] for k in ("ids", "targets", "weights"))
        self._jit = jit_for_platform(
            step, in_shardings=(state_sh, *f_sh), out_shardings=((scalar,), state_sh), donate_argnums=(0,)
        )
        put = lambda d, sh: {n: jax.device_put(d[n], sh[n]) for n in names}  # noqa: E731
        self._state = (
            put({n: values[n] for n in names}, p_sh),
            put({n: values[f"{n}/adam_m"] for n in names}, m_sh),
            put({n: values[f"{n}/adam_v"] for n in names}, v_sh),
            jax.device_put(np.float32(values["global_step"]), state_sh[3]),
        )
        self._compiled = None
        self.feeds = m.feeds

    def _feed_args(self, feeds):
        import jax

        return tuple(jax.device_put(np.asarray(feeds[k]), self._feed_sh[k]) for k in ("ids", "targets", "weights"))

    @property
    def compiled(self):
        """The compiled step (lowered and compiled once: it runs, and its text is read)."""
        if self._compiled is None:
            self._compiled = self._jit.lower(self._state, *self._feed_args(self.feeds)).compile()
        return self._compiled

    def step(self, feeds=None) -> list[float]:
        outs, self._state = self.compiled(self._state, *self._feed_args(self.feeds if feeds is None else feeds))
        return [float(np.asarray(o)) for o in outs]

    def compiled_text(self) -> str:
        return self.compiled.as_text()

    def params(self) -> dict[str, np.ndarray]:
        return {n: np.asarray(a) for n, a in self._state[0].items()}


def max_param_diff(m: MeshaxLm, j: JaxLm) -> tuple[float, str]:
    """The largest absolute difference between the two sides' parameters (after equal steps),
    and the parameter where it is. (Adam divides by sqrt(v): where a gradient is ~0 on both
    sides, rounding differences reach the update at full learning rate, so expect ~steps * lr.)"""
    mine, theirs = m.values(), j.params()
    diffs = {n: float(np.max(np.abs(mine[n] - theirs[n]))) for n in j.names}
    where = max(diffs, key=diffs.get)
    return diffs[where], where


def outputs_agree(a: list[float], b: list[float], rtol: float = 1e-4) -> bool:
    return bool(np.allclose(a, b, rtol=rtol, atol=rtol))


_MODELS: dict = {}


def model(preset: str, mesh_shape: str, layout: str, sharding: str = "") -> MeshaxLm:
    """One MeshaxLm per (preset, mesh, layout, sharding) per run, shared by the sections."""
    key = (preset, mesh_shape, layout, sharding)
    if key not in _MODELS:
        _MODELS[key] = MeshaxLm(preset, mesh_shape, layout, sharding)
    return _MODELS[key]
