"""Mesh-TensorFlow parity (issue 17): the compatibility page is generated from the code, every
function it calls "same" takes Mesh-TensorFlow's argument names in Mesh-TensorFlow's order, and
each one runs under a split layout against NumPy, called with those names as keywords."""

import importlib.util
import inspect
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import meshax as mx
from tests.conftest import B, D, H, assert_close, new_mesh, rand, run

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("mtf_compat", ROOT / "scripts" / "mtf_compat.py")
mtf_compat = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mtf_compat)
ROWS = mtf_compat.table()
SAME = {(r["module"], r["name"]) for r in ROWS if r["status"] == "same"}

LAYOUT = "b:rows;d:cols;heads:cols"  # the split every case runs under, on rows:2;cols:4
HEADS, IO, KV = mx.Dimension("heads", 4), mx.Dimension("io", 8), mx.Dimension("d_kv", 4)
L, M = mx.Dimension("length", 8), mx.Dimension("memory_length", 8)
K2, E = mx.Dimension("k", 2), mx.Dimension("e", 2)
X = rand([8, 8], 1, -2.0, 2.0)  # [b, d]
Y = rand([8, 8], 2, -2.0, 2.0)
POS = rand([8, 8], 3, 0.2, 3.0)
X3 = rand([8, 4, 8], 4)  # [b, h, d]
IDS = (np.arange(8, dtype=np.int32) * 3) % 8


def test_the_page_is_generated_from_the_code():
    page = mtf_compat.PAGE.read_text()
    assert page == mtf_compat.render(ROWS), "run python scripts/mtf_compat.py"
    assert "differs" not in {r["status"] for r in ROWS}, [r for r in ROWS if r["status"] == "differs"]
    assert len(ROWS) == 205 and len(SAME) >= 140


def test_each_same_function_takes_mesh_tensorflow_argument_names():
    for r in ROWS:
        if r["status"] != "same":
            continue
        params = inspect.signature(mtf_compat.meshax_function(r["module"], r["name"])).parameters
        exempt = mtf_compat.EXEMPT_ARGUMENTS.get(r["name"], set())
        missing = [a for a in r["args"] if a not in params and a not in exempt]
        assert not missing, f"{r['meshax']} lacks {missing}"


def test_older_argument_names_still_work():
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, D])
    assert mx.softmax(x, dim=D).shape == x.shape and mx.argmax(x, dim=D).shape == mx.Shape([B])
    assert mx.concat([x, x], dim_name="d").shape[1].size == 16
    assert len(mx.split(x, dim=D, sizes=2)) == 2 and mx.add(x=x, y=1.0).shape == x.shape
    assert mx.where(mx.less(x, 0.0), x=x, y=0.0).shape == x.shape
    assert mx.dropout(x, 0.5).shape == x.shape  # (meshax's rate second)
    assert mx.get_variable(mesh, "w", [D], mx.initializers.ones()).dtype == np.float32  # (initializer fourth)
    with pytest.raises(TypeError, match="not both"):
        mx.softmax(x, reduced_dim=D, dim=D)


class _Case:
    """A case's inputs: placeholders with unique names, and their values."""

    def __init__(self, mesh, name: str):
        self.mesh, self.name, self.feeds, self.n = mesh, name, {}, 0

    def input(self, shape, value, dtype="float32"):
        self.n += 1
        t = mx.placeholder(self.mesh, f"{self.name}/{self.n}", shape, dtype)
        self.feeds[t] = np.asarray(value)
        return t


def _fixed(value):
    """An initializer giving `value`."""
    return lambda key, shape, dtype: jnp.asarray(value, dtype).reshape(shape)


def close(want, **kw):
    return lambda got: assert_close(got, np.asarray(want, np.float32), **kw)


def equal(want):
    return lambda got: np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _softmax(a, axis, extra=None):
    m = a.max(axis, keepdims=True) if extra is None else np.maximum(a.max(axis, keepdims=True), extra)
    e = np.exp(a - m)
    s = e.sum(axis, keepdims=True) + (0 if extra is None else np.exp(extra - m))
    return e / s


# name -> builder(case) -> (tensors, check(*values)); ("layers", name) for mx.layers
UNARY = {
    "identity": (lambda a: a, X),
    "sin": (np.sin, X),
    "cos": (np.cos, X),
    "square": (np.square, X),
    "sqrt": (np.sqrt, POS),
    "rsqrt": (lambda a: 1 / np.sqrt(a), POS),
    "log": (np.log, POS),
    "exp": (np.exp, X),
    "sigmoid": (lambda a: 1 / (1 + np.exp(-a)), X),
    "tanh": (np.tanh, X),
    "negative": (np.negative, X),
    "swish": (lambda a: a / (1 + np.exp(-a)), X),
    "gelu": (lambda a: 0.5 * a * (1 + np.vectorize(math.erf)(a / math.sqrt(2))), X),
    "elu": (lambda a: np.where(a > 0, a, np.expm1(np.minimum(a, 0))), X),
    "selu": (lambda a: 1.0507009873554805 * np.where(a > 0, a, 1.6732632423543772 * np.expm1(np.minimum(a, 0))), X),
    "softplus": (lambda a: np.log1p(np.exp(a)), X),
    "reciprocal": (lambda a: 1 / a, POS),
    "relu": (lambda a: np.maximum(a, 0), X),
    "squared_relu": (lambda a: np.maximum(a, 0) ** 2, X),
    "sign": (np.sign, X),
    "mtf_abs": (np.abs, X),
    "stop_gradient": (lambda a: a, X),
    "to_float": (lambda a: a, X),
    "leaky_relu": (lambda a: np.where(a > 0, a, 0.2 * a), X),
}
BINARY = {
    "less": np.less,
    "greater": np.greater,
    "less_equal": np.less_equal,
    "greater_equal": np.greater_equal,
    "equal": np.equal,
    "not_equal": np.not_equal,
    "minimum": np.minimum,
    "maximum": np.maximum,
    "add": np.add,
    "sub": np.subtract,
    "multiply": np.multiply,
    "divide": np.divide,
    "floordiv": np.floor_divide,
    "mod": np.mod,
}


def _unary(name):
    fn, value = UNARY[name]

    def build(c):
        return [getattr(mx, name)(x=c.input([B, D], value))], close(fn(value.astype(np.float64)), atol=1e-4)

    return build


def _binary(name):
    def build(c):
        x1, x2 = c.input([B, D], X), c.input([D], Y[0])
        # output_shape orders (and broadcasts) the result: [d, b]
        out = getattr(mx, name)(x1=x1, x2=x2, output_shape=[D, B])
        want = BINARY[name](X, Y[0][None, :]).T
        return [out], (equal(want) if want.dtype == bool else close(want))

    return build


def _reduce(name, np_fn):
    def build(c):
        x = c.input([B, H, D], X3 > 0.0 if name in ("reduce_all", "reduce_any") else X3, "float32")
        outs = [getattr(mx, name)(x, output_shape=[D, B]), getattr(mx, name)(x, reduced_dim=H)]
        want = np_fn(X3 > 0.0 if name in ("reduce_all", "reduce_any") else X3, axis=1)

        def check(a, b):
            assert_close(np.asarray(a, np.float32), want.T.astype(np.float32))
            assert_close(np.asarray(b, np.float32), want.astype(np.float32))

        return outs, check

    return build


def _variable_case(c):
    v = mx.get_variable(
        c.mesh,
        "mtf/v",
        [B, D],
        dtype="float32",
        master_dtype="float32",
        activation_dtype="bfloat16",
        initializer=_fixed(X),
    )
    assert v.dtype == jnp.bfloat16
    update = mx.assign(var=v.operation.inputs[0], new_val=mx.to_float(v) * 2.0)
    assert mx.read_variable(var=v.operation.inputs[0]) is v.operation.inputs[0]
    return [v, update.inputs[1]], lambda a, b: (
        close(X, atol=2e-2)(np.asarray(a, np.float32)),
        close(2 * X, atol=4e-2)(b),
    )


