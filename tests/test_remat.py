"""Rematerialization: `mx.recompute_grad` and TransformerConfig(remat=True)."""

import dataclasses

import numpy as np
import pytest

import meshax as mx
from meshax.models.transformer import PRESETS, TransformerConfig
from meshax.optimize import SgdOptimizer
from meshax.plan import memory_per_device
from meshax.train import LmTask
from meshax.train.loop import build
from tests.conftest import rand

B, D, H = mx.Dimension("b", 8), mx.Dimension("d", 8), mx.Dimension("h", 16)


@pytest.mark.parametrize("layout", ["", "b:rows;d:cols", "h:all"])
def test_recompute_grad_gives_the_same_gradients_and_recomputes_behind_a_barrier(layout):
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    x = mx.placeholder(mesh, "x", [B, D])
    w1, w2 = mx.get_variable(mesh, "w1", [D, H]), mx.get_variable(mesh, "w2", [H, D])

    def layer(x, seed):  # reads the weights from outside, as a Transformer layer does
        h = mx.dropout(mx.relu(mx.einsum(x, w1, reduced_dims=[D])), 0.25, seed=seed)
        return mx.tanh(mx.einsum(h, w2, reduced_dims=[H])) + x

    # (each path's two dropouts draw with seeds 1 and 2: the same masks in both paths)
    inner = mx.recompute_grad(lambda x: layer(x, 1), [x])
    remat = mx.reduce_sum(mx.square(mx.recompute_grad(lambda x: layer(x, 2), [inner])))
    plain = mx.reduce_sum(mx.square(layer(layer(x, 1), 2)))
    grads = mx.gradients(remat, [w1, w2, x]) + mx.gradients(plain, [w1, w2, x])
    mesh_shape = "all:8" if layout == "h:all" else "rows:2;cols:4"
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl(mesh_shape, layout)}).function([remat, plain, *grads])
    out = fn({x: rand([8, 8], 1)}, seed=3)
    assert out[0] == out[1]
    for name, a, b in zip(["w1", "w2", "x"], out[2:5], out[5:8]):
        # the same ops on the same values, dropout too; the gradient sums may round differently
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)


def _tanh_count(remat: bool) -> int:
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    x = mx.placeholder(mesh, "x", [B, D])
    w1, w2 = mx.get_variable(mesh, "w1", [D, H]), mx.get_variable(mesh, "w2", [H, D])
    layer = lambda x: mx.tanh(mx.einsum(mx.einsum(x, w1, reduced_dims=[D]), w2, reduced_dims=[H])) + x  # noqa: E731
    f = (lambda x: mx.recompute_grad(layer, [x])) if remat else layer
    loss = mx.reduce_sum(mx.square(f(f(x))))
    grads = mx.gradients(loss, [w1, w2])
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "")}).function([loss, *grads])
    return fn.compiled_text().count(" tanh(")


def test_xla_does_not_merge_the_recomputation_away():
    """tanh's gradient reads its output, so only a recomputation runs tanh again: without the
    optimization barrier XLA would see the same tanh of the same input and keep one."""
    assert (_tanh_count(False), _tanh_count(True)) == (2, 4)


def test_a_gradient_no_one_asked_for_is_not_computed():
    """The backward recompute op can give every input's gradient; the program computes only the
    ones it reads. With `h` split, x's gradient would be an allreduce that XLA drops: the
    counters counted it (2 allreduces where the compiled program holds 1)."""
    counts = []
    for remat in (False, True):
        graph = mx.Graph()
        mesh = mx.Mesh(graph, "mesh")
        x = mx.placeholder(mesh, "x", [B, D])
        w1, w2 = mx.get_variable(mesh, "w1", [D, H]), mx.get_variable(mesh, "w2", [H, D])
        layer = lambda x, w1=w1, w2=w2: mx.einsum(mx.tanh(mx.einsum(x, w1, reduced_dims=[D])), w2, reduced_dims=[H])  # noqa: E731
        y = mx.recompute_grad(layer, [x]) if remat else layer(x)
        loss = mx.reduce_sum(mx.square(y))
        fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "h:all")}).function(
            [loss, *mx.gradients(loss, [w1, w2])]
        )
        fn({x: rand([8, 8], 1)})
        hlo = mx.hlo_collectives(fn.compiled_text())
        assert {k: (fn.counters[k].count, fn.counters[k].values) for k in hlo} == {
            k: (v["count"], v["values"]) for k, v in hlo.items()
        }
        counts.append(fn.counters["allreduce"].count)
    assert counts == [1, 1]


