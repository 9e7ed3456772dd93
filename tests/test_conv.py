"""Convolutions and pooling (issue 11) against jax.lax, forward and gradient, under random
spatial, batch and channel splits, even and uneven; the halo each device sends; bad input."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshax as mx
from tests.conftest import IMPL_IDS, IMPLS

MESHES = ["r:2;c:4", "r:4;c:2", "r:8", "r:3;c:2"]
SPATIAL = "hwz"


def _dims(names_sizes):
    return [mx.Dimension(n, s) for n, s in names_sizes]


def _check(build, ref, feeds, shapes, mesh, rules, impl=mx.SimdMeshImpl, seed=0):
    """Build y = build(*(placeholders + 1)); compare y and the gradients of sum(y * r) with jax.
    (The + 1 makes the padding of uneven splits non-zero, as it is in any computed tensor.)"""
    rng = np.random.default_rng(seed)
    g = mx.Graph()
    m = mx.Mesh(g, "m")
    xs = [mx.placeholder(m, f"p{i}", s) for i, s in enumerate(shapes)]
    y = build(*[x + 1.0 for x in xs])
    plus_one = ref
    ref = lambda *a: plus_one(*[b + 1 for b in a])  # noqa: E731
    r = rng.normal(size=y.shape.to_integer_list).astype(np.float32)
    loss = mx.reduce_sum(y * mx.import_tensor(m, r, y.shape))
    grads = mx.gradients([loss], xs)
    low = mx.Lowering(g, {m: impl(mesh, rules)})
    got = low.function([y, *grads])({f"p{i}": v for i, v in enumerate(feeds)})
    want = [ref(*feeds), *jax.grad(lambda *a: jnp.sum(ref(*a) * r), argnums=tuple(range(len(feeds))))(*feeds)]
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4, err_msg=f"output {i} under {mesh} {rules}")
    return low


def _random_rules(rng, mesh, names):
    """Each mesh dim splits one of `names` (or nothing): spatial splits, even or not."""
    rules, taken = [], set()
    for part in mesh.split(";"):
        mname = part.split(":")[0]
        free = [n for n in names if n not in taken]
        if free and rng.random() < 0.85:
            n = free[rng.integers(len(free))]
            taken.add(n)
            rules.append(f"{n}:{mname}")
    return ";".join(rules)


@pytest.mark.parametrize("case", range(8))
def test_conv_matches_lax_under_random_splits(case):
    rng = np.random.default_rng(100 + case)
    k = [1, 2, 2, 2, 3, 2, 1, 2][case]
    sizes = [int(rng.integers(3, 12)) for _ in range(k)]
    fsize = [int(rng.integers(1, 4)) for _ in range(k)]
    strides = [int(rng.integers(1, 4)) for _ in range(k)]
    dil = [int(rng.integers(1, 3)) for _ in range(k)]
    pad = ["SAME", "VALID", [(int(rng.integers(0, 3)), int(rng.integers(0, 3))) for _ in range(k)]][case % 3]
    if pad == "VALID":
        sizes = [max(s, dl * (f - 1) + 1) for s, f, dl in zip(sizes, fsize, dil)]
    spatial = list(zip(SPATIAL[:k], sizes))
    x_shape = _dims([("b", 2), *spatial, ("i", 3)])
    f_shape = _dims([*[(f"f{n}", s) for (n, _), s in zip(spatial, fsize)], ("i", 3), ("o", 4)])
    x = np.random.default_rng(case).normal(size=[d.size for d in x_shape]).astype(np.float32)
    f = np.random.default_rng(case + 1).normal(size=[d.size for d in f_shape]).astype(np.float32)
    op = {1: mx.conv1d, 2: mx.conv2d, 3: mx.conv3d}[k]
    sp = "DHW"[-k:]
    numbers = (f"N{sp}C", f"{sp}IO", f"N{sp}C")

    def ref(a, b):
        return jax.lax.conv_general_dilated(a, b, strides, pad, rhs_dilation=dil, dimension_numbers=numbers)

    mesh = MESHES[case % len(MESHES)]
    rules = _random_rules(rng, mesh, [*SPATIAL[:k], "b", "i", "o"])
    _check(lambda a, b: op(a, b, strides, pad, dilations=dil), ref, [x, f], [x_shape, f_shape], mesh, rules)


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_conv_both_backends_uneven_spatial_split(impl):
    x_shape, f_shape = (
        _dims([("b", 2), ("h", 7), ("w", 5), ("i", 2)]),
        _dims([("fh", 3), ("fw", 3), ("i", 2), ("o", 3)]),
    )
    x = np.random.default_rng(0).normal(size=(2, 7, 5, 2)).astype(np.float32)
    f = np.random.default_rng(1).normal(size=(3, 3, 2, 3)).astype(np.float32)

    def ref(a, b):
        return jax.lax.conv_general_dilated(a, b, (2, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    _check(
        lambda a, b: mx.conv2d(a, b, [1, 2, 1, 1], "SAME"), ref, [x, f], [x_shape, f_shape], "r:4;c:2", "h:r;w:c", impl
    )


@pytest.mark.parametrize(
    "mesh, rules",
    [("r:2", "i:r"), ("r:2", "b:r"), ("r:4", "o:r"), ("r:3;c:2", "h:r;i:c"), ("r:3;c:2", "b:r;o:c")],
)
def test_conv_with_uneven_batch_and_channel_splits(mesh, rules):
    """Channels contracted and batch summed over padded dims (in the input, filter and
    gradient convolutions) must not add the padding in."""
    x_shape, f_shape = _dims([("b", 3), ("h", 5), ("i", 3)]), _dims([("fh", 3), ("i", 3), ("o", 5)])
    x = np.random.default_rng(0).normal(size=(3, 5, 3)).astype(np.float32)
    f = np.random.default_rng(1).normal(size=(3, 3, 5)).astype(np.float32)

    def ref(a, b):
        return jax.lax.conv_general_dilated(a, b, (1,), "SAME", dimension_numbers=("NHC", "HIO", "NHC"))

    _check(lambda a, b: mx.conv1d(a, b, 1, "SAME"), ref, [x, f], [x_shape, f_shape], mesh, rules)


def test_conv_transpose_with_uneven_channel_split():
    x_shape, f_shape = (
        _dims([("b", 2), ("h", 5), ("w", 3), ("i", 3)]),
        _dims([("fh", 3), ("fw", 2), ("o", 3), ("i", 3)]),
    )
    x = np.random.default_rng(0).normal(size=(2, 5, 3, 3)).astype(np.float32)
    f = np.random.default_rng(1).normal(size=(3, 2, 3, 3)).astype(np.float32)

    def ref(a, b):
        conv = lambda z: jax.lax.conv_general_dilated(  # noqa: E731
            z, b, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        return jax.linear_transpose(conv, jax.ShapeDtypeStruct((2, 10, 6, 3), jnp.float32))(a)[0]

    _check(lambda a, b: mx.conv2d_transpose(a, b, (2, 2)), ref, [x, f], [x_shape, f_shape], "r:3;s:2", "h:r;i:s")


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("case", range(3))
def test_pooling_matches_reduce_window(kind, case):
    rng = np.random.default_rng(case)
    k = [2, 1, 3][case]
    ksize = [int(rng.integers(1, 4)) for _ in range(k)]
    sizes = [int(rng.integers(f, 13)) for f in ksize]
    x_shape = _dims([("b", 2), *zip(SPATIAL[:k], sizes), ("i", 3)])
    x = rng.normal(size=[d.size for d in x_shape]).astype(np.float32)
    op = getattr(mx, f"{kind}_pool{k}d")
    dims = (1, *ksize, 1)

    def ref(a):
        if kind == "max":
            return jax.lax.reduce_window(a, -jnp.inf, jax.lax.max, dims, dims, "VALID")
        return jax.lax.reduce_window(a, 0.0, jax.lax.add, dims, dims, "VALID") / np.prod(ksize)

    mesh = MESHES[case]
    _check(lambda a: op(a, ksize), ref, [x], [x_shape], mesh, _random_rules(rng, mesh, [*SPATIAL[:k], "b", "i"]))


@pytest.mark.parametrize("k", [0, 1, 3], ids=["max_pool", "conv1x1", "conv3x3"])
def test_a_spatial_dim_split_over_two_mesh_dims_is_gathered_for_the_window(k):
    """h over rows and cols: a window's halo exchange runs over one mesh dim, so the op gathers
    h (a 2x2 pool and a 1x1 convolution, whose windows need no halo, crashed the lowering)."""
    rng = np.random.default_rng(7)
    x_shape = _dims([("b", 2), ("h", 8), ("w", 6), ("i", 3)])
    f_shape = _dims([("fh", max(k, 1)), ("fw", max(k, 1)), ("i", 3), ("o", 4)])
    feeds = [rng.normal(size=[d.size for d in s]).astype(np.float32) for s in (x_shape, f_shape)]

    def build(a, w):
        return mx.max_pool2d(a, [2, 2]) + mx.reduce_sum(w) if k == 0 else mx.conv2d(a, w)

    def ref(a, w):
        if k == 0:
            return jax.lax.reduce_window(a, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") + w.sum()
        return jax.lax.conv_general_dilated(a, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    _check(build, ref, feeds, [x_shape, f_shape], "rows:2;cols:4", "h:rows;h:cols")


def test_a_shift_by_zero_passes_its_dim_split_over_two_mesh_dims():
    """A shift by 0 is the identity: its dim passes, split over rows and cols, and nothing moves
    (the windowed dims' one-mesh-dim limit is for windows; it gathered the dim)."""
    g = mx.Graph()
    m = mx.Mesh(g, "m")
    x = mx.placeholder(m, "x", _dims([("b", 2), ("length", 8)]))
    ys = [mx.shift(x, 0, "length", wrap=w) for w in (False, True)]
    fn = mx.Lowering(g, {m: mx.SimdMeshImpl("rows:2;cols:4", "length:rows;length:cols")}).function(ys)
    v = np.arange(16, dtype=np.float32).reshape(2, 8)
    for y in fn({"x": v}):
        np.testing.assert_array_equal(y, v)
    assert not list(fn.counters.sites())


@pytest.mark.parametrize("padding", ["SAME", "VALID"])
def test_conv2d_transpose_matches_lax(padding):
    x_shape, f_shape = (
        _dims([("b", 2), ("h", 5), ("w", 3), ("i", 3)]),
        _dims([("fh", 3), ("fw", 2), ("o", 2), ("i", 3)]),
    )
    x = np.random.default_rng(0).normal(size=(2, 5, 3, 3)).astype(np.float32)
    f = np.random.default_rng(1).normal(size=(3, 2, 2, 3)).astype(np.float32)

    def ref(a, b):  # tf.nn.conv2d_transpose: the gradient of conv2d with filter [fh, fw, out, in]
        out = (2, 5 * 2, 3 * 2, 2) if padding == "SAME" else (2, 4 * 2 + 3, 2 * 2 + 2, 2)
        conv = lambda z: jax.lax.conv_general_dilated(  # noqa: E731
            z, b, (2, 2), padding, dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        return jax.linear_transpose(conv, jax.ShapeDtypeStruct(out, jnp.float32))(a)[0]

    _check(
        lambda a, b: mx.conv2d_transpose(a, b, (2, 2), padding), ref, [x, f], [x_shape, f_shape], "r:4;c:2", "h:r;w:c"
    )


def test_halo_values_each_device_sends():
    """A 3x3 SAME convolution (halo 1 on each side) of x [b=2, h=16, w=8, i=3] with h over
    rows:4 and w over cols:2: per split spatial dim and direction, each device sends
    halo x (the product of its slice's other dims): for h, 1 x (2 x 4 x 3) = 24 values per
    direction; for w, after h's exchange, 1 x (2 x (4 + 2) x 3) = 36 (the corners ride along).
    The forward pass exchanges 2 x 24 + 2 x 36 = 120 values in 4 collective permutes, exactly
    the collective permutes in the compiled HLO."""
    g = mx.Graph()
    m = mx.Mesh(g, "m")
    x = mx.placeholder(m, "x", "b:2;h:16;w:8;i:3")
    f = mx.placeholder(m, "f", "fh:3;fw:3;i:3;o:4")
    y = mx.conv2d(x, f, (1, 1), "SAME")
    low = mx.Lowering(g, {m: mx.SimdMeshImpl("rows:4;cols:2", "h:rows;w:cols")})
    c = low.trace_step([y])
    assert (c["permute"].count, c["permute"].values) == (4, 2 * 1 * 2 * 4 * 3 + 2 * 1 * 2 * 6 * 3)
    hlo = mx.hlo_collectives(low.function(y).compiled_text())
    assert hlo["permute"] == {"count": 4, "values": c["permute"].values}
    # the same layout without halo exchange would allgather h and w instead
    assert c["allgather"].count == 0


def test_an_average_pooling_gradient_moves_no_input_values():
    """avg_pool's gradient is linear in the cotangent and reads no x, so x is not laid out for
    it: x [a=2, b=4, c=2] annotated c over all:2, the rules a:all. Before, it moved x to its
    own layout (4 alltoalls of 28 values counted, 3 of 20 compiled: XLA dropped the unread one)."""
    g = mx.Graph()
    m = mx.Mesh(g, "m")
    x = mx.placeholder(m, "x", "a:2;b:4;c:2")
    y = mx.avg_pool1d(mx.shard(x, "c:all"), 2)
    (dx,) = mx.gradients(mx.reduce_sum(y * y), [x])
    fn = mx.Lowering(g, {m: mx.SimdMeshImpl("all:2", "a:all")}).function([y, dx])
    value = np.arange(16, dtype=np.float32).reshape(2, 4, 2)
    got_y, got_dx = fn({"x": value})
    want = value.reshape(2, 2, 2, 2).mean(2)
    np.testing.assert_allclose(got_y, want)
    np.testing.assert_allclose(got_dx, np.repeat(want, 2, axis=1))  # d(sum y^2)/dx = 2 y / 2
    hlo = mx.hlo_collectives(fn.compiled_text())
    assert (fn.counters["alltoall"].count, fn.counters["alltoall"].values) == (3, 20)
    assert {k: (v["count"], v["values"]) for k, v in hlo.items() if v["count"]} == {"alltoall": (3, 20)}


def test_wide_and_uneven_halos_take_several_hops():
    """A 7-tap filter over h=10 split 8 ways (slices of 2, the last ones padding) needs 3
    values from each side: two hops per side."""
    x_shape, f_shape = _dims([("b", 1), ("h", 10), ("i", 2)]), _dims([("fh", 7), ("i", 2), ("o", 2)])
    x = np.random.default_rng(0).normal(size=(1, 10, 2)).astype(np.float32)
    f = np.random.default_rng(1).normal(size=(7, 2, 2)).astype(np.float32)

    def ref(a, b):
        return jax.lax.conv_general_dilated(a, b, (1,), "SAME", dimension_numbers=("NHC", "HIO", "NHC"))

    low = _check(lambda a, b: mx.conv1d(a, b, 1, "SAME"), ref, [x, f], [x_shape, f_shape], "r:8", "h:r")
    y = next(t for op in low.graph.operations for t in op.outputs if t.operation.name.startswith("conv1d"))
    assert low.trace_step([y])["permute"].count == 4


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda x, f: mx.conv2d(x, f, (1, 1, 1), "SAME"), "strides must be 2 positive ints"),
        (lambda x, f: mx.conv2d(x, f, (0, 1), "SAME"), "strides must be 2 positive ints"),
        (lambda x, f: mx.conv2d(x, f, (1, 1), "SAME", dilations=(1, 0)), "dilations must be 2 positive ints"),
        (lambda x, f: mx.conv2d(x, f, (1, 1), "FULL"), "padding must be 'SAME', 'VALID' or 2 (lo, hi) pairs"),
        (lambda x, f: mx.conv3d(x, f, 1, "SAME"), "needs at least 4 dims"),
        (lambda x, f: mx.max_pool2d(x, (9, 1)), "the window spans 9 values of h but the padded input has 8"),
        (lambda x, f: mx.conv2d_transpose(x, mx.ones(x.mesh, "h:3;fw:3;o:2;i:3")), "filter dims ['h'] are also dims"),
        (
            lambda x, f: mx.conv2d(x, mx.ones(x.mesh, "fh:3;fw:3;j:3;o:2")),
            "input channels j=3 must be x's last dim i=3",
        ),
        (lambda x, f: mx.layers.conv2d(x, mx.Dimension("o", 4), (3, 3, 3)), "filter_size must be 2 ints"),
        (lambda x, f: mx.conv2d(x > 0.0, f), "are bool"),
    ],
)
def test_bad_input_is_a_clear_error(call, message):
    g = mx.Graph()
    m = mx.Mesh(g, "m")
    x = mx.placeholder(m, "x", "h:8;w:8;i:3")
    f = mx.placeholder(m, "f", "fh:3;fw:3;i:3;o:4")
    with pytest.raises(mx.GraphError, match=re.escape(message)):
        call(x, f)