def test_assign_fn_computes_each_slice_as_mesh_tensorflow_s():
    """assign(var, val, assign_fn=mtf.assign_add_slice) adds; a JAX function of one's own runs
    on each device's slices; assign_add takes no assign_fn."""
    _, mesh = new_mesh()
    v = mx.get_variable(mesh, "v", [B, D], initializer=_fixed(X))
    w = mx.get_variable(mesh, "w", [B, D], initializer=_fixed(X))
    u = mx.get_variable(mesh, "u", [B, D], initializer=_fixed(X))
    updates = [
        mx.assign(v, mx.ones_like(v), assign_fn=mx.assign_add_slice),
        mx.assign(w, mx.ones_like(w), assign_fn=mx.assign_sub_slice),
        mx.assign(u, mx.ones_like(u) * 3.0, assign_fn=lambda var, old, new: old * new),
    ]
    lowering = mx.Lowering(mesh.graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "b:rows;d:cols")})
    lowering.function([mx.reduce_sum(v)], updates=updates)({})
    close(X + 1)(lowering.variable_value(v.operation))
    close(X - 1)(lowering.variable_value(w.operation))
    close(3 * X)(lowering.variable_value(u.operation))
    with pytest.raises(mx.GraphError, match="takes no assign_fn"):
        mx.assign_add(v, 1.0, assign_fn=mx.assign_add_slice)


def _gradients_case(c):
    x = c.input([B, D], X)
    y = mx.reduce_sum(mx.square(x))
    (g,) = mx.gradients(ys=[y], xs=[x], grad_ys=None, operations=list(x.graph.operations))
    return [g], close(2 * X)


def _slicewise_case(c):
    x = c.input([B, D], X)
    y = mx.slicewise(tf_fn=lambda a: a * a * a, xs=[x], output_shape=x.shape, splittable_dims=[B, D])
    (g,) = mx.gradients(mx.reduce_sum(y), [x])  # its gradient: jax.vjp slice by slice
    custom = mx.slicewise(
        tf_fn=jnp.sin, xs=[x], splittable_dims=[B], grad_function=lambda op, dy: [dy * 10.0], name="sw"
    )
    (gc,) = mx.gradients(mx.reduce_sum(custom), [x])
    return [y, g, gc], lambda a, b, d: (close(X**3)(a), close(3 * X**2)(b), close(np.full_like(X, 10.0))(d))


def _cwise_case(c):
    x = c.input([B, D], X)
    y = mx.cwise(tf_fn=jnp.cos, xs=[x], output_dtype="float32")
    (g,) = mx.gradients(mx.reduce_sum(y), [x])
    return [y, g], lambda a, b: (close(np.cos(X))(a), close(-np.sin(X), atol=1e-4)(b))


def _custom_gradient_case(c):
    x = c.input([B, D], X)
    w = c.input([D], Y[0])

    def grad_fn(explicit_inputs, all_inputs, forward_operations, outputs, output_grads):
        assert explicit_inputs == [x] and all_inputs == [x, w] and outputs[0].shape == x.shape
        return [output_grads[0] * -1.0, mx.reduce_sum(output_grads[0] * outputs[0], reduced_dim=B)]

    y = mx.custom_gradient(fn=lambda a: a * 3.0 + w, grad_fn=grad_fn, explicit_inputs=[x])
    gx, gw = mx.gradients(mx.reduce_sum(y), [x, w])
    return [y, gx, gw], lambda a, b, d: (
        close(3 * X + Y[0])(a),
        close(-np.ones_like(X))(b),
        close((3 * X + Y[0]).sum(0))(d),
    )


def _recompute_case(c):
    x = c.input([B, D], X)
    y = mx.recompute_grad(fn=lambda a: mx.tanh(a), explicit_inputs=[x], control_dependencies=[])
    (g,) = mx.gradients(mx.reduce_sum(y), [x])
    return [y, g], lambda a, b: (close(np.tanh(X))(a), close(1 - np.tanh(X) ** 2, atol=1e-4)(b))


def _top_case(c):
    x = c.input([B, D], X)
    v, i = mx.top_k(x, reduced_dim=D, k_dim=mx.Dimension("top", 3))
    v1, i1 = mx.top_1(x, reduced_dim=D)
    order = np.argsort(-X, axis=1)
    return [
        v,
        i,
        v1,
        i1,
        mx.nth_largest_element(x, n=2, reduced_dim=D),
        mx.nth_smallest_element(x, n=0, reduced_dim=D),
    ], (
        lambda a, b, a1, b1, nl, ns: (
            close(np.take_along_axis(X, order[:, :3], 1))(a),
            equal(order[:, :3])(b),
            close(X.max(1))(a1),
            equal(X.argmax(1))(b1),
            close(-np.sort(-X, 1)[:, 2])(nl),
            close(X.min(1))(ns),
        )
    )


def _while_case(c):
    x = c.input([B, D], X)
    h, n = X, 0
    while (h * h).max() < 2500:  # the trip count the data decide: under "b:rows;d:cols" a max over devices
        h, n = h * 2, n + 1

    outs = mx.while_loop(
        cond_fn=lambda h, k: mx.less(mx.reduce_max(h * h), 2500.0),
        body_fn=lambda h, k: [h * 2.0, k + 1],
        inputs=[x, mx.zeros(c.mesh, [], dtype=np.int32)],
        num_loop_vars=None,
        has_accumulators=False,
    )
    return outs, lambda a, k: (close(h)(a), equal(n)(k))


def _softmax_case(c):
    x = c.input([B, D], X)
    outs = [
        mx.softmax(x, reduced_dim=D, extra_logit=0.5),
        mx.log_softmax(x, reduced_dim=D),
        mx.reduce_logsumexp(x, reduced_dim=D, extra_logit=1.0),
        mx.argmax(x, reduced_dim=D),
    ]
    lse = np.log(np.exp(X).sum(1) + np.exp(1.0))
    return outs, lambda a, b, d, e: (
        close(_softmax(X, 1, 0.5))(a),
        close(np.log(_softmax(X, 1)), atol=1e-4)(b),
        close(lse)(d),
        equal(X.argmax(1))(e),
    )


def _shape_case(c):
    x = c.input([B, D], X)
    x3 = c.input([B, H, D], X3)
    pieces = mx.split(x, split_dim=D, num_or_size_splits=[3, 5])
    joined = mx.concat(xs=pieces[::-1], concat_dim_name="d")
    stacked = mx.stack(xs=[x, x * 2.0], dim_name="s", axis=1)
    rows = mx.unstack(x, dim=B)
    bd = mx.Dimension("bd", 64)
    outs = [
        joined,
        stacked,
        rows[3],
        mx.reshape(x, new_shape=[bd]),
        mx.transpose(x3, new_shape=[D, B, H]),
        mx.rename_dimension(x, old_name="d", new_name="e8"),
        mx.replace_dimensions(tensor_or_shape=x, old_dim_or_dims=D, new_dim_or_dims=[K2, mx.Dimension("q", 4)]),
        mx.broadcast(x, new_shape=[B, H, D]),
        mx.mtf_slice(x, begin=2, size=3, slice_dim_name="d"),
        mx.pad(x, paddings=[1, 2], dim_name="d"),
        mx.cumsum(x, dim=D, exclusive=True),
        mx.shift(x, offset=1, dim=D, wrap=True),
        mx.anonymize(x),
    ]
    assert mx.replace_dimensions(x.shape, D, [K2, mx.Dimension("q", 4)]).to_integer_list == [8, 2, 4]
    wants = [
        np.concatenate([X[:, 3:], X[:, :3]], 1),
        np.stack([X, 2 * X], 1),
        X[3],
        X.reshape(64),
        X3.transpose(2, 0, 1),
        X,
        X.reshape(8, 2, 4),
        np.broadcast_to(X[:, None, :], (8, 4, 8)),
        X[:, 2:5],
        np.pad(X, [(0, 0), (1, 2)]),
        np.cumsum(X, 1) - X,
        np.roll(X, 1, 1),
        X,
    ]
    return outs, lambda *got: [close(w)(g) for g, w in zip(got, wants)]


