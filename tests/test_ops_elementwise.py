"""Elementwise unary / binary ops, operators, comparisons, where and cast, vs NumPy.

Each test runs a whole family of cases as one program per (impl, layout), see
`check_cases` in conftest.py; a failure message names the failing case(s)."""

import math

import numpy as np
import pytest

import meshax as mx
from tests.conftest import LAYOUTS, B, D, H, check_cases, names, new_mesh, rand

layouts = pytest.mark.parametrize("layout", LAYOUTS, ids=lambda s: s or "replicated")

_erf = np.vectorize(math.erf, otypes=[np.float64])


def np_gelu(x):
    x = x.astype(np.float64)
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


def _input(domain, shape, seed):
    if domain == "pos":
        return rand(shape, seed, 0.1, 3.0)
    return rand(shape, seed, -3.0, 3.0)


# ---------------------------------------------------------------- unary ops

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


def _unary_case(op, seed):
    mx_fn, np_fn, domain = UNARY[op]

    def build(mesh):
        x = mx.placeholder(mesh, "x_" + op, [B, H, D])
        y = mx_fn(x)
        assert names(y) == ["b", "h", "d"]
        assert y.dtype == np.float32
        xv = _input(domain, [8, 4, 8], seed)
        return [(y, np_fn(xv).astype(np.float32))], {x: xv}

    return build


def _logical_not(mesh):
    x = mx.placeholder(mesh, "x_not", [B, D])
    y = mx.logical_not(x > 0.0)
    assert y.dtype == np.bool_
    xv = rand([8, 8], seed=2)
    return [(y, ~(xv > 0.0))], {x: xv}


def _cast_float_to_int(mesh):
    x = mx.placeholder(mesh, "x_cast1", [B, D])
    y = mx.cast(x, "int32")
    assert y.dtype == np.int32
    xv = rand([8, 8], seed=3, low=-5.0, high=5.0)
    return [(y, xv.astype(np.int32))], {x: xv}


def _cast_bool_to_float(mesh):
    x = mx.placeholder(mesh, "x_cast2", [B, D])
    y = mx.cast(x > 0.25, "float32") * x
    assert y.dtype == np.float32
    xv = rand([8, 8], seed=4)
    return [(y, (xv > 0.25).astype(np.float32) * xv)], {x: xv}


UNARY_CASES = {op: _unary_case(op, seed) for seed, op in enumerate(sorted(UNARY))}
UNARY_CASES.update(
    {"logical_not": _logical_not, "cast-float-int32": _cast_float_to_int, "cast-bool-float32": _cast_bool_to_float}
)


@layouts
def test_unary(layout, impl_cls):
    check_cases(UNARY_CASES, impl_cls, layout)


# ---------------------------------------------------------------- binary ops

# name -> (meshax fn, numpy fn, domain of x, domain of y)
BINARY = {
    "add": (mx.add, np.add, "any", "any"),
    "subtract": (mx.subtract, np.subtract, "any", "any"),
    "multiply": (mx.multiply, np.multiply, "any", "any"),
    "divide": (mx.divide, np.divide, "any", "pos"),
    "maximum": (mx.maximum, np.maximum, "any", "any"),
    "minimum": (mx.minimum, np.minimum, "any", "any"),
    "pow": (mx.pow, np.power, "pos", "any"),
}


def _binary_case(op, seed):
    """x[b,h] op y[h,d] -> [b,h,d];  p[b,d] op q[b,d];  v[d] op q[b,d] -> [d,b]."""
    mx_fn, np_fn, dx, dy = BINARY[op]

    def build(mesh):
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
        xv = _input(dx, [8, 4], seed)
        yv = _input(dy, [4, 8], seed + 100)
        pv = _input(dx, [8, 8], seed + 200)
        qv = _input(dy, [8, 8], seed + 300)
        vv = _input(dx, [8], seed + 400)
        pairs = [(z0, np_fn(xv[:, :, None], yv[None, :, :])), (z1, np_fn(pv, qv)), (z2, np_fn(vv[:, None], qv.T))]
        return pairs, {x: xv, y: yv, p: pv, q: qv, v: vv}

    return build


