"""The Transformer (issue 4): paper presets, the paper's layouts, resume, and the plan at scale."""

import dataclasses

import numpy as np
import pytest

import meshax as mx
from meshax.models.transformer import PAPER_PARAMETERS, PRESETS, Transformer, TransformerConfig
from meshax.optimize import AdamWeightDecayOptimizer, SgdOptimizer
from meshax.plan import summarize
from meshax.train import LmTask, Seq2SeqTask, train
from meshax.train.loop import build

# Small enough for the placement backend; heads, vocab and d_ff divide by 8 for the 8-way splits.
SMALL = TransformerConfig(vocab_size=16, d_model=16, d_ff=32, num_heads=8, d_kv=4, num_layers=1)
PAPER_LAYOUTS = [
    ("all:8", "batch:all"),
    ("all:8", "vocab:all;d_ff:all;heads:all"),
    ("rows:2;cols:4", "batch:rows;vocab:cols;d_ff:cols;heads:cols"),
]


@pytest.mark.parametrize("name", sorted(PAPER_PARAMETERS))
def test_paper_presets_match_table_3(name):
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    b, length = mx.Dimension("batch", 2), mx.Dimension("length", 4)
    Transformer(PRESETS[name], mesh).encoder_decoder(
        mx.placeholder(mesh, "i", [b, length], "int32"), mx.placeholder(mesh, "t", [b, length], "int32")
    )
    built = sum(v.value.size for v in graph.trainable_variables)
    assert built == PRESETS[name].parameter_count()
    assert built / 1e9 == pytest.approx(PAPER_PARAMETERS[name], rel=0.05)


def _losses(task, mesh, layout, backend, steps):
    """Training losses of `steps` steps (SGD: the layouts are what is tested, not the optimizer)."""
    program = build(task, mesh, layout, backend, SgdOptimizer(0.5))
    return [float(program.train_fn(task.train_batch(step), seed=step)[0]) for step in range(steps)]


def test_paper_layouts_give_the_same_losses_as_no_layout():
    """Every paper layout, on SIMD. (The placement backend, a loop over devices that compiles
    ~30x slower, trains the MLP and the small model of test_properties and test_train.)"""
    task = LmTask(model=SMALL, source="markov", markov_vocab=16, batch_size=8, length=8)
    reference = _losses(task, "all:1", "", "simd", 20)
    assert reference[-1] < reference[0]
    for mesh, layout in PAPER_LAYOUTS:
        np.testing.assert_allclose(
            _losses(task, mesh, layout, "simd", 20), reference, rtol=2e-4, atol=2e-5, err_msg=f"simd {mesh} {layout}"
        )


def test_encoder_decoder_under_the_2d_layout_matches():
    task = Seq2SeqTask(model=dataclasses.replace(SMALL, num_encoder_layers=1), batch_size=8, length=8)
    reference = _losses(task, "all:1", "", "simd", 10)
    np.testing.assert_allclose(_losses(task, *PAPER_LAYOUTS[2], "simd", 10), reference, rtol=2e-4, atol=2e-5)