def _create_case(c):
    x = c.input([B, D], X)
    outs = [
        mx.constant(c.mesh, value=2.5, shape=[B], dtype="float32"),
        mx.zeros(c.mesh, shape=[B], dtype="int32"),
        mx.ones(c.mesh, shape=[D], dtype="float32"),
        mx.zeros_like(t=x),
        mx.ones_like(t=x),
        mx.mtf_range(c.mesh, dim=D, dtype="int32"),
        mx.import_fully_replicated(c.mesh, tf_tensor=X, shape=[B, D]),
        mx.one_hot(indices=c.input([B], IDS, "int32"), output_dim=D, on_value=2.0, off_value=-1.0, dtype="float32"),
        mx.depend(x, dependencies=[]),
        mx.Print(x, data=[x], message="mtf Print"),
    ]
    # each device's slice of X on rows:2;cols:4, b over rows and d over cols, in device order
    slices = [X[r * 4 : r * 4 + 4, col * 2 : col * 2 + 2] for r in range(2) for col in range(4)]
    outs.append(mx.import_laid_out_tensor(c.mesh, mx.LaidOutTensor(slices, mx.TensorLayout([(0,), (1,)])), [B, D]))
    hot = np.where(np.eye(8)[IDS] > 0, 2.0, -1.0)
    wants = [np.full(8, 2.5), np.zeros(8, np.int32), np.ones(8), 0 * X, 1 + 0 * X, np.arange(8), X, hot, X, X, X]
    return outs, lambda *got: [close(w)(np.asarray(g, np.float32)) for g, w in zip(got, wants)]


def _indexing_case(c):
    table = c.input([D, H], X3[0].T)  # [d, h]
    ids = c.input([B], IDS, "int32")
    x = c.input([B, D], X)
    gathered = mx.gather(weights=table, indices=ids, dim=D, output_shape=[H, B])
    chosen = mx.where(condition=mx.greater(x, 0.0), if_true=x, if_false=0.0, output_shape=[D, B])
    total = mx.add_n(xs=[x, x, x])
    sample = mx.sample_with_temperature(logits=x * 100.0, dim=D, temperature=0.0)
    return [gathered, chosen, total, sample], lambda a, b, t, s: (
        close(X3[0].T[IDS].T)(a),
        close(np.where(X > 0, X, 0).T)(b),
        close(3 * X)(t),
        equal(X.argmax(1))(s),
    )


def _einsum_case(c):
    x3, w = c.input([B, H, D], X3), c.input([D, H], X3[1].T)
    return [
        mx.einsum(xs=[x3, w], output_shape=[B, H]),
        mx.matmul(a=x3, b=w, output_shape=[B], reduced_dims=[H, D]),
    ], lambda a, b: (close(np.einsum("bhd,dh->bh", X3, X3[1].T))(a), close(np.einsum("bhd,dh->b", X3, X3[1].T))(b))


def _casts_case(c):
    x = c.input([B, D], X)
    outs = [mx.cast(x, dtype="int32"), mx.to_int32(x), mx.to_bfloat16(x), mx.mtf_pow(x=mx.abs(x), y=0.5)]
    outs.append(mx.logical_not(x=mx.greater(x, 0.0)))
    return outs, lambda a, b, h, p, n: (
        equal(X.astype(np.int32))(a),
        equal(X.astype(np.int32))(b),
        close(X, atol=2e-2)(np.asarray(h, np.float32)),
        close(np.sqrt(np.abs(X)))(p),
        equal(~(X > 0))(n),
    )


def _logical_case(c):
    p, q = c.input([B, D], X > 0, "bool"), c.input([D], Y[0] > 0, "bool")
    return [mx.logical_and(x1=p, x2=q, output_shape=[B, D]), mx.logical_or(x1=p, x2=q)], lambda a, b: (
        equal((X > 0) & (Y[0] > 0))(a),
        equal((X > 0) | (Y[0] > 0))(b),
    )


def _halo_case(c):
    x = c.input([B, D], X)  # b: the blocks (split over rows), d: the block
    both = mx.halo_exchange(x, blocks_dim=B, block_size_dim=D, halo_size=2, wrap=False)
    left = mx.left_halo_exchange(x, blocks_dim=B, block_size_dim=D, halo_size=1, wrap=True)
    before = np.concatenate([np.zeros((1, 2)), X[:-1, -2:]])
    after = np.concatenate([X[1:, :2], np.zeros((1, 2))])
    return [both, left], lambda a, b: (
        close(np.concatenate([before, X, after], 1))(a),
        close(np.concatenate([np.roll(X, 1, 0)[:, -1:], X], 1))(b),
    )


def _pooling_helpers_case(c):
    x = c.input([B, D], X)
    return [
        mx.pool_tensor_1d(tensor=x, pool_dim=D, reduce_fn=mx.reduce_max, pool_size=2),
        mx.stride_tensor_1d(tensor=x, pool_dim=D, pool_size=4),
        mx.reduce_first(tensor=x, reduced_dim=D),
    ], lambda a, b, f: (close(X.reshape(8, 4, 2).max(2))(a), close(X[:, ::4])(b), close(X[:, 0])(f))


def _random_case(c):
    u = mx.random_uniform(c.mesh, shape=[B, D], minval=2.0, maxval=3.0, seed=1)
    n = mx.random_normal(c.mesh, shape=[B, D], seed=2)
    x = c.input([B, D], 1.0 + 0 * X)
    kept = mx.dropout(x, is_training=True, keep_prob=0.5, noise_shape=[B, D], seed=3)
    off = mx.dropout(x, is_training=False, rate=0.5)

    def check(a, b, k, o):
        a, k = np.asarray(a), np.asarray(k)
        assert ((a >= 2) & (a < 3)).all() and np.asarray(b).std() > 0.5
        assert set(np.unique(k)) <= {0.0, 2.0} and 0 < (k == 0).sum() < 64
        close(np.ones_like(X))(o)

    return [u, n, kept, off], check


def _layers_dense_case(c):
    x = c.input([B, D], X)
    w = rand([2, 8, 4], 5)  # [e, d, h]: a kernel per expert
    x2 = c.input([E, B, D], np.stack([X, Y]))
    y = mx.layers.dense(
        x2,
        new_dims=H,
        reduced_dims=[D],
        expert_dims=[E],
        use_bias=False,
        activation=mx.relu,
        master_dtype="float32",
        kernel_initializer=_fixed(w),
        name="mtf_dense",
    )
    k = mx.layers.get_dense_kernel_weights(x, new_dims=[H], reduced_dims=[D], kernel_initializer=_fixed(w[0]), name="k")
    rd = mx.layers.dense_relu_dense(x, hidden_channels=H, is_training=False, dropout=0.1, name="drd")
    variables = {v.name: v.value for v in x.graph.trainable_variables}
    wi, wo = variables["drd/wi/kernel"], variables["drd/wo/kernel"]
    return [y, k, rd, wi, wo], lambda a, kk, r, wiv, wov: (
        close(np.maximum(np.einsum("ebd,edh->ebh", np.stack([X, Y]), w), 0))(a),
        close(w[0])(kk),
        close(np.maximum(X @ wiv, 0) @ wov, atol=1e-4)(r),
    )


def _layers_norms_case(c):
    x = c.input([B, D], X)
    ln = mx.layers.layer_norm(x, dim=D, epsilon=1e-6, name="ln")
    bn, updates = mx.layers.batch_norm(
        x, is_training=True, momentum=0.9, epsilon=1e-9, dims_idx_start=0, dims_idx_end=1
    )
    moving = updates[0].inputs[1]
    centered = X - X.mean(1, keepdims=True)
    mean = X.mean(0)
    moving_mean0 = mx.read_variable(updates[0].inputs[0])
    return [ln, bn, moving, moving_mean0], lambda a, b, m, m0: (
        close(centered / np.sqrt((centered**2).mean(1, keepdims=True) + 1e-6), atol=1e-4)(a),
        close((X - mean) / np.sqrt(X.var(0) + 1e-9), atol=1e-4)(b),
        close(0.9 * np.asarray(m0) + 0.1 * mean)(m),
    )


def _layers_losses_case(c):
    logits, soft = c.input([B, D], X), c.input([B, D], _softmax(Y, 1))
    targets = c.input([B], IDS, "int32")
    hard = mx.layers.softmax_cross_entropy_with_logits(logits, targets=targets, vocab_dim=D, z_loss=1e-2)
    soft_loss = mx.layers.softmax_cross_entropy_with_logits(logits=logits, targets=soft, vocab_dim=D)
    sig = mx.layers.sigmoid_cross_entropy_with_logits(logits=logits, targets=soft)
    nz = mx.layers.weights_nonzero(targets=targets, dtype="float32")
    log_z = np.log(np.exp(X).sum(1))
    logp = X - log_z[:, None]
    sm = _softmax(Y, 1)
    return [hard, soft_loss, sig, nz], lambda h, s, g, n: (
        close(-logp[np.arange(8), IDS] + 1e-2 * log_z**2)(h),
        close(-(sm * logp).sum(1))(s),
        close(np.maximum(X, 0) - X * sm + np.log1p(np.exp(-np.abs(X))))(g),
        close((IDS != 0).astype(np.float32))(n),
    )


