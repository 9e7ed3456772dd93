"""Section 6: GPU. meshax's decoder-LM training step beside a plain-JAX twin written the fast way.

Both sides are the same model (meshax's Transformer: pre-norm, tied embeddings, sinusoidal
positions, ReLU feed-forward) in bfloat16 with float32 master weights, float32 logits whose
gradient comes back through bfloat16 matmuls, cuDNN attention through
`jax.nn.dot_product_attention`, bfloat16 copies of the weights kept between steps (written by the
update), and Adam (or SGD: `optimizer=`, the same on both sides),
compiled with the same XLA options (meshax's own for
the platform); the twin starts from meshax's initial weights, so their
first losses agree (checked, to bfloat16 tolerance). Both are timed in one run, each alone on
the device (meshax's arrays freed before the twin's are made): a size is measured when each side
fits alone, and meshax's numbers are kept where only the twin runs out of memory. Throughput is
of steps queued as meshax's training loop queues them (each loss fetched after the next step is
dispatched); the time of a step waited for is recorded beside it.
Reported: TFLOP/s (3 x the forward matmul FLOPs, attention scores included, as in the issue's
table), MFU against the device's dense bf16 peak (a table by device name, and a large bf16
matmul measured in the same run) and meshax's throughput over the twin's.

On any device, first: both sides' compiled steps at a small size by XLA's cost analysis, meshax's
bytes accessed over the twin's at equal FLOPs (a check of the two programs that needs no GPU).
The timed sizes run only when JAX's first device is a GPU; otherwise a "skipped" record. `measure`
itself runs anywhere (tests/test_benchmark_gpu.py runs a tiny size on the CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import time
from collections.abc import Callable

import numpy as np

from benchmarks.records import record, side
from benchmarks.timing import first_then_median, queued
from meshax.lower.mesh_impl import jit_for_platform

# Dense bf16 peaks (TFLOP/s, without sparsity), by a substring of jax's device_kind.
PEAKS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0, "V100": 125.0}
VOCAB = 50304  # GPT-2's 50257, rounded up to a multiple of 64
TWIN_ATTENTION = "cudnn"  # the twin's jax.nn.dot_product_attention implementation (None: JAX's choice, XLA's)


@dataclasses.dataclass(frozen=True)
class Lm:
    name: str
    layers: int
    d_model: int
    heads: int
    batch: int
    length: int = 1024
    vocab: int = VOCAB

    @property
    def d_kv(self) -> int:
        return self.d_model // self.heads

    @property
    def d_ff(self) -> int:
        return 4 * self.d_model

    def parameters(self) -> int:
        return self.layers * (4 * self.d_model**2 + 2 * self.d_model * self.d_ff) + self.vocab * self.d_model

    def flops(self) -> float:
        """FLOPs of one training step: 3 x the forward's matmuls (weights, attention scores and
        values over the whole [length, length], logits)."""
        tokens = self.batch * self.length
        weights = (
            2
            * tokens
            * (self.layers * (4 * self.d_model**2 + 2 * self.d_model * self.d_ff) + self.vocab * self.d_model)
        )
        attention = self.layers * 2 * 2 * self.batch * self.length**2 * self.d_model
        return 3.0 * (weights + attention)


SIZES = [
    Lm("125M", 12, 768, 12, batch=16),
    Lm("350M", 24, 1024, 16, batch=16),
    Lm("1.3B", 24, 2048, 16, batch=8),
]
LARGER = [Lm("2.7B", 32, 2560, 32, batch=8)]  # tried after the three: the largest that fits
COSTED = Lm("small", 2, 256, 4, batch=4, length=256, vocab=8192)  # compiled and costed on any device
COSTED_QUICK = Lm("tiny", 2, 64, 4, batch=4, length=64, vocab=512)


def peak_tflops(device_kind: str) -> float | None:
    return next((p for k, p in PEAKS.items() if k.lower() in device_kind.lower()), None)


def matmul_tflops(n: int = 8192, reps: int = 20) -> float:
    """Measured bf16 matmul throughput: `reps` chained [n, n] products in one program."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16) / math.sqrt(n)

    @jit_for_platform  # (through cuBLAS on a GPU, as meshax's matmuls)
    def chain(x):
        for _ in range(reps):
            x = x @ a
        return x

    chain(a).block_until_ready()
    t0 = time.perf_counter()
    chain(a).block_until_ready()
    return 2.0 * n**3 * reps / (time.perf_counter() - t0) / 1e12


