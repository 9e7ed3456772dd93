"""Autoregressive decoding (issue 17): incremental attention over key/value caches equals the
training forward pass, a trained reversal model decodes its inputs reversed exactly, under the
data-, model- and 2-D layouts alike, beam search scores at least as well as greedy, and sampling
at temperature 0 (or top-1) is greedy."""

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


@pytest.mark.parametrize("mesh,layout", LAYOUTS[::3], ids=["one device", "2-D"])
def test_incremental_logits_equal_the_training_forward_pass(mesh, layout):
    """Step by step over the caches, the LM's logits at each position are the causal forward
    pass's (the training graph's language_model) from the same weights."""
    config = PRESETS["tiny"]
    graph = mx.Graph()
    m = mx.Mesh(graph, "mesh")
    ids = mx.placeholder(m, "ids", [mx.Dimension("batch", 8), mx.Dimension("length", 8)], "int32")
    logits = Transformer(config, m).language_model(ids)
    full = mx.Lowering(graph, {m: mx.SimdMeshImpl("all:1", "")})
    values = np.random.default_rng(0).integers(0, 256, (8, 8)).astype(np.int32)
    want = np.asarray(full.function(logits)({"ids": values}))
    decoder = Decoder(config, mesh, layout, batch=8, length=8)
    decoder.load(full)
    caches = decoder._zeros()
    for t in range(8):
        got, *caches = decoder.step_fn(decoder._feeds(values[:, t], t, caches, None))
        assert_close(got, want[:, t], rtol=1e-4, atol=1e-4)


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
