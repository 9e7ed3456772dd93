"""Elementwise unary / binary ops, operators, where and cast, vs NumPy."""
import math

import numpy as np
import pytest

import meshax as mx
from tests.conftest import B, D, H, LAYOUTS, assert_close, assert_equal, names, new_mesh, rand, run

layouts = pytest.mark.parametrize("layout", LAYOUTS, ids=lambda s: s or "replicated")

_erf = np.vectorize(math.erf, otypes=[np.float64])


def np_gelu(x):
    x = x.astype(np.float64)
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


# name -> (meshax fn, numpy fn, input domain)
UNARY = {
    "negative": (mx.negative, np.negative, "any"),
    "abs": (mx.abs, np.abs, "any"),
    "exp": (mx.exp, np.exp, "any"),
    "log": (mx.log, np.log, "pos"),
    "sqrt": (mx.sqrt, np.sqrt, "pos"),
    "rsqrt": (mx.rsqrt, lambda x: 1.0 / np.sqrt(x), "pos"),
    "square": (mx.square, np.square, "any"),
    "reciprocal": (mx.reciprocal, lambda x: 1.0 / x, "pos"),
    "sin": (mx.sin, np.sin, "any"),
    "cos": (mx.cos, np.cos, "any"),
    "tanh": (mx.tanh, np.tanh, "any"),
    "sigmoid": (mx.sigmoid, np_sigmoid, "any"),
    "relu": (mx.relu, lambda x: np.maximum(x, 0.0), "any"),
    "gelu": (mx.gelu, np_gelu, "any"),
    "softplus": (mx.softplus, lambda x: np.log1p(np.exp(x.astype(np.float64))), "any"),
    "sign": (mx.sign, np.sign, "any"),
    "identity": (mx.identity, lambda x: x, "any"),
}


def _input(domain, shape, seed):
    if domain == "pos":
        return rand(shape, seed, 0.1, 3.0)
    return rand(shape, seed, -3.0, 3.0)


@layouts
@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary(op, layout, impl_cls):
    mx_fn, np_fn, domain = UNARY[op]
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, H, D])
    y = mx_fn(x)
    assert names(y) == ["b", "h", "d"]
    assert y.dtype == np.float32
    xv = _input(domain, [8, 4, 8], seed=1)
    out = run(y, impl_cls, layout=layout, feeds={x: xv})
    assert out.dtype == np.float32
    assert_close(out, np_fn(xv).astype(np.float32))


@layouts
def test_logical_not(layout, impl_cls):
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, D])
    y = mx.logical_not(x > 0.0)
    assert y.dtype == np.bool_
    xv = rand([8, 8], seed=2)
    assert_equal(run(y, impl_cls, layout=layout, feeds={x: xv}), ~(xv > 0.0))


@layouts
def test_cast_float_to_int(layout, impl_cls):
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, D])
    y = mx.cast(x, "int32")
    assert y.dtype == np.int32
    xv = rand([8, 8], seed=3, low=-5.0, high=5.0)
    out = run(y, impl_cls, layout=layout, feeds={x: xv})
    assert out.dtype == np.int32
    assert_equal(out, xv.astype(np.int32))


@layouts
def test_cast_bool_to_float(layout, impl_cls):
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, D])
    y = mx.cast(x > 0.25, "float32") * x
    xv = rand([8, 8], seed=4)
    out = run(y, impl_cls, layout=layout, feeds={x: xv})
    assert out.dtype == np.float32
    assert_close(out, (xv > 0.25).astype(np.float32) * xv)


# ---------------------------------------------------------------- binary ops

# name -> (meshax fn, numpy fn, domain of x, domain of y, result is bool)
BINARY = {
    "add": (mx.add, np.add, "any", "any"),
    "subtract": (mx.subtract, np.subtract, "any", "any"),
    "multiply": (mx.multiply, np.multiply, "any", "any"),
    "divide": (mx.divide, np.divide, "any", "pos"),
    "maximum": (mx.maximum, np.maximum, "any", "any"),
    "minimum": (mx.minimum, np.minimum, "any", "any"),
    "pow": (mx.pow, np.power, "pos", "any"),
}

COMPARE = {
    "equal": (mx.equal, np.equal),
    "not_equal": (mx.not_equal, np.not_equal),
    "less": (mx.less, np.less),
    "less_equal": (mx.less_equal, np.less_equal),
    "greater": (mx.greater, np.greater),
    "greater_equal": (mx.greater_equal, np.greater_equal),
}


@layouts
@pytest.mark.parametrize("op", sorted(BINARY))
def test_binary(op, layout, impl_cls):
    """x[b,h] op y[h,d] -> [b,h,d];  x[b,d] op y[b,d];  v[d] op x[b,d] -> [d,b]."""
    mx_fn, np_fn, dx, dy = BINARY[op]
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, H])
    y = mx.placeholder(mesh, "y", [H, D])
    p = mx.placeholder(mesh, "p", [B, D])
    q = mx.placeholder(mesh, "q", [B, D])
    v = mx.placeholder(mesh, "v", [D])
    z0 = mx_fn(x, y)
    z1 = mx_fn(p, q)
    z2 = mx_fn(v, q)  # v's dims first, then q's remaining dims
    assert names(z0) == ["b", "h", "d"]
    assert names(z1) == ["b", "d"]
    assert names(z2) == ["d", "b"]
    xv = _input(dx, [8, 4], seed=5)
    yv = _input(dy, [4, 8], seed=6)
    pv = _input(dx, [8, 8], seed=7)
    qv = _input(dy, [8, 8], seed=8)
    vv = _input(dx, [8], seed=9)
    o0, o1, o2 = run([z0, z1, z2], impl_cls, layout=layout,
                     feeds={x: xv, y: yv, p: pv, q: qv, v: vv})
    assert_close(o0, np_fn(xv[:, :, None], yv[None, :, :]).astype(np.float32))
    assert_close(o1, np_fn(pv, qv).astype(np.float32))
    assert_close(o2, np_fn(vv[:, None], qv.T).astype(np.float32))