def test_a_pool_window_error_suggests_what_pools_take():
    g = mx.Graph()
    x = mx.placeholder(mx.Mesh(g, "m"), "x", "h:4;w:4;i:3")
    with pytest.raises(mx.GraphError) as info:
        mx.avg_pool2d(x, (5, 1))
    said = str(info.value)
    assert said.startswith("avg_pool2d: the window spans 5 values of h but the padded input has 4"), said
    assert said.endswith("; use a smaller window"), said  # (a pool takes no dilation, and pads no more)


def test_an_input_and_filter_of_different_dtypes_promote():
    g = mx.Graph()
    m = mx.Mesh(g, "m")
    x = mx.placeholder(m, "x", "b:2;h:6;i:3")
    f = mx.placeholder(m, "f", "fh:3;i:3;o:2", "bfloat16")
    y = mx.conv1d(x, f, 1, "SAME")
    assert y.dtype == np.float32
    xv, fv = np.ones((2, 6, 3), np.float32), np.ones((3, 3, 2), jnp.bfloat16)
    got = mx.Lowering(g, {m: mx.SimdMeshImpl("r:4", "h:r")}).function(y)({"x": xv, "f": fv})
    assert got[0, 0, 0] == 6.0 and got[0, 1, 0] == 9.0


def test_a_filter_larger_than_the_padded_input_is_refused():
    g = mx.Graph()
    m = mx.Mesh(g, "m")
    x = mx.placeholder(m, "x", "h:4;w:4;i:3")
    f = mx.placeholder(m, "f", "fh:5;fw:3;i:3;o:4")
    with pytest.raises(mx.GraphError, match="the window spans 5 values of h but the padded input has 4"):
        mx.conv2d(x, f, (1, 1), "VALID")


@pytest.mark.parametrize("layer", ["conv1d", "conv2d", "conv3d", "conv2d_transpose", "conv3d_transpose"])
def test_conv_layers_take_variable_dtype_none_as_mesh_tensorflow_s_default(layer):
    """variable_dtype=None (Mesh-TensorFlow's default: a float32 kernel read in x's dtype) was
    given to get_variable as a dtype, np.dtype(None) = float64: 'dtype float64 needs JAX's
    64-bit mode'. The kernel is float32, used in x's dtype (float16 here)."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    k = int(layer[4])
    x = mx.placeholder(mesh, "x", _dims([("b", 2), *zip(SPATIAL[:k], [4] * k), ("ch", 3)]), dtype="float16")
    y = getattr(mx.layers, layer)(x, mx.Dimension("o", 4), variable_dtype=None)
    assert y.dtype == np.float16
    assert {str(v.value.dtype) for v in graph.trainable_variables} == {"float32"}
