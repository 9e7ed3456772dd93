"""The Transformer pipelined (GPipe, circular; encoder and decoder each its own pipeline, as in
the GSPMD paper's Figure 2) and with mixture-of-experts layers, against the same model run
layer after layer and on one device."""

import dataclasses
import re

import numpy as np
import pytest

import meshax as mx
from meshax.models.transformer import PRESETS, Transformer, TransformerConfig
from meshax.optimize import SgdOptimizer
from meshax.plan import summarize
from meshax.train import LmTask, Seq2SeqTask
from meshax.train.loop import build

TINY = TransformerConfig(vocab_size=16, d_model=16, d_ff=32, num_heads=4, d_kv=4, num_layers=4)


def _unstacked(name: str, value: np.ndarray, config: TransformerConfig) -> dict[str, np.ndarray]:
    """A pipelined variable's values under the names the same layers have unpipelined: block
    b = r * stages + s (circular) holds layers b * k .. b * k + k - 1, k layers per block."""
    m = re.match(r"(.*/(?:decoder|encoder))/(\d+)/(.*)", name)
    if not m:
        return {name: value}
    stages, repeats = config.pipeline_stages, config.circular_repeats
    layers = (config.num_layers if "decoder" in m[1] else config.num_encoder_layers) // (stages * repeats)
    blocks = value.reshape(stages * repeats, *value.shape[1 + (repeats > 1) :])
    return {f"{m[1]}/{b * layers + int(m[2])}/{m[3]}": blocks[b] for b in range(stages * repeats)}


def _loss_and_grads(config, mesh_shape, layout, values=None, seq2seq=False):
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    b, length = mx.Dimension("batch", 8), mx.Dimension("length", 6)
    ids = mx.placeholder(mesh, "ids", [b, length], "int32")
    model = Transformer(config, mesh)
    logits = model.encoder_decoder(ids, ids, pad_id=None) if seq2seq else model.language_model(ids)
    loss = mx.reduce_mean(mx.square(logits))
    params = graph.trainable_variables
    grads = mx.gradients(loss, params)
    lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl(mesh_shape, layout)})
    if values is not None:
        for v in params:
            lowering.set_variable_value(v, values[v.name])
    got = lowering.function([loss, *grads])({"ids": np.arange(48).reshape(8, 6) % 16})
    return (
        lowering,
        got[0],
        {v.name: lowering.variable_value(v) for v in params},
        dict(zip([v.name for v in params], got[1:])),
    )


PIPELINES = [
    ("rows:2;cols:4", "stage:rows;batch:cols", dict(pipeline_stages=2, microbatches=2), False),
    ("rows:2;cols:4", "stage:cols;heads:rows", dict(pipeline_stages=4, microbatches=4), False),
    (
        "rows:2;cols:4",
        "stage:rows;vocab:cols;d_ff:cols",
        dict(pipeline_stages=2, microbatches=2, circular_repeats=2),
        False,
    ),
    pytest.param(
        "rows:2;cols:4",
        "stage:rows;batch:cols",
        dict(pipeline_stages=2, microbatches=2, num_encoder_layers=2),
        True,
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize("mesh_shape,layout,pipe,seq2seq", PIPELINES)
def test_pipelined_transformer_equals_its_layers_in_sequence(mesh_shape, layout, pipe, seq2seq):
    config = dataclasses.replace(TINY, **pipe)
    lowering, loss, values, grads = _loss_and_grads(config, mesh_shape, layout, seq2seq=seq2seq)
    plain = dataclasses.replace(config, pipeline_stages=0, microbatches=1, circular_repeats=1)
    flat = {k: v for name, value in values.items() for k, v in _unstacked(name, value, config).items()}
    _, want_loss, _, want_grads = _loss_and_grads(plain, "all:1", "", flat, seq2seq=seq2seq)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for name, g in grads.items():
        for k, v in _unstacked(name, g, config).items():
            np.testing.assert_allclose(v, want_grads[k], rtol=2e-4, atol=2e-6, err_msg=k)
    stacked = [v for v in lowering.graph.trainable_variables if "stage" in v.value.shape.dimension_names]
    assert stacked and all(lowering.layout_of(v.value).startswith("stage:") for v in stacked)
    pipelines = summarize(lowering, lowering.counters, []).pipelines
    assert [p["name"] for p in pipelines] == (["encoder_pipeline"] if seq2seq else []) + ["decoder_pipeline"]


@pytest.mark.slow
def test_seq2seq_with_two_pipelines_trains():
    """Figure 2: encoder and decoder pipelined separately over the same mesh dim."""
    config = dataclasses.replace(TINY, num_encoder_layers=2, pipeline_stages=2, microbatches=4)
    task = Seq2SeqTask(model=config, batch_size=16, length=6, vocab=8)
    program = build(task, "rows:2;cols:4", "stage:rows;batch:cols", "simd", SgdOptimizer(0.5))
    losses = [float(program.train_fn(task.train_batch(step), seed=step)[0]) for step in range(30)]
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])