def _layers_attention_case(c):
    q_in = c.input([B, L, IO], rand([8, 8, 8], 6))
    pos = c.input([L], np.arange(8, dtype=np.int32), "int32")
    mask = mx.layers.attention_mask_autoregressive(query_pos=pos, dtype="float32")
    out = mx.layers.multihead_attention(
        q_in, memory_antecedent=None, mask=mask, kv_channels=KV, heads=HEADS, is_training=False, name="att"
    )
    variables = {v.name: v.value for v in q_in.graph.trainable_variables}
    ws = [variables[f"att/{n}"] for n in "qkvo"]
    seg = c.input([L], np.array([0, 0, 0, 1, 1, 2, 2, 2], np.int32), "int32")
    ids = c.input([B, L], np.where(np.arange(8) < 6, 1, 0)[None].repeat(8, 0).astype(np.int32), "int32")
    same = mx.layers.attention_mask_same_segment(query_segment=seg, memory_segment=None, dtype="float32")
    pad = mx.layers.attention_mask_ignore_padding(inputs=ids, dtype="float32")
    renamed = mx.layers.rename_length_to_memory_length(pos, length_name="length", memory_length_name="memory_length")
    params = mx.layers.multihead_attention_params(c.mesh, heads=HEADS, io_channels=IO, kv_channels=KV, combine=True)
    vars_ = mx.layers.multihead_attention_vars(c.mesh, HEADS, IO, KV, activation_dtype="bfloat16", name="mav")
    a_q, a_k = c.input([B, HEADS, L, KV], rand([8, 4, 8, 4], 7)), c.input([B, HEADS, M, KV], rand([8, 4, 8, 4], 8))
    dpa = mx.layers.dot_product_attention(q=a_q, k=a_k, v=a_k, mask=None, is_training=False, extra_logit=0.0)
    assert [w.shape for w in params] == [mx.Shape([HEADS, IO, KV])] * 4 and vars_[0].dtype == jnp.bfloat16

    def check(o, wq, wk, wv, wo, s, p, r, d):
        x = np.asarray(c.feeds[q_in], np.float64)
        qv, kv, vv = (np.einsum("blc,hck->bhlk", x, np.asarray(w)) for w in (wq, wk, wv))
        logits = np.einsum("bhlk,bhmk->bhlm", qv, kv) + np.where(np.arange(8)[:, None] < np.arange(8)[None], -1e9, 0)
        want = np.einsum("bhlm,bhmk,hck->blc", _softmax(logits, -1), vv, np.asarray(wo))
        close(want, atol=1e-4)(o)
        segs = c.feeds[seg]
        close(np.where(segs[:, None] != segs[None, :], -1e9, 0))(s)
        close(np.where(c.feeds[ids] == 0, -1e9, 0))(p)
        equal(np.arange(8))(r)
        aq, ak = c.feeds[a_q].astype(np.float64), c.feeds[a_k].astype(np.float64)
        close(np.einsum("bhlm,bhmk->bhlk", _softmax(np.einsum("bhlk,bhmk->bhlm", aq, ak), -1, 0.0), ak), atol=1e-4)(d)

    return [out, *ws, same, pad, renamed, dpa], check


def np_local_attention(x, wq, wk, wv, wo, window, per_split):
    """masked_local_attention_1d in NumPy: position p attends to the positions of its block up to
    itself and to the `window` before the block (zeros before the start), as Mesh-TensorFlow's."""
    block = max(window, 128)
    while per_split % block:
        block -= 1
    q, k, v = (np.einsum("blc,hck->bhlk", x, w) for w in (wq, wk, wv))
    length = x.shape[1]
    out = np.zeros_like(q)
    for p in range(length):
        start, qb = p - p % block, p % block
        keys = [start - window + j for j in range(window + block)]
        seen = [g for j, g in enumerate(keys) if qb + window - block < j <= qb + window]
        kk = np.stack([k[:, :, g] if g >= 0 else 0 * k[:, :, 0] for g in seen], 2)
        vv = np.stack([v[:, :, g] if g >= 0 else 0 * v[:, :, 0] for g in seen], 2)
        w = _softmax(np.einsum("bhk,bhmk->bhm", q[:, :, p], kk), -1)
        out[:, :, p] = np.einsum("bhm,bhmk->bhk", w, vv)
    return np.einsum("bhlk,hck->blc", out, wo)


def _local_attention(c, per_split):
    x = c.input([B, L, IO], rand([8, 8, 8], 13))
    kv = []
    out = mx.layers.masked_local_attention_1d(
        x, kv_channels=KV, heads=HEADS, is_training=False, window_size=2, length_per_split=per_split, return_kv=kv
    )
    variables = {v.name: v.value for v in x.graph.trainable_variables}
    ws = [variables[f"masked_local_attention_1d/{n}"] for n in "qkvo"]
    assert len(kv) == 2 and kv[0].shape == mx.Shape([B, HEADS, L, KV])

    def check(o, *w):
        close(np_local_attention(np.asarray(c.feeds[x], np.float64), *w, 2, per_split), atol=1e-4)(o)

    return [out, *ws], check


def _layers_local_case(c):
    tensors, check = _local_attention(c, 2)
    k = c.input([B, L, IO], rand([8, 8, 8], 14))
    block = mx.Dimension("memory_block_length", 4)
    blocks = mx.Dimension("length", 2)
    k4 = mx.reshape(k, [B, blocks, block, IO])
    hk, hv = mx.layers.local_1d_halo_exchange(k4, k4 * 2.0, num_w_blocks=blocks, w_dim=block, mask_right=True)
    pk, _ = mx.layers.local_1d_halo_exchange(k4, k4, num_w_blocks=None, w_dim=block, mask_right=False)
    bias = mx.layers.attention_bias_local_block(c.mesh, block_length=mx.Dimension("q4", 4), memory_length=block)
    compressed = mx.layers.compress_mean(c.input([B, D], X), dim=D, compression_factor=4)
    kv4 = c.feeds[k].reshape(8, 2, 4, 8)
    before = np.concatenate([np.zeros((8, 1, 4, 8)), kv4[:, :1]], 1)
    want_bias = np.concatenate([np.zeros((4, 4)), np.where(np.arange(4)[:, None] < np.arange(4)[None], -1e9, 0)], 1)

    def more(o, *rest):
        check(o, *rest[:4])
        a, b, p, bi, cm = rest[4:]
        close(np.concatenate([before, kv4], 2))(a)
        close(2 * np.concatenate([before, kv4], 2))(b)
        close(np.pad(kv4, [(0, 0), (0, 0), (4, 4), (0, 0)]))(p)
        close(want_bias)(bi)
        close(X.reshape(8, 2, 4).mean(2))(cm)

    return [*tensors, hk, hv, pk, bias, compressed], more


def _dynamic_shift_case(c):
    x = c.input([B, D], X)
    offsets = c.input([B], np.arange(8, dtype=np.int32) % 3 - 1, "int32")  # -1, 0, 1, ... per row
    rolled = mx.dynamic_shift(x, offset=offsets, dim=D, wrap=True)
    filled = mx.dynamic_shift(x, offset=offsets, dim=D, wrap=False)
    off = c.feeds[offsets]
    want_roll = np.stack([np.roll(X[b], off[b]) for b in range(8)])
    want_fill = np.stack([[X[b, i - off[b]] if 0 <= i - off[b] < 8 else 0.0 for i in range(8)] for b in range(8)])
    return [rolled, filled], lambda a, f: (close(want_roll)(a), close(want_fill)(f))


