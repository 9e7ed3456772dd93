"""Fused attention (`mx.fused_attention`) against the einsum attention, forward and gradient,
with heads split and not, causal and with a padding mask, in float32, bfloat16 and float16 (on
the CPU, XLA's attention of float16 inputs runs in float32: XLA:CPU has no float16 matmul summing
in float32)."""

import numpy as np
import pytest

import meshax as mx
from meshax.lower.context import LoweringContext
from meshax.ops.attention import AttentionOperation
from tests.conftest import rand, run

BATCH, LENGTH, HEADS, D_KV = (mx.Dimension(n, s) for n, s in [("b", 4), ("length", 8), ("heads", 4), ("d_kv", 8)])
MEMORY = mx.Dimension("memory_length", 8)


def _both(mesh, dtype, causal):
    """(fused, einsum) outputs and their gradients wrt q, k, v, and the feeds."""
    q, k, v = (
        mx.placeholder(mesh, n, s)
        for n, s in [("q", [BATCH, LENGTH, HEADS, D_KV])] + [(n, [BATCH, MEMORY, HEADS, D_KV]) for n in "kv"]
    )
    ids = mx.placeholder(mesh, "ids", [BATCH, MEMORY], "int32")
    w = mx.placeholder(mesh, "w", [BATCH, LENGTH, HEADS, D_KV])
    keep = mx.not_equal(ids, 0)
    qc, kc, vc = (mx.cast(t, dtype) for t in (q, k, v))
    fused = mx.fused_attention(qc, kc, vc, D_KV, HEADS, mask=keep, causal=causal)
    logits = mx.einsum(qc, kc, reduced_dims=[D_KV], dtype="float32") * (1.0 / D_KV.size**0.5)
    bias = mx.where(keep, 0.0, -1e9)
    if causal:
        bias = bias + mx.where(mx.greater(mx.range(mesh, MEMORY), mx.range(mesh, LENGTH)), -1e9, 0.0)
    weights = mx.cast(mx.softmax(logits + bias, MEMORY), dtype)
    plain = mx.einsum(weights, vc, reduced_dims=[MEMORY])
    outs = []
    for out in (fused, plain):
        loss = mx.reduce_sum(mx.cast(out, "float32") * w)
        outs += [mx.cast(out, "float32"), *mx.gradients(loss, [q, k, v])]
    ids_v = np.random.default_rng(0).integers(1, 5, (4, 8)).astype(np.int32)
    ids_v[:, 6:] = 0  # the last two keys are padding
    feeds = {
        q: rand([4, 8, 4, 8], 1),
        k: rand([4, 8, 4, 8], 2),
        v: rand([4, 8, 4, 8], 3),
        w: rand([4, 8, 4, 8], 4),
        ids: ids_v,
    }
    return outs, feeds


@pytest.mark.parametrize("layout", ["", "heads:cols", "b:rows;heads:cols", "length:cols;memory_length:rows"])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 3e-2), ("float16", 5e-3)])
def test_fused_attention_equals_einsum_attention(layout, dtype, tol):
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    outs, feeds = _both(mesh, dtype, causal=True)
    got = run(outs, mx.SimdMeshImpl, "rows:2;cols:4", layout, feeds)
    fused, plain = got[:4], got[4:]
    for name, a, b in zip(["output", "dq", "dk", "dv"], fused, plain):
        scale = max(1.0, float(np.abs(b).max()))
        np.testing.assert_allclose(a, b, atol=tol * scale, rtol=tol, err_msg=f"{name} under {layout!r} in {dtype}")
    assert np.abs(fused[0][:, 0]).max() > 0  # (causal: the first query sees one key, not none)


def test_fused_attention_counts_the_einsums_flops_and_keeps_sequences_whole():
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    outs, _ = _both(mesh, "float32", causal=False)
    lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "b:rows;heads:cols")})
    lowering.function(outs)
    flops = lowering.counters.flops
    types = lowering.counters.op_types
    fused = sum(f for n, f in flops.items() if types[n].startswith("Attention"))
    # forward: q.k and w.v, 2 x 4*8*8*4*8 multiply-adds each; gradient: four such matmuls; per device 1/8
    assert fused == (2 + 4) * 2 * 4 * 8 * 8 * 4 * 8 // 8
    assert not any(s.op_type.startswith("Attention") for s in lowering.counters.sites())


def test_fused_attention_errors_name_the_problem():
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    q = mx.placeholder(mesh, "q", [BATCH, LENGTH, HEADS, D_KV])
    k = mx.placeholder(mesh, "k", [BATCH, MEMORY, HEADS, D_KV])
    with pytest.raises(mx.GraphError, match="same dims"):
        mx.fused_attention(q, k, q, D_KV, HEADS)
    with pytest.raises(mx.GraphError, match="exactly one dim"):
        mx.fused_attention(q, q, q, D_KV, HEADS)
    with pytest.raises(mx.GraphError, match="must be bool"):
        mx.fused_attention(q, k, k, D_KV, HEADS, mask=mx.placeholder(mesh, "m", [BATCH, MEMORY]))
    short = mx.placeholder(mesh, "s", [BATCH, mx.Dimension("memory_length", 4), HEADS, D_KV])
    with pytest.raises(mx.GraphError, match="causal needs"):
        mx.fused_attention(q, short, short, D_KV, HEADS, causal=True)
    assert isinstance(mx.fused_attention(q, k, k, D_KV, HEADS).operation, AttentionOperation)