# ---- meshax's step ------------------------------------------------------------------------------
def _task(size: Lm, dtype: str = "bfloat16"):
    from meshax.models.transformer import TransformerConfig
    from meshax.train import LmTask

    config = TransformerConfig(
        vocab_size=size.vocab,
        d_model=size.d_model,
        d_ff=size.d_ff,
        num_heads=size.heads,
        d_kv=size.d_kv,
        num_layers=size.layers,
        max_length=size.length,
        dtype=dtype,
        attention="fused",
    )
    return LmTask(model=config, batch_size=size.batch, length=size.length)


OPTIMIZERS = ("adam", "sgd")  # both sides' optimizer, by name


def optimizers(name: str, lr: float):
    """(meshax's optimizer, optax's) called `name`: the same update (Adam: bias-corrected, with
    optax's defaults, which are meshax's; its moments in the weights' dtype on the twin's side,
    float32 on meshax's)."""
    import optax

    from meshax.optimize import AdamWeightDecayOptimizer, SgdOptimizer

    pairs = {"adam": (AdamWeightDecayOptimizer, optax.adam), "sgd": (SgdOptimizer, optax.sgd)}
    if name not in pairs:
        raise ValueError(f"optimizer {name!r}: one of {', '.join(pairs)}")
    return tuple(make(lr) for make in pairs[name])


def _program(
    size: Lm, lr: float = 1e-4, compiler_options=None, optimizer: str = "adam", cast_copies=None, dtype="bfloat16"
):
    """(meshax's compiled training program on one device, its initial weights by name, the task)."""
    from meshax.train.loop import build

    task = _task(size, dtype)
    program = build(
        task,
        "all:1",
        "",
        "simd",
        optimizers(optimizer, lr)[0],
        compiler_options=compiler_options,
        cast_copies=cast_copies,
    )
    program.lowering.initialize()
    return program, _weights(program), task


def _weights(program) -> dict:
    """meshax's trainable weights now, by variable name, on the host."""
    return {v.name: program.lowering.variable_value(v) for v in program.lowering.graph.trainable_variables}


@dataclasses.dataclass
class Stepper:
    """One side's training step on a fixed batch, split as a training loop runs it: `dispatch()`
    queues a step on the device and returns its loss unfetched; `fetch(loss)` waits for it."""

    dispatch: Callable[[], object]
    fetch: Callable[[object], float]
    weights: Callable[[], dict]  # the weights now, by variable name, on the host
    compiled_text: Callable[[], str]  # the step's compiled HLO module, as text

    def __call__(self) -> float:
        """One step, waited for: its loss."""
        return self.fetch(self.dispatch())


def meshax_step(
    size: Lm, lr: float = 1e-4, compiler_options=None, optimizer: str = "adam", cast_copies=None, dtype="bfloat16"
):
    """(a Stepper on the task's first batch, the initial weights by variable name, the task); the
    program compiled with XLA's `compiler_options` where given, keeping 16-bit copies of its
    weights as `cast_copies` says (`Lowering.function`; default: on a GPU), computing in `dtype`
    (float16: loss-scaled)."""
    program, weights, task = _program(size, lr, compiler_options, optimizer, cast_copies, dtype)
    batch, calls = task.train_batch(0), [0]

    def dispatch():
        calls[0] += 1
        return program.train_fn.dispatch(batch, seed=calls[0])

    def fetch(outputs):
        return float(program.train_fn.fetch(outputs)[0])

    return Stepper(dispatch, fetch, functools.partial(_weights, program), program.train_fn.compiled_text), weights, task


