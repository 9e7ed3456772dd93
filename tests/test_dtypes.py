"""The dtype policy (issue 9): every public op's declared dtype is the dtype it produces, on both
backends, for float32, bfloat16, int32 and bool inputs; a dtype it cannot take is a GraphError
when the graph is built. Results follow jax.numpy's promotion, weak Python scalars included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshax as mx
from meshax.ops import __all__ as PUBLIC_OPS
from tests.conftest import IMPL_IDS, IMPLS, B, D, new_mesh, run

DTYPES = ["float32", "bfloat16", "int32", "bool"]
K = mx.Dimension("k", 2)
KK = mx.Dimension("kk", 2)

# op name -> builder(x [b, d] of the dtype under test, ids [b] int32, mesh) -> tensor(s)
BUILDERS = {
    "abs": lambda x, i, m: mx.abs(x),
    "add": lambda x, i, m: mx.add(x, x),
    "argmax": lambda x, i, m: mx.argmax(x, D),
    "assign": lambda x, i, m: mx.assign(mx.get_variable(m, "v1", x.shape, dtype=x.dtype), x).inputs[0],
    "assign_add": lambda x, i, m: mx.assign_add(mx.get_variable(m, "v2", x.shape, dtype=x.dtype), x).inputs[0],
    "assign_sub": lambda x, i, m: mx.assign_sub(mx.get_variable(m, "v3", x.shape, dtype=x.dtype), x).inputs[0],
    "broadcast": lambda x, i, m: mx.broadcast(x, [B, D, K]),
    "cast": lambda x, i, m: mx.cast(x, "float32"),
    "concat": lambda x, i, m: mx.concat([x, x], "d"),
    "constant": lambda x, i, m: mx.constant(m, 1, [B], x.dtype),
    "conv1d": lambda x, i, m: mx.conv1d(x, mx.ones(m, "fb:3;d:8;o:2", x.dtype)),
    "conv2d": lambda x, i, m: mx.conv2d(mx.broadcast(x, [K, B, D]), mx.ones(m, "fk:1;fb:3;d:8;o:2", x.dtype)),
    "conv3d": lambda x, i, m: mx.conv3d(
        mx.broadcast(x, [K, KK, B, D]), mx.ones(m, "fk:1;fkk:1;fb:3;d:8;o:2", x.dtype), 1
    ),
    "conv2d_transpose": lambda x, i, m: mx.conv2d_transpose(
        mx.broadcast(x, [K, B, D]), mx.ones(m, "fk:1;fb:2;o:2;d:8", x.dtype), (1, 2)
    ),
    "conv3d_transpose": lambda x, i, m: mx.conv3d_transpose(
        mx.broadcast(x, [K, KK, B, D]), mx.ones(m, "fk:1;fkk:1;fb:2;o:2;d:8", x.dtype), (1, 1, 2)
    ),
    "max_pool1d": lambda x, i, m: mx.max_pool1d(x, 2),
    "max_pool2d": lambda x, i, m: mx.max_pool2d(mx.broadcast(x, [K, B, D]), (2, 2)),
    "max_pool3d": lambda x, i, m: mx.max_pool3d(mx.broadcast(x, [K, KK, B, D]), (1, 2, 2)),
    "avg_pool1d": lambda x, i, m: mx.avg_pool1d(x, 2),
    "avg_pool2d": lambda x, i, m: mx.avg_pool2d(mx.broadcast(x, [K, B, D]), (2, 2)),
    "avg_pool3d": lambda x, i, m: mx.avg_pool3d(mx.broadcast(x, [K, KK, B, D]), (1, 2, 2)),
    "cos": lambda x, i, m: mx.cos(x),
    "cumsum": lambda x, i, m: mx.cumsum(x, D),
    "divide": lambda x, i, m: mx.divide(x, 3),
    "dropout": lambda x, i, m: mx.dropout(x, 0.5),
    "einsum": lambda x, i, m: mx.einsum(x, x, output_shape=[B]),
    "equal": lambda x, i, m: mx.equal(x, x),
    "erf": lambda x, i, m: mx.erf(x),
    "exp": lambda x, i, m: mx.exp(x),
    "fused_attention": lambda x, i, m: mx.fused_attention(x, *[mx.rename_dimension(x, "b", "kb")] * 2, D),
    "gather": lambda x, i, m: mx.gather(x, i, B),
    "gelu": lambda x, i, m: mx.gelu(x),
    "get_variable": lambda x, i, m: mx.get_variable(m, "v4", [D], dtype=x.dtype),
    "greater": lambda x, i, m: mx.greater(x, 0),
    "greater_equal": lambda x, i, m: mx.greater_equal(x, 0),
    "identity": lambda x, i, m: mx.identity(x),
    "import_tensor": lambda x, i, m: mx.import_tensor(m, np.ones([8], x.dtype), [B]),
    "less": lambda x, i, m: mx.less(x, 0.5),
    "less_equal": lambda x, i, m: mx.less_equal(x, 1),
    "log": lambda x, i, m: mx.log(x),
    "log_softmax": lambda x, i, m: mx.log_softmax(x, D),
    "logical_and": lambda x, i, m: mx.logical_and(x, x),
    "logical_not": lambda x, i, m: mx.logical_not(x),
    "logical_or": lambda x, i, m: mx.logical_or(x, True),
    "matmul": lambda x, i, m: mx.matmul(x, x, output_shape=[D]),
    "maximum": lambda x, i, m: mx.maximum(x, 0),
    "minimum": lambda x, i, m: mx.minimum(x, x),
    "multiply": lambda x, i, m: x * 2,
    "negative": lambda x, i, m: -x,
    "not_equal": lambda x, i, m: mx.not_equal(x, 1),
    "one_hot": lambda x, i, m: mx.one_hot(x, K, dtype="float32"),
    "ones": lambda x, i, m: mx.ones(m, [B], x.dtype),
    "ones_like": lambda x, i, m: mx.ones_like(x),
    "pad": lambda x, i, m: mx.pad(x, [1, 3], "d"),
    "placeholder": lambda x, i, m: mx.placeholder(m, "p", [B], x.dtype),
    "pow": lambda x, i, m: mx.pow(x, x),
    "random_normal": lambda x, i, m: mx.random_normal(m, [B], dtype=x.dtype),
    "random_uniform": lambda x, i, m: mx.random_uniform(m, [B], dtype=x.dtype),
    "range": lambda x, i, m: mx.range(m, B, x.dtype),
    "reciprocal": lambda x, i, m: mx.reciprocal(x),
    "reduce_all": lambda x, i, m: mx.reduce_all(x, reduced_dim=D),
    "reduce_any": lambda x, i, m: mx.reduce_any(x, reduced_dim=D),
    "reduce_logsumexp": lambda x, i, m: mx.reduce_logsumexp(x, reduced_dim=B),
    "reduce_max": lambda x, i, m: mx.reduce_max(x, reduced_dim=B),
    "reduce_mean": lambda x, i, m: mx.reduce_mean(x, output_shape=[D]),
    "reduce_min": lambda x, i, m: mx.reduce_min(x),
    "reduce_sum": lambda x, i, m: mx.reduce_sum(x, reduced_dim=D),
    "relu": lambda x, i, m: mx.relu(x),
    "rename_dimension": lambda x, i, m: mx.rename_dimension(x, "d", "e"),
    "replace_dimensions": lambda x, i, m: mx.replace_dimensions(x, D, [mx.Dimension("e", 2), mx.Dimension("f", 4)]),
    "reshape": lambda x, i, m: mx.reshape(x, [mx.Dimension("bd", 64)]),
    "rsqrt": lambda x, i, m: mx.rsqrt(x),
    "shard": lambda x, i, m: mx.shard(x, "d:cols"),
    "mesh_split": lambda x, i, m: mx.mesh_split(mx.identity(x), [mx.OPEN, "cols"]),
    "shift": lambda x, i, m: mx.shift(x, 1, B, wrap=False),
    "recompute_grad": lambda x, i, m: mx.recompute_grad(mx.identity, [x]),
    "while_loop": lambda x, i, m: tuple(
        mx.while_loop(
            lambda h, k: mx.less(k, 2),
            lambda h, k: [mx.negative(h) if h.dtype != np.bool_ else h, k + 1],
            [x, mx.zeros(m, [], dtype=np.int32)],
        )
    ),
    "cond": lambda x, i, m: mx.cond(
        mx.greater(mx.reduce_sum(i), 3), mx.identity, lambda h: mx.cast(h * 2, x.dtype), [x]
    ),
    "switch": lambda x, i, m: mx.switch(mx.reduce_sum(i), [mx.identity, mx.stop_gradient], [x]),
    "scan": lambda x, i, m: tuple(
        t
        for ts in mx.scan(lambda c, s: ([s[0]], [c[0]]), [mx.cast(mx.zeros(m, [B]), x.dtype)], [x], dim="d")
        for t in ts
    ),
    "sigmoid": lambda x, i, m: mx.sigmoid(x),
    "sign": lambda x, i, m: mx.sign(x),
    "sin": lambda x, i, m: mx.sin(x),
    "slice": lambda x, i, m: mx.slice(x, 2, 4, "b"),
    "slicewise": lambda x, i, m: mx.slicewise(lambda a: a * a, [x], splittable_dims=["b", "d"]),
    "softmax": lambda x, i, m: mx.softmax(x, B),
    "softplus": lambda x, i, m: mx.softplus(x),
    "split": lambda x, i, m: mx.split(x, D, 2)[1],
    "sqrt": lambda x, i, m: mx.sqrt(x),
    "square": lambda x, i, m: mx.square(x),
    "stack": lambda x, i, m: mx.stack([x, x], "s", 1),
    "stop_gradient": lambda x, i, m: mx.stop_gradient(x),
    "subtract": lambda x, i, m: x - 1,
    "tanh": lambda x, i, m: mx.tanh(x),
    "top_k": lambda x, i, m: mx.top_k(x, D, 3),
    "transpose": lambda x, i, m: mx.transpose(x, [D, B]),
    "unstack": lambda x, i, m: mx.unstack(x, B)[3],
    "where": lambda x, i, m: mx.where(mx.less(i, 4), x, 0),
    "zeros": lambda x, i, m: mx.zeros(m, [B], x.dtype),
    "zeros_like": lambda x, i, m: mx.zeros_like(x),
    # Mesh-TensorFlow's names (issue 17)
    "Print": lambda x, i, m: mx.Print(x, [i], "ids"),
    "add_n": lambda x, i, m: mx.add_n([x, x, x]),
    "cwise": lambda x, i, m: mx.cwise(lambda a: a, [x]),
    "custom_gradient": lambda x, i, m: mx.custom_gradient(mx.identity, lambda **kw: kw["output_grads"], [x]),
    "depend": lambda x, i, m: mx.depend(x, [i]),
    "elu": lambda x, i, m: mx.elu(x),
    "floordiv": lambda x, i, m: mx.floordiv(x, 2),
    "import_fully_replicated": lambda x, i, m: mx.import_fully_replicated(m, np.ones([8], x.dtype), [B]),
    "leaky_relu": lambda x, i, m: mx.leaky_relu(x),
    "mod": lambda x, i, m: mx.mod(x, 2),
    "mtf_abs": lambda x, i, m: mx.mtf_abs(x),
    "mtf_pow": lambda x, i, m: mx.mtf_pow(x, x),
    "mtf_range": lambda x, i, m: mx.mtf_range(m, B, x.dtype),
    "mtf_slice": lambda x, i, m: mx.mtf_slice(x, 2, 4, "b"),
    "nth_largest_element": lambda x, i, m: mx.nth_largest_element(x, 1, D),
    "nth_smallest_element": lambda x, i, m: mx.nth_smallest_element(x, 2, D),
    "reduce_first": lambda x, i, m: mx.reduce_first(x, D),
    "sample_with_temperature": lambda x, i, m: mx.sample_with_temperature(x, D, 0.5),
    "selu": lambda x, i, m: mx.selu(x),
    "squared_relu": lambda x, i, m: mx.squared_relu(x),
    "sub": lambda x, i, m: mx.sub(x, 1),
    "swish": lambda x, i, m: mx.swish(x),
    "to_bfloat16": lambda x, i, m: mx.to_bfloat16(x),
    "to_float": lambda x, i, m: mx.to_float(x),
    "to_int32": lambda x, i, m: mx.to_int32(x),
    "top_1": lambda x, i, m: mx.top_1(x, D),
    "anonymize": lambda x, i, m: mx.anonymize(x),
    "halo_exchange": lambda x, i, m: mx.halo_exchange(x, B, D, 1),
    "left_halo_exchange": lambda x, i, m: mx.left_halo_exchange(x, B, D, 2, wrap=True),
    "pool_tensor_1d": lambda x, i, m: mx.pool_tensor_1d(x, D, mx.reduce_sum, 2),
    "stride_tensor_1d": lambda x, i, m: mx.stride_tensor_1d(x, D, 4),
    "dynamic_shift": lambda x, i, m: mx.dynamic_shift(x, i, D, wrap=True),
    "import_laid_out_tensor": lambda x, i, m: mx.import_laid_out_tensor(
        m, mx.LaidOutTensor([np.ones([4], x.dtype)] * 4, mx.TensorLayout([(0,)])), [B]
    ),
    "assign_slice": lambda x, i, m: mx.assign(
        mx.get_variable(m, "v6", x.shape, dtype=x.dtype), x, assign_fn=mx.assign_slice
    ).inputs[0],
    "assign_add_slice": lambda x, i, m: mx.assign(
        mx.get_variable(m, "v7", x.shape, dtype=x.dtype), x, assign_fn=mx.assign_add_slice
    ).inputs[0],
    "assign_sub_slice": lambda x, i, m: mx.assign(
        mx.get_variable(m, "v8", x.shape, dtype=x.dtype), x, assign_fn=mx.assign_sub_slice
    ).inputs[0],
    "log_scalar": lambda x, i, m: mx.log_scalar("total", mx.reduce_sum(x)),
    "read_variable": lambda x, i, m: mx.read_variable(mx.get_variable(m, "v5", [D], dtype=x.dtype)),
}


def test_every_public_op_is_covered():
    assert sorted(BUILDERS) == sorted(PUBLIC_OPS)


def _value(dtype):
    v = np.random.default_rng(0).uniform(0.5, 3, (8, 8))
    return (v > 1.5) if dtype == "bool" else v.astype(jnp.dtype(dtype))


# every dtype on SIMD; on the placement backend (~20-40 s a dtype: in the slow run) a float and
# bool, the two ends of the promotion rules
@pytest.mark.parametrize(
    "impl_cls,dtype",
    [(IMPLS[0], d) for d in DTYPES] + [pytest.param(IMPLS[1], d, marks=pytest.mark.slow) for d in ("bfloat16", "bool")],
    ids=[f"{IMPL_IDS[0]}-{d}" for d in DTYPES] + [f"{IMPL_IDS[1]}-{d}" for d in ("bfloat16", "bool")],
)
def test_declared_dtype_is_produced_or_refused_at_build_time(impl_cls, dtype):
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, D], dtype)
    ids = mx.placeholder(mesh, "ids", [B], "int32")
    outs, refused = [], []
    for name, build in BUILDERS.items():
        try:
            made = build(x, ids, mesh)
        except mx.GraphError:
            refused.append(name)
            continue
        outs += [t for t in (made if isinstance(made, tuple) else (made,))]
    feeds = {x: _value(dtype), ids: np.arange(8, dtype=np.int32), "p": np.ones(8, dtype)}
    got = run(outs, impl_cls, "rows:2;cols:2", "b:rows;d:cols", feeds)
    wrong = [
        (t.name, str(t.dtype), str(np.asarray(g).dtype)) for t, g in zip(outs, got) if np.asarray(g).dtype != t.dtype
    ]
    assert not wrong
    logical = {"logical_and", "logical_not", "logical_or"}  # bools only
    floats_only = {"dropout", "fused_attention", "random_normal", "random_uniform"}
    expected = {
        "float32": logical | {"one_hot"},  # one_hot takes integer indices
        "bfloat16": logical | {"one_hot"},
        "int32": logical | floats_only | {"conv2d_transpose", "conv3d_transpose"},
        # bools are not numbers: no products, negation, sign, max or min (reduce_any/all are those)
        "bool": floats_only
        | {
            "einsum",
            "matmul",
            "negative",
            "one_hot",
            "reduce_max",
            "reduce_min",
            "sign",
            "nth_smallest_element",
            "top_1",
            "dynamic_shift",  # (a product with a permutation matrix)
        }
        | {f"{op}{k}d" for op in ("conv", "max_pool", "avg_pool") for k in (1, 2, 3)}
        | {"conv2d_transpose", "conv3d_transpose"},
    }
    assert sorted(refused) == sorted(expected[dtype])


def test_results_follow_jax_promotion_with_weak_scalars():
    _, mesh = new_mesh()
    f32, bf16 = mx.placeholder(mesh, "f", [B], "float32"), mx.placeholder(mesh, "h", [B], "bfloat16")
    i32, b = mx.placeholder(mesh, "i", [B], "int32"), mx.placeholder(mesh, "b", [B], "bool")
    cases = [
        (bf16 * 0.5, "bfloat16"),
        (bf16 + 2, "bfloat16"),
        (i32 + 1, "int32"),
        (i32 * 0.5, "float32"),
        (i32 + f32, "float32"),
        (bf16 + f32, "float32"),
        (bf16 + i32, "bfloat16"),
        (mx.add(b, 1), "int32"),
        (mx.add(b, True), "bool"),
        (mx.where(b, 1, 0), "int32"),
        (mx.where(b, i32, 0.5), "float32"),
        (mx.reduce_mean(i32), "float32"),
        (mx.reduce_mean(bf16), "bfloat16"),
        (mx.reduce_sum(b), "int32"),
        (mx.exp(b), "float32"),
        (mx.log_softmax(i32, B), "float32"),
        (i32 / 2, "float32"),
    ]
    assert [str(t.dtype) for t, _ in cases] == [want for _, want in cases]


def test_a_python_int_past_the_integer_dtype_it_takes_is_refused_not_wrapped():
    """A Python int beside an int32 tensor is an int32, as in JAX, which refuses one that does not
    fit (OverflowError); here it wrapped around silently: i + 2**40 was i + 0, i * 2**31 was
    i * -2**31. A constant of an integer dtype is refused so too, as NumPy refuses it (2**40 as
    int32 was 0, -1 as uint8 255)."""
    _, mesh = new_mesh()
    i32 = mx.placeholder(mesh, "i", [B], "int32")
    for make, value in (
        (lambda: i32 + 2**40, 2**40),
        (lambda: i32 * 2**31, 2**31),
        (lambda: mx.maximum(i32, -(2**33)), -(2**33)),
        (lambda: mx.constant(mesh, 2**40, [B], "int32"), 2**40),
    ):
        with pytest.raises(mx.GraphError, match=rf"constant: {value} is outside int32's -2147483648..2147483647"):
            make()
    with pytest.raises(mx.GraphError, match=r"constant: -1 is outside uint8's 0..255"):
        mx.constant(mesh, -1, [B], "uint8")
    outputs = [i32 + (2**31 - 9), mx.constant(mesh, True, [B], "int32")]
    got = run(outputs, mx.SimdMeshImpl, feeds={"i": np.arange(8, dtype=np.int32)})
    np.testing.assert_array_equal(got[0], np.arange(8) + 2**31 - 9)
    np.testing.assert_array_equal(got[1], np.ones(8))


def test_a_gradient_has_its_tensors_dtype_where_an_op_promoted_it():
    """As jax.grad: a bfloat16 tensor's gradient is bfloat16 where an op promoted it beside a
    float32 one (the conversion's transpose casts the float32 gradient back), summed over the dims
    it was broadcast over first. The elementwise ops gave it float32 (found by the fuzzer), and so
    did concat and stack."""
    _, mesh = new_mesh()
    h = mx.placeholder(mesh, "h", [B], "bfloat16")
    f = mx.placeholder(mesh, "f", [B, D], "float32")
    builders = [
        (lambda h, f: h * f, lambda h, f: h[:, None] * f),
        (lambda h, f: f / (h * h + 1), lambda h, f: f / (h * h + 1)[:, None]),
        (lambda h, f: mx.subtract(h, f), lambda h, f: h[:, None] - f),
        (lambda h, f: mx.where(mx.less(f, 0.0), h, f), lambda h, f: jnp.where(f < 0, h[:, None], f)),
        (lambda h, f: mx.pow(h * h + 1, f), lambda h, f: (h * h + 1)[:, None] ** f),
        (
            lambda h, f: mx.concat([mx.reshape(h, [B, mx.Dimension("d", 1)]), f], "d"),
            lambda h, f: jnp.concatenate([h[:, None], f], 1),
        ),
        (
            lambda h, f: mx.stack([h, mx.reduce_sum(f, reduced_dim=D)], "s", 1),
            lambda h, f: jnp.stack([h, jnp.sum(f, 1)], 1),
        ),
    ]
    rng = np.random.default_rng(0)
    hv, fv = rng.uniform(-1, 1, [8]).astype(jnp.bfloat16), rng.uniform(-1, 1, [8, 8]).astype(np.float32)
    for build, ref in builders:
        grads = mx.gradients(mx.reduce_sum(build(h, f)), [h, f])
        assert [str(g.dtype) for g in grads] == ["bfloat16", "float32"]
        got = run(grads, mx.SimdMeshImpl, layout="b:rows;d:cols", feeds={h: hv, f: fv})
        want = jax.grad(lambda a, b, ref=ref: jnp.sum(ref(a, b)), argnums=(0, 1))(jnp.asarray(hv), jnp.asarray(fv))
        for g, w in zip(got, want):
            assert g.dtype == w.dtype
            np.testing.assert_allclose(g.astype(np.float32), np.asarray(w, np.float32), rtol=2e-2, atol=2e-2)


def test_pow_and_divide_gradients_compute_in_the_dtype_the_op_did():
    """x ** y and x / y of a float32 x and a bfloat16 y compute in float32 (JAX promotes y first),
    and so must what their gradients compute from y alone: pow's gradient rounded y - 1 to
    bfloat16 (d/dx 0.4% off on the placement backend, which runs op by op; one XLA program may
    keep the excess precision, or not), divide's y * y. Found by the fuzzer."""
    _, mesh = new_mesh()
    x, y = mx.placeholder(mesh, "x", [B], "float32"), mx.placeholder(mesh, "y", [B], "bfloat16")
    xv = np.linspace(1.5, 9.0, 8).astype(np.float32)
    yv = np.array([-0.16796875, 0.3359375, 0.6640625, 2.015625, -1.171875, 0.4296875, 1.3203125, -0.5078125])
    yv = yv.astype(jnp.bfloat16)
    gx, gy = mx.gradients(mx.reduce_sum(mx.pow(x, y)), [x, y])
    got = run([gx, gy], mx.PlacementMeshImpl, layout="b:cols", feeds={x: xv, y: yv})
    want = jax.grad(lambda a, b: jnp.sum(a**b), argnums=(0, 1))(xv, jnp.asarray(yv))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(got[1].astype(np.float32), np.asarray(want[1], np.float32), rtol=2**-8)
    mx.gradients(mx.reduce_sum(x / y), [y])
    squares = [op for op in mesh.graph.operations if op.grad_of is not None and op.name.startswith("multiply")]
    assert squares and all(op.outputs[0].dtype == np.float32 for op in squares)


def test_refusals_say_what_to_do():
    _, mesh = new_mesh()
    b = mx.placeholder(mesh, "b", [B], "bool")
    with pytest.raises(mx.GraphError, match=r"bool.*cast"):
        mx.einsum(b, b, output_shape=[])
    with pytest.raises(mx.GraphError, match="reduce_any"):
        mx.reduce_max(b)
    with pytest.raises(mx.GraphError, match="negative does not take bool"):
        mx.negative(b)
    with pytest.raises(mx.GraphError, match="float"):
        mx.dropout(mx.placeholder(mesh, "i", [B], "int32"), 0.5)


@pytest.mark.parametrize("dtype", ["float", "float64", np.float64, "int64", np.dtype("uint64"), int])
def test_a_64_bit_dtype_is_refused_when_built_not_truncated_at_run_time(dtype):
    """Without JAX's 64-bit mode JAX computes 64-bit dtypes in 32 bits: refused at build time,
    not as an 'internal error' on the first run."""
    _, mesh = new_mesh()
    with pytest.raises(mx.ConfigError, match=r"needs JAX's 64-bit mode .*use a 32-bit dtype"):
        mx.placeholder(mesh, "x", [B], dtype)
    with pytest.raises(mx.ConfigError, match="64-bit mode"):
        mx.import_tensor(mesh, np.ones([8], np.float64), [B])
    with pytest.raises(mx.ConfigError, match="unknown dtype 'nonsense'"):
        mx.placeholder(mesh, "y", [B], "nonsense")


@pytest.mark.parametrize("dtype", [object, str, "U5", "datetime64[s]", np.void])
def test_a_dtype_jax_does_not_compute_in_is_refused_when_built(dtype):
    """An object, text or date dtype (a placeholder's, a variable's, an imported array's) was
    taken, and failed in JAX on the first run ('Dtype object is not a valid JAX array type')."""
    _, mesh = new_mesh()
    with pytest.raises(mx.ConfigError, match=r"is not one JAX computes in .*use a number or bool dtype"):
        mx.placeholder(mesh, "x", [B], dtype)
    with pytest.raises(mx.ConfigError, match=r"is not one JAX computes in"):
        mx.get_variable(mesh, "v", [B], dtype=dtype)
    with pytest.raises(mx.ConfigError, match=r"dtype object is not one JAX computes in"):
        mx.import_tensor(mesh, np.array([object()] * 8), [B])
    for fine in ("bfloat16", "float8_e4m3fn", "int4", bool, "uint8"):
        assert mx.zeros(mesh, [B], fine).dtype == np.dtype(fine)


def test_feeds_are_refused_where_a_name_is_unknown_or_the_cast_would_change_them():
    graph, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B])
    i = mx.placeholder(mesh, "i", [B], "int32")
    mx.placeholder(mesh, "unused", [B])
    f = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:1", "")}).function(x + mx.cast(i, "float32"))
    xs, ids = np.arange(8.0), np.arange(8)  # float64 and int64, as NumPy makes them: cast exactly
    np.testing.assert_array_equal(f({"x": xs, "i": ids, "unused": xs}), 2 * xs)  # another placeholder: ignored
    np.testing.assert_array_equal(f({"x": xs.astype(jnp.bfloat16), "i": ids}), 2 * xs)  # bf16 (kind 'V') too
    for feeds, message in [
        ({"xx": xs, "i": ids}, r"feeds name 'xx', which is no placeholder of the graph \(did you mean 'x'\?\)"),
        ({"x": xs, "i": ids + 0.5}, r"'i' is int32 .* fed float64 values"),
        ({"x": xs, "i": ids + 2**40}, r"outside int32's -2147483648..2147483647"),
        ({"x": np.array(["a"] * 8), "i": ids}, r"'x' is float32 .* fed an array of <U1"),
        ({"x": xs + 1j, "i": ids}, r"'x' is float32 .* fed complex128 values .* dropping the imaginary parts"),
    ]:
        with pytest.raises(mx.MeshaxError, match=message):
            f(feeds)
    with pytest.raises(TypeError, match=r"feeds are a dict .*, got ndarray: call it as fn\(\{'x': ..., 'i': ...\}\)"):
        f(xs)  # (an array alone: NumPy's 'truth value of an array ... is ambiguous' before)
    with pytest.raises(TypeError, match=r"Lowering takes the graph and a dict \{mesh: its implementation\}, got Simd"):
        mx.Lowering(graph, mx.SimdMeshImpl("all:1", ""))  # (before: 'object of type 'SimdMeshImpl' has no len()')
    mx.placeholder(mesh, "later", [B])  # the graph grows after the first call: its placeholders are known
    np.testing.assert_array_equal(f({"x": xs, "i": ids, "later": xs}), 2 * xs)