def test_model_parallel_layout_costs():
    """vocab:all;d_ff:all;heads:all splits every parameter but the norms and d_model biases,
    and moves activations, not parameters: no allreduce carries a parameter gradient."""
    task = LmTask(model=SMALL, source="markov", batch_size=8, length=8)
    lowering, outputs, updates = build(task, "all:8", "vocab:all;d_ff:all;heads:all", compile=False)
    s = summarize(lowering, lowering.trace_step(outputs, updates), outputs)
    split = [v for v in lowering.graph.trainable_variables if not lowering.plan[v.value].is_fully_replicated]
    assert {v.name.rsplit("/", 1)[-1] for v in split} >= {"embedding", "q", "k", "v", "o", "kernel"}
    assert s.parameter_bytes_per_device == 4 * ((s.parameters - s.replicated_parameters) // 8 + s.replicated_parameters)
    # [batch, length, d_model] activations; [batch, length] for the softmax over the split vocab;
    # [d_model] for gradients of replicated parameters, summed over batch and length *before* the
    # allreduce (lazy reduction); scalars for the loss
    activation, per_token, d_model = 8 * 8 * 16, 8 * 8, 16
    sizes = {site.values for site in s.counters["allreduce"].sites}
    assert activation in sizes and sizes <= {activation, per_token, d_model, 1}


@pytest.mark.slow  # 29 s; tests/test_cli.py resumes a Transformer run by default
def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    task = LmTask(model=SMALL, source="markov", batch_size=8, length=8)
    straight = train(task, "rows:2;cols:4", "batch:rows;heads:cols", steps=8, optimizer=AdamWeightDecayOptimizer(3e-3))
    train(
        task,
        "rows:2;cols:4",
        "batch:rows;heads:cols",
        steps=4,
        optimizer=AdamWeightDecayOptimizer(3e-3),
        checkpoint_dir=str(tmp_path),
    )
    resumed = train(
        task,
        "rows:2;cols:4",
        "batch:rows;heads:cols",
        steps=8,
        optimizer=AdamWeightDecayOptimizer(3e-3),
        checkpoint_dir=str(tmp_path),
        resume=True,
    )
    assert resumed.first_step == 4
    np.testing.assert_array_equal(resumed.losses, straight.losses[4:])
    # and onto another mesh and layout: the same run, to float tolerance
    moved = tmp_path / "moved"
    train(
        task,
        "rows:2;cols:4",
        "batch:rows;heads:cols",
        steps=4,
        optimizer=AdamWeightDecayOptimizer(3e-3),
        checkpoint_dir=str(moved),
    )
    continued = train(
        task,
        "all:8",
        "vocab:all;d_ff:all;heads:all",
        steps=8,
        optimizer=AdamWeightDecayOptimizer(3e-3),
        checkpoint_dir=str(moved),
        resume=True,
    )
    np.testing.assert_allclose(continued.losses, straight.losses[4:], rtol=2e-4, atol=2e-5)


def test_plan_of_the_largest_paper_model_on_16x32():
    task = Seq2SeqTask(model="paper-ff65536", batch_size=256, length=256)
    lowering, outputs, updates = build(
        task, "rows:16;cols:32", "batch:rows;vocab:cols;d_ff:cols;heads:cols", compile=False
    )
    s = summarize(lowering, lowering.trace_step(outputs, updates), outputs)
    assert s.parameters == PRESETS["paper-ff65536"].parameter_count()
    per_device = (s.parameters - s.replicated_parameters) // 32 + s.replicated_parameters
    assert s.parameter_bytes_per_device == 4 * per_device
    # data-parallel term (paper section 8): each device allreduces its parameter gradients over rows
    rows_only = sum(site.values for site in s.counters["allreduce"].sites if site.mesh_axes == ("rows",))
    assert rows_only == pytest.approx(per_device, rel=0.001)
    # model-parallel term: one [batch/16, length, d_model] allreduce over cols per contraction of a split dim
    # (and [batch/16, length] per token for the softmax over the split vocab)
    activation, per_token = 256 // 16 * 256 * 1024, 256 // 16 * 256
    cols_only = [site.values for site in s.counters["allreduce"].sites if site.mesh_axes == ("cols",)]
    assert set(cols_only) <= {activation, per_token}
    # forward and backward: 2 per encoder layer, 3 per decoder layer, and the two embeddings
    assert cols_only.count(activation) == 2 * (6 * 2 + 6 * 3 + 2)


def test_padding_mask_hides_padded_inputs():
    """With pad_id 0, what the encoder holds at padded positions cannot reach the logits."""
    config = dataclasses.replace(SMALL, num_encoder_layers=1)
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    b, length = mx.Dimension("batch", 2), mx.Dimension("length", 8)
    inputs = mx.placeholder(mesh, "inputs", [b, length], "int32")
    targets_in = mx.placeholder(mesh, "t", [b, length], "int32")
    logits = Transformer(config, mesh).encoder_decoder(inputs, targets_in, pad_id=0)
    lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "batch:rows;heads:cols")})
    fn = lowering.function(logits)
    feeds = {
        "inputs": np.array([[3, 4, 5, 0, 0, 0, 0, 0], [6, 7, 8, 9, 10, 11, 0, 0]], np.int32),
        "t": np.array([[1, 5, 4, 3, 2, 2, 2, 2]] * 2, np.int32),
    }
    before = fn(feeds)
    table = next(v for v in graph.all_variables if v.name == "transformer/input_embedding")
    value = lowering.variable_value(table)
    value[0] = np.random.default_rng(0).normal(size=value.shape[1]) * 10  # the pad token's embedding
    lowering.set_variable_value(table, value)
    np.testing.assert_allclose(fn(feeds), before, rtol=1e-5, atol=1e-5)
    value[3] += np.random.default_rng(1).normal(size=value.shape[1])  # a real token's embedding does reach them
    lowering.set_variable_value(table, value)
    assert np.abs(fn(feeds) - before).max() > 1e-3


def test_learned_positions_untied_gelu_and_dropout_under_the_paper_layouts():
    """Dropout masks are keyed by global position, so even with dropout every layout trains alike."""
    config = dataclasses.replace(
        SMALL, positions="learned", max_length=8, tie_embeddings=False, dropout=0.1, activation="gelu"
    )
    task = LmTask(model=config, source="markov", batch_size=8, length=8)
    reference = _losses(task, "all:1", "", "simd", 5)
    for mesh, layout in PAPER_LAYOUTS:
        np.testing.assert_allclose(_losses(task, mesh, layout, "simd", 5), reference, rtol=2e-4, atol=2e-5)
    graph = build(task, "all:1", "", compile=False)[0].graph
    names = {v.name for v in graph.trainable_variables}
    assert {"transformer/embedding_positions", "transformer/softmax"} <= names
    assert sum(v.value.size for v in graph.trainable_variables) == config.parameter_count()


@pytest.mark.parametrize(
    "changes, mesh, layout",
    [
        ({}, "all:8", "batch:all"),
        (dict(dtype="bfloat16"), "rows:2;cols:4", "batch:rows;vocab:cols;d_ff:cols;heads:cols"),
        (dict(pipeline_stages=2, microbatches=4), "rows:2;cols:4", "stage:rows;batch:cols"),
    ],
)
def test_the_plans_memory_of_the_steps_arguments_is_xlas(changes, mesh, layout):
    """The training step's arguments per device (the variables, the batch and the imported
    arrays: the sinusoid table, a pipeline's stage tables) are what XLA allocates for them, to
    the byte. The plan left the imported arrays out (16 KB of the tiny model's 1.41 MB)."""
    task = LmTask(model=dataclasses.replace(PRESETS["tiny"], **changes), batch_size=16, length=64)
    program = build(task, mesh, layout, "simd", AdamWeightDecayOptimizer(1e-3))
    fn = program.train_fn
    s = summarize(program.lowering, fn.counters, fn.outputs[:1])
    arguments = fn._run.compiled().memory_analysis().argument_size_in_bytes
    assert s.parameter_bytes_per_device + s.optimizer_state_bytes_per_device + s.input_bytes_per_device == arguments