def _layers_more_case(c):
    x = c.input([B, D], X)
    gated = mx.layers.dense_product(
        x,
        reduced_dims=[D],
        new_dims=[H],
        activation_functions=["relu", "linear"],
        name="dp",
        use_bias=False,
        kernel_initializer=None,
    )
    variables = {v.name: v.value for v in x.graph.trainable_variables}
    k0, k1 = variables["dp_0/kernel"], variables["dp_1/kernel"]
    pearson = mx.layers.corr(x, dim=D)
    seq = c.input([B, L, IO], rand([8, 8, 8], 15))
    compressed = mx.layers.multihead_self_attention_memory_compressed(
        seq, mask_right=True, compression_factor=2, kv_channels=KV, heads=HEADS, name="mc"
    )
    variables = {v.name: v.value for v in x.graph.trainable_variables}
    ws = [variables[f"mc/{n}"] for n in "qkvo"]

    def check(g, a, b, p, o, wq, wk, wv, wo):
        close(np.maximum(X @ np.asarray(a), 0) * (X @ np.asarray(b)), atol=1e-4)(g)
        close(np.corrcoef(X.T), atol=1e-4)(p)
        xs = np.asarray(c.feeds[seq], np.float64)
        mem = xs.reshape(8, 4, 2, 8).mean(2)
        q = np.einsum("blc,hck->bhlk", xs, np.asarray(wq))
        k, v = (np.einsum("bmc,hck->bhmk", mem, np.asarray(w_)) for w_ in (wk, wv))
        mask = np.where(np.arange(4)[None, :] * 2 + 1 > np.arange(8)[:, None], -1e9, 0.0)
        logits = np.einsum("bhlk,bhmk->bhlm", q, k) + mask
        want = np.einsum("bhlm,bhmk,hkc->blc", _softmax(logits, -1, 0.0), v, np.asarray(wo).transpose(0, 2, 1))
        close(want, atol=1e-4)(o)

    return [gated, k0, k1, pearson, compressed, *ws], check


def _layers_clip_case(c):
    x = c.input([B, D], X)
    y = mx.layers.clip_activation_gradient(x, clip_rms_norm=0.5)
    (g,) = mx.gradients(mx.reduce_sum(y * 3.0), [x])  # upstream gradient: 3 everywhere, RMS 3
    return [y, g], lambda a, b: (close(X)(a), close(np.full_like(X, 0.5))(b))


def _incremental_case(c):
    """Decoding step by step with key/value caches equals causal attention over the whole
    sequence (the weights of the layer of the same name, shared); attention to an encoder's
    keys and values likewise."""
    x = c.input([B, L, IO], rand([8, 8, 8], 16))
    pos = mx.range(c.mesh, L, "int32")
    full = mx.layers.multihead_attention(
        x, None, mx.layers.attention_mask_autoregressive(pos), kv_channels=KV, heads=HEADS, name="inc"
    )
    k = v = mx.zeros(c.mesh, [B, HEADS, M, KV])
    steps = []
    for t, x_t in enumerate(mx.unstack(x, L)):
        y, k, v = mx.layers.multihead_self_attention_incremental(
            x_t, prev_k=k, prev_v=v, step_num=mx.constant(c.mesh, t, [], "int32"), name="inc"
        )
        steps.append(y)
    memory = c.input([B, M, IO], rand([8, 8, 8], 17))
    cross = mx.layers.multihead_attention(x, memory, None, kv_channels=KV, heads=HEADS, name="cross")
    variables = {v.name: v.value for v in x.graph.trainable_variables}
    wq, wk, wv, wo = [variables[f"cross/{n}"] for n in "qkvo"]
    mk, mv = (mx.einsum([memory, w], output_shape=[B, HEADS, M, KV]) for w in (wk, wv))
    x3 = mx.unstack(x, L)[3]
    cross3 = mx.layers.multihead_encdec_attention_incremental(x3, wq=wq, wo=wo, k=mk, v=mv, mask=None)
    assert len([n for n in variables if n.startswith("inc")]) == 4  # (shared, not made anew)

    def check(f, stacked, cr, cr3):
        close(np.asarray(f), atol=1e-5)(np.asarray(stacked).transpose(1, 0, 2))
        close(np.asarray(cr)[:, 3], atol=1e-5)(cr3)

    return [full, mx.stack(steps, "steps"), cross, cross3], check


def _np_attend(q, keys, values, visible):
    """q [b, h, k]; keys, values [b, h, m, k]; visible [m] bool: softmax attention."""
    logits = np.einsum("bhk,bhmk->bhm", q, keys) + np.where(visible, 0.0, -1e9)
    return np.einsum("bhm,bhmk->bhk", _softmax(logits, -1), values)


