"""Six cases where the layout (or the backend) changed the numbers, found by a random-program
fuzzer (issue 9). Each runs unsplit and split, on both backends, against NumPy / jax.grad."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshax as mx
from tests.conftest import IMPL_IDS, IMPLS, assert_close, assert_equal, new_mesh, run

impls = pytest.mark.parametrize("impl_cls", IMPLS, ids=IMPL_IDS)
# no split / the dim under test split 8 ways / split over two mesh dims of a 2-D mesh
LAYOUTS = pytest.mark.parametrize(
    "mesh_shape,rules",
    [
        ("all:8", ""),
        ("all:8", "v:all"),
        ("rows:2;cols:4", "v:rows;v:cols"),
        ("rows:2;cols:4", "v:cols;c:rows"),
    ],
)

V = mx.Dimension("v", 8)
C = mx.Dimension("c", 2)


@impls
@LAYOUTS
def test_gather_with_indices_named_like_the_table_dim(impl_cls, mesh_shape, rules):
    """1. ids over a "v" dim looking up a table split over "v": w[ids], not zeros."""
    _, mesh = new_mesh()
    w = mx.placeholder(mesh, "w", [V, C])
    ids = mx.placeholder(mesh, "ids", [V], dtype="int32")
    out = mx.gather(w, ids, V)
    assert out.shape == mx.Shape([V, C])
    loss = mx.reduce_sum(out * out)
    (gw,) = mx.gradients(loss, [w])
    wv = np.arange(16, dtype=np.float32).reshape(8, 2) + 1
    iv = np.array([3, 3, 7, 0, 1, 6, 5, 3], np.int32)
    got, got_gw = run([out, gw], impl_cls, mesh_shape, rules, feeds={w: wv, ids: iv})
    assert_close(got, wv[iv])
    want_gw = jax.grad(lambda t: jnp.sum(t[iv] ** 2))(wv)
    assert_close(got_gw, want_gw)


@impls
@LAYOUTS
@pytest.mark.parametrize(
    "op,ref", [(mx.reduce_mean, np.mean), (mx.reduce_logsumexp, None), (mx.reduce_sum, np.sum), (mx.reduce_max, np.max)]
)
def test_reductions_honour_the_order_of_output_shape(impl_cls, mesh_shape, rules, op, ref):
    """2. output_shape [c, b] gives dims [c, b] (and an array of that shape) for every reduction."""
    b = mx.Dimension("b", 4)
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [b, V, C])
    y = op(x, output_shape=[C, b])
    assert y.shape == mx.Shape([C, b])
    xv = np.random.default_rng(0).normal(size=(4, 8, 2)).astype(np.float32)
    got = run(y, impl_cls, mesh_shape, rules, feeds={x: xv})
    want = ref(xv, axis=1) if ref else jax.scipy.special.logsumexp(xv, axis=1)
    assert_close(got, np.asarray(want).T)


@impls
@LAYOUTS
def test_sums_of_bools_count(impl_cls, mesh_shape, rules):
    """3. accuracy as mean(equal(pred, label)): a fraction on every layout; sum is an int32 count."""
    _, mesh = new_mesh()
    pred = mx.placeholder(mesh, "pred", [V], dtype="int32")
    label = mx.placeholder(mesh, "label", [V], dtype="int32")
    hit = mx.equal(pred, label)
    acc, count = mx.reduce_mean(hit), mx.reduce_sum(hit)
    per_c = mx.reduce_sum(mx.equal(mx.broadcast(pred, [V, C]), label), output_shape=[C])
    running = mx.cumsum(hit, V)
    assert (acc.dtype, count.dtype, per_c.dtype, running.dtype) == (np.float32, np.int32, np.int32, np.int32)
    pv = np.array([1, 2, 3, 4, 5, 6, 7, 0], np.int32)
    lv = np.array([1, 0, 3, 0, 0, 6, 0, 1], np.int32)
    got = run([acc, count, per_c, running], impl_cls, mesh_shape, rules, feeds={pred: pv, label: lv})
    assert_close(got[0], np.float32(0.375))
    assert_equal(got[1], np.int32(3))
    assert_equal(got[2], np.array([3, 3], np.int32))
    assert_equal(got[3], np.cumsum(pv == lv).astype(np.int32))


@impls
@LAYOUTS
@pytest.mark.filterwarnings("ignore:layout rule c.rows splits nothing")  # (this graph has no dim c)
def test_integers_promote_in_true_division_and_transcendental_ops(impl_cls, mesh_shape, rules):
    """4. int32 / 3 is float32 true division on both backends; exp, sqrt, sigmoid promote too."""
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [V], dtype="int32")
    outs = [mx.divide(x, 3), x / x, mx.exp(x), mx.sqrt(x), mx.sigmoid(x), x * 0.5, x + 1, mx.softmax(x, V)]
    assert [t.dtype for t in outs] == [np.float32] * 6 + [np.int32, np.float32]
    xv = np.arange(1, 9, dtype=np.int32)
    got = run(outs, impl_cls, mesh_shape, rules, feeds={x: xv})
    xs = jnp.asarray(xv)
    want = [
        xs / 3,
        xs / xs,
        jnp.exp(xs),
        jnp.sqrt(xs),
        jax.nn.sigmoid(xs.astype(jnp.float32)),
        xs * 0.5,
        xs + 1,
        jax.nn.softmax(xs.astype(jnp.float32)),
    ]
    for g, w in zip(got, want):
        assert np.asarray(g).dtype == np.asarray(w).dtype
        assert_close(g, w)


@impls
@pytest.mark.parametrize("source_impl", IMPLS, ids=IMPL_IDS)
def test_copying_weights_never_consumes_the_source(impl_cls, source_impl):
    """5. B.set_variable_value(vB, A.variable_state(vA)), then many B steps: A's array lives,
    and so does a NumPy array or jax.Array the user passed in."""

    def model(lr):
        graph, mesh = new_mesh()
        v = mx.get_variable(mesh, "v", [V, C], initializer=mx.initializers.normal())
        update = mx.assign_sub(v, lr * v)
        return graph, mesh, v, update

    ga, ma, va, _ = model(0.0)
    a = mx.Lowering(ga, {ma: source_impl("rows:2;cols:4", "v:cols;c:rows")})
    before = a.variable_value(va)
    gb, mb, vb, upd = model(0.5)
    b = mx.Lowering(gb, {mb: impl_cls("rows:2;cols:4", "v:cols;c:rows")})  # the same sharding
    b.set_variable_value(vb, a.variable_state(va))
    user_jax = jax.device_put(np.ones((8, 2), np.float32), b.impl.named_sharding(b.plan[vb]))
    user_np = np.full((8, 2), 3.0, np.float32)
    step = b.function([], updates=[upd])
    for value in (None, user_jax, user_np):
        if value is not None:
            b.set_variable_value(vb, value)
        for _ in range(4):
            step()
    assert_equal(a.variable_value(va), before)
    assert_equal(np.asarray(a.variable_state(va)), before)
    assert_equal(np.asarray(user_jax), np.ones((8, 2), np.float32))
    assert_equal(user_np, np.full((8, 2), 3.0, np.float32))
    assert_close(b.variable_value(vb), np.full((8, 2), 3.0 * 0.5**4, np.float32))


@impls
@LAYOUTS
@pytest.mark.parametrize("kind", ["max", "min"])
def test_max_and_min_gradients_share_ties(impl_cls, mesh_shape, rules, kind):
    """6. d max(x)/dx with ties is 1/(number of ties) at each tied maximum, as jax.grad gives."""
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [C, V])
    reduce, ref = (mx.reduce_max, jnp.max) if kind == "max" else (mx.reduce_min, jnp.min)
    y = reduce(x, reduced_dim=V)
    (gx,) = mx.gradients(mx.reduce_sum(y * mx.constant(mesh, np.array([1.0, 2.0], np.float32), [C])), [x])
    s = 1 if kind == "max" else -1
    xv = s * np.array([[1, 1, 0, 1, 0, 0, 0, 0], [2, 0, 2, 0, 0, 0, 0, 0]], np.float32)
    got = run(gx, impl_cls, mesh_shape, rules, feeds={x: xv})
    want = jax.grad(lambda t: jnp.sum(ref(t, axis=1) * jnp.array([1.0, 2.0])))(xv)
    assert_close(got, want)
    assert_close(got.sum(axis=1), np.array([1.0, 2.0], np.float32))


@impls
def test_size_one_mesh_dims_are_left_out_of_partition_specs(impl_cls):
    """A split over a mesh dim of size 1 splits nothing: JAX's spec must not name it (newer JAX
    refuses a shard_map spec naming it for an input it sees as replicated)."""
    impl = impl_cls("rows:1;cols:8", "v:rows;c:cols")
    assert impl.partition_spec(mx.TensorLayout([(0,), (0, 1)])) == jax.sharding.PartitionSpec(None, "cols")
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [V])
    xv = np.arange(8, dtype=np.float32)
    assert_close(run(mx.reduce_sum(x * 2.0), impl_cls, "all:1", "v:all", feeds={x: xv}), xv.sum() * 2)


@impls
@pytest.mark.parametrize(
    "mesh_shape,rules", [("all:8", ""), ("rows:2;cols:4", "v:cols"), ("rows:2;cols:4", "c:rows;v:cols")]
)
def test_gather_with_indices_named_like_the_table_dim_of_another_size(impl_cls, mesh_shape, rules):
    """ids over a "v" of size 4 into a table over "v" of size 8: forward and gradient (found by
    the fuzzer's long profile: the gradient's one_hot met two sizes of "v")."""
    _, mesh = new_mesh()
    w = mx.placeholder(mesh, "w", [V, C])
    ids = mx.placeholder(mesh, "ids", [mx.Dimension("v", 4)], dtype="int32")
    out = mx.gather(w, ids, V)
    (gw,) = mx.gradients(mx.reduce_sum(out * out), [w])
    wv = np.arange(16, dtype=np.float32).reshape(8, 2) + 1
    iv = np.array([7, 0, 7, 2], np.int32)
    got, got_gw = run([out, gw], impl_cls, mesh_shape, rules, feeds={w: wv, ids: iv})
    assert_close(got, wv[iv])
    assert_close(got_gw, jax.grad(lambda t: jnp.sum(t[iv] ** 2))(wv))
