"""Autoregressive decoding (issue 17): incremental attention over key/value caches equals the
training forward pass, a trained reversal model decodes its inputs reversed exactly, under the
data-, model- and 2-D layouts alike, beam search scores at least as well as greedy, and sampling
at temperature 0 (or top-1) is greedy."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import meshax as mx
from meshax.models.transformer import PRESETS, Transformer
from meshax.optimize import AdamWeightDecayOptimizer
from meshax.train import Seq2SeqTask, synthetic, train
from meshax.train.decode import Decoder, sequence_log_probability
from tests.conftest import assert_close

LAYOUTS = [  # (mesh, layout): one device, data-, model- and 2-D parallel, the caches split by position
    ("all:1", ""),
    ("all:8", "batch:all"),
    ("all:4", "heads:all;d_ff:all;vocab:all"),
    ("rows:2;cols:4", "batch:rows;heads:cols;d_ff:cols"),
    ("all:4", "memory_length:all"),
]


@pytest.fixture(scope="module")
def reversal():
    """A tiny encoder-decoder trained to reverse 8 tokens (exact match 1.0 after 600 steps),
    and 8 test sequences it has not seen (other seeds)."""
    task = Seq2SeqTask(model="tiny", batch_size=32, length=8, vocab=16)
    result = train(task, "all:1", "", steps=600, optimizer=AdamWeightDecayOptimizer(3e-3))
    assert result.evals[-1][1]["exact_match"] > 0.99
    inputs, _, targets = synthetic.reversal_batch([np.random.default_rng(10_000 + i) for i in range(8)], 8, 16)
    return task, result.lowering, inputs, targets


@pytest.mark.parametrize("mesh,layout", LAYOUTS, ids=[m + " " + (lay or "replicated") for m, lay in LAYOUTS])
def test_greedy_decoding_reverses_the_input_exactly_under_every_layout(reversal, mesh, layout):
    task, trained, inputs, targets = reversal
    decoder = Decoder(task.config, mesh, layout, batch=8, length=8, input_length=8)
    decoder.load(trained)
    greedy = decoder.greedy(inputs=inputs)
    np.testing.assert_array_equal(greedy, targets)
    np.testing.assert_array_equal(decoder.sample(inputs=inputs, temperature=0.0), greedy)
    np.testing.assert_array_equal(decoder.sample(inputs=inputs, temperature=1.0, top_k=1, seed=3), greedy)


def test_beam_search_scores_at_least_as_well_as_greedy(reversal):
    task, trained, inputs, targets = reversal
    greedy_decoder = Decoder(task.config, batch=8, length=8, input_length=8)
    greedy_decoder.load(trained)
    greedy = greedy_decoder.greedy(inputs=inputs)
    beams = Decoder(task.config, "all:4", "batch:all", batch=8 * 4, length=8, input_length=8)
    beams.load(trained)
    best, scores = beams.beam_search(inputs=inputs, beam_size=4, alpha=0.6)
    np.testing.assert_array_equal(best, targets)
    beam_logp = sequence_log_probability(greedy_decoder, inputs, best)
    greedy_logp = sequence_log_probability(greedy_decoder, inputs, greedy)
    assert (beam_logp >= greedy_logp - 1e-6).all()
    assert_close(scores, beam_logp / ((5.0 + 8) / 6.0) ** 0.6, rtol=1e-4, atol=1e-4)  # the length penalty


def test_sampling_draws_from_the_top_k():
    """An untrained LM: samples at temperature 1 vary with the seed, and with top_k=3 every
    token is one of the three most likely."""
    config = PRESETS["tiny"]
    decoder = Decoder(config, "all:2", "batch:all", batch=4, length=8)
    prompt = np.full((4, 2), 65, np.int32)
    a = decoder.sample(prompt, steps=6, temperature=1.0, seed=0)
    b = decoder.sample(prompt, steps=6, temperature=1.0, seed=1)
    assert a.shape == (4, 6) and (a != b).any()
    *_, logits = decoder._start(prompt, None)
    top3 = np.argsort(-logits, -1)[:, :3]
    for seed in range(5):
        first = decoder.sample(prompt, steps=1, temperature=5.0, top_k=3, seed=seed)[:, 0]
        assert all(t in row for t, row in zip(first, top3))


def _steps_equal_the_forward_pass(config, mesh: str, layout: str) -> Decoder:
    """Step by step over the caches, the logits at each position are the causal forward pass's
    (the training graph's language_model, or encoder_decoder over the same inputs) from the same
    weights; the decoder, to look at."""
    graph = mx.Graph()
    m = mx.Mesh(graph, "mesh")
    dims = [mx.Dimension("batch", 8), mx.Dimension("length", 8)]
    ids = mx.placeholder(m, "ids", dims, "int32")
    model = Transformer(config, m)
    rng = np.random.default_rng(0)
    feeds = {"ids": rng.integers(0, config.vocab_size, (8, 8)).astype(np.int32)}
    if config.num_encoder_layers:
        logits = model.encoder_decoder(mx.placeholder(m, "inputs", dims, "int32"), ids, pad_id=None)
        feeds["inputs"] = rng.integers(0, config.vocab_size, (8, 8)).astype(np.int32)
    else:
        logits = model.language_model(ids)
    full = mx.Lowering(graph, {m: mx.SimdMeshImpl("all:1", "")})
    want, *dropped = full.function([logits, *(o.dropped_fraction for o in model.moe_outputs)])(feeds)
    assert all(float(d) == 0 for d in dropped)  # (the MoE layers' capacity dropped no token)
    decoder = Decoder(config, mesh, layout, batch=8, length=8, input_length=8 if "inputs" in feeds else None)
    decoder.load(full)
    caches = decoder._zeros()
    encoded = [np.asarray(t) for t in decoder.encode_fn({"inputs": feeds["inputs"]})] if "inputs" in feeds else None
    for t in range(8):
        got, *caches = decoder.step_fn(decoder._feeds(feeds["ids"][:, t], t, caches, encoded))
        assert_close(got, np.asarray(want)[:, t], rtol=1e-4, atol=1e-4)
    return decoder


@pytest.mark.parametrize("mesh,layout", LAYOUTS[::3], ids=["one device", "2-D"])
def test_incremental_logits_equal_the_training_forward_pass(mesh, layout):
    _steps_equal_the_forward_pass(PRESETS["tiny"], mesh, layout)


@pytest.mark.parametrize(
    "mesh,layout", [("all:1", ""), ("rows:2;cols:4", "batch:rows;experts:rows;heads:cols;expert_hidden:cols")]
)
def test_a_mixture_of_experts_lm_decodes_as_its_forward_pass(mesh, layout):
    """Each step's tokens are routed as groups of one, with room at each of their experts: where
    training's capacity dropped no token, the step's logits are the forward pass's, and under
    expert parallelism the step sends its tokens to their experts and back (an all-to-all each
    way per MoE layer)."""
    config = dataclasses.replace(PRESETS["tiny"], moe_experts=4, moe_capacity_factor=4.0)  # (no token dropped)
    decoder = _steps_equal_the_forward_pass(config, mesh, layout)
    assert decoder.step_fn.counters["alltoall"].count == (2 if layout else 0)  # (tiny: 2 layers, the second MoE)


@pytest.mark.parametrize(
    "changes",
    [
        dict(pipeline_stages=2, microbatches=2),
        dict(pipeline_stages=2, microbatches=2, circular_repeats=2, num_layers=4),
        dict(pipeline_stages=2, microbatches=2, num_encoder_layers=2, vocab_size=32),
    ],
    ids=["gpipe", "circular", "encoder-decoder"],
)
@pytest.mark.parametrize("mesh,layout", [("all:1", ""), ("rows:2;cols:4", "stage:rows;heads:cols;d_ff:cols")])
def test_a_pipelined_model_decodes_as_its_forward_pass(changes, mesh, layout):
    """The stages run one after another, each layer's weights read from the pipeline's stacked
    variables [(repeat,) stage, ...] at its block; split over `stage`, the weights come from the
    devices holding them, every step (allreduces over the stage's mesh dim, which splits nothing
    else here)."""
    decoder = _steps_equal_the_forward_pass(dataclasses.replace(PRESETS["tiny"], **changes), mesh, layout)
    assert any("stage" in v.shape.dimension_names for v in decoder.lowering.graph.trainable_variables)
    over_stage = [s for s in decoder.step_fn.counters.sites() if s.mesh_axes == ("rows",)]
    assert {s.kind for s in over_stage} == ({"allreduce"} if layout else set())


def test_decoder_refuses_what_it_cannot_decode():
    with pytest.raises(mx.ConfigError, match="input_length"):
        Decoder(PRESETS["tiny"].__class__(**{**PRESETS["tiny"].__dict__, "num_encoder_layers": 1}), batch=2, length=4)
    decoder = Decoder(PRESETS["tiny"], batch=2, length=4)
    with pytest.raises(mx.ConfigError, match="prompt of 1 to 4 tokens"):
        decoder.greedy(np.zeros((2, 5), np.int32))
    with pytest.raises(mx.ConfigError, match=r"prompt token -1 is not in the vocabulary 0\.\.255"):
        decoder.greedy(np.array([[3, -1], [2, 2]]))
    with pytest.raises(mx.ConfigError, match="integer token ids"):
        decoder.greedy(np.array([[3.5], [2.0]]))
    with pytest.raises(mx.ConfigError, match="top_k 300 must be from 0"):
        decoder.sample(np.ones((2, 1), np.int32), temperature=1.0, top_k=300)
    with pytest.raises(mx.ConfigError, match="give a temperature > 0"):
        decoder.sample(np.ones((2, 1), np.int32), temperature=0.0, top_k=3)
    # (the backend was a KeyError; length 0 decoded to max_length, batch 0 built a step of no rows)
    with pytest.raises(mx.ConfigError, match=r"unknown backend 'gpu'; choose one of"):
        Decoder(PRESETS["tiny"], backend="gpu")
    for field, bad in (("length", 0), ("batch", 0), ("length", 4.0), ("batch", True)):
        with pytest.raises(mx.ConfigError, match=rf"Decoder: {field}={bad!r} must be a whole number of at least 1"):
            Decoder(PRESETS["tiny"], **{field: bad})


def test_decoding_past_max_length_equals_the_forward_pass():
    """Sinusoidal positions have no end: training takes any --length (tiny's max_length is 256),
    and the step's position encoding at t >= max_length is the forward pass's (it was none: a
    gather past the end of a [max_length, d_model] table). Learned positions end at max_length:
    a longer decoder is refused."""
    import dataclasses

    config = dataclasses.replace(PRESETS["tiny"], max_length=4)
    graph = mx.Graph()
    m = mx.Mesh(graph, "mesh")
    ids = mx.placeholder(m, "ids", [mx.Dimension("batch", 2), mx.Dimension("length", 8)], "int32")
    full = mx.Lowering(graph, {m: mx.SimdMeshImpl("all:1", "")})
    want = np.asarray(full.function(Transformer(config, m).language_model(ids))({"ids": (values := _ids(2, 8))}))
    decoder = Decoder(config, batch=2, length=8)
    decoder.load(full)
    caches = decoder._zeros()
    for t in range(8):
        got, *caches = decoder.step_fn(decoder._feeds(values[:, t], t, caches, None))
        assert_close(got, want[:, t], rtol=1e-4, atol=1e-4)
    with pytest.raises(mx.ConfigError, match="length 8 passes the model's max_length 4"):
        Decoder(dataclasses.replace(config, positions="learned"), batch=2, length=8)


def _ids(batch, length):
    return np.random.default_rng(0).integers(0, 256, (batch, length)).astype(np.int32)


def test_prompts_of_other_rows_and_steps_past_the_length_are_refused():
    """A prompt is [batch, n] (beam search: [sequences, n]); it was reshaped to [batch, -1], so 4
    prompts of 4 tokens decoded as 8 of 2. `steps` is 1 .. the room left (it was cut short, or 0
    ended in numpy's "need at least one array to stack")."""
    decoder = Decoder(PRESETS["tiny"], batch=4, length=6)
    with pytest.raises(mx.ConfigError, match=r"token ids \[4, n\], a row per sequence decoded; got shape \(2, 4\)"):
        decoder.greedy(_ids(2, 4))
    with pytest.raises(mx.ConfigError, match=r"\[2, n\], a row per sequence \(4 / beam_size 2\); got shape \(4, 2\)"):
        decoder.beam_search(prompt=_ids(4, 2), beam_size=2)
    for steps in (0, 6):
        with pytest.raises(mx.ConfigError, match=f"steps {steps}: after 2 tokens .* room for 1 to 5"):
            decoder.sample(_ids(4, 2), steps=steps, temperature=1.0)
    with pytest.raises(mx.ConfigError, match="room for 1 to 5"):
        decoder.beam_search(prompt=_ids(2, 2), beam_size=2, steps=6)
    with pytest.raises(mx.ConfigError, match="beam_size 0"):
        decoder.beam_search(prompt=_ids(2, 2), beam_size=0)
    # (each was a TypeError from a comparison, a range, a slice or a power)
    for call, says in (
        (lambda: decoder.greedy(_ids(4, 2), steps=2.5), r"steps 2\.5 \(float\) must be a whole number"),
        (lambda: decoder.sample(_ids(4, 2), top_k=2.5), r"top_k 2\.5 \(float\) must be a whole number"),
        (lambda: decoder.sample(_ids(4, 2), temperature="0.8"), r"temperature '0\.8' \(str\) must be a number"),
        (lambda: decoder.beam_search(prompt=_ids(2, 2), beam_size=2.0), r"beam_size 2\.0 \(float\) must be a whole"),
        (lambda: decoder.beam_search(prompt=_ids(2, 2), beam_size=2, alpha="0.6"), r"alpha '0\.6' \(str\) must be"),
    ):
        with pytest.raises(mx.ConfigError, match=says):
            call()
    # (a decoder-only model ignored them: the prompt alone decoded)
    with pytest.raises(mx.ConfigError, match="inputs are for an encoder-decoder"):
        decoder.greedy(_ids(4, 2), inputs=_ids(4, 2))
    with pytest.raises(mx.ConfigError, match="inputs are for an encoder-decoder"):
        decoder.beam_search(inputs=_ids(2, 2), prompt=_ids(2, 2), beam_size=2)
    with pytest.raises(mx.ConfigError, match="input_length is for an encoder-decoder"):
        Decoder(PRESETS["tiny"], batch=4, length=6, input_length=6)
    with pytest.raises(mx.ConfigError, match="all rows of one length"):
        decoder.greedy([[1, 2], [3], [4, 5], [6, 7]])  # (NumPy's ValueError "inhomogeneous shape")
    assert decoder.greedy(_ids(4, 2), steps=np.int64(5)).shape == (4, 5)
    sampled = decoder.sample(_ids(4, 2), steps=jnp.int32(2), temperature=jnp.float32(0.5), top_k=np.int64(3))
    assert sampled.shape == (4, 2)  # (NumPy's and JAX's numbers are numbers)
    assert decoder.beam_search(prompt=_ids(2, 2), beam_size=2, steps=5)[0].shape == (2, 5)


def test_a_tiny_temperature_is_greedy_and_top_k_keeps_k_tokens():
    """logits / 1e-320 overflowed (inf - inf: NaN, "Probabilities contain NaN"); top_k kept every
    token tied with the k-th, so top_k 1 over tied logits was not greedy."""
    from meshax.train.decode import _choose

    logits = np.array([[3.0, 1.0, 0.5, 0.0], [2.0, 2.0, 2.0, 0.0]])
    for seed in range(20):
        rng = np.random.default_rng(seed)
        assert _choose(logits, 1e-320, 0, rng)[0] == 0  # (the tied row: any of its three most likely)
        np.testing.assert_array_equal(_choose(logits, 1.0, 1, rng), [0, 0])
        assert _choose(logits, 1e300, 2, rng)[1] in (0, 1)


def test_the_placement_backend_and_weight_rules_decode_the_same_tokens():
    decoder = Decoder(PRESETS["tiny"], "all:4", "heads:all", batch=4, length=6)
    other = Decoder(
        PRESETS["tiny"], "all:4", "heads:all", batch=4, length=6, backend="placement", weight_layout="d_model:all"
    )
    assert type(other.lowering.impl).__name__ == "PlacementMeshImpl" and other.lowering.impl.weight_rules is not None
    other.load(decoder.lowering)
    np.testing.assert_array_equal(other.greedy(_ids(4, 2)), decoder.greedy(_ids(4, 2)))


def test_sequence_log_probability_refuses_tokens_it_cannot_score():
    """Tokens past the decoder's length were scored from steps whose keys and values had no
    place in the caches (7 tokens on a decoder of length 6 scored -25.72, where a longer decoder
    scores them -25.92); tokens outside the vocabulary, of a float dtype or 1-D were IndexErrors."""
    config = dataclasses.replace(PRESETS["tiny"], vocab_size=16, num_encoder_layers=1)
    short = Decoder(config, batch=2, length=6, input_length=4)
    inputs, tokens = np.arange(8).reshape(2, 4), _ids(2, 6) % 16
    long = Decoder(config, batch=2, length=12, input_length=4)
    long.load(short.lowering)
    assert_close(sequence_log_probability(short, inputs, tokens), sequence_log_probability(long, inputs, tokens))
    for bad, says in (
        (_ids(2, 7) % 16, "tokens: 1 to the decoder's length 6 are scored, got 7"),
        (np.full((2, 3), 99), "tokens token 99 is not in the vocabulary"),
        (np.ones((2, 3)), "integer token ids"),
        (np.ones(3, np.int32), r"token ids \[2, n\]"),
    ):
        with pytest.raises(mx.ConfigError, match=says):
            sequence_log_probability(short, inputs, bad)


def test_load_refuses_a_trained_model_of_other_layers():
    """A trained model of 2 layers loaded into a decoder of 1 decoded with its first layer alone,
    without a word; a source that is neither a folder nor a Lowering was an AttributeError."""
    config = dataclasses.replace(PRESETS["tiny"], vocab_size=16, num_layers=2)
    trained = Decoder(config, batch=2, length=4)
    fewer = Decoder(dataclasses.replace(config, num_layers=1), batch=2, length=4)
    with pytest.raises(mx.ConfigError, match=r"has no variable 'transformer/decoder/1/.*same model"):
        fewer.load(trained.lowering)
    with pytest.raises(mx.ConfigError, match="load takes a checkpoint directory or a trained Lowering, got int"):
        fewer.load(42)


def test_load_refuses_a_checkpoint_of_more_layers(tmp_path):
    """A checkpoint of a 2-layer model loaded into a decoder of 1 decoded with its first layer
    alone, without a word (the warning of variables the graph lacks was silenced, for the
    optimizer's slots); the model of the checkpoint's config loads, its slots and step passed over."""
    from meshax.train import LmTask

    config = dataclasses.replace(PRESETS["tiny"], num_layers=2)
    train(LmTask(model=config, batch_size=2, length=8), "all:1", "", steps=1, checkpoint_dir=str(tmp_path))
    fewer = Decoder(dataclasses.replace(config, num_layers=1), batch=1, length=8)
    with pytest.raises(mx.ConfigError, match=r"no variable 'transformer/decoder/1/.* of the checkpoint's model"):
        fewer.load(tmp_path)
    same = Decoder(config, batch=1, length=8)
    same.load(tmp_path)
    assert same.greedy(prompt=np.ones((1, 2), np.int32), steps=3).shape == (1, 3)
