"""random_uniform, random_normal and dropout.

There is no NumPy reference, so check: identical values under every layout
and both implementations, determinism, sane statistics, and independence of
two random ops in one graph."""

import jax.numpy as jnp
import numpy as np
import pytest

import meshax as mx
from tests.conftest import IMPL_IDS, IMPLS, LAYOUTS, PLACEMENT_LAYOUTS, lower, new_mesh, run

BIG_B = mx.Dimension("b", 64)
BIG_D = mx.Dimension("d", 64)
SHAPE = [BIG_B, BIG_D]  # 4096 values, for statistics
SMALL = [mx.Dimension("b", 16), mx.Dimension("d", 16)]  # for exact comparisons
STATS_LAYOUTS = ["", "b:rows;d:cols"]
# Every layout on SIMD; the placement backend (slow to compile) on the two-mesh-dim layout, as in
# the other layout-parametrized tests (conftest.PLACEMENT_LAYOUTS).
ALL_CONFIGS = [(impl, lay) for impl in IMPLS for lay in LAYOUTS if impl is IMPLS[0] or lay in PLACEMENT_LAYOUTS]

impls = pytest.mark.parametrize("impl_cls", IMPLS, ids=IMPL_IDS)


def _uniform(mesh, **kw):
    return mx.random_uniform(mesh, SMALL, minval=-2.0, maxval=3.0, seed=kw.pop("seed", 7), **kw)


def _normal(mesh, **kw):
    return mx.random_normal(mesh, SMALL, mean=0.0, stddev=1.0, seed=kw.pop("seed", 8), **kw)


def _dropout(mesh, **kw):
    x = mx.constant(mesh, 1.0, SMALL) + mx.cast(mx.range(mesh, SMALL[1]), "float32")
    return mx.dropout(x, 0.25, seed=kw.pop("seed", 9), **kw)


BUILDERS = {"uniform": _uniform, "normal": _normal, "dropout": _dropout}


# ------------------------------------------------ (a) layout independence


def test_same_values_under_every_layout_and_impl():
    kinds = list(BUILDERS)
    results = {}
    for impl_cls, layout in ALL_CONFIGS:
        _, mesh = new_mesh()
        outs = [BUILDERS[kind](mesh) for kind in kinds]
        results[(impl_cls.__name__, layout)] = run(outs, impl_cls, layout=layout)
    ref_key = (IMPLS[0].__name__, "")
    ref = results[ref_key]
    for r in ref:
        assert r.shape == (16, 16)
        assert len(np.unique(r)) > 16
    for key, got in results.items():
        for kind, g, r in zip(kinds, got, ref):
            np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6, err_msg=f"{kind} differs for {key} vs {ref_key}")


# ---------------------------------------------------------- (b) determinism


@impls
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_deterministic(kind, impl_cls):
    _, mesh = new_mesh()
    y = BUILDERS[kind](mesh)
    _lowering, fn = lower(y, impl_cls, layout="b:rows;d:cols")
    first = fn({})
    second = fn({})
    np.testing.assert_array_equal(first, second)
    # a new lowering of the same graph gives the same numbers too
    _, fn2 = lower(y, impl_cls, layout="b:rows;d:cols")
    np.testing.assert_array_equal(fn2({}), first)


@impls
def test_same_seed_same_values_across_graphs(impl_cls):
    vals = []
    for _ in range(2):
        _, mesh = new_mesh()
        vals.append(run(_uniform(mesh, seed=123), impl_cls, layout="b:cols"))
    np.testing.assert_array_equal(vals[0], vals[1])


# -------------------------------------------------------------- (c) statistics


def _check_uniform(g01, g):
    assert g01.dtype == np.float32
    assert g01.shape == (64, 64)
    assert g01.min() >= 0.0 and g01.max() < 1.0
    assert abs(g01.mean() - 0.5) < 0.03
    assert abs(g01.std() - np.sqrt(1 / 12)) < 0.02
    assert len(np.unique(g01)) > 4000  # not a few repeated slices
    # no two 8x8 blocks are equal (e.g. every device drawing the same numbers)
    blocks = [g01[i * 8 : (i + 1) * 8, j * 8 : (j + 1) * 8] for i in range(8) for j in range(8)]
    assert len({blk.tobytes() for blk in blocks}) == len(blocks)
    assert g.min() >= -2.0 and g.max() < 3.0
    assert abs(g.mean() - 0.5) < 0.15


def _check_normal(g01, g):
    assert g01.dtype == np.float32
    assert abs(g01.mean()) < 0.06
    assert abs(g01.std() - 1.0) < 0.05
    assert (g01 < 0).any() and (g01 > 2).any()
    assert abs(g.mean() - 3.0) < 0.12
    assert abs(g.std() - 2.0) < 0.1