COMPARE = {
    "equal": (mx.equal, np.equal),
    "not_equal": (mx.not_equal, np.not_equal),
    "less": (mx.less, np.less),
    "less_equal": (mx.less_equal, np.less_equal),
    "greater": (mx.greater, np.greater),
    "greater_equal": (mx.greater_equal, np.greater_equal),
}


def _compare_case(op, seed):
    mx_fn, np_fn = COMPARE[op]

    def build(mesh):
        x = mx.placeholder(mesh, "x", [B, H])
        y = mx.placeholder(mesh, "y", [H, D])
        z = mx_fn(x, y)
        assert names(z) == ["b", "h", "d"]
        assert z.dtype == np.bool_
        # small integer-valued floats so that ties occur
        xv = np.random.default_rng(seed).integers(0, 3, size=(8, 4)).astype(np.float32)
        yv = np.random.default_rng(seed + 1).integers(0, 3, size=(4, 8)).astype(np.float32)
        return [(z, np_fn(xv[:, :, None], yv[None, :, :]))], {x: xv, y: yv}

    return build


def _logical_case(op, seed):
    mx_fn, np_fn = getattr(mx, op), getattr(np, op)

    def build(mesh):
        x = mx.placeholder(mesh, "x", [B, D])
        y = mx.placeholder(mesh, "y", [D])
        z = mx_fn(x > 0.0, y > 0.0)
        assert z.dtype == np.bool_
        assert names(z) == ["b", "d"]
        xv, yv = rand([8, 8], seed=seed), rand([8], seed=seed + 1)
        return [(z, np_fn(xv > 0.0, (yv > 0.0)[None, :]))], {x: xv, y: yv}

    return build


def _where(mesh):
    x = mx.placeholder(mesh, "x", [B, D])
    y = mx.placeholder(mesh, "y", [B, D])
    v = mx.placeholder(mesh, "v", [D])
    z1 = mx.where(x > 0.0, x, y)
    z2 = mx.where(x > 0.0, x, v)
    assert names(z1) == ["b", "d"]
    assert names(z2) == ["b", "d"]
    xv, yv, vv = rand([8, 8], 15), rand([8, 8], 16), rand([8], 17)
    pairs = [(z1, np.where(xv > 0.0, xv, yv)), (z2, np.where(xv > 0.0, xv, vv[None, :]))]
    return pairs, {x: xv, y: yv, v: vv}


BINARY_CASES = {}
for _i, _op in enumerate(sorted(BINARY)):
    BINARY_CASES[_op] = _binary_case(_op, 10 * _i + 5)
for _i, _op in enumerate(sorted(COMPARE)):
    BINARY_CASES[_op] = _compare_case(_op, 10 * _i + 7)
for _i, _op in enumerate(["logical_and", "logical_or"]):
    BINARY_CASES[_op] = _logical_case(_op, 10 * _i + 9)
BINARY_CASES["where"] = _where


@layouts
def test_binary(layout, impl_cls):
    check_cases(BINARY_CASES, impl_cls, layout)


# ---------------------------------------------------------------- operators

OPERATORS = {
    "x+y": (lambda x, y: x + y, lambda x, y: x + y),
    "x-y": (lambda x, y: x - y, lambda x, y: x - y),
    "x*y": (lambda x, y: x * y, lambda x, y: x * y),
    "x/y": (lambda x, y: x / y, lambda x, y: x / y),
    "x**2": (lambda x, y: x**2, lambda x, y: x**2),
    "-x": (lambda x, y: -x, lambda x, y: -x),
    "x+3": (lambda x, y: x + 3.0, lambda x, y: x + 3.0),
    "3+x": (lambda x, y: 3.0 + x, lambda x, y: 3.0 + x),
    "x-3": (lambda x, y: x - 3.0, lambda x, y: x - 3.0),
    "3-x": (lambda x, y: 3.0 - x, lambda x, y: 3.0 - x),
    "2*x": (lambda x, y: 2.0 * x, lambda x, y: 2.0 * x),
    "x*2": (lambda x, y: x * 2.0, lambda x, y: x * 2.0),
    "x/2": (lambda x, y: x / 2.0, lambda x, y: x / 2.0),
    "2/y": (lambda x, y: 2.0 / y, lambda x, y: 2.0 / y),
    "2**x": (lambda x, y: 2.0**x, lambda x, y: 2.0**x),
    "y**x": (lambda x, y: y**x, lambda x, y: y**x),
    "mixed": (lambda x, y: (x * y - 1.5) / (y + 1.0) + -x, lambda x, y: (x * y - 1.5) / (y + 1.0) + -x),
}