SMALL = TransformerConfig(vocab_size=16, d_model=16, d_ff=32, num_heads=8, d_kv=4, num_layers=2, dropout=0.1)


@pytest.mark.parametrize("attention", ["einsum", "fused"])
def test_a_rematerialized_transformer_trains_identically(attention):
    def losses(config):
        if attention == "fused":  # (which has no dropout on the attention weights)
            config = dataclasses.replace(config, attention=attention, dropout=0.0)
        task = LmTask(model=config, source="markov", markov_vocab=16, batch_size=8, length=8)
        program = build(task, "rows:2;cols:4", "batch:rows;vocab:cols;d_ff:cols;heads:cols", "simd", SgdOptimizer(0.5))
        return [float(program.train_fn(task.train_batch(s), seed=s)[0]) for s in range(4)]

    # Bit for bit under XLA's default CPU compiler; this suite turns its fusion emitters off
    # (tests/conftest.py), which may fuse a recomputed forward pass otherwise: float32 rounding.
    remat, plain = losses(dataclasses.replace(SMALL, remat=True)), losses(SMALL)
    assert remat[0] == plain[0]
    np.testing.assert_allclose(remat, plain, rtol=1e-6)


def _activations(remat: bool, layout: str = ""):
    config = dataclasses.replace(PRESETS["small"], remat=remat)
    task = LmTask(model=config, batch_size=16, length=256)
    lowering, outputs, _ = build(task, "rows:2;cols:4", layout, "simd", SgdOptimizer(0.1), compile=False)
    return lowering, memory_per_device(lowering, outputs)["activations"]


@pytest.mark.parametrize("layout", ["", "batch:rows;vocab:cols;d_ff:cols;heads:cols"])
def test_the_plans_activation_memory_drops_by_the_stated_factor(layout):
    """Without remat the plan keeps R + L x A (L layers of internals A, the rest R); with it,
    R + L x X + A (each layer's output X, and one layer's internals while its gradient runs)."""
    from meshax.ops.recompute import RecomputeOperation

    _, plain = _activations(False, layout)
    lowering, remat = _activations(True, layout)
    slice_bytes = lambda t: int(np.prod(lowering.impl.slice_shape(t.shape, lowering.plan[t]))) * t.dtype.itemsize  # noqa: E731
    regions = [op for op in lowering.graph.operations if isinstance(op, RecomputeOperation) and not op.barrier]
    assert len(regions) == 4  # the small model's layers
    internals = [sum(slice_bytes(t) for b in op.body for t in b.outputs) for op in regions]
    assert len(set(internals)) == 1
    layer, output = internals[0], slice_bytes(regions[0].outputs[0])
    rest = plain - 4 * layer
    assert remat == rest + 4 * output + layer
    assert plain / remat > 3.0  # 4 layers, attention [16, 8, 256, 256] per layer: the internals dominate


def test_remat_refuses_what_it_cannot_do():
    with pytest.raises(mx.ConfigError, match="a pipeline already recomputes"):
        dataclasses.replace(SMALL, remat=True, pipeline_stages=2, num_layers=2)
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    x = mx.placeholder(mesh, "x", [B, D])
    with pytest.raises(mx.GraphError, match="unchanged"):
        mx.recompute_grad(lambda x: x, [x])
    with pytest.raises(mx.GraphError, match="at least one explicit input"):
        mx.recompute_grad(lambda: x * 2.0, [])