def _moe_losses(mesh, layout, steps=8):
    config = dataclasses.replace(TINY, num_layers=2, moe_experts=4, moe_capacity_factor=2.0)
    task = LmTask(model=config, source="markov", markov_vocab=16, batch_size=8, length=8)
    program = build(task, mesh, layout, "simd", SgdOptimizer(0.5))
    return program, [float(program.train_fn(task.train_batch(step), seed=step)[0]) for step in range(steps)]


def test_moe_transformer_trains_the_same_expert_parallel_and_on_one_device():
    _, reference = _moe_losses("all:1", "")
    assert reference[-1] < reference[0]
    # GSPMD Table 6: experts and batch on one mesh dim; Table 7's hybrid: dense layers 2-D split
    for mesh, layout in [
        ("all:8", "batch:all;experts:all"),
        ("x:4;y:2", "batch:x;experts:x;d_ff:y;heads:y;expert_hidden:y"),
    ]:
        program, losses = _moe_losses(mesh, layout)
        np.testing.assert_allclose(losses, reference, rtol=2e-4, atol=2e-5, err_msg=layout)
        assert program.train_fn.counters["alltoall"].count == 4  # one MoE layer: 2 forward, 2 backward


# GSPMD Table 4: the 16B narrower model (M 4096, H 16384, N 64, D 128, 64 layers) on meshes
# (L, X, Y): stages over L, batch over X, and in-layer model parallelism over Y; the paper keeps
# weights off X. The paper prints peak memory (optimizer state and activations included), not
# parameter memory; what its description fixes is each device's share of the weights.
# (Two of its four meshes, (8, 8, 4) and (4, 16, 4): ~30 s each to trace; (8, 16, 2) and (2, 16, 8)
# follow the same formula.)
TABLE_4 = [(8, 8, 4), (4, 16, 4)]


@pytest.mark.slow
@pytest.mark.parametrize("stages,x,y", TABLE_4)
def test_plan_gives_table_4s_parameter_memory_per_device(stages, x, y):
    config = dataclasses.replace(PRESETS["gspmd-16b-narrow"], pipeline_stages=stages, microbatches=16)
    task = LmTask(model=config, batch_size=16 * 64, length=1024)
    lowering, outputs, updates = build(
        task, f"l:{stages};x:{x};y:{y}", "stage:l;batch:x;heads:y;d_ff:y;vocab:y", compile=False
    )
    s = summarize(lowering, lowering.trace_step(outputs, updates), outputs)
    M, H, layers = 4096, 16384, 64
    assert layers * (4 * M * 64 * 128 + 2 * M * H) == 2**34  # the paper's "16 billion"
    # per layer: the 2^28 weights and the d_ff bias split over stages and Y; the d_model bias
    # and the two norms' scales and biases over stages only
    stage_values = layers * ((2**28 + H) // (stages * y) + 5 * M // stages)
    (pipe,) = s.pipelines
    assert pipe["stage_weight_bytes_per_device"] == 4 * stage_values
    # outside the pipeline: the tied embedding (vocab over Y) and the final norm
    assert s.parameter_bytes_per_device == 4 * (stage_values + 32000 * M // y + 2 * M)
    assert pipe["bubble_fraction"] == pytest.approx((stages - 1) / (16 + stages - 1))


@pytest.mark.parametrize(
    "fields,says",
    [
        (dict(pipeline_stages=2, circular_repeats=0), "circular_repeats=0 must be a whole number of at least 1"),
        (dict(pipeline_stages=-2), "pipeline_stages=-2"),
        (dict(pipeline_stages="2"), "pipeline_stages='2'"),
        (dict(pipeline_stages=True), "pipeline_stages=True"),
        (dict(moe_experts=-2), "moe_experts=-2"),
        (dict(microbatches=4), "microbatches needs pipeline_stages > 1"),
        (dict(moe_experts=2, moe_loss_coef=float("nan")), "moe_loss_coef=nan must be a finite number >= 0"),
        (dict(moe_experts=2, moe_loss_coef="0.01"), "moe_loss_coef='0.01'"),
        (dict(layer_norm_epsilon=-1.0), "layer_norm_epsilon=-1.0 must be a finite number >= 0"),
    ],
)
def test_config_refuses_bad_pipeline_and_expert_counts(fields, says):
    """Before: circular_repeats=0 divided by zero, a text count compared with an int
    (TypeError), and a negative stage count or microbatches without stages ran unpipelined; a
    nan moe_loss_coef or a negative layer_norm_epsilon trained on nan losses."""
    with pytest.raises(mx.ConfigError, match=re.escape(says)):
        dataclasses.replace(TINY, **fields)