def _operator_case(expr):
    mx_fn, np_fn = OPERATORS[expr]

    def build(mesh):
        x = mx.placeholder(mesh, "x", [B, D])
        y = mx.placeholder(mesh, "y", [B, D])
        z = mx_fn(x, y)
        assert names(z) == ["b", "d"]
        xv = rand([8, 8], 18, -2.0, 2.0)
        yv = rand([8, 8], 19, 0.5, 2.0)
        return [(z, np.asarray(np_fn(xv, yv), dtype=np.float32))], {x: xv, y: yv}

    return build


@layouts
def test_operators(layout, impl_cls):
    check_cases({e: _operator_case(e) for e in OPERATORS}, impl_cls, layout)


def test_binary_output_shape_order():
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [D, B])
    y = mx.placeholder(mesh, "y", [H, B, D])
    assert names(x + y) == ["d", "b", "h"]
    assert names(y * x) == ["h", "b", "d"]
    assert names(mx.maximum(y, x)) == ["h", "b", "d"]
    assert names(x - 1.0) == ["d", "b"]
    assert names(2.0 * y) == ["h", "b", "d"]
    assert (x > y).dtype == np.bool_
    assert names(x > y) == ["d", "b", "h"]


def test_the_direct_lax_kernels_are_jnps_programs():
    """Ops on two floats of one dtype bind jnp's lax primitive directly: the same jaxpr as jnp's
    function, broadcasting included, for each such op and float dtype."""
    import jax
    import jax.numpy as jnp

    from meshax.ops.elementwise import _BINARY, _SAME_FLOAT_LAX

    rng = np.random.default_rng(0)
    for dtype in ("float32", "bfloat16", "float16"):
        for fn, kernel in _SAME_FLOAT_LAX.items():
            for a, b in [((3, 4), (3, 4)), ((3, 1), (1, 4)), ((), ())]:
                x, y = (jnp.asarray(np.abs(rng.normal(size=s)) + 0.1, dtype) for s in (a, b))
                assert str(jax.make_jaxpr(kernel)(x, y)) == str(jax.make_jaxpr(_BINARY[fn])(x, y)), (fn, dtype)


def test_complex_tensors_compare_as_jnp_orders_them():
    """Complex ops keep jnp's functions (lax.lt refuses complex; jnp orders by real, then imaginary part)."""
    import jax.numpy as jnp

    (graph, mesh), b = new_mesh(), mx.Dimension("b", 8)
    xv = (np.arange(8) % 2 + 1j * np.arange(8)).astype(np.complex64)
    yv = np.full(8, 1 + 3j, np.complex64)
    x, y = (mx.import_tensor(mesh, v, [b]) for v in (xv, yv))
    outs = [mx.less(x, y), mx.greater_equal(x, y), mx.maximum(x, y)]
    got = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "b:all")}).function(outs)({})
    for value, want in zip(got, [jnp.less(xv, yv), jnp.greater_equal(xv, yv), jnp.maximum(xv, yv)]):
        np.testing.assert_array_equal(value, want)


def test_the_relus_gradient_reads_its_output_not_its_input():
    """relu's gradient masks by y > 0 (where x > 0): the relu is the input's only reader, so a
    step need not keep the input for the gradient (on the CPU a bfloat16 LM step accessed 1.2%
    fewer bytes by XLA's cost analysis); its values are jax.grad's (tests/test_autodiff.py)."""
    graph, mesh = new_mesh()
    x = mx.get_variable(mesh, "x", [B, D])
    pre = x * 2.0
    y = mx.relu(pre)
    (grad,) = mx.gradients(mx.reduce_sum(y * y), [x])
    assert [op for op in graph.operations if pre in op.inputs] == [y.operation]
    assert grad.shape == x.shape
