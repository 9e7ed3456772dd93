"""Section 6 (GPU) on the CPU: its measurement and its bookkeeping, so a GPU run, rare and
short, does not die on a bug that a CPU could have caught."""

import numpy as np
import pytest

from benchmarks import gpu

TINY = gpu.Lm("125M", 2, 64, 4, batch=4, length=64, vocab=512)  # named as a size with an MFU row


def test_section6_measures_the_same_model_on_both_sides():
    """meshax's step and the plain-JAX twin start from the same weights, so their first losses
    agree; both are timed."""
    r = gpu.measure(TINY, steps=2, warmup=1)
    meshax_loss, twin_loss = r["first_losses"]
    assert abs(meshax_loss - twin_loss) < 1e-2 * twin_loss
    assert r["meshax_tflops"] > 0 and r["twin_tflops"] > 0 and min(r["first_call_s"]) > 0
    assert r["throughput_ratio"] == pytest.approx(r["twin_s"] / r["meshax_s"])
    assert r["meshax_waited_s"] > 0 and r["twin_waited_s"] > 0  # steps waited for, beside the queued ones
    assert TINY.flops() == 3 * (2 * 4 * 64 * (2 * 12 * 64**2 + 512 * 64) + 2 * 4 * 4 * 64 * 64**2)
    assert gpu.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0 and gpu.peak_tflops("cpu") is None


@pytest.mark.parametrize("name", gpu.OPTIMIZERS)
def test_each_sides_optimizer_makes_the_same_update(name):
    """meshax's optimizer and optax's of one name, from the same weights and gradients (those of
    sum(w * t) + |w|^2 / 2), give the same weights after each of three steps."""
    import jax.numpy as jnp
    import optax

    import meshax as mx

    mine, theirs = gpu.optimizers(name, 0.05)
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    a = mx.Dimension("a", 16)
    w = mx.get_variable(mesh, "w", [a], initializer=mx.initializers.normal(1.0))
    t = mx.placeholder(mesh, "t", [a])
    (g,) = mx.gradients(mx.reduce_sum(w * t) + 0.5 * mx.reduce_sum(mx.square(w)), [w])
    lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:1", "")})
    step = lowering.function([], updates=mine.apply_grads([g], [w]))
    target = np.geomspace(1e-4, 10.0, 16, dtype=np.float32) * np.resize([1, -1], 16)  # gradients of every scale
    params = jnp.asarray(lowering.variable_value(w))
    state = theirs.init(params)
    for _ in range(3):
        step({"t": target})
        updates, state = theirs.update(target + params, state, params)
        params = optax.apply_updates(params, updates)
        np.testing.assert_allclose(lowering.variable_value(w), params, rtol=1e-6, atol=1e-7)


def test_both_sides_train_alike_with_the_optimizer_asked_for():
    """The optimizer asked for (SGD, not the default Adam) reaches both steps: from the same
    weights and batch, meshax's step and the twin's lose the same before each of four steps
    (after 0 to 3 updates), to the rounding of bfloat16 computation, and each side's `weights()`
    (its weights now) moved alike."""
    m_step, weights, task = gpu.meshax_step(TINY, lr=1e-2, optimizer="sgd")
    weights = {k: np.asarray(v) for k, v in weights.items()}
    twin = gpu.twin_step(TINY, weights, task.train_batch(0), lr=1e-2, optimizer="sgd")
    meshax_losses = [m_step() for _ in range(4)]
    twin_losses = [twin() for _ in range(4)]
    assert meshax_losses[-1] < meshax_losses[0] - 0.05  # each update changes the loss
    np.testing.assert_allclose(meshax_losses, twin_losses, rtol=1e-3)
    now = m_step.weights(), twin.weights()
    for name, start in weights.items():  # moved by the updates, and by about as much on both sides
        moved = [np.linalg.norm(side[name] - start) for side in now]
        assert min(moved) > 0 and moved[0] == pytest.approx(moved[1], rel=0.05), name
        # as SGD moves them, by lr x the gradient: Adam would move each element about lr a step
        assert max(moved) / np.sqrt(start.size) < 1e-2, name