# ---- the plain-JAX twin ----------------------------------------------------------------------
def _norm(x, scale, bias):
    import jax
    import jax.numpy as jnp

    x32 = x.astype(jnp.float32)
    c = x32 - x32.mean(-1, keepdims=True)
    y = c * jax.lax.rsqrt((c * c).mean(-1, keepdims=True) + 1e-6) * scale + bias
    return y.astype(x.dtype)


def kept_statistics_norm(barrier: bool = False):
    """`_norm` whose gradient reads the rows' mean and reciprocal deviation the forward computed
    (two [b, t] float32 arrays), where JAX's gradient of `_norm` reads the centred input, which
    XLA recomputes from x with both row reductions in each of the backward's fusions; the scale's
    gradient then needs no row reduction and can fuse into its column sum. `barrier`: the two
    pass `jax.lax.optimization_barrier`, so XLA keeps them rather than recompute them."""
    import jax
    import jax.numpy as jnp

    def statistics(x):
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        c = x32 - mean
        stats = (mean, jax.lax.rsqrt((c * c).mean(-1, keepdims=True) + 1e-6))
        return jax.lax.optimization_barrier(stats) if barrier else stats

    def norm(x, scale, bias):
        mean, rstd = statistics(x)
        return (((x.astype(jnp.float32) - mean) * rstd) * scale + bias).astype(x.dtype)

    def forward(x, scale, bias):
        mean, rstd = statistics(x)
        y = ((x.astype(jnp.float32) - mean) * rstd) * scale + bias
        return y.astype(x.dtype), (x, scale, mean, rstd)

    def backward(saved, g):
        x, scale, mean, rstd = saved
        g = g.astype(jnp.float32)
        xhat = (x.astype(jnp.float32) - mean) * rstd
        dxhat = g * scale
        dx = rstd * (dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True))
        rows = tuple(range(g.ndim - 1))
        return dx.astype(x.dtype), (g * xhat).sum(rows).astype(scale.dtype), g.sum(rows).astype(scale.dtype)

    rule = jax.custom_vjp(norm)
    rule.defvjp(forward, backward)
    return rule


def wide_logits(y, table):
    """y [b, t, m] bfloat16 times the float32 table cast to bfloat16, summed into float32 logits
    (`jax.grad` of it feeds the float32 gradient to both gradient matmuls: float32 matmuls)."""
    import jax.numpy as jnp

    return jnp.einsum("btm,vm->btv", y, table.astype(y.dtype), preferred_element_type=jnp.float32)


def narrow_gradient_logits():
    """`wide_logits` whose gradient comes back at bfloat16 width first, as meshax's wide einsums
    pass theirs, so both gradient matmuls are bfloat16 ones; the table's gradient is summed in
    float32 (and given the table's dtype: a twin may be given bfloat16 weights)."""
    import jax
    import jax.numpy as jnp

    def forward(y, table):
        return wide_logits(y, table), (y, table)

    def backward(saved, g):
        y, table = saved
        g = g.astype(y.dtype)
        dy = jnp.einsum("btv,vm->btm", g, table.astype(y.dtype))
        return dy, jnp.einsum("btv,btm->vm", g, y, preferred_element_type=jnp.float32).astype(table.dtype)

    rule = jax.custom_vjp(wide_logits)
    rule.defvjp(forward, backward)
    return rule


def read_copy(w, copy):
    """A float32 weight `w` read through its bfloat16 `copy`: the value is the copy, the gradient
    goes to `w` in float32, as `w.astype(bfloat16)`'s does (the copy's is zero)."""
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def read(w, copy):
        return copy

    read.defvjp(lambda w, copy: (copy, None), lambda _, g: (g.astype(jnp.float32), None))
    return read(w, copy)