def _check_dropout(got, xv, rate):
    kept = got != 0
    assert abs(kept.mean() - (1 - rate)) < 0.04
    np.testing.assert_allclose(got[kept], xv[kept] / (1 - rate), rtol=1e-5, atol=1e-5)


def _check_dropout_noise_shape(got):
    # the mask depends on d only: each column is all 0 or all 2
    zero_cols = (got == 0).all(axis=0)
    two_cols = np.isclose(got, 2.0).all(axis=0)
    assert (zero_cols | two_cols).all()
    assert 0.25 < two_cols.mean() < 0.75


# SIMD only: test_same_values_under_every_layout_and_impl shows the placement backend draws the
# same values
simd_only = pytest.mark.parametrize("impl_cls", [mx.SimdMeshImpl], ids=["simd"])


@simd_only
@pytest.mark.parametrize("layout", STATS_LAYOUTS, ids=lambda s: s or "replicated")
def test_statistics(layout, impl_cls):
    _, mesh = new_mesh()
    u01 = mx.random_uniform(mesh, SHAPE, seed=1)
    u = mx.random_uniform(mesh, SHAPE, minval=-2.0, maxval=3.0, seed=2)
    n01 = mx.random_normal(mesh, SHAPE, seed=3)
    n = mx.random_normal(mesh, SHAPE, mean=3.0, stddev=2.0, seed=4)
    x = mx.placeholder(mesh, "x", SHAPE)
    rate = 0.25
    drop = mx.dropout(x, rate, seed=5)
    drop_cols = mx.dropout(mx.ones(mesh, SHAPE), 0.5, noise_shape=[BIG_D], seed=6)
    xv = np.random.default_rng(80).uniform(1.0, 2.0, size=(64, 64)).astype(np.float32)
    got = run([u01, u, n01, n, drop, drop_cols], impl_cls, layout=layout, feeds={x: xv})
    _check_uniform(got[0], got[1])
    _check_normal(got[2], got[3])
    _check_dropout(got[4], xv, rate)
    _check_dropout_noise_shape(got[5])


# ------------------------------------------------------ (d) independence


@simd_only
def test_two_random_ops_differ(impl_cls):
    _, mesh = new_mesh()
    shape = [mx.Dimension("b", 32), mx.Dimension("d", 32)]
    u1 = mx.random_uniform(mesh, shape)
    u2 = mx.random_uniform(mesh, shape)
    n1 = mx.random_normal(mesh, shape)
    n2 = mx.random_normal(mesh, shape)
    s1 = mx.random_uniform(mesh, shape, seed=10)
    s2 = mx.random_uniform(mesh, shape, seed=11)
    g = run([u1, u2, n1, n2, s1, s2], impl_cls, layout="b:rows;d:cols")
    for a, b in [(0, 1), (2, 3), (4, 5)]:
        assert not np.allclose(g[a], g[b])
        # not merely shifted / correlated copies
        assert abs(np.corrcoef(g[a].ravel(), g[b].ravel())[0, 1]) < 0.15


@impls
def test_two_dropouts_differ(impl_cls):
    _, mesh = new_mesh()
    x = mx.ones(mesh, SMALL)
    d1 = mx.dropout(x, 0.5)
    d2 = mx.dropout(x, 0.5)
    g1, g2 = run([d1, d2], impl_cls, layout="b:cols")
    assert ((g1 != 0) != (g2 != 0)).any()