@layouts
@pytest.mark.parametrize("op", sorted(COMPARE))
def test_comparison(op, layout, impl_cls):
    mx_fn, np_fn = COMPARE[op]
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, H])
    y = mx.placeholder(mesh, "y", [H, D])
    z = mx_fn(x, y)
    assert names(z) == ["b", "h", "d"]
    assert z.dtype == np.bool_
    # small integer-valued floats so that ties occur
    xv = np.random.default_rng(11).integers(0, 3, size=(8, 4)).astype(np.float32)
    yv = np.random.default_rng(12).integers(0, 3, size=(4, 8)).astype(np.float32)
    out = run(z, impl_cls, layout=layout, feeds={x: xv, y: yv})
    assert out.dtype == np.bool_
    assert_equal(out, np_fn(xv[:, :, None], yv[None, :, :]))


@layouts
@pytest.mark.parametrize("op", ["logical_and", "logical_or"])
def test_logical_binary(op, layout, impl_cls):
    mx_fn = getattr(mx, op)
    np_fn = getattr(np, op)
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, D])
    y = mx.placeholder(mesh, "y", [D])
    z = mx_fn(x > 0.0, y > 0.0)
    assert z.dtype == np.bool_
    assert names(z) == ["b", "d"]
    xv = rand([8, 8], seed=13)
    yv = rand([8], seed=14)
    out = run(z, impl_cls, layout=layout, feeds={x: xv, y: yv})
    assert_equal(out, np_fn(xv > 0.0, (yv > 0.0)[None, :]))


@layouts
def test_where(layout, impl_cls):
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, D])
    y = mx.placeholder(mesh, "y", [B, D])
    v = mx.placeholder(mesh, "v", [D])
    z1 = mx.where(x > 0.0, x, y)
    z2 = mx.where(x > 0.0, x, v)
    assert names(z1) == ["b", "d"]
    assert names(z2) == ["b", "d"]
    xv, yv, vv = rand([8, 8], 15), rand([8, 8], 16), rand([8], 17)
    o1, o2 = run([z1, z2], impl_cls, layout=layout, feeds={x: xv, y: yv, v: vv})
    assert_close(o1, np.where(xv > 0.0, xv, yv))
    assert_close(o2, np.where(xv > 0.0, xv, vv[None, :]))


# ---------------------------------------------------------------- operators

OPERATORS = {
    "x+y": (lambda x, y: x + y, lambda x, y: x + y),
    "x-y": (lambda x, y: x - y, lambda x, y: x - y),
    "x*y": (lambda x, y: x * y, lambda x, y: x * y),
    "x/y": (lambda x, y: x / y, lambda x, y: x / y),
    "x**2": (lambda x, y: x ** 2, lambda x, y: x ** 2),
    "-x": (lambda x, y: -x, lambda x, y: -x),
    "x+3": (lambda x, y: x + 3.0, lambda x, y: x + 3.0),
    "3+x": (lambda x, y: 3.0 + x, lambda x, y: 3.0 + x),
    "x-3": (lambda x, y: x - 3.0, lambda x, y: x - 3.0),
    "3-x": (lambda x, y: 3.0 - x, lambda x, y: 3.0 - x),
    "2*x": (lambda x, y: 2.0 * x, lambda x, y: 2.0 * x),
    "x*2": (lambda x, y: x * 2.0, lambda x, y: x * 2.0),
    "x/2": (lambda x, y: x / 2.0, lambda x, y: x / 2.0),
    "2/y": (lambda x, y: 2.0 / y, lambda x, y: 2.0 / y),
    "2**x": (lambda x, y: 2.0 ** x, lambda x, y: 2.0 ** x),
    "y**x": (lambda x, y: y ** x, lambda x, y: y ** x),
    "mixed": (lambda x, y: (x * y - 1.5) / (y + 1.0) + -x,
              lambda x, y: (x * y - 1.5) / (y + 1.0) + -x),
}


@layouts
def test_operators(layout, impl_cls):
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, D])
    y = mx.placeholder(mesh, "y", [B, D])
    exprs = list(OPERATORS)
    outs = [OPERATORS[e][0](x, y) for e in exprs]
    for e, z in zip(exprs, outs):
        assert names(z) == ["b", "d"], e
    xv = rand([8, 8], 18, -2.0, 2.0)
    yv = rand([8, 8], 19, 0.5, 2.0)
    results = run(outs, impl_cls, layout=layout, feeds={x: xv, y: yv})
    assert len(results) == len(exprs)
    failures = []
    for e, got in zip(exprs, results):
        want = np.asarray(OPERATORS[e][1](xv, yv)).astype(np.float32)
        try:
            assert_close(got, want)
        except AssertionError as err:
            failures.append(f"{e}: {err}")
    assert not failures, "\n".join(failures)


def test_binary_output_shape_order():
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [D, B])
    y = mx.placeholder(mesh, "y", [H, B, D])
    assert names(x + y) == ["d", "b", "h"]
    assert names(y * x) == ["h", "b", "d"]
    assert names(mx.maximum(y, x)) == ["h", "b", "d"]
    assert (x > y).dtype == np.bool_
