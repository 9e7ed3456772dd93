"""Gradients of every differentiable op, against jax.grad of the same mathematics (issue 3).

loss = sum(op(inputs) * r) for a random r; meshax's graph gradients must equal jax.grad under
a replicated and a split layout (SIMD), and under a split layout on the placement backend.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshax as mx

b, d, h = mx.Dimension("b", 8), mx.Dimension("d", 8), mx.Dimension("h", 4)
BD, D, HD = [b, d], [d], [h, d]


def pos(a):  # inputs for ops that need positive values
    return np.abs(a) + 0.5


def case(name, inputs, f_mx, f_jnp, prep=None):
    return pytest.param(inputs, f_mx, f_jnp, prep, id=name)


UNARY = ["negative", "abs", "exp", "square", "sin", "cos", "tanh", "sigmoid", "relu", "softplus", "identity", "erf"]
CASES = [
    case(
        n,
        [BD],
        lambda x, n=n: getattr(mx, n)(x),
        lambda x, n=n: {
            "negative": jnp.negative,
            "identity": lambda a: a,
            "relu": jax.nn.relu,
            "sigmoid": jax.nn.sigmoid,
            "softplus": jax.nn.softplus,
            "erf": jax.scipy.special.erf,
        }.get(n, getattr(jnp, n, None))(x),
    )
    for n in UNARY
]
CASES += [
    case("gelu", [BD], mx.gelu, lambda x: jax.nn.gelu(x, approximate=False)),
    case("log", [BD], mx.log, jnp.log, pos),
    case("sqrt", [BD], mx.sqrt, jnp.sqrt, pos),
    case("rsqrt", [BD], mx.rsqrt, jax.lax.rsqrt, pos),
    case("reciprocal", [BD], mx.reciprocal, jnp.reciprocal, pos),
    case("add_broadcast", [BD, D], mx.add, lambda x, y: x + y),
    case("subtract", [BD, HD], mx.subtract, lambda x, y: x[:, :, None] - y.T[None]),
    case("multiply", [BD, D], mx.multiply, lambda x, y: x * y),
    case("divide", [BD, D], mx.divide, lambda x, y: x / y, pos),
    case("maximum", [BD, D], mx.maximum, jnp.maximum),
    case("minimum", [BD, D], mx.minimum, jnp.minimum),
    case("pow", [BD, D], mx.pow, jnp.power, pos),
    case("operators", [BD, D], lambda x, y: (x * 2.0 - y) / 3.0 + (-x) ** 2, lambda x, y: (x * 2 - y) / 3 + x**2),
    case("where", [BD, D], lambda x, y: mx.where(x > 0.0, x * y, y), lambda x, y: jnp.where(x > 0, x * y, y)),
    case("reduce_sum", [BD], lambda x: mx.reduce_sum(x, reduced_dim=b), lambda x: x.sum(0)),
    case("reduce_mean", [BD], lambda x: mx.reduce_mean(x, reduced_dim=d), lambda x: x.mean(1)),
    case("reduce_max", [BD], lambda x: mx.reduce_max(x, reduced_dim=b), lambda x: x.max(0)),
    case("reduce_min", [BD], lambda x: mx.reduce_min(x, reduced_dim=d), lambda x: x.min(1)),
    case(
        "reduce_logsumexp",
        [BD],
        lambda x: mx.reduce_logsumexp(x, reduced_dim=d),
        lambda x: jax.scipy.special.logsumexp(x, axis=1),
    ),
    case("softmax", [BD], lambda x: mx.softmax(x, d), lambda x: jax.nn.softmax(x, axis=1)),
    case("log_softmax", [BD], lambda x: mx.log_softmax(x, b), lambda x: jax.nn.log_softmax(x, axis=0)),
    case("einsum", [BD, HD], lambda x, y: mx.einsum(x, y, output_shape=[b, h]), lambda x, y: x @ y.T),
    case(
        "einsum_sum_only_in_one_input",
        [BD, [h]],
        lambda x, y: mx.einsum(x, y, output_shape=[h]),
        lambda x, y: x.sum() * y,
    ),
    case("reshape", [BD], lambda x: mx.reshape(x, [mx.Dimension("bd", 64)]), lambda x: x.reshape(64)),
    case("transpose", [BD], lambda x: mx.transpose(x, [d, b]), lambda x: x.T),
    case("broadcast", [D], lambda x: mx.broadcast(x, [b, d]), lambda x: jnp.broadcast_to(x, (8, 8))),
    case("rename", [BD], lambda x: mx.rename_dimension(x, "d", "e") * 1.0, lambda x: x),
    case("slice", [BD], lambda x: mx.slice(x, 3, 4, "d"), lambda x: x[:, 3:7]),
    case("pad", [BD], lambda x: mx.pad(x, [1, 3], "b"), lambda x: jnp.pad(x, ((1, 3), (0, 0)))),
    case("concat", [BD, BD], lambda x, y: mx.concat([x, y], "d"), lambda x, y: jnp.concatenate([x, y], 1)),
    case("split", [BD], lambda x: mx.split(x, d, [4, 4])[1] * 2.0, lambda x: x[:, 4:] * 2),
    case("stack", [BD, BD], lambda x, y: mx.stack([x, y], "s", axis=1), lambda x, y: jnp.stack([x, y], 1)),
    case("unstack", [BD], lambda x: mx.unstack(x, b)[3], lambda x: x[3]),
    case("shift", [BD], lambda x: mx.shift(x, 2, b, wrap=False), lambda x: jnp.pad(x, ((2, 0), (0, 0)))[:8]),
    case("shift_wrap", [BD], lambda x: mx.shift(x, -3, d, wrap=True), lambda x: jnp.roll(x, -3, 1)),
    case("cumsum", [BD], lambda x: mx.cumsum(x, b), lambda x: jnp.cumsum(x, 0)),
    case("cumsum_exclusive", [BD], lambda x: mx.cumsum(x, d, exclusive=True), lambda x: jnp.cumsum(x, 1) - x),
    case("shard", [BD], lambda x: mx.shard(x, "d:cols") * 1.0, lambda x: x),
    case(
        "cast",
        [BD],
        lambda x: mx.cast(mx.cast(x, "bfloat16"), "float32"),
        lambda x: x.astype(jnp.bfloat16).astype(jnp.float32),
    ),
    case(
        "layer_norm",  # (its statistics pass optimization barriers: `layers._kept`)
        [BD],
        lambda x: mx.layers.layer_norm(x, d, epsilon=1e-3),
        lambda x: (x - x.mean(1, keepdims=True)) * jax.lax.rsqrt(x.var(1, keepdims=True) + 1e-3),
    ),
    case("top_k_values", [BD], lambda x: mx.top_k(x, d, 3)[0], lambda x: jax.lax.top_k(x, 3)[0]),
    case(
        "cross_entropy",
        [BD, BD],
        lambda x, t: mx.layers.softmax_cross_entropy_with_logits(x, mx.softmax(t, d), d),
        lambda x, t: -(jax.nn.softmax(t, 1) * jax.nn.log_softmax(x, 1)).sum(1),
    ),
]


def check(impl_cls, mesh_shape, layout, inputs, f_mx, f_jnp, prep):
    rng = np.random.default_rng(0)
    arrays = [rng.uniform(-1, 1, size=[x.size for x in s]).astype(np.float32) for s in inputs]
    if prep:
        arrays = [prep(a) for a in arrays]
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    xs = [mx.placeholder(mesh, f"x{i}", s) for i, s in enumerate(inputs)]
    out = f_mx(*xs)
    r = mx.placeholder(mesh, "r", out.shape)
    loss = mx.reduce_sum(out * r)
    grads = mx.gradients(loss, xs)
    rv = rng.uniform(-1, 1, size=out.shape.to_integer_list).astype(np.float32)
    lowering = mx.Lowering(graph, {mesh: impl_cls(mesh_shape, layout)})
    feeds = {f"x{i}": a for i, a in enumerate(arrays)} | {"r": rv}
    got = lowering.function(grads)(feeds)
    want = jax.grad(lambda *a: jnp.sum(f_jnp(*a) * rv), argnums=tuple(range(len(arrays))))(*arrays)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, np.asarray(w), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("layout", ["", "b:rows;d:cols"], ids=["replicated", "split"])
@pytest.mark.parametrize("inputs,f_mx,f_jnp,prep", CASES)
def test_gradient_simd(inputs, f_mx, f_jnp, prep, layout):
    check(mx.SimdMeshImpl, "rows:2;cols:4", layout, inputs, f_mx, f_jnp, prep)


@pytest.mark.parametrize(
    "inputs,f_mx,f_jnp,prep",
    [c for c in CASES if c.id in ("einsum", "reduce_max", "gather", "shift", "softmax", "concat")],
)
def test_gradient_placement(inputs, f_mx, f_jnp, prep):
    check(mx.PlacementMeshImpl, "rows:2;cols:4", "b:rows;b:cols", inputs, f_mx, f_jnp, prep)


@pytest.mark.parametrize("layout", ["", "v:all", "n:all"])
def test_gather_gradient_scatters_into_the_table(layout):
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    v, e, n = mx.Dimension("v", 16), mx.Dimension("e", 4), mx.Dimension("n", 8)
    table = mx.placeholder(mesh, "table", [v, e])
    ids = mx.placeholder(mesh, "ids", [n], dtype="int32")
    r = mx.placeholder(mesh, "r", [n, e])
    (g,) = mx.gradients(mx.reduce_sum(mx.gather(table, ids, v) * r), [table])
    rng = np.random.default_rng(0)
    idv = np.array([0, 3, 3, 15, 8, 7, 3, 1], np.int32)
    rv = rng.normal(size=(8, 4)).astype(np.float32)
    want = np.zeros((16, 4), np.float32)
    np.add.at(want, idv, rv)
    lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", layout)})
    got = lowering.function(g)({"table": rng.normal(size=(16, 4)).astype(np.float32), "ids": idv, "r": rv})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_no_path_gives_none_and_integer_inputs_get_none():
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    x = mx.placeholder(mesh, "x", BD)
    unrelated = mx.placeholder(mesh, "u", BD)
    ids = mx.placeholder(mesh, "ids", [b], dtype="int32")
    loss = mx.reduce_sum(mx.gather(x, ids, b))
    gx, gu, gi = mx.gradients(loss, [x, unrelated, ids])
    assert gx is not None and gx.shape == x.shape
    assert gu is None and gi is None


def test_gradient_flows_through_stop_gradient_nowhere():
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    x = mx.placeholder(mesh, "x", BD)
    y = x * 3.0
    # one of two: None; every one None is an error (a port that would silently train nothing)
    assert mx.gradients([y, mx.reduce_sum(mx.stop_gradient(x) * 2.0)], [x, y])[0] is not None
    with pytest.raises(mx.GraphError, match=r"no gradient flows .* back to any of x"):
        mx.gradients(mx.reduce_sum(mx.stop_gradient(x) * 2.0), [x])


def test_grad_ys_scales_the_gradient():
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    x = mx.placeholder(mesh, "x", BD)
    y = x * 3.0
    gy = mx.placeholder(mesh, "gy", BD)
    (gx,) = mx.gradients(y, [x], grad_ys=[gy])
    gv = np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32)
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "b:all")}).function(gx)
    np.testing.assert_allclose(fn({"x": np.zeros((8, 8), np.float32), "gy": gv}), 3 * gv, rtol=1e-6)


def test_a_variable_stands_for_its_value_and_anything_else_is_refused():
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    w = mx.get_variable(mesh, "w", BD)
    loss = mx.reduce_sum(w * w)
    (by_op,) = mx.gradients(loss, graph.trainable_variables)  # Mesh-TensorFlow passes variables
    (by_value,) = mx.gradients(loss, [w])
    assert by_op is not None and by_op.shape == by_value.shape == w.shape
    with pytest.raises(mx.GraphError, match="not a Tensor or a variable"):
        mx.gradients(loss, ["w"])


def test_ys_grad_ys_and_xs_that_do_not_fit_are_named():
    """A variable of another graph among the xs got a None gradient, silently (an optimizer then
    left it alone), or, alone, 'no gradient flows' (not why); a loss of another graph beside this
    one's was left out; a grad_ys of another shape than its y was broadcast into the gradients;
    a y or grad_ys that is no tensor was an AttributeError or TypeError from inside."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    w = mx.get_variable(mesh, "w", "io:4")
    loss = mx.reduce_sum(w * w)
    other = mx.Mesh(mx.Graph(), "m")
    w2 = mx.get_variable(other, "w2", "io:4")
    for xs in ([w2], [w, w2]):
        with pytest.raises(mx.GraphError, match=r"gradients: w2 belongs to another mx.Graph than reduce_sum"):
            mx.gradients(loss, xs)
    with pytest.raises(mx.GraphError, match=r"gradients: total belongs to another mx.Graph"):
        mx.gradients([loss, mx.reduce_sum(w2, name="total")], [w])
    with pytest.raises(mx.GraphError, match=r"the grad_ys of reduce_sum Shape\(\[\]\) must be a Tensor of its shape"):
        mx.gradients(loss, [w], grad_ys=[mx.ones(mesh, "io:4")])
    with pytest.raises(mx.GraphError, match=r"must be a Tensor of its shape, got float 2.0"):
        mx.gradients(loss, [w], grad_ys=[2.0])
    with pytest.raises(mx.GraphError, match=r"gradients: ys are meshax Tensors \(the loss\), got str 'loss'"):
        mx.gradients("loss", [w])