def test_the_twin_trains_on_weights_stored_in_bfloat16():
    """The twin given bfloat16 weights (no float32 master copy, as the GPU guide measured it):
    its first loss is the float32 weights' (it computes in bfloat16 either way), SGD's steps
    lower it, and its weights stay bfloat16."""
    import ml_dtypes

    _, weights, task = gpu.meshax_step(TINY, optimizer="sgd")
    batch = task.train_batch(0)
    full = gpu.twin_step(TINY, {k: np.asarray(v) for k, v in weights.items()}, batch, optimizer="sgd")
    narrow = {k: np.asarray(v).astype(ml_dtypes.bfloat16) for k, v in weights.items()}
    twin = gpu.twin_step(TINY, narrow, batch, lr=1e-1, optimizer="sgd")
    losses = [twin() for _ in range(3)]
    assert abs(losses[0] - full()) < 1e-2 * losses[0]
    assert losses[-1] < losses[0] - 0.05
    assert {str(v.dtype) for v in twin.weights().values()} == {"bfloat16"}  # updated in bfloat16


def test_the_twin_reading_bf16_copies_its_update_wrote_makes_the_very_same_steps():
    """`gpu_candidates`' "bf16 copies": the update writes the bfloat16 copy of each layer weight,
    the next step reads it in place of a cast. Its mathematics is the twin's: with Adam, the
    losses and the float32 weights after three steps are the same (to the bit where XLA
    optimizes; the suite's unoptimized compiles round a few elements 1e-6 apart); `gpu_candidates.run`
    times it beside the others, all from one first loss (to the logsumexp's rounding)."""
    from benchmarks import gpu_candidates

    _, weights, task = gpu.meshax_step(TINY)
    weights, batch = {k: np.asarray(v) for k, v in weights.items()}, task.train_batch(0)
    plain = gpu.twin_step(TINY, weights, batch, lr=1e-2)
    copies = gpu.twin_step(TINY, weights, batch, lr=1e-2, copies=True)
    assert [plain() for _ in range(3)] == pytest.approx([copies() for _ in range(3)], rel=1e-6)
    after, copied = plain.weights(), copies.weights()
    for k in after:  # (Adam moved each weight by about 3e-2: 1e-2 a step)
        np.testing.assert_allclose(after[k], copied[k], rtol=0, atol=1e-5)
    wi = "transformer/decoder/1/ffn/wi/kernel"
    assert not np.array_equal(after[wi], weights[wi])  # (the gradient reached the float32 weight)
    read = gpu.copied(after)  # a stale copy would change the later losses: each layer's 8 are copied
    assert len(read) == 2 * 8 and wi in read and all(str(v.dtype) == "bfloat16" for v in read.values())

    records = gpu_candidates.run(TINY, steps=2, warmup=1)
    names = [r["name"] for r in records]
    assert names == [gpu_candidates.AS_IT_IS, *gpu_candidates.CANDIDATES, gpu_candidates.AS_IT_IS]
    assert [r["first"] for r in records] == pytest.approx([records[0]["first"]] * len(records), rel=1e-5)
    assert all(r["tflops"] > 0 and r["x_as_it_is"] > 0 for r in records)