def test_fused_attention_asks_for_cudnn_on_a_gpu_and_falls_back_to_xla(monkeypatch):
    """On a GPU, 16-bit attention asks for cuDNN (JAX's own default runs XLA's, 5x slower on an
    H100); where cuDNN refuses, XLA's runs. Float32, and any other platform, go to JAX as given."""
    import jax
    import jax.numpy as jnp

    from meshax.ops import attention

    asked = []
    real = jax.nn.dot_product_attention

    def spy(q, k, v, implementation=None, **kw):
        asked.append(implementation)
        if implementation == "cudnn":
            raise RuntimeError("cuDNN is not detected.")
        return real(q, k, v, implementation=implementation, **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    expected = real(q, q, q, is_causal=True)
    out = attention._attend(q, q, q, None, "gpu", is_causal=True)
    assert asked == ["cudnn", None] and jnp.array_equal(out, expected)
    asked.clear()
    f = q.astype(jnp.float32)
    attention._attend(f, f, f, None, "gpu")
    attention._attend(q, q, q, "xla", "gpu")
    assert asked == [None, "xla"]
    asked.clear()
    attention._attend(q, q, q, None, "cpu")
    assert asked == [None]

    def out_of_memory(q, k, v, implementation=None, **kw):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory")

    monkeypatch.setattr(jax.nn, "dot_product_attention", out_of_memory)
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):  # not hidden by a second try
        attention._attend(q, q, q, None, "gpu")


def test_the_attention_path_is_chosen_by_the_platform_given():
    """cuDNN for 16 bits on a GPU, float16 widened to float32 on the CPU, else as given: by the
    platform of the devices the program runs on, passed in, not JAX's default backend."""
    import jax.numpy as jnp

    from meshax.ops.attention import _path

    assert [_path(jnp.float16, None, p) for p in ("gpu", "cpu", "tpu")] == ["cudnn", "float32", "as given"]
    assert [_path(jnp.bfloat16, None, p) for p in ("gpu", "cpu")] == ["cudnn", "as given"]
    assert [_path(jnp.float32, None, p) for p in ("gpu", "cpu")] == ["as given", "as given"]
    assert _path(jnp.float16, "xla", "gpu") == "as given" and _path(jnp.float16, "xla", "cpu") == "float32"
    assert _path(jnp.float16, "cudnn", "cpu") == "as given"


@pytest.mark.parametrize("impl_cls", [mx.SimdMeshImpl, mx.PlacementMeshImpl])
def test_a_cpu_mesh_takes_the_cpu_path_where_jax_defaults_to_a_gpu(monkeypatch, impl_cls):
    """A mesh of CPU devices in a process whose default backend is a GPU: float16 attention
    (forward and gradient) runs as on the CPU, widened to float32, and never asks for cuDNN.
    The path followed `jax.default_backend()`, so such a mesh asked the CPU for cuDNN."""
    import jax

    asked = []
    real = jax.nn.dot_product_attention

    def spy(q, k, v, implementation=None, **kw):
        asked.append((implementation, str(q.dtype)))
        return real(q, k, v, implementation=implementation, **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    q = mx.placeholder(mesh, "q", [BATCH, LENGTH, HEADS, D_KV], "float16")
    k = mx.placeholder(mesh, "k", [BATCH, MEMORY, HEADS, D_KV], "float16")
    out = mx.fused_attention(q, k, k, D_KV, HEADS, causal=True)
    grads = mx.gradients(mx.reduce_sum(mx.cast(out, "float32")), [q, k])
    run(
        [out, *grads],
        impl_cls,
        "rows:2;cols:4",
        "b:rows;heads:cols",
        {q: rand([4, 8, 4, 8], 1), k: rand([4, 8, 4, 8], 2)},
    )
    assert asked and set(asked) == {(None, "float32")}


@pytest.mark.parametrize("impl_cls", [mx.SimdMeshImpl, mx.PlacementMeshImpl])
def test_the_gradient_reuses_the_forwards_kernel_call(monkeypatch, impl_cls):
    """The forward runs as jax.vjp of the kernel and the gradient applies its pullback: half the
    kernel calls of running it again (cuDNN's forward with and without its statistics are two
    calls that XLA does not merge). Where the gradient op does not get the forward's slices, it
    runs the kernel again, with the same values."""
    import jax

    calls = []
    real = jax.nn.dot_product_attention

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    q = mx.placeholder(mesh, "q", [BATCH, LENGTH, HEADS, D_KV])
    k = mx.placeholder(mesh, "k", [BATCH, MEMORY, HEADS, D_KV])
    out = mx.fused_attention(q, k, k, D_KV, HEADS, causal=True)
    grads = mx.gradients(mx.reduce_sum(out * out), [q, k])
    qv, kv = rand([4, 8, 4, 8], 1), rand([4, 8, 4, 8], 2)
    feeds = {q: qv, k: kv}
    reused = run([out, *grads], impl_cls, "rows:2;cols:4", "b:rows;heads:cols", feeds)
    once = len(calls)
    calls.clear()
    monkeypatch.setattr(LoweringContext, "recall", lambda *a: None)
    again = run([out, *grads], impl_cls, "rows:2;cols:4", "b:rows;heads:cols", feeds)
    assert once > 0 and len(calls) == 2 * once
    for a, b in zip(reused, again):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # a graph without the gradient (decoding) runs the forward-only kernel: nothing kept
    kept = []
    monkeypatch.setattr(LoweringContext, "remember", lambda *a: kept.append(a))
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    q = mx.placeholder(mesh, "q", [BATCH, LENGTH, HEADS, D_KV])
    k = mx.placeholder(mesh, "k", [BATCH, MEMORY, HEADS, D_KV])
    alone = run(
        [mx.fused_attention(q, k, k, D_KV, HEADS, causal=True)], impl_cls, "rows:2;cols:4", "b:rows", {q: qv, k: kv}
    )
    assert not kept
    np.testing.assert_allclose(alone[0], reused[0], rtol=1e-6, atol=1e-6)
