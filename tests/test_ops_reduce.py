"""Reductions, softmax / log_softmax and argmax, vs NumPy.

Each test runs a family of cases as one program per (impl, layout), see
`check_cases` in conftest.py."""

import jax
import numpy as np
import pytest

import meshax as mx
from tests.conftest import LAYOUTS, B, D, H, check_cases, impls_and_layouts, names, new_mesh, rand

# the canonical layouts on both impls (see conftest.PLACEMENT_LAYOUTS), plus (SIMD only) one more layout
layouts = impls_and_layouts(LAYOUTS, simd_extra=["d:rows;h:cols"])

AXIS = {"b": 0, "h": 1, "d": 2}


def np_logsumexp(x, axes):
    x = x.astype(np.float64)
    m = np.max(x, axis=axes, keepdims=True)
    out = m + np.log(np.sum(np.exp(x - m), axis=axes, keepdims=True))
    return np.squeeze(out, axis=axes)


NP_REDUCE = {
    "reduce_sum": np.sum,
    "reduce_mean": np.mean,
    "reduce_max": np.max,
    "reduce_min": np.min,
    "reduce_logsumexp": np_logsumexp,
}

# name -> (kwargs builder, reduced dim names, expected output names)
SHAPES = {
    "b": (lambda: dict(reduced_dim=B), ("b",), ["h", "d"]),
    "h": (lambda: dict(reduced_dim=H), ("h",), ["b", "d"]),
    "d": (lambda: dict(reduced_dim=D), ("d",), ["b", "h"]),
    "b,d": (lambda: dict(reduced_dim=[B, D]), ("b", "d"), ["h"]),
    "all": (lambda: dict(), ("b", "h", "d"), []),
    "out=[h,d]": (lambda: dict(output_shape=[H, D]), ("b",), ["h", "d"]),
    "out=[b]": (lambda: dict(output_shape=mx.Shape([B])), ("h", "d"), ["b"]),
}


def _reduce_case(op, shape_case, seed):
    kwargs, reduced, out_names = SHAPES[shape_case]

    def build(mesh):
        x = mx.placeholder(mesh, "x", [B, H, D])
        y = getattr(mx, op)(x, **kwargs())
        assert names(y) == out_names
        assert y.dtype == np.float32
        xv = rand([8, 4, 8], seed=seed, low=-2.0, high=2.0)
        axes = tuple(AXIS[n] for n in reduced)
        return [(y, NP_REDUCE[op](xv.astype(np.float64), axes))], {x: xv}

    return build


def _bool_case(op, np_fn, thresh, seed):
    def build(mesh):
        x = mx.placeholder(mesh, "x", [B, H, D])
        mx_fn = getattr(mx, op)
        c = x > thresh
        outs = [mx_fn(c, reduced_dim=B), mx_fn(c, reduced_dim=[H, D]), mx_fn(c, reduced_dim=D), mx_fn(c)]
        assert [names(o) for o in outs] == [["h", "d"], ["b"], ["b", "h"], []]
        for o in outs:
            assert o.dtype == np.bool_
        xv = rand([8, 4, 8], seed=seed)
        cv = xv > thresh
        want = [np_fn(cv, axis=0), np_fn(cv, axis=(1, 2)), np_fn(cv, axis=2), np.asarray(np_fn(cv))]
        assert want[2].any() and not want[2].all()  # the data is not degenerate
        return list(zip(outs, want)), {x: xv}

    return build


def _int_case(mesh):
    x = mx.placeholder(mesh, "xi", [B, D], dtype="int32")
    y = mx.reduce_sum(x, reduced_dim=B)
    m = mx.reduce_max(x, reduced_dim=D)
    assert y.dtype == np.int32 and m.dtype == np.int32
    xv = np.random.default_rng(26).integers(-50, 50, size=(8, 8)).astype(np.int32)
    return [(y, xv.sum(axis=0).astype(np.int32)), (m, xv.max(axis=1).astype(np.int32))], {x: xv}


REDUCE_CASES = {}
for _i, _op in enumerate(sorted(NP_REDUCE)):
    # every argument form for reduce_sum; the main ones for the others
    _shapes = list(SHAPES) if _op == "reduce_sum" else ["b", "h", "b,d", "all"]
    for _j, _s in enumerate(_shapes):
        REDUCE_CASES[f"{_op}[{_s}]"] = _reduce_case(_op, _s, 100 + 10 * _i + _j)
