"""Options that are on or off take a bool (or 0 / 1): a text like 'no' or 'False' is true to
Python, so before these checks it turned the option on without a word."""

import numpy as np
import pytest

import meshax as mx
from meshax.models.transformer import TransformerConfig
from meshax.search import search_layout
from meshax.train import MlpTask


def _x(dims="b:8;d:4"):
    return mx.import_tensor(mx.Mesh(mx.Graph(), "m"), np.ones((8, 4), np.float32), dims)


def _scan(flag):
    x = _x()
    mx.scan(lambda c, xs: ([c[0] + xs[0]], []), [mx.reduce_sum(x, reduced_dim="b")], [x], dim="b", reverse=flag)


def _while(flag):
    i = mx.constant(_x().mesh, 0, [], dtype="int32")
    mx.while_loop(lambda i: mx.less(i, 3), lambda i: [i + 1], [i], has_accumulators=flag)


def _gather(flag):
    x = _x()
    mx.gather(x, mx.constant(x.mesh, 1, "k:2", dtype="int32"), "b", batched=flag)


def _attention(flag):
    q = mx.import_tensor(mx.Mesh(mx.Graph(), "m"), np.ones((4, 2, 8), np.float32), "length:4;heads:2;d_kv:8")
    k = mx.rename_dimension(q, "length", "memory_length")
    mx.fused_attention(q, k, k, "d_kv", "heads", causal=flag)


def _batch_norm(flag):
    mx.layers.batch_norm(_x(), is_training=flag, momentum=0.9)


CASES = {
    "shift: wrap": lambda f: mx.shift(_x(), 1, "b", wrap=f),
    "cumsum: exclusive": lambda f: mx.cumsum(_x(), "b", exclusive=f),
    "halo_exchange: wrap": lambda f: mx.halo_exchange(_x("blocks:8;size:4"), "blocks", "size", 1, f),
    "scan: reverse": _scan,
    "while_loop: has_accumulators": _while,
    "gather: batched": _gather,
    "fused_attention: causal": _attention,
    "moe: train": lambda f: mx.moe.moe(_x(), 8, 2, train=f),
    "dense: use_bias": lambda f: mx.layers.dense(_x(), mx.Dimension("h", 3), use_bias=f),
    "batch_norm: is_training": _batch_norm,
    "AdamWeightDecayOptimizer: bias_correction": lambda f: mx.optimize.AdamWeightDecayOptimizer(0.1, bias_correction=f),
    "AdafactorOptimizer: factored": lambda f: mx.optimize.AdafactorOptimizer(factored=f),
    "TransformerConfig: remat": lambda f: TransformerConfig(remat=f),
    "TransformerConfig: tie_embeddings": lambda f: TransformerConfig(tie_embeddings=f),
    "search_layout: search_weights": lambda f: search_layout(MlpTask(hidden=16), "all:8", search_weights=f),
    "train: resume": lambda f: mx.train.train(MlpTask(hidden=16), "all:8", "", steps=1, resume=f),
}


@pytest.mark.parametrize("what", CASES)
def test_a_text_for_an_option_is_refused(what):
    with pytest.raises(mx.MeshaxError, match=rf"{what} is 'no' \(str\): give True or False"):
        CASES[what]("no")


def test_bools_of_numpy_and_0_or_1_are_taken():
    x = _x()
    rows = np.arange(32, dtype=np.float32).reshape(8, 4)
    y = mx.import_tensor(x.mesh, rows, "b:8;d:4")
    outs = [mx.shift(y, 1, "b", wrap=f) for f in (np.False_, 0, True)]
    got = mx.Lowering(x.graph, {x.mesh: mx.SimdMeshImpl("all:8", "b:all")}).function(outs)({})
    assert np.array_equal(got[0], got[1]) and got[0][0].sum() == 0 and np.array_equal(got[2], np.roll(rows, 1, 0))
    config = TransformerConfig(remat=np.True_)
    assert config.remat is True


def test_numpy_and_jax_scalars_of_0_or_1_are_taken_as_python_ones_are():
    """A flag held as a NumPy integer (np.int64(1), read from an array) or a 0-d array
    (np.array(True), jnp.asarray(True): dropout's is_training takes JAX's bool) is what Python's
    1 or True is; it was refused though `if flag:` took it before as_flag."""
    import jax.numpy as jnp

    from meshax.core.errors import as_flag

    for flag in (np.int64(1), np.uint8(1), np.array(True), np.array(1), jnp.asarray(True), jnp.int32(1)):
        assert as_flag(flag, "f") is True, flag
    for flag in (np.int64(0), np.array(False), jnp.asarray(False)):
        assert as_flag(flag, "f") is False, flag
    for flag in (np.int64(2), np.array([True]), np.float32(1.0), jnp.asarray([1])):
        with pytest.raises(mx.ConfigError, match=r"f is .*: give True or False"):
            as_flag(flag, "f")
    assert mx.layers.batch_norm(_x(), is_training=jnp.asarray(False), momentum=0.9)[1] == []


def test_a_bool_where_a_count_is_taken_is_refused():
    """True was taken for 1 microbatch, 1 token per MoE group, an offset of 1: a bool is no count."""
    x = _x("b:8;d:4")
    with pytest.raises(mx.GraphError, match=r"shift: offset True \(bool\) is not a whole number"):
        mx.shift(x, True, "b", wrap=False)
    with pytest.raises(mx.GraphError, match=r"num_microbatches=True is not a whole number"):
        mx.pipeline(lambda h: h, x, mx.Dimension("stage", 2), True)
    with pytest.raises(mx.GraphError, match=r"moe: group_size=True is not a whole number"):
        mx.moe.moe(x, 8, 2, group_size=True)