def test_feeds_past_a_narrower_float_range_are_refused_not_made_inf():
    """Finite values fed to a float16 placeholder past 65504 (float32 70000, int32 100000) were
    cast to inf without a word, as integers outside int32's range are refused; infs fed stay
    infs, and 65519 rounds to 65504, finite."""
    graph, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [mx.Dimension("a", 4)], "float16")
    f = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:1", "")}).function(x * 1.0)
    got = f({"x": np.array([1.0, 65519.0, np.inf, -np.inf], np.float32)})
    np.testing.assert_array_equal(got, np.array([1.0, 65504.0, np.inf, -np.inf], np.float16))
    for fed, shown in [(np.array([1, -70000, 2, 3], np.float32), "70000.0"), (np.arange(4) * 100_000, "300000")]:
        with pytest.raises(mx.MeshaxError, match=rf"'x' is float16 .* fed \w+ values up to {shown}, which are inf"):
            f({"x": fed})


def test_variable_values_past_a_narrower_float_range_are_refused_not_made_inf():
    """set_variable_value casts to the variable's dtype as a feed is cast to its placeholder's:
    float32 70000 set to a float16 variable was inf without a word, where fed it is refused (the
    same check now, its other refusals too: fractions to an integer variable). A jax.Array of another
    dtype is checked on its least and greatest finite values, never gathered to the host."""
    graph, mesh = new_mesh()
    v = mx.get_variable(mesh, "v", [mx.Dimension("a", 4)], "float16", initializer=mx.initializers.zeros())
    n = mx.get_variable(mesh, "n", [], "int32", initializer=mx.initializers.zeros(), trainable=False)
    lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:1", "")})
    too_big = [(np.array([1, -70000, 2, 3], np.float32), "70000.0"), ([1e5, 0, 0, 0], "100000.0")]
    for value, shown in [*too_big, (jnp.array([1, -70000, 2, 3], jnp.float32), "70000.0")]:  # (a jax.Array too)
        with pytest.raises(
            mx.MeshaxError, match=rf"variable 'v' is float16 .* set to \w+ values up to {shown}, which are inf"
        ):
            lowering.set_variable_value(v, value)
    with pytest.raises(mx.MeshaxError, match=r"variable 'n' is int32 .* set to float64 values \(cast them yourself"):
        lowering.set_variable_value(n, 2.5)
    lowering.set_variable_value(v, np.array([1.0, 65519.0, np.inf, -np.inf], np.float32))
    np.testing.assert_array_equal(lowering.variable_value(v), np.array([1.0, 65504.0, np.inf, -np.inf], np.float16))
    lowering.set_variable_value(n, 7)
    assert lowering.variable_value(n) == 7