REDUCE_CASES["reduce_any"] = _bool_case("reduce_any", np.any, 0.7, 22)
REDUCE_CASES["reduce_all"] = _bool_case("reduce_all", np.all, -0.7, 23)
REDUCE_CASES["int32"] = _int_case


@layouts
def test_reductions(layout, impl_cls):
    check_cases(REDUCE_CASES, impl_cls, layout)


def test_reduce_all_is_scalar():
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, H, D])
    for op in NP_REDUCE:
        y = getattr(mx, op)(x)
        assert y.shape.rank == 0, op


# --------------------------------------------------- softmax / argmax family


def np_softmax(x, axis):
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _softmax_case(dim, seed):
    def build(mesh):
        x = mx.placeholder(mesh, "x", [B, H, D])
        s = mx.softmax(x, dim)
        ls = mx.log_softmax(x, dim)
        assert names(s) == ["b", "h", "d"]
        assert names(ls) == ["b", "h", "d"]
        xv = rand([8, 4, 8], seed=seed, low=-3.0, high=3.0)
        want = np_softmax(xv, AXIS[dim.name])
        return [(s, want), (ls, np.log(want))], {x: xv}

    return build


def _argmax_ties_case(dim, seed):
    def build(mesh):
        x = mx.placeholder(mesh, "x", [B, H, D])
        a = mx.argmax(x, dim)
        assert names(a) == [n for n in "bhd" if n != dim.name]
        assert a.dtype == np.int32
        # integer-valued floats with many ties: argmax must return the first index
        xv = np.random.default_rng(seed).integers(0, 3, size=(8, 4, 8)).astype(np.float32)
        return [(a, np.argmax(xv, axis=AXIS[dim.name]).astype(np.int32))], {x: xv}

    return build


def _argmax_distinct(mesh):
    x = mx.placeholder(mesh, "x", [B, D])
    a = mx.argmax(x, B)
    xv = rand([8, 8], seed=25)
    return [(a, np.argmax(xv, axis=0).astype(np.int32))], {x: xv}


def _argmax_nan(mesh):
    """A NaN is the largest value, as for np.argmax and jnp.argmax, on every layout (XLA's max
    over devices may drop it; the index must not depend on that)."""
    x = mx.placeholder(mesh, "x", [B, D])
    a = mx.argmax(x, D)
    xv = rand([8, 8], seed=26)
    xv[1, 5] = xv[2, 0] = xv[2, 7] = xv[6, 3] = np.nan
    return [(a, np.argmax(xv, axis=1).astype(np.int32))], {x: xv}


def _logsumexp_of_infinities(mesh):
    """A row of -inf sums to nothing: its logsumexp is -inf (not -inf - -inf = NaN), as
    jax.nn.logsumexp's, with and without an extra logit of -inf; +inf and NaN propagate."""
    x = mx.placeholder(mesh, "x", [B, D])
    xv = rand([8, 8], seed=27)
    xv[1] = -np.inf
    xv[2, 3], xv[4, 6] = np.inf, np.nan
    want = np.array(jax.nn.logsumexp(xv, axis=1))
    assert np.isneginf(want[1]) and np.isposinf(want[2]) and np.isnan(want[4])
    return [(mx.reduce_logsumexp(x, D), want), (mx.reduce_logsumexp(x, D, extra_logit=-np.inf), want)], {x: xv}


SOFTMAX_CASES = {}
for _i, _d in enumerate([B, H, D]):
    SOFTMAX_CASES[f"softmax/log_softmax[{_d.name}]"] = _softmax_case(_d, 30 + _i)
    SOFTMAX_CASES[f"argmax-ties[{_d.name}]"] = _argmax_ties_case(_d, 40 + _i)
SOFTMAX_CASES["argmax-distinct[b]"] = _argmax_distinct
SOFTMAX_CASES["argmax-nan[d]"] = _argmax_nan
SOFTMAX_CASES["logsumexp-infinities[d]"] = _logsumexp_of_infinities