def _spatial_case(c):
    """1-D and 2-D attention within blocks (the previous blocks seen through halos, the own
    block causally), and a decoding step of local attention over a ring of cached positions."""
    x1 = c.input([B, E, H, IO], rand([8, 2, 4, 8], 30))  # [batch, w blocks, w, io]
    y1 = mx.layers.local_self_attention_spatial_blocks(x1, kv_channels=KV, heads=HEADS, mask_right=True, name="sb1")
    h2, w2 = mx.Dimension("h", 2), mx.Dimension("w", 2)
    x2 = c.input([B, E, K2, h2, w2, IO], rand([8, 2, 2, 2, 2, 8], 31))  # [batch, h blocks, w blocks, h, w, io]
    y2 = mx.layers.local_2d_self_attention_spatial_blocks(x2, kv_channels=KV, heads=HEADS, mask_right=True, name="sb2")
    window = mx.Dimension("window", 3)
    xs = c.input([B, L, IO], rand([8, 8, 8], 32))
    k = v = mx.zeros(c.mesh, [B, HEADS, window, KV])
    steps = []
    for t, x_t in enumerate(mx.unstack(xs, L)):
        y, k, v = mx.layers.masked_local_attention_1d_incremental(x_t, prev_k=k, prev_v=v, step_num=t, name="ring")
        steps.append(y)
    variables = {v.name: v.value for v in c.mesh.graph.trainable_variables}
    weights = [variables[f"{n}/{w}"] for n in ("sb1", "sb2", "ring") for w in "qkvo"]

    def check(a, b, ring, *w):
        q_, k_, v_, o_ = (np.asarray(t, np.float64) for t in w[:4])
        x = np.asarray(c.feeds[x1], np.float64).reshape(8, 8, 8)  # positions 0..7 (2 blocks of 4)
        q, kk, vv = (np.einsum("blc,hck->bhlk", x, t) for t in (q_, k_, v_))
        out = np.zeros_like(q)
        zero = np.zeros_like(kk[:, :, 0])
        for p in range(8):  # the previous block (zeros before the first: seen, as in Mesh-TensorFlow), own causally
            seen = [m for m in range(p - p % 4 - 4, p + 1)]
            keys = np.stack([kk[:, :, m] if m >= 0 else zero for m in seen], 2)
            vals = np.stack([vv[:, :, m] if m >= 0 else zero for m in seen], 2)
            out[:, :, p] = _np_attend(q[:, :, p], keys, vals, np.ones(len(seen), bool))
        close(np.einsum("bhlk,hck->blc", out, o_).reshape(8, 2, 4, 8), atol=1e-4)(a)
        q_, k_, v_, o_ = (np.asarray(t, np.float64) for t in w[4:8])
        img = np.asarray(c.feeds[x2], np.float64).transpose(0, 1, 3, 2, 4, 5).reshape(8, 4, 4, 8)  # [b, row, col]
        q, kk, vv = (np.einsum("brsc,hck->bhrsk", img, t) for t in (q_, k_, v_))
        out = np.zeros_like(q)
        for r in range(4):
            for col in range(4):
                br, bc = r // 2, col // 2
                seen = [  # the 2 x 2 blocks ending at the own one (zeros outside the image), own causally
                    (mr, mc)
                    for mr in range(2 * br - 2, 2 * br + 2)
                    for mc in range(2 * bc - 2, 2 * bc + 2)
                    if not (mr // 2 == br and mc // 2 == bc and (mr, mc) > (r, col))
                ]
                zero = np.zeros_like(kk[:, :, 0, 0])
                keys = np.stack([kk[:, :, mr, mc] if min(mr, mc) >= 0 else zero for mr, mc in seen], 2)
                vals = np.stack([vv[:, :, mr, mc] if min(mr, mc) >= 0 else zero for mr, mc in seen], 2)
                out[:, :, r, col] = _np_attend(q[:, :, r, col], keys, vals, np.ones(len(seen), bool))
        want = np.einsum("bhrsk,hck->brsc", out, o_).reshape(8, 2, 2, 2, 2, 8).transpose(0, 1, 3, 2, 4, 5)
        close(want, atol=1e-4)(b)
        q_, k_, v_, o_ = (np.asarray(t, np.float64) for t in w[8:])
        x = np.asarray(c.feeds[xs], np.float64)
        q, kk, vv = (np.einsum("blc,hck->bhlk", x, t) for t in (q_, k_, v_))
        for t in range(8):  # the ring holds positions t-2 .. t (zeros where none yet)
            keys = np.stack([kk[:, :, p] if p >= 0 else 0 * kk[:, :, 0] for p in range(t - 2, t + 1)], 2)
            vals = np.stack([vv[:, :, p] if p >= 0 else 0 * vv[:, :, 0] for p in range(t - 2, t + 1)], 2)
            want = np.einsum("bhk,hck->bc", _np_attend(q[:, :, t], keys, vals, np.ones(3, bool)), o_)
            close(want, atol=1e-4)(np.asarray(ring)[t])

    return [y1, y2, mx.stack(steps, "steps"), *weights], check


def _schedule_case(c):
    """annealed_dropout at step 0 of a start 0, end 10, init_rate 0.5 schedule: keep half, scaled
    by 2; us_einsum without the unit-scaling convention is einsum."""
    x = c.input([B, D], 1.0 + 0 * X)
    dropped = mx.layers.annealed_dropout(x, is_training=True, start_step=0, end_step=10, init_rate=0.5)
    same = mx.layers.annealed_dropout(x, is_training=False, start_step=0, end_step=10, init_rate=0.5)
    y = mx.layers.us_einsum([x, c.input([D], Y[0])], output_shape=[B])
    assert mx.layers.unit_scaling_convention() is False

    def check(d, s_, u):
        d = np.asarray(d)
        assert set(np.unique(d)) <= {0.0, 2.0} and 0 < (d == 0).sum() < 64
        close(np.ones_like(X))(s_)
        close(np.full(8, Y[0].sum()))(u)

    return [dropped, same, y], check


def _accumulation_case(c):
    """serialize_training_step's summed microbatch gradients and reassembled outputs equal the
    whole batch's; reversible_half_residual_and_swap's values and gradients equal its formula's."""
    x = c.input([B, D], X)
    w0 = rand([8, 4], 40)

    def model_fn(features):
        w = mx.get_variable(c.mesh, "acc/w", [D, H], initializer=_fixed(w0))
        y = mx.einsum(features["x"], w, output_shape=[features["x"].shape[0], H])
        return {"loss": mx.reduce_sum(mx.square(y)), "y": y}

    grads, outputs = mx.serialize_training_step({"x": x}, model_fn, batch_dim=B, num_splits=4)
    w = c.mesh.graph.trainable_variables[-1].value
    x1, x2 = c.input([B, D], Y), c.input([B, D], X * 0.5)
    f = lambda t: mx.tanh(t * 2.0)  # noqa: E731
    a, a_back, b, b_back = mx.layers.reversible_half_residual_and_swap(x1, None, x2, None, f, recompute_grads=True)
    ga = mx.gradients(mx.reduce_sum(b * b) + mx.reduce_sum(a), [x1, x2])

    def check(g, y, loss, wv, av, abv, bv, bbv, g1, g2):
        want_y = X @ np.asarray(wv)
        close(want_y)(y)
        close((want_y**2).sum(), atol=1e-3)(loss)
        close(2 * X.T @ want_y, atol=1e-3)(g)
        close(X * 0.5)(av)
        close(Y + np.tanh(X))(bv)
        close(0 * X)(abv)
        close(0 * X)(bbv)
        by = Y + np.tanh(X)
        close(2 * by)(g1)
        close(1 + 2 * by * 2 * (1 - np.tanh(X) ** 2), atol=1e-4)(g2)

    return [grads[-1], outputs["y"], outputs["loss"], w, a, a_back, b, b_back, *ga], check


def _separable_case(c):
    """separable_conv1d: a filter per depth channel over relative positions -1, 0, 1 (zeros
    past the ends), then a pointwise dense; under the split layout the length is whole, d split."""
    x = c.input([B, L, D], rand([8, 8, 8], 50))  # [b, length, depth d]
    taps = [rand([8], 51 + i) for i in range(3)]
    out = mx.layers.separable_conv1d(
        x,
        output_dim=H,
        min_relative_pos=-1,
        max_relative_pos=1,
        name="sep",
        use_bias=False,
        kernel_depth_weights=[c.input([D], t) for t in taps],
    )
    variables = {v.name: v.value for v in c.mesh.graph.trainable_variables}

    def check(y, pointwise):
        xs = np.asarray(c.feeds[x], np.float64)
        padded = np.pad(xs, [(0, 0), (1, 1), (0, 0)])
        depthwise = sum(padded[:, 1 + r : 9 + r] * taps[r + 1] for r in (-1, 0, 1))
        close(depthwise @ np.asarray(pointwise), atol=1e-4)(y)

    return [out, variables["sep/pointwise_dense/kernel"]], check


def _layers_embedding_case(c):
    ids = c.input([B], IDS, "int32")
    table = rand([8, 4], 9)
    emb = mx.layers.embedding(indices=ids, vocab_dim=D, output_dim=H, variable_dtype="float32", name="emb")
    weights = mx.layers.embedding_weights(
        c.mesh,
        vocab_dim=D,
        output_dim=H,
        variable_dtype="float32",
        name="emb2",
        ensemble_dim=[K2],
        initializer=_fixed(np.stack([table, table])),
    )
    variables = {v.name: v.value for v in ids.graph.trainable_variables}
    x = c.input([B, D], X)
    jitter = mx.layers.multiplicative_jitter(x, epsilon=1e-2)
    return [emb, variables["emb/table"], weights, jitter], lambda e, t, w, j: (
        close(np.asarray(t)[IDS])(e),
        close(np.stack([table, table]))(w),
        close(X, atol=0.021)(j),
    )


def _layers_conv_case(c):
    img = c.input([B, L, D], rand([8, 8, 8], 10))  # [b, length, channels d]
    out_c = mx.Dimension("o", 2)
    y1 = mx.layers.conv1d(img, output_dim=out_c, filter_size=1, stride=1)
    img2 = c.input([B, L, M, H], rand([8, 8, 8, 4], 11))
    y2 = mx.layers.conv2d(
        img2,
        output_dim=out_c,
        filter_size=(1, 1),
        strides=(1, 1),
        padding="SAME",
        filter_initializer=mx.initializers.ones(),
        variable_dtype="float32",
        name="c2",
    )
    y2t = mx.layers.conv2d_transpose(
        img2,
        output_dim=out_c,
        filter_size=(1, 1),
        strides=(1, 1),
        padding="SAME",
        filter_initializer=mx.initializers.ones(),
        name="c2t",
    )
    img3 = c.input([B, L, M, K2, H], rand([8, 8, 8, 2, 4], 12))
    y3 = mx.layers.conv3d(
        img3,
        output_dim=out_c,
        filter_size=(1, 1, 1),
        strides=(1, 1, 1),
        padding="SAME",
        filter_initializer=mx.initializers.ones(),
        name="c3",
    )
    y3t = mx.layers.conv3d_transpose(
        img3,
        output_dim=out_c,
        filter_size=(1, 1, 1),
        strides=(1, 1, 1),
        padding="SAME",
        filter_initializer=mx.initializers.ones(),
        name="c3t",
    )
    pools = [
        mx.layers.max_pool2d(img2, ksize=(2, 2)),
        mx.layers.avg_pool2d(img2, ksize=(2, 2)),
        mx.layers.max_pool3d(img3, ksize=(2, 2, 1)),
        mx.layers.avg_pool3d(img3, ksize=(2, 2, 1)),
    ]
    variables = {v.name: v.value for v in img.graph.trainable_variables}
    k1 = next(v for n, v in variables.items() if n.startswith("conv1d") and n.endswith("kernel"))
    i2, i3 = c.feeds[img2], c.feeds[img3]

    def check(a, k, b, bt, d, dt, mp2, ap2, mp3, ap3):
        close(np.einsum("blc,co->blo", c.feeds[img], np.asarray(k)[0]), atol=1e-4)(a)
        for got in (b, bt):
            close(np.repeat(i2.sum(-1, keepdims=True), 2, -1), atol=1e-4)(got)
        for got in (d, dt):
            close(np.repeat(i3.sum(-1, keepdims=True), 2, -1), atol=1e-4)(got)
        close(i2.reshape(8, 4, 2, 4, 2, 4).max((2, 4)))(mp2)
        close(i2.reshape(8, 4, 2, 4, 2, 4).mean((2, 4)))(ap2)
        close(i3.reshape(8, 4, 2, 4, 2, 2, 4).max((2, 4)))(mp3)
        close(i3.reshape(8, 4, 2, 4, 2, 2, 4).mean((2, 4)))(ap3)

    return [y1, k1, y2, y2t, y3, y3t, *pools], check


def _no_tensor_case(c):
    """The functions that build no tensor: shapes, rules, counters, variable sizes."""
    assert mx.convert_to_dimension(d=("a", 3)) == mx.Dimension("a", 3) and mx.convert_to_dimension("a:3").size == 3
    assert mx.convert_to_shape(x="a:2;b:3").to_integer_list == [2, 3]
    assert str(mx.convert_to_layout_rules(x="batch:rows")) == "batch:rows"
    assert mx.anonymous_shape(shape="a:2").dimension_names == ["_a"]
    assert mx.combined_dimension(dims=[K2, E], name="ke") == mx.Dimension("ke", 4)
    x = c.input([B, D], X)
    v = mx.get_variable(c.mesh, "sizes/v", [B, D])
    impl = mx.SimdMeshImpl("rows:2;cols:4", "b:rows;d:cols")
    text = mx.log_variable_sizes(var_list=[v.operation], tag="vars", verbose=True, mesh_to_impl={c.mesh: impl})
    assert "sizes/v" in text and "64 values, 8 per device" in text
    low = mx.Lowering(x.graph, {c.mesh: impl})
    counters = low.trace_step([mx.reduce_sum(x)])
    assert "allreduce: " in mx.pretty_print_counters(counters=counters)
    return [], lambda: None


CASES = {
    **{("ops", n): _unary(n) for n in UNARY},
    **{("ops", n): _binary(n) for n in BINARY},
    **{
        ("ops", n): _reduce(n, f)
        for n, f in [
            ("reduce_sum", np.sum),
            ("reduce_mean", np.mean),
            ("reduce_max", np.max),
            ("reduce_min", np.min),
            ("reduce_all", np.all),
            ("reduce_any", np.any),
        ]
    },
    ("ops", "get_variable"): _variable_case,
    ("ops", "gradients"): _gradients_case,
    ("ops", "slicewise"): _slicewise_case,
    ("ops", "cwise"): _cwise_case,
    ("ops", "custom_gradient"): _custom_gradient_case,
    ("ops", "recompute_grad"): _recompute_case,
    ("ops", "top_k"): _top_case,
    ("ops", "while_loop"): _while_case,
    ("ops", "softmax"): _softmax_case,
    ("ops", "split"): _shape_case,
    ("ops", "constant"): _create_case,
    ("ops", "gather"): _indexing_case,
    ("ops", "einsum"): _einsum_case,
    ("ops", "cast"): _casts_case,
    ("ops", "logical_and"): _logical_case,
    ("ops", "halo_exchange"): _halo_case,
    ("ops", "pool_tensor_1d"): _pooling_helpers_case,
    ("ops", "random_uniform"): _random_case,
    ("ops", "convert_to_shape"): _no_tensor_case,
    ("layers", "dense"): _layers_dense_case,
    ("layers", "layer_norm"): _layers_norms_case,
    ("layers", "softmax_cross_entropy_with_logits"): _layers_losses_case,
    ("layers", "multihead_attention"): _layers_attention_case,
    ("layers", "embedding"): _layers_embedding_case,
    ("layers", "conv2d"): _layers_conv_case,
    ("layers", "masked_local_attention_1d"): _layers_local_case,
    ("layers", "clip_activation_gradient"): _layers_clip_case,
    ("ops", "dynamic_shift"): _dynamic_shift_case,
    ("layers", "multihead_self_attention_incremental"): _incremental_case,
    ("layers", "local_self_attention_spatial_blocks"): _spatial_case,
    ("layers", "annealed_dropout"): _schedule_case,
    ("ops", "serialize_training_step"): _accumulation_case,
    ("layers", "separable_conv1d"): _separable_case,
    ("layers", "dense_product"): _layers_more_case,
}
# The functions each case exercises beyond the one it is filed under ("layers.x": mx.layers.x);
# the assign_fn slices run in test_assign_fn_computes_each_slice_as_mesh_tensorflow_s.
ALSO = {
    ("ops", "get_variable"): [
        "assign",
        "assign_add",
        "assign_sub",
        "read_variable",
        "to_float",
        "assign_slice",
        "assign_add_slice",
        "assign_sub_slice",
    ],
    ("ops", "top_k"): ["top_1", "nth_largest_element", "nth_smallest_element"],
    ("ops", "softmax"): ["log_softmax", "reduce_logsumexp", "argmax"],
    ("ops", "split"): [
        "concat",
        "stack",
        "unstack",
        "reshape",
        "transpose",
        "rename_dimension",
        "replace_dimensions",
        "broadcast",
        "mtf_slice",
        "pad",
        "cumsum",
        "shift",
        "anonymize",
    ],
    ("ops", "constant"): [
        "zeros",
        "ones",
        "zeros_like",
        "ones_like",
        "mtf_range",
        "import_fully_replicated",
        "one_hot",
        "depend",
        "Print",
        "import_laid_out_tensor",
    ],
    ("ops", "gather"): ["where", "add_n", "sample_with_temperature"],
    ("ops", "einsum"): ["matmul"],
    ("ops", "cast"): ["to_int32", "to_bfloat16", "mtf_pow", "logical_not"],
    ("ops", "logical_and"): ["logical_or"],
    ("ops", "halo_exchange"): ["left_halo_exchange"],
    ("ops", "pool_tensor_1d"): ["stride_tensor_1d", "reduce_first"],
    ("ops", "random_uniform"): ["random_normal", "dropout"],
    ("ops", "convert_to_shape"): [
        "convert_to_dimension",
        "convert_to_layout_rules",
        "anonymous_shape",
        "combined_dimension",
        "log_variable_sizes",
        "pretty_print_counters",
    ],
    ("layers", "dense"): ["get_dense_kernel_weights", "dense_relu_dense"],
    ("layers", "layer_norm"): ["batch_norm"],
    ("layers", "softmax_cross_entropy_with_logits"): ["sigmoid_cross_entropy_with_logits", "weights_nonzero"],
    ("layers", "multihead_attention"): [
        "attention_mask_autoregressive",
        "attention_mask_same_segment",
        "attention_mask_ignore_padding",
        "rename_length_to_memory_length",
        "multihead_attention_params",
        "multihead_attention_vars",
        "dot_product_attention",
    ],
    ("layers", "embedding"): ["embedding_weights", "multiplicative_jitter"],
    ("layers", "masked_local_attention_1d"): ["local_1d_halo_exchange", "attention_bias_local_block", "compress_mean"],
    ("layers", "dense_product"): ["corr", "multihead_self_attention_memory_compressed"],
    ("layers", "multihead_self_attention_incremental"): ["multihead_encdec_attention_incremental"],
    ("layers", "local_self_attention_spatial_blocks"): [
        "local_2d_self_attention_spatial_blocks",
        "local_2d_halo_exchange",
        "attention_bias_local_2d_block",
        "masked_local_attention_1d_incremental",
    ],
    ("layers", "annealed_dropout"): ["us_einsum", "unit_scaling_convention"],
    ("ops", "serialize_training_step"): ["layers.reversible_half_residual_and_swap"],
    ("layers", "conv2d"): [
        "conv1d",
        "conv2d_transpose",
        "conv3d",
        "conv3d_transpose",
        "max_pool2d",
        "avg_pool2d",
        "max_pool3d",
        "avg_pool3d",
    ],
}


def test_every_same_function_has_a_case():
    also = {
        ("layers", n[len("layers.") :]) if n.startswith("layers.") else (m, n)
        for (m, _), ns in ALSO.items()
        for n in ns
    }
    covered = set(CASES) | also
    assert SAME - covered == set(), "functions the page calls same that no case runs"
    assert covered - SAME == set()


def test_each_function_under_a_split_layout_against_numpy():
    _, mesh = new_mesh()
    outputs, checks, feeds, errors = [], [], {}, []
    for (module, name), build in CASES.items():
        c = _Case(mesh, f"{module}.{name}")
        try:
            tensors, check = build(c)
        except Exception as err:  # (reported with the case's name)
            errors.append(f"{module}.{name}: building raised {type(err).__name__}: {err}")
            continue
        feeds.update(c.feeds)
        checks.append((f"{module}.{name}", len(outputs), len(tensors), check))
        outputs += tensors
    assert not errors, "\n".join(errors)
    results = run(outputs, mx.SimdMeshImpl, "rows:2;cols:4", LAYOUT, feeds)
    for name, start, n, check in checks:
        try:
            check(*results[start : start + n])
        except AssertionError as err:
            errors.append(f"{name}: {err}")
    assert not errors, "\n".join(errors)


def test_local_attention_exchanges_halos_between_devices():
    """With the length split (one block of 2 per device), each block's keys and values come
    from its left neighbour's device: permutes, and the values of one device."""
    _, mesh = new_mesh()
    c = _Case(mesh, "local")
    tensors, check = _local_attention(c, 2)
    lowering = mx.Lowering(mesh.graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "length:cols;heads:rows")})
    fn = lowering.function(tensors)
    check(*fn({t.operation.name: v for t, v in c.feeds.items()}))
    assert fn.counters["permute"].count >= 2 and fn.counters["allgather"].count == 0