def test_the_candidates_to_time_can_be_chosen_by_name(tmp_path, monkeypatch, capsys):
    """`--only "statistics"`: the twin as it is, the two kept-statistics norms, the twin again; a
    name in no candidate is one line naming them."""
    import json

    from benchmarks import gpu_candidates

    monkeypatch.setattr(gpu, "SIZES", [TINY])
    monkeypatch.setattr(gpu, "LARGER", [])
    out = tmp_path / "c.json"
    gpu_candidates.main(["--size", TINY.name, "--only", "statistics", "--out", str(out)])
    names = [r["name"] for r in json.loads(out.read_text())["records"]]
    kept = [n for n in gpu_candidates.CANDIDATES if "statistics" in n]
    assert len(kept) == 2 and names == [gpu_candidates.AS_IT_IS, *kept, gpu_candidates.AS_IT_IS]
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        gpu_candidates.main(["--size", TINY.name, "--only", "nothing like it"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "--only 'nothing like it' is in no candidate's name: " in line]
    assert len(said) == 1 and all(name in said[0] for name in gpu_candidates.CANDIDATES), err


def test_section6_records_each_size_and_a_failing_one_without_losing_the_rest(monkeypatch):
    """run() as on a GPU (the device faked): the matmul peak, then per size a throughput ratio
    and an MFU row; a size that fails is a record naming its error, and the sizes after it run."""
    import jax

    real = jax.devices

    class FakeGpu:
        platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"

        def __init__(self, device):
            self._device = device

        def __getattr__(self, name):
            return getattr(self._device, name)

        def memory_stats(self):
            return {"peak_bytes_in_use": 3 * 2**30}

    def first_device_faked(*args):
        jax.devices = real  # only run()'s own look at the platform sees the fake
        return [FakeGpu(real(*args)[0])]

    monkeypatch.setattr(jax, "devices", first_device_faked)
    monkeypatch.setattr(gpu, "matmul_tflops", lambda: 500.0)  # an 8192^3 chain is minutes on a CPU
    monkeypatch.setattr(gpu, "TWIN_ATTENTION", None)  # no cuDNN on a CPU
    broken = gpu.Lm("broken", 2, 63, 4, batch=4, length=64, vocab=512)  # d_model 63: odd, no sinusoids
    twinless = gpu.Lm("350M", 1, 64, 4, batch=4, length=64, vocab=512)  # its twin runs out of memory
    copyless = gpu.Lm("1.3B", 1, 64, 4, batch=4, length=64, vocab=512)  # its twin's bf16 copies do not fit
    twin_step = gpu.twin_step

    def twin_step_or_out_of_memory(size, weights, batch, **kw):
        if size is twinless or (size is copyless and kw["copies"]):
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 99GiB")
        return twin_step(size, weights, batch, **kw)

    monkeypatch.setattr(gpu, "twin_step", twin_step_or_out_of_memory)
    measure = gpu.measure  # (fewer steps than on a GPU: the records are checked, not the timings)
    monkeypatch.setattr(
        gpu, "measure", lambda size, steps, warmup, **kw: measure(size, 2, 1, copies=size is copyless, **kw)
    )
    monkeypatch.setattr(gpu, "SIZES", [broken, TINY, twinless, copyless])
    monkeypatch.setattr(gpu, "LARGER", [])

    def cost_record_fails(size, platform):  # (the costing itself: the test without a GPU)
        raise RuntimeError("INTERNAL: the cost analysis failed")

    monkeypatch.setattr(gpu, "cost_record", cost_record_fails)
    costed, *records = gpu.run(quick=False)
    assert costed["name"] == "compiled step's bytes accessed, meshax / twin: failed"
    assert costed["value"] is None and "cost analysis failed" in costed["note"]  # and the timings go on
    names = [r["name"] for r in records]
    assert names == [
        "bf16 matmul peak, measured",
        "LM broken: failed (GraphError)",
        "LM 125M step, meshax / twin throughput",
        "LM 125M MFU (meshax)",
        "LM 350M: the twin does not fit",
        "LM 350M MFU (meshax)",
        "LM 1.3B step, meshax / twin throughput",
        "LM 1.3B MFU (meshax)",
    ]
    peak, failed, ratio, mfu, no_twin, mfu_alone, without_copies, _ = records
    assert peak["value"] == 500.0 and peak["table_peak"] == 989.0
    assert failed["value"] is None and "d_model" in failed["note"]
    assert ratio["target"] == ">= 0.95" and ratio["value"] > 0 and ratio["process_peak_gib_so_far"] == 3.0
    assert mfu["value"] == pytest.approx(ratio["numerator"]["value"] / 989.0)
    assert mfu["config"]["measured_peak_tflops"] == 500.0
    assert "RESOURCE_EXHAUSTED" in no_twin["note"] and no_twin["value"] is None
    assert mfu_alone["value"] > 0 and mfu_alone["twin_mfu"] is None and mfu_alone["met"] is False  # target 45%
    # a twin whose bf16 copies do not fit is timed without them, and says so
    assert without_copies["value"] > 0 and without_copies["twin_copies"] is False
    assert "without bf16 copies" in without_copies["note"] and "without" not in ratio["note"]


def test_without_a_gpu_the_two_compiled_steps_are_costed_and_the_timings_skipped(tmp_path):
    """On the CPU, section 6 compares the two compiled steps by XLA's cost analysis: meshax's
    accesses no more bytes than the twin's, at the same FLOPs (to 1%); its records are written
    to the benchmarks' JSON as they are."""
    import json

    from benchmarks import report

    costed, skipped = gpu.run(quick=True)  # (a tiny model)
    assert skipped["status"] == "skipped: no GPU"
    assert costed["met"] is True and 0 < costed["value"] <= 1.0
    assert costed["value"] == pytest.approx(costed["numerator"]["value"] / costed["denominator"]["value"])
    meshax_flops, twin_flops = costed["flops"]
    assert meshax_flops == pytest.approx(twin_flops, rel=0.01)
    report.write_json(str(tmp_path / "results.json"), {}, [costed, skipped], 0.0)
    written = json.loads((tmp_path / "results.json").read_text())["records"]
    assert written == json.loads(json.dumps([costed, skipped]))  # nothing stringified on the way
    assert all({"section", "name", "config", "value", "unit"} <= set(r) and r["section"] == 6 for r in written)


def test_the_parts_of_a_step_are_each_timed_or_say_why_not(monkeypatch):
    """`python -m benchmarks.gpu_parts` on the CPU at a tiny size: every part is timed, except
    cuDNN's attention, which names its error."""
    from benchmarks import gpu_parts

    monkeypatch.setattr(gpu, "TWIN_ATTENTION", None)  # the whole gradient's (cuDNN on a GPU)

    records = gpu_parts.parts(gpu.Lm("tiny", 2, 64, 4, batch=2, length=64, vocab=512), reps=2)
    assert len(records) == 14 and len({r["part"] for r in records}) == 14
    failed = [r for r in records if r["ms"] is None]
    assert [r["part"] for r in failed] == [
        "attention, one layer, cudnn",
        "attention, one layer, padding as key lengths, cudnn",
    ]
    assert all(r["error"] for r in failed)
    assert all(r["ms"] > 0 and r["compile_s"] > 0 for r in records if r not in failed)
    assert [r["part"] for r in gpu_parts.parts(gpu.Lm("tiny", 1, 32, 2, 2, 32, 64), reps=1, only="embedding")] == [
        "embedding lookup, distinct ids",
        "embedding lookup, text's repeated ids",
    ]


def test_the_twins_logits_pass_a_bfloat16_gradient_to_bfloat16_matmuls():
    """As meshax's wide einsum does: the same gradient as jax.grad of the einsum, to bfloat16's
    rounding, with both of its matmuls taking bfloat16 operands."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    y = jnp.asarray(rng.standard_normal((2, 8, 16)), jnp.bfloat16)
    table = jnp.asarray(rng.standard_normal((32, 16)) * 0.1, jnp.float32)

    def loss(logits):
        return lambda y, t: jnp.sum(jax.nn.log_softmax(logits(y, t))[..., 3])

    narrow = jax.grad(loss(gpu.narrow_gradient_logits()), argnums=(0, 1))
    got, want = narrow(y, table), jax.grad(loss(gpu.wide_logits), argnums=(0, 1))(y, table)
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)
    dots = [e for e in jax.make_jaxpr(narrow)(y, table).jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3 and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)


def test_the_profile_of_each_sides_step_names_where_its_time_goes(tmp_path, monkeypatch):
    """`python -m benchmarks.gpu_profile` on the CPU at a tiny size: each side's trace is read
    back into busy time per line, by kind, and its costliest events (the CPU's host plane
    stands in for a GPU's device plane)."""
    import json
    import tempfile

    from benchmarks import gpu_profile

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    gpu_profile.run(gpu.Lm("tiny", 2, 64, 4, batch=2, length=64, vocab=512), 2, str(tmp_path / "p.json"))
    assert not list(scratch.iterdir())  # the traces are removed once read
    saved = json.loads((tmp_path / "p.json").read_text())
    for side in ("meshax", "twin"):
        r = saved[side]
        assert r["wall_ms"] > 0
        busiest = max(r["lines"], key=lambda line: line["busy_ms"])
        assert busiest["busy_ms"] > 0 and busiest["top"][0]["ms"] > 0
        assert sum(busiest["by_kind_ms"].values()) == pytest.approx(busiest["busy_ms"])
        # kernels tied to their HLO instructions (on the CPU, on the XLA threads' lines)
        described = [op for line in r["lines"] for op in line["top_ops"] if op["instruction"]]
        assert described and all(" = " in op["instruction"] and op["ms"] > 0 for op in described)
    assert gpu_profile.kind_of("nvjet_sm90_tst_176x128_64x5_1x2_h_bz_TNN") == "matmul"
    assert gpu_profile.kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16") == "attention"


def test_each_hlo_instruction_is_described_by_its_shapes_and_what_it_is():
    """A GPU module's matmul is a custom call with a tuple result and its operands' shapes come
    from their own lines; a fusion says its kind; ROOT and layouts are read past."""
    from benchmarks import gpu_profile

    text = """
ENTRY %main (p.1: bf16[8192,2048], p.2: bf16[2048,2048]) -> bf16[8192,2048] {
  %p.1 = bf16[8192,2048]{1,0} parameter(0), metadata={op_name="x"}
  %p.2 = bf16[2048,2048]{1,0} parameter(1)
  %custom-call.3 = (bf16[8192,2048]{1,0}, s8[4194304]{0}) custom-call(bf16[8192,2048]{1,0} %p.1, %p.2), \
custom_call_target="__cublas$gemm", backend_config={"alpha_real":1}
  %get-tuple-element.4 = bf16[8192,2048]{1,0} get-tuple-element(%custom-call.3), index=0
  ROOT %loop_add_fusion.5 = bf16[8192,2048]{1,0} fusion(%get-tuple-element.4, %p.1), kind=kLoop, calls=%fused.1
}
""".replace("\\\n", "")
    described = gpu_profile.instructions(text)
    assert described["custom-call.3"] == (
        "(bf16[8192,2048], s8[4194304]) = custom-call __cublas$gemm(bf16[8192,2048], bf16[2048,2048])"
    )
    assert described["loop_add_fusion.5"] == "bf16[8192,2048] = fusion kLoop(bf16[8192,2048], bf16[8192,2048])"
    assert described["p.2"] == "bf16[2048,2048] = parameter()"
    # what a kernel moves at least: its instruction's arrays, here 3 of 8192 x 2048 bf16
    assert gpu_profile.bytes_of(described["loop_add_fusion.5"]) == 3 * 8192 * 2048 * 2
    assert gpu_profile.bytes_of(described["custom-call.3"]) == 2 * 8192 * 2048 * 2 + 2048 * 2048 * 2 + 4194304
    # a GPU kernel inside a command buffer is tied to the fusion it is named after, not the buffer
    named = gpu_profile.kernel_names(described)
    assert gpu_profile.tie("loop_add_fusion_5", "command_buffer_1", named) == "loop_add_fusion.5"
    assert gpu_profile.tie("nvjet_sm90_tst_176x128_64x5_1x2_h_bz_TNN", "custom-call.3", named) == "custom-call.3"
    assert gpu_profile.instructions("  %odd = \n  %also.odd = f32[2]\n") == {}  # skipped, not fatal


def test_the_one_pass_logsumexp_candidate_equals_jaxs_with_its_gradient():
    """gpu_parts' candidate for the float32 loss: one variadic reduce, the same values and
    gradient as jax.nn.logsumexp, also where a row holds -inf (a masked logit)."""
    import jax
    import jax.numpy as jnp

    from benchmarks import gpu_parts

    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 5, 40)) * 4, jnp.float32)
    x = x.at[0, 0, :7].set(-jnp.inf)
    mine = gpu_parts.one_pass_logsumexp()
    np.testing.assert_allclose(mine(x), jax.nn.logsumexp(x, -1), rtol=1e-6)
    weights = jnp.arange(15.0).reshape(3, 5)
    grads = [jax.grad(lambda x, f=f: jnp.sum(f(x) * weights))(x) for f in (mine, lambda x: jax.nn.logsumexp(x, -1))]
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("barrier", [False, True])
def test_the_norm_that_keeps_its_statistics_has_the_norms_values_and_gradients(barrier):
    """gpu's candidate layer norm (its gradient from the forward's row mean and reciprocal
    deviation) equals the twin's `_norm` and JAX's gradient of it, in float32 and in bfloat16
    (where both compute in float32 and round the result)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(2)
    mine = gpu.kept_statistics_norm(barrier)
    scale, bias = (jnp.asarray(rng.standard_normal(48), jnp.float32) for _ in range(2))
    g = rng.standard_normal((3, 5, 48))
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
        x = jnp.asarray(rng.standard_normal((3, 5, 48)) * 3 + 1, dtype)
        for f in (mine, gpu._norm):
            assert f(x, scale, bias).dtype == dtype
        np.testing.assert_allclose(
            np.float32(mine(x, scale, bias)), np.float32(gpu._norm(x, scale, bias)), rtol=tol, atol=tol
        )
        grads = [
            jax.grad(lambda *a, f=f: jnp.sum(f(*a).astype(jnp.float32) * g), argnums=(0, 1, 2))(x, scale, bias)
            for f in (mine, gpu._norm)
        ]
        for a, b in zip(*grads):
            assert a.dtype == b.dtype
            np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=tol, atol=tol * np.abs(np.float32(b)).max())


def test_xla_option_candidates_are_each_timed_and_the_faster_ones_tried_together(monkeypatch):
    """`python -m benchmarks.gpu_options`: XLA's defaults first and last, each candidate between
    (a refused one records XLA's reason, and the rest go on), then the candidates faster than the
    defaults by more than the two defaults' spread, together. One real step at a tiny size; the
    order and the choice with the step's timing faked."""
    from benchmarks import gpu_options

    tiny = gpu.Lm("tiny", 2, 64, 4, batch=2, length=64, vocab=512)
    real = gpu_options.one(tiny, "cuBLASLt", {"xla_gpu_enable_cublaslt": True}, steps=2, warmup=1)
    assert real["queued_s"] > 0 and real["tflops"] > 0 and np.isfinite(real["first_loss"])
    refused = gpu_options.one(tiny, "typo", {"xla_gpu_enable_cublasltt": True}, steps=2, warmup=1)
    assert refused["queued_s"] is None and "xla_gpu_enable_cublasltt" in refused["error"]
    # meshax's own choice for the program (not an XLA option): the step with kept bf16 weight copies
    copies = gpu_options.one(tiny, "copies", {"cast_copies": True}, steps=2, warmup=1)
    assert copies["queued_s"] > 0 and copies["first_loss"] == real["first_loss"]
    half = gpu_options.one(tiny, "float16", gpu_options.CANDIDATES["float16, loss-scaled"], steps=2, warmup=1)
    assert half["queued_s"] > 0 and half["first_loss"] == pytest.approx(real["first_loss"], rel=1e-2)
    assert half["first_loss"] != real["first_loss"]  # (computed in float16, not bfloat16)

    times = {"a": 0.0895, "b": 0.095, "c": 0.0889, "bad": None}
    defaults = iter([0.0910, 0.0905])

    def fake(size, name, options, steps, warmup):
        s = next(defaults) if name == gpu_options.DEFAULTS else times.get(name, 0.088)
        return {"name": name, "options": options, "queued_s": s, "tflops": s and 1.0, "error": None if s else "refused"}

    monkeypatch.setattr(gpu_options, "one", fake)
    candidates = {name: {f"option_{name}": True} for name in times}
    records = gpu_options.run(tiny, candidates)
    names = [r["name"] for r in records]
    assert names == [gpu_options.DEFAULTS, "a", "b", "c", "bad", gpu_options.DEFAULTS, gpu_options.TOGETHER]
    # the spread of the defaults is 0.55%: a (1.1% faster) and c (1.8%) count, b and bad do not
    assert records[-1]["options"] == {"option_a": True, "option_c": True}
    assert records[1]["vs_defaults"] == pytest.approx(0.0905 / 0.0895) and records[4]["vs_defaults"] is None
    assert "refused" in gpu_options.table(records, 989.0)
    # one faster candidate alone is not timed again
    defaults = iter([0.0910, 0.0905])
    times = {"a": 0.089, "b": 0.095}
    assert [r["name"] for r in gpu_options.run(tiny, {n: {n: 1} for n in times})][-1] == gpu_options.DEFAULTS