@layouts
def test_softmax_and_argmax(layout, impl_cls):
    check_cases(SOFTMAX_CASES, impl_cls, layout)


def test_dims_may_be_named_without_their_sizes():
    """reduced_dim, reduced_dims and output_shape take the inputs' dim names, as softmax does."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", "batch:4;hidden:8")
    w = mx.placeholder(mesh, "w", "hidden:8;out:2")
    batch, out = x.shape[0], w.shape[1]
    assert mx.reduce_sum(x, reduced_dim="hidden").shape == mx.Shape([batch])
    assert mx.reduce_max(x, output_shape=["batch"]).shape == mx.Shape([batch])
    assert mx.reduce_sum(x, reduced_dim=["batch", "hidden"]).shape == mx.Shape([])
    assert mx.einsum([x, w], output_shape=["out", "batch"]).shape == mx.Shape([out, batch])
    assert mx.einsum(x, w, output_shape="batch;out").shape == mx.einsum(x, w, reduced_dims="hidden").shape
    for reduce in [mx.reduce_sum, mx.reduce_mean, mx.reduce_logsumexp]:  # a Dimension, sizes or names
        for spec in [batch, "batch:4", ["batch"], "batch"]:
            assert reduce(x, output_shape=spec).shape == mx.Shape([batch]), (reduce, spec)
    assert mx.einsum([x, mx.placeholder(mesh, "y", [batch])], output_shape=batch).shape == mx.Shape([batch])
    with pytest.raises(mx.GraphError, match=r"no input has a dimension 'hiden' \(did you mean 'hidden'\?\)"):
        mx.reduce_sum(x, reduced_dim="hiden")
    with pytest.raises(mx.GraphError, match=r"'outt' \(did you mean 'out'\?\) \(inputs: x .*, w "):
        mx.einsum(x, w, output_shape=["batch", "outt"])


@pytest.mark.parametrize("dtype", [np.uint32, np.uint8, np.int32, np.int8])
@pytest.mark.parametrize("n", [0, 2])
def test_nth_smallest_element_of_integers_at_the_ends_of_their_range(dtype, n):
    """Negating integers does not reverse their order: an unsigned 0 stays 0 and the signed
    minimum overflows to itself, so both read as the largest."""
    info = np.iinfo(dtype)
    xv = np.array([[info.min, 1, 2, info.max], [5, info.max, 4, info.min + 1]], dtype)
    graph, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", "b:2;t:4", dtype=dtype)
    outs = [mx.nth_smallest_element(x, n, "t"), mx.nth_largest_element(x, n, "t")]
    for shape, layout in [("all:1", ""), ("all:4", "t:all")]:
        small, large = mx.Lowering(graph, {mesh: mx.SimdMeshImpl(shape, layout)}).function(outs)({"x": xv})
        np.testing.assert_array_equal(small, np.sort(xv, axis=1)[:, n])
        np.testing.assert_array_equal(large, np.sort(xv, axis=1)[:, -1 - n])
        assert small.dtype == dtype


@pytest.mark.parametrize("impl_cls", [mx.SimdMeshImpl, mx.PlacementMeshImpl])
@pytest.mark.parametrize("layout", ["", "a:all"])
def test_the_mean_of_float16_values_is_summed_in_float32_as_jnp_mean(impl_cls, layout):
    """reduce_mean summed float16 values in float16 and divided after: the mean of 80,000
    ones was inf (the sum past 65504), where jnp.mean sums in float32: 1.0. It stays float16,
    its gradient too."""
    graph, mesh = new_mesh()
    a = mx.Dimension("a", 80_000)
    x = mx.placeholder(mesh, "x", [a], dtype="float16")
    mean = mx.reduce_mean(x)
    (grad,) = mx.gradients(mx.cast(mean, "float32"), [x])
    assert mean.dtype == grad.dtype == np.float16
    lowering = mx.Lowering(graph, {mesh: impl_cls("all:8", layout)})
    values = np.linspace(0.5, 1.5, 80_000).astype(np.float16)
    got, dx = lowering.function([mean, grad])({"x": values})
    assert float(got) == float(jax.numpy.mean(values)) == 1.0
    np.testing.assert_array_equal(np.asarray(dx), np.full(80_000, 1 / 80_000, np.float16))