def test_log_scalar_is_written_with_the_training_metrics(tmp_path):
    """Mesh-TensorFlow's scalar_summary, without TensorFlow: each step's value in the JSON lines."""
    import dataclasses
    import json

    from meshax.train import MlpTask, train

    @dataclasses.dataclass
    class Logged(MlpTask):
        def build(self, mesh):
            built = super().build(mesh)
            mx.log_scalar("twice_the_loss", built.loss * 2.0)
            return built

    path = tmp_path / "metrics.jsonl"
    result = train(Logged(batch_size=16, io=8, hidden=32), "all:2", "batch:all", steps=3, metrics_path=str(path))
    steps = [e for e in map(json.loads, path.read_text().splitlines()) if "step_seconds" in e]
    assert [e["step"] for e in steps] == [1, 2, 3]
    np.testing.assert_allclose([e["twice_the_loss"] for e in steps], 2 * np.asarray(result.losses), rtol=1e-6)
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B])
    with pytest.raises(mx.GraphError, match="scalar"):
        mx.log_scalar("x", x)


def test_corr_holds_in_float16():
    """corr's epsilon (1e-20) is 0 in float16 and its sums of squares overflow past 65504: a
    constant entry's correlations were 0 / 0, NaN, and those of an entry of values in the
    hundreds 0 (its norm inf). Taken in float32, as reduce_mean sums float16, and returned in
    float16, they are float32's: np.corrcoef's, 0 for the constant entry (its own NaN in both:
    epsilon squared, 1e-40, is a float32 subnormal, which XLA flushes to 0)."""
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    x[:, 1], x[:, 2] = 3.0, x[:, 2] * 300
    got = {}
    for dtype in ("float32", "float16"):
        _, mesh = new_mesh()
        p = mx.layers.corr(
            mx.placeholder(mesh, "x", [mx.Dimension("b", 8), mx.Dimension("d", 4)], dtype), mx.Dimension("d", 4)
        )
        got[dtype] = run([p], mx.SimdMeshImpl, "all:2", "b:all", {"x": x})[0]
    assert got["float16"].dtype == np.float16
    np.testing.assert_allclose(got["float16"].astype(np.float32), got["float32"], atol=2e-3)
    with np.errstate(invalid="ignore"):  # (the constant entry's: 0 / 0)
        expected = np.nan_to_num(np.corrcoef(x.T.astype(np.float64)))
    expected[1, 1] = np.nan
    np.testing.assert_allclose(got["float32"], expected, atol=1e-5)


