"""Reductions, softmax / log_softmax and argmax, vs NumPy."""
import numpy as np
import pytest

import meshax as mx
from tests.conftest import B, D, H, LAYOUTS, assert_close, assert_equal, names, new_mesh, rand, run

# the canonical layouts plus one that splits the middle dim h
REDUCE_LAYOUTS = LAYOUTS + ["d:rows;h:cols"]
layouts = pytest.mark.parametrize("layout", REDUCE_LAYOUTS, ids=lambda s: s or "replicated")

AXIS = {"b": 0, "h": 1, "d": 2}


def np_logsumexp(x, axis):
    x = x.astype(np.float64)
    m = np.max(x, axis=axis, keepdims=True)
    out = m + np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))
    return np.squeeze(out, axis=axis) if axis is not None else out.reshape(())


NP_REDUCE = {
    "reduce_sum": np.sum,
    "reduce_mean": np.mean,
    "reduce_max": np.max,
    "reduce_min": np.min,
    "reduce_logsumexp": np_logsumexp,
}

# (kwargs builder, reduced dim names or None for all, expected output names)
CASES = {
    "b": (lambda: dict(reduced_dim=B), ("b",), ["h", "d"]),
    "h": (lambda: dict(reduced_dim=H), ("h",), ["b", "d"]),
    "d": (lambda: dict(reduced_dim=D), ("d",), ["b", "h"]),
    "b,d": (lambda: dict(reduced_dim=[B, D]), ("b", "d"), ["h"]),
    "all": (lambda: dict(), ("b", "h", "d"), []),
    "out=[h,d]": (lambda: dict(output_shape=[H, D]), ("b",), ["h", "d"]),
    "out=[b]": (lambda: dict(output_shape=mx.Shape([B])), ("h", "d"), ["b"]),
}


def _np_reduce(np_fn, xv, reduced):
    axes = tuple(AXIS[n] for n in reduced)
    if np_fn is np_logsumexp:
        out = xv.astype(np.float64)
        for ax in sorted(axes, reverse=True):
            out = np_logsumexp(out, ax)
        return out
    return np_fn(xv.astype(np.float64), axis=axes)


@layouts
@pytest.mark.parametrize("op", sorted(NP_REDUCE))
def test_reduce(op, layout, impl_cls):
    """Every reduction case of CASES, computed in one program."""
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, H, D])
    cases = list(CASES)
    outs = []
    for case in cases:
        kwargs, _, out_names = CASES[case]
        y = getattr(mx, op)(x, **kwargs())
        assert names(y) == out_names, case
        outs.append(y)
    xv = rand([8, 4, 8], seed=21, low=-2.0, high=2.0)
    got = run(outs, impl_cls, layout=layout, feeds={x: xv})
    failures = []
    for case, g in zip(cases, got):
        want = _np_reduce(NP_REDUCE[op], xv, CASES[case][1]).astype(np.float32)
        try:
            assert_close(g, want)
        except AssertionError as err:
            failures.append(f"{op} {case}: {err}")
    assert not failures, "\n".join(failures)


@layouts
@pytest.mark.parametrize("op,np_fn", [("reduce_any", np.any), ("reduce_all", np.all)])
def test_reduce_bool(op, np_fn, layout, impl_cls):
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, H, D])
    mx_fn = getattr(mx, op)
    thresh = 0.7 if op == "reduce_any" else -0.7
    c = x > thresh
    outs = [mx_fn(c, reduced_dim=B), mx_fn(c, reduced_dim=[H, D]), mx_fn(c, reduced_dim=D), mx_fn(c)]
    assert [names(o) for o in outs] == [["h", "d"], ["b"], ["b", "h"], []]
    for o in outs:
        assert o.dtype == np.bool_
    xv = rand([8, 4, 8], seed=22)
    cv = xv > thresh
    got = run(outs, impl_cls, layout=layout, feeds={x: xv})
    want = [np_fn(cv, axis=0), np_fn(cv, axis=(1, 2)), np_fn(cv, axis=2), np_fn(cv)]
    # make sure the test data is not degenerate
    assert want[2].any() and not want[2].all()
    for g, w in zip(got, want):
        assert_equal(g, w)


def np_softmax(x, axis):
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@layouts
@pytest.mark.parametrize("dim", [B, H, D], ids=lambda d: d.name)
def test_softmax_and_log_softmax(dim, layout, impl_cls):
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, H, D])
    s = mx.softmax(x, dim)
    ls = mx.log_softmax(x, dim)
    assert names(s) == ["b", "h", "d"]
    assert names(ls) == ["b", "h", "d"]
    xv = rand([8, 4, 8], seed=23, low=-3.0, high=3.0)
    got_s, got_ls = run([s, ls], impl_cls, layout=layout, feeds={x: xv})
    want = np_softmax(xv, AXIS[dim.name])
    assert_close(got_s, want.astype(np.float32))
    assert_close(got_ls, np.log(want).astype(np.float32))


@layouts
@pytest.mark.parametrize("dim", [B, H, D], ids=lambda d: d.name)
def test_argmax(dim, layout, impl_cls):
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, H, D])
    a = mx.argmax(x, dim)
    assert names(a) == [n for n in "bhd" if n != dim.name]
    assert a.dtype == np.int32
    # integer-valued floats with many ties: argmax must return the first index
    xv = np.random.default_rng(24).integers(0, 3, size=(8, 4, 8)).astype(np.float32)
    out = run(a, impl_cls, layout=layout, feeds={x: xv})
    assert out.dtype == np.int32
    assert_equal(out, np.argmax(xv, axis=AXIS[dim.name]).astype(np.int32))


@layouts
def test_argmax_distinct_values(layout, impl_cls):
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, D])
    a = mx.argmax(x, B)
    xv = rand([8, 8], seed=25)
    assert_equal(run(a, impl_cls, layout=layout, feeds={x: xv}), np.argmax(xv, axis=0))


@layouts
def test_reduce_int(layout, impl_cls):
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, D], dtype="int32")
    y = mx.reduce_sum(x, reduced_dim=B)
    m = mx.reduce_max(x, reduced_dim=D)
    assert y.dtype == np.int32
    xv = np.random.default_rng(26).integers(-50, 50, size=(8, 8)).astype(np.int32)
    gy, gm = run([y, m], impl_cls, layout=layout, feeds={x: xv})
    assert_equal(gy, xv.sum(axis=0).astype(np.int32))
    assert_equal(gm, xv.max(axis=1).astype(np.int32))