def test_sampling_16_bit_logits_draws_float32_gumbel_noise():
    """sample_with_temperature drew its Gumbel noise in the logits' dtype: bfloat16 uniform
    draws 2**-8 apart cut the noise's tails and tie, and the argmax takes the first of a tie, so
    of logits [0, 1, 2, 4, 6, 6.5] the first was drawn 0.0020 of the time, 0.0009 due. The noise
    is float32: the samples of 16-bit logits are those of the same float32 logits."""
    logits = np.array([0.0, 1.0, 2.0, 4.0, 6.0, 6.5], np.float32)  # (exact in 16 bits)
    samples = {}
    for dtype in ("float32", "bfloat16", "float16"):
        graph, mesh = new_mesh()
        n, v = mx.Dimension("n", 100_000), mx.Dimension("vocab", 6)
        x = mx.cast(mx.placeholder(mesh, "logits", [v]) + mx.zeros(mesh, [n, v]), dtype)
        lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:1", "")})
        samples[dtype] = np.asarray(
            lowering.function([mx.sample_with_temperature(x, v)])({"logits": logits}, seed=1)[0]
        )
    np.testing.assert_array_equal(samples["bfloat16"], samples["float32"])
    np.testing.assert_array_equal(samples["float16"], samples["float32"])
    first = np.mean(samples["float32"] == 0)
    assert abs(first - np.exp(0.0) / np.exp(logits).sum()) < 3e-4  # (0.00094 due)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_uniform_values_stay_below_maxval(dtype):
    """Uniform draws are made in float32 and cast: those past the 16-bit dtype's last value below
    maxval rounded up to maxval itself (of 1,000,000 in [0, 1): 1,923 ones in bfloat16, 243 in
    float16), outside [minval, maxval) (so -log(1 - u) was inf). Now at most that last value."""
    graph, mesh = new_mesh()
    n = mx.Dimension("n", 1_000_000)
    ranges = [(0.0, 1.0), (-2.0, 3.0)]
    outs = [mx.random_uniform(mesh, [n], lo, hi, dtype=dtype) for lo, hi in ranges]
    lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:1", "")})
    for (lo, hi), u in zip(ranges, lowering.function(outs)({}, seed=3)):
        u = np.asarray(u, np.float32)
        assert lo <= u.min() and u.max() < hi
        assert np.mean(u) == pytest.approx((lo + hi) / 2, abs=0.01 * (hi - lo))


def test_dropout_takes_numpy_bools_and_names_a_bad_is_training_or_rate():
    """is_training as NumPy's or JAX's bool is that bool (np.True_ was taken for a rate of 1.0,
    refused as such, and np.False_ for a rate of 0); one that is neither a bool nor a rate, and a
    keep_prob that disagrees with the rate, are named (a ValueError from float('yes'), and
    keep_prob=0.9 with rate=0.5 dropped at 0.1, silently)."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", SHAPE)
    assert mx.dropout(x, np.True_, rate=0.5) is not x
    assert mx.dropout(x, jnp.bool_(True), rate=0.5) is not x
    assert mx.dropout(x, np.False_, rate=0.5) is x
    for bad in ("yes", None):
        with pytest.raises(mx.GraphError, match=rf"dropout: is_training {bad!r} is neither a bool nor a rate"):
            mx.dropout(x, bad)
    with pytest.raises(mx.GraphError, match=r"dropout: keep_prob 0.9 and rate 0.5 disagree"):
        mx.dropout(x, True, keep_prob=0.9, rate=0.5)
    assert mx.dropout(x, True, keep_prob=0.75, rate=0.25) is not x


def test_random_uniform_refuses_a_minval_not_below_maxval():
    """random_uniform(minval=2, maxval=1) drew from (1, 2], silently (initializers.uniform refuses it)."""
    mesh = mx.Mesh(mx.Graph(), "m")
    with pytest.raises(mx.GraphError, match=r"minval 2 must be less than maxval 1"):
        mx.random_uniform(mesh, "b:8", minval=2, maxval=1)


def test_random_normal_refuses_a_negative_stddev():
    """random_normal(stddev=-1) drew with stddev 1, silently."""
    mesh = mx.Mesh(mx.Graph(), "m")
    with pytest.raises(mx.GraphError, match=r"stddev -1 is negative"):
        mx.random_normal(mesh, "b:8", stddev=-1)
    with pytest.raises(mx.GraphError, match=r"stddev nan is NaN: a spread is 0 or more"):  # (not 'negative')
        mx.random_normal(mesh, "b:8", stddev=float("nan"))


def test_dropout_of_16_bit_values_keeps_what_float32_dropout_keeps():
    """The mask is drawn in float32 whatever x's dtype: drawn in bfloat16, the draws just below
    the rate rounded up to it and were kept (rate 0.5: those in [0.5 - 2**-10, 0.5)), so a
    bfloat16 dropout kept 0.5 + 2**-10 of its values, not 0.5, and other values than the same
    float32 dropout (the fuzzer's seed 7018 found one). Now the masks are equal."""
    kept = {}
    for dtype in ("float32", "bfloat16", "float16"):
        graph, mesh = new_mesh()
        n = mx.Dimension("n", 1_000_000)
        for rate in (0.5, 0.1):
            y = mx.dropout(mx.ones(mesh, [n], dtype=dtype), rate, seed=4)
            lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:1", "")})
            kept[dtype, rate] = np.asarray(lowering.function([y])({}, seed=0)[0], np.float32) != 0
    for rate in (0.5, 0.1):
        np.testing.assert_array_equal(kept["bfloat16", rate], kept["float32", rate])
        np.testing.assert_array_equal(kept["float16", rate], kept["float32", rate])
        assert np.mean(kept["float32", rate]) == pytest.approx(1 - rate, abs=2e-3)