def twin_loss(params, ids, targets, weights, size: Lm, implementation=None, copies=None, logsumexp=None, norm=None):
    """meshax's Transformer LM written directly in JAX, the fast way (bf16, fused attention).
    `copies`: bfloat16 copies of the layers' weights (`copied`), read in place of casting each
    float32 weight (`read_copy`); `logsumexp`: the loss's (default `jax.nn.logsumexp`); `norm`:
    the layer norm (default `_norm`)."""
    import jax
    import jax.numpy as jnp

    bf = jnp.bfloat16
    p = "transformer"
    logsumexp = logsumexp or jax.nn.logsumexp
    layer_norm = norm or _norm
    table = params[f"{p}/embedding"]
    pos = np.arange(size.length)[:, None] / np.power(10000.0, 2 * np.arange(size.d_model // 2)[None, :] / size.d_model)
    signal = np.concatenate([np.sin(pos), np.cos(pos)], axis=1).astype(np.float32)
    # Rows gathered in float32, then cast: the gradient is a float32 scatter-add. Gathering from a
    # bf16 copy scatter-adds in bf16, which the H100 serializes where ids repeat (text has ~100
    # distinct bytes in 16k tokens): the twin's 125M step took 86 ms that way, its gradient 43 ms
    # with distinct ids.
    x = (table[ids].astype(bf) * math.sqrt(size.d_model) + jnp.asarray(signal).astype(bf)).astype(bf)
    for i in range(size.layers):
        w = lambda n, i=i: params[f"{p}/decoder/{i}/{n}"]  # noqa: E731

        def b(n, i=i):  # a layer's weight in bfloat16
            name = f"{p}/decoder/{i}/{n}"
            return params[name].astype(bf) if copies is None else read_copy(params[name], copies[name])

        y = layer_norm(x, w("self_attention_norm/scale"), w("self_attention_norm/bias"))
        q, k, v = (jnp.einsum("btm,mnh->btnh", y, b(f"self_attention/{n}")) for n in "qkv")
        o = jax.nn.dot_product_attention(q, k, v, scale=1.0, is_causal=True, implementation=implementation)
        x = x + jnp.einsum("btnh,nhm->btm", o, b("self_attention/o"))
        y = layer_norm(x, w("ffn_norm/scale"), w("ffn_norm/bias"))
        h = jax.nn.relu(y @ b("ffn/wi/kernel") + b("ffn/wi/bias"))
        x = x + (h @ b("ffn/wo/kernel") + b("ffn/wo/bias"))
    y = layer_norm(x, params[f"{p}/decoder/final_norm/scale"], params[f"{p}/decoder/final_norm/bias"])
    logits = narrow_gradient_logits()(y, table)
    xent = logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return jnp.sum(xent * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def copied(params: dict) -> dict:
    """The layers' weights the twin reads in bfloat16 (all but the embedding and the norms'), as
    bfloat16 copies: what a twin with `copies` keeps beside its float32 weights."""
    import jax.numpy as jnp

    return {k: v.astype(jnp.bfloat16) for k, v in params.items() if "/self_attention/" in k or "/ffn/" in k}


def _twin_update(
    size: Lm, lr: float, implementation, compiler_options=None, optimizer: str = "adam", copies=False, **loss_kw
):
    """(the twin's jitted update(params, copies, opt_state, ids, targets, weights), its optax
    optimizer); compiled with the XLA options meshax gives its own programs on this platform
    (cuBLAS for every matmul on a GPU), overridden by `compiler_options`: the two sides differ
    in their programs, not in XLA's options. With `copies`, the update also writes the bfloat16
    copies (`copied`) of the weights it updates, which the next step reads (`twin_loss`), so no
    step casts its float32 weights again; without, `copies` is None throughout."""
    import jax
    import optax

    transform = optimizers(optimizer, lr)[1]

    @functools.partial(jit_for_platform, compiler_options=compiler_options)
    def update(params, bf16, opt_state, ids, targets, w):
        loss, grads = jax.value_and_grad(twin_loss)(params, ids, targets, w, size, implementation, bf16, **loss_kw)
        updates, opt_state = transform.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, copied(params) if copies else None, opt_state, loss

    return update, transform


def twin_step(
    size: Lm,
    weights: dict,
    batch: dict,
    lr: float = 1e-4,
    implementation=None,
    optimizer: str = "adam",
    copies: bool = False,
    **loss_kw,
) -> Stepper:
    """The twin's Stepper from `weights` on `batch`; `copies` as `_twin_update`'s, `loss_kw`
    (`logsumexp`, `norm`) as `twin_loss`'s."""
    import jax

    params = {k: jax.device_put(v) for k, v in weights.items()}
    update, transform = _twin_update(size, lr, implementation, None, optimizer, copies, **loss_kw)
    state = [params, copied(params) if copies else None, transform.init(params)]

    def args():
        return *state, batch["ids"], batch["targets"], batch["weights"]

    def dispatch():
        *state[:], loss = update(*args())  # the new params, copies and optimizer state; the loss
        return loss

    def now():
        return {k: np.asarray(v) for k, v in state[0].items()}

    def compiled_text():  # (jit's own compiled step, from its cache: not compiled again)
        return update.lower(*args()).compile().as_text()

    return Stepper(dispatch, lambda loss: float(np.asarray(loss)), now, compiled_text)


def timed(stepper: Stepper, steps: int, warmup: int) -> dict:
    """The first step's loss and seconds (compile and run); then seconds per step, the mean of
    two rounds of `steps` steps queued as meshax's training loop queues them (each loss fetched
    after the next step is dispatched: the host's work hides behind the device's, except for
    each round's first dispatch), and the median of `steps` steps each waited for (the host's
    work adds to the device's)."""
    first, first_s, waited = first_then_median(stepper, steps, warmup)
    return {
        "first": first,
        "first_s": first_s,
        "queued_s": queued(stepper.dispatch, stepper.fetch, steps, rounds=2),
        "waited_s": waited,
    }


def measure(size: Lm, steps: int, warmup: int, implementation=None, optimizer: str = "adam", copies=None) -> dict:
    """meshax's step and the twin's, from the same weights, each timed alone: meshax's arrays are
    freed before the twin's are made, and a twin that does not fit leaves meshax's numbers (its
    fields None, `twin_error` saying why). A GPU step's time varies little from one call to the
    next, so the two need not be interleaved. Throughput is of queued steps (`timed`). Both
    sides train with `optimizer` (`OPTIMIZERS`; section 6's rows: Adam), and the twin keeps
    bfloat16 copies of its weights where `copies` (default: on a GPU, as meshax's step does there:
    `Lowering.function`); a twin whose copies do not fit runs without them (`copies_dropped`)."""
    import jax

    m_step, weights, task = meshax_step(size, optimizer=optimizer)
    weights = {k: np.asarray(v) for k, v in weights.items()}  # on the host, to outlive meshax's arrays
    m = timed(m_step, steps, warmup)
    del m_step
    gc.collect()  # meshax's program holds reference cycles: free its arrays before the twin's
    flops = size.flops()
    r = {
        "meshax_s": m["queued_s"],
        "meshax_tflops": flops / m["queued_s"] / 1e12,
        "meshax_waited_s": m["waited_s"],
        "first_losses": (m["first"], None),
        "steps": steps,
    }
    batch = task.train_batch(0)

    def twin_timed(copies: bool) -> dict:
        twin = twin_step(size, weights, batch, implementation=implementation, optimizer=optimizer, copies=copies)
        return timed(twin, steps, warmup)

    copies = jax.devices()[0].platform == "gpu" if copies is None else copies
    dropped = False
    try:
        try:
            t = twin_timed(copies)
        except Exception as err:
            if not (copies and _fits_error(err)):
                raise
            gc.collect()  # (the failed twin's arrays)
            t, copies, dropped = twin_timed(False), False, True  # (the copies take 2 bytes a weight)
    except Exception as err:
        if not _fits_error(err):
            raise
        return {
            **r,
            "twin_s": None,
            "twin_tflops": None,
            "twin_waited_s": None,
            "throughput_ratio": None,
            "first_call_s": (m["first_s"], None),
            "twin_error": str(err).splitlines()[0][:300],
        }
    return {
        **r,
        "twin_s": t["queued_s"],
        "twin_tflops": flops / t["queued_s"] / 1e12,
        "twin_waited_s": t["waited_s"],
        "throughput_ratio": t["queued_s"] / m["queued_s"],  # meshax's throughput over the twin's
        "first_losses": (m["first"], t["first"]),  # before any update
        "first_call_s": (m["first_s"], t["first_s"]),
        "twin_copies": copies,
        "copies_dropped": dropped,
    }


def compiled_costs(size: Lm) -> dict:
    """XLA's cost analysis of each side's compiled step (FLOPs and bytes accessed), on whatever
    device JAX has: a check of the two programs that needs no GPU to run. On a GPU both are
    compiled for it with XLA's Triton gemms, which its FLOPs count, not as they are timed."""
    import jax

    # XLA's cost analysis counts the matmuls XLA emits itself (its Triton gemm fusions on a GPU),
    # not calls to cuBLAS: both steps are costed as XLA compiles them by default.
    # (Its autotuner may still pick cuBLAS for some matmul, whose FLOPs then go uncounted: the
    # row's check of equal FLOPs would say so. On the H100, at COSTED, both counts were complete.)
    counted = {"xla_gpu_enable_triton_gemm": True}
    program, weights, task = _program(size, compiler_options=counted)
    batch = task.train_batch(0)
    program_cost = program.train_fn.cost_analysis()
    params = {k: jax.numpy.asarray(v) for k, v in weights.items()}
    attention = TWIN_ATTENTION if jax.default_backend() == "gpu" else None
    update, transform = _twin_update(size, 1e-4, attention, compiler_options=counted)
    twin = update.lower(
        params, None, transform.init(params), batch["ids"], batch["targets"], batch["weights"]
    ).compile()
    twin_cost = twin.cost_analysis()
    twin_cost = twin_cost[0] if isinstance(twin_cost, list) else twin_cost
    return {
        "meshax_bytes": program_cost["bytes accessed"],
        "twin_bytes": twin_cost["bytes accessed"],
        "meshax_flops": program_cost["flops"],
        "twin_flops": twin_cost["flops"],
    }


def cost_record(size: Lm, platform: str) -> dict:
    """meshax's compiled step against the twin's by XLA's cost analysis: bytes accessed (the
    memory traffic a GPU step is bound by, outside its matmuls) at equal FLOPs."""
    c = compiled_costs(size)
    ratio = c["meshax_bytes"] / c["twin_bytes"]
    same_flops = abs(c["meshax_flops"] - c["twin_flops"]) <= 0.01 * c["twin_flops"]
    return record(
        6,
        "compiled step's bytes accessed, meshax / twin (XLA's cost analysis)",
        {
            "platform": platform,
            "layers": size.layers,
            "d_model": size.d_model,
            "vocab": size.vocab,
            "batch": size.batch,
            "length": size.length,
        },
        ratio,
        "x",
        target="<= 1.0, equal FLOPs",
        met=ratio <= 1.0 and same_flops,
        numerator=side("meshax", c["meshax_bytes"], "bytes"),
        denominator=side("plain-JAX twin", c["twin_bytes"], "bytes"),
        flops=(c["meshax_flops"], c["twin_flops"]),
    )


def _fits_error(err: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(err) or "out of memory" in str(err).lower()


def _peak_gib(device) -> float | None:
    """The device's peak bytes in use so far (over every size measured), in GiB."""
    stats = device.memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def run(quick: bool) -> list[dict]:
    import sys

    import jax

    device = jax.devices()[0]
    costed_size = COSTED_QUICK if quick else COSTED
    try:
        costed = cost_record(costed_size, device.platform)
    except Exception as err:  # it must not cost the GPU timings that follow
        name = "compiled step's bytes accessed, meshax / twin: failed"
        config = {"platform": device.platform, "model": costed_size.name}
        costed = record(6, name, config, None, "", note=str(err).splitlines()[0][:300])
    if device.platform != "gpu":
        return [
            costed,
            record(
                6,
                "GPU benchmarks",
                {"platform": device.platform},
                None,
                "",
                status="skipped: no GPU",
                note="skipped: no GPU",
            ),
        ]
    kind = device.device_kind
    table_peak, measured_peak = peak_tflops(kind), matmul_tflops()
    print(
        f"section 6: {kind}: bf16 matmul {measured_peak:.0f} TFLOP/s (table {table_peak})", file=sys.stderr, flush=True
    )
    peak = table_peak or measured_peak
    out = [
        costed,
        record(
            6,
            "bf16 matmul peak, measured",
            {"device": kind, "n": 8192},
            measured_peak,
            "TFLOP/s",
            table_peak=table_peak,
        ),
    ]
    targets = {"350M": 0.45, "1.3B": 0.58}
    sizes = SIZES[:1] if quick else SIZES + LARGER
    for size in sizes:
        config = {
            "device": kind,
            "model": size.name,
            "batch": size.batch,
            "length": size.length,
            "parameters": size.parameters(),
        }
        gc.collect()  # the last size's arrays, or a failure's, freed first
        try:
            r = measure(size, steps=5 if quick else 10, warmup=2 if quick else 3, implementation=TWIN_ATTENTION)
        except Exception as err:  # one size failing must not lose the others' numbers
            what = "does not fit" if _fits_error(err) else f"failed ({type(err).__name__})"
            out.append(record(6, f"LM {size.name}: {what}", config, None, "", note=str(err).splitlines()[0][:300]))
            print(f"section 6: LM {size.name}: {what}: {str(err)[:2000]}", file=sys.stderr, flush=True)
            continue
        print(
            f"section 6: LM {size.name}: {r} (process peak so far {_peak_gib(device)} GiB)", file=sys.stderr, flush=True
        )
        memory = {"first_call_s": r["first_call_s"], "process_peak_gib_so_far": _peak_gib(device)}
        if r["twin_s"] is None:
            out.append(record(6, f"LM {size.name}: the twin does not fit", config, None, "", note=r["twin_error"]))
        else:
            agree = abs(r["first_losses"][0] - r["first_losses"][1]) <= 0.02 * abs(r["first_losses"][1])
            out.append(
                record(
                    6,
                    f"LM {size.name} step, meshax / twin throughput",
                    config,
                    r["throughput_ratio"],
                    "x",
                    target=">= 0.95",
                    met=r["throughput_ratio"] >= 0.95 and agree,
                    numerator=side("meshax", r["meshax_tflops"], "TFLOP/s"),
                    denominator=side("plain-JAX twin", r["twin_tflops"], "TFLOP/s"),
                    note=f"first losses {r['first_losses'][0]:.4f} / {r['first_losses'][1]:.4f}"
                    + ("; the twin without bf16 copies (with them, out of memory)" if r["copies_dropped"] else ""),
                    waited_step_s=(r["meshax_waited_s"], r["twin_waited_s"]),
                    twin_copies=r["twin_copies"],
                    **memory,
                )
            )
        mfu = r["meshax_tflops"] / peak
        target = targets.get(size.name)
        out.append(
            record(
                6,
                f"LM {size.name} MFU (meshax)",
                {**config, "peak_tflops": peak, "measured_peak_tflops": measured_peak},
                mfu,
                "of peak",
                target=f">= {target:.0%}" if target else None,
                met=mfu >= target if target else None,
                twin_mfu=None if r["twin_tflops"] is None else r["twin_tflops"] / peak,
                **memory,
            )
        )
    return out