def test_a_bad_activation_is_named_before_the_layer_makes_its_variables():
    """dense's activation is a function, the name of a meshax op (as dense_product takes), or
    None: 'relu' was a TypeError ('str' object is not callable) after the kernel and bias were
    made, so the layer, called again fixed, was refused ('a variable named 'd/kernel' already
    exists'); an unknown name in dense_product was an AttributeError from the ops module."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", "b:4;io:3")
    hidden = mx.Dimension("hidden", 5)
    with pytest.raises(mx.GraphError, match=r"activation 'rleu' is no meshax op \(did you mean 'relu'\?\)"):
        mx.layers.dense(x, hidden, activation="rleu", name="d")
    with pytest.raises(mx.GraphError, match=r"activation 3 \(int\) is not a function"):
        mx.layers.dense(x, hidden, activation=3, name="d")
    with pytest.raises(mx.GraphError, match=r"activation 'nope' is no meshax op"):
        mx.layers.dense_product(x, "io", hidden, ["gelu", "nope"], name="p")
    assert not graph.all_variables
    y = mx.layers.dense(x, hidden, activation="relu", name="d")
    got = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:1", "")}).function(y)({"x": -np.ones([4, 3], np.float32)})
    assert [v.name for v in graph.all_variables] == ["d/kernel", "d/bias"] and got.min() >= 0 and got.max() > 0


def test_compress_mean_by_a_factor_that_does_not_divide_the_dim_is_named():
    """compress_mean by 0 was a ZeroDivisionError, by 3 of 8 a reshape's error (32 elements to
    24), naming neither the factor nor the layer."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", "b:8;c:4")
    for factor in (0, 3):
        with pytest.raises(
            mx.GraphError, match=rf"compress_mean: compression_factor {factor} does not divide Dimension\('b', 8\)"
        ):
            mx.layers.compress_mean(x, mx.Dimension("b", 8), factor)
    assert mx.layers.compress_mean(x, "b", 2).shape == mx.convert_to_shape("b:4;c:4")


def test_a_slicewise_function_whose_slices_do_not_fit_the_output_is_named():
    """A cwise function that changed a slice's shape made an output of another size, silently
    (jnp.mean over a split dim: [2, 4] out of an [8, 4] tensor on 2 devices); slicewise's was an
    error from inside shard_map, a slice of another dtype an 'internal error ... please report
    it', and a function that is none a TypeError at the first run."""

    def run(make):
        graph = mx.Graph()
        mesh = mx.Mesh(graph, "m")
        x = mx.placeholder(mesh, "x", "b:8;d:4")
        fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:2", "b:all")}).function(make(x))
        return fn({"x": np.ones([8, 4], np.float32)})

    for make, message in (
        (lambda x: mx.cwise(lambda a: a.mean(0, keepdims=True), [x]), r"a slice of shape \[1, 4\] \(float32\)"),
        (lambda x: mx.slicewise(lambda a: a.sum(0), [x]), r"a slice of shape \[4\] \(float32\), but the output"),
        (lambda x: mx.slicewise(lambda a: a.astype(jnp.int32), [x]), r"returned a slice of shape \[8, 4\] \(int32\)"),
    ):
        with pytest.raises(mx.GraphError, match=message):
            run(make)
    with pytest.raises(mx.GraphError, match=r"slicewise needs a function of the slices, got 3"):
        run(lambda x: mx.cwise(3, [x]))
    np.testing.assert_array_equal(run(lambda x: mx.slicewise(lambda a: (a * 2,), [x])), np.full([8, 4], 2.0))


def test_laid_out_slices_of_another_shape_or_a_layout_past_the_mesh_are_named():
    """import_laid_out_tensor took a slice of another shape than its device holds: a smaller one
    was broadcast into the tensor (one row given for two: the row twice), a larger one cut, both
    silently; a layout naming a mesh axis the mesh lacks was an IndexError from inside. Slices as
    the mesh holds them, padded where the split is uneven, or without the padding, are taken."""

    def run(slices, axes, shape):
        graph = mx.Graph()
        mesh = mx.Mesh(graph, "m")
        t = mx.import_laid_out_tensor(mesh, mx.LaidOutTensor(slices, mx.TensorLayout(axes)), shape)
        return mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:2", "")}).function(t)({})

    row = np.ones((1, 3), np.float32)
    for slices, message in (
        ([row, row], r"slice 0 has shape \[1, 3\], but device 0 of the mesh Shape\(\[all=2\]\) holds \[2, 3\]"),
        ([np.ones((2, 3), np.float32), np.ones((3, 3), np.float32)], r"slice 1 has shape \[3, 3\]"),
    ):
        with pytest.raises(mx.GraphError, match=message):
            run(slices, [(0,), ()], "a:4;b:3")
    with pytest.raises(mx.GraphError, match=r"names mesh axes \[3\], but the mesh Shape\(\[all=2\]\) has 1"):
        run([row, row], [(3,), ()], "a:2;b:3")
    five = np.arange(15, dtype=np.float32).reshape(5, 3)
    padded = [five[:3], np.concatenate([five[3:], np.zeros((1, 3), np.float32)])]
    for slices in (padded, [five[:3], five[3:]]):
        np.testing.assert_array_equal(run(slices, [(0,), ()], "a:5;b:3"), five)
