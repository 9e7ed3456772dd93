"""one_hot, gather and top_k vs NumPy.

All cases run as one program per (impl, layout), see `check_cases`."""

import numpy as np

import meshax as mx
from tests.conftest import LAYOUTS, B, D, H, check_cases, impls_and_layouts, names, rand, randint

K = mx.Dimension("k", 4)
# the canonical layouts on both impls, plus (SIMD only) one more layout
layouts = impls_and_layouts(LAYOUTS, simd_extra=["h:cols;b:rows"])


def np_one_hot(idx, n, on=1.0, off=0.0, dtype=np.float32):
    return np.where(idx[..., None] == np.arange(n), on, off).astype(dtype)


# ------------------------------------------------------------------- one_hot


def _one_hot(mesh):
    i1 = mx.placeholder(mesh, "i1", [B], dtype="int32")
    i2 = mx.placeholder(mesh, "i2", [B, H], dtype="int32")
    i3 = mx.placeholder(mesh, "i3", [B], dtype="int32")
    o1 = mx.one_hot(i1, D)
    o2 = mx.one_hot(i2, D, on_value=2.0, off_value=-1.0)
    o3 = mx.one_hot(i3, H, dtype="int32")
    assert names(o1) == ["b", "d"]
    assert names(o2) == ["b", "h", "d"]
    assert names(o3) == ["b", "h"]
    assert o1.dtype == np.float32
    assert o3.dtype == np.int32
    v1 = randint([8], 8, seed=70)
    v2 = randint([8, 4], 8, seed=71)
    v3 = randint([8], 4, seed=72)
    pairs = [(o1, np_one_hot(v1, 8)), (o2, np_one_hot(v2, 8, 2.0, -1.0)), (o3, np_one_hot(v3, 4, dtype=np.int32))]
    return pairs, {i1: v1, i2: v2, i3: v3}


# -------------------------------------------------------------------- gather


def np_gather(weights, w_names, indices, idx_names, dim_name):
    """np.take, then transpose to indices dims followed by the other weight dims."""
    axis = w_names.index(dim_name)
    taken = np.take(weights, indices, axis=axis)
    # np.take layout: w[:axis] + idx dims + w[axis+1:]
    n_idx = len(idx_names)
    lead = list(range(axis))
    idx_axes = list(range(axis, axis + n_idx))
    trail = list(range(axis + n_idx, taken.ndim))
    return np.transpose(taken, idx_axes + lead + trail)


GATHERS = {
    # name: (weights dims, indices dims, gathered dim name)
    "w[h,d]-i[b]-h": ([H, D], [B], "h"),
    "w[d,h]-i[b]-d": ([D, H], [B], "d"),
    "w[b,h]-i[d]-b": ([B, H], [D], "b"),
    "w[h,d,k]-i[b]-d": ([H, D, K], [B], "d"),
    "w[d,k]-i[b,h]-d": ([D, K], [B, H], "d"),
}


def _gather_case(name, seed):
    w_dims, i_dims, dim_name = GATHERS[name]

    def build(mesh):
        w = mx.placeholder(mesh, "w", w_dims)
        i = mx.placeholder(mesh, "i", i_dims, dtype="int32")
        dim = next(d for d in w_dims if d.name == dim_name)
        y = mx.gather(w, i, dim)
        w_names = [d.name for d in w_dims]
        i_names = [d.name for d in i_dims]
        assert names(y) == i_names + [n for n in w_names if n != dim_name]
        wv = rand([d.size for d in w_dims], seed=seed)
        iv = randint([d.size for d in i_dims], dim.size, seed=seed + 1)
        return [(y, np_gather(wv, w_names, iv, i_names, dim_name))], {w: wv, i: iv}

    return build


def test_np_gather_reference():
    w = np.arange(24).reshape(2, 3, 4)
    idx = np.array([[2, 0]])
    g = np_gather(w, ["a", "c", "e"], idx, ["i", "j"], "c")
    assert g.shape == (1, 2, 2, 4)
    np.testing.assert_array_equal(g[0, 0], w[:, 2, :])
    np.testing.assert_array_equal(g[0, 1], w[:, 0, :])


# --------------------------------------------------------------------- top_k


def np_top_k(v, axis, k):
    order = np.argsort(-v, axis=axis, kind="stable")
    idx = np.take(order, np.arange(k), axis=axis)
    return np.take_along_axis(v, idx, axis=axis), idx.astype(np.int32)


def _top_k_case(dim, axis, k):
    def build(mesh):
        x = mx.placeholder(mesh, "x", [B, H, D])
        values, indices = mx.top_k(x, dim, k)
        expected_names = ["b", "h", "d"]
        expected_names[axis] = dim.name + "_topk"
        assert names(values) == expected_names
        assert names(indices) == expected_names
        assert values.shape.get_dim_by_name(dim.name + "_topk").size == k
        assert indices.dtype == np.int32
        xv = rand([8, 4, 8], seed=75)  # distinct values, no ties
        wv, wi = np_top_k(xv, axis, k)
        return [(values, wv), (indices, wi)], {x: xv}

    return build


INDEX_CASES = {"one_hot": _one_hot}
INDEX_CASES.update({"gather " + name: _gather_case(name, 73 + 2 * i) for i, name in enumerate(GATHERS)})
INDEX_CASES.update(
    {
        f"top_k {dim.name} k={k}": _top_k_case(dim, axis, k)
        for dim, axis, k in [(D, 2, 3), (B, 0, 2), (H, 1, 4), (D, 2, 1)]
    }
)


@layouts
def test_indexing(layout, impl_cls):
    check_cases(INDEX_CASES, impl_cls, layout)


def test_gather_gradient_is_a_scatter_add_not_a_one_hot_product():
    """The table's gradient adds each looked-up row's gradient at its index (JAX's transpose of
    gather): no [indices, table rows] one-hot and no matmul, also with the table split."""
    vocab, d, n = mx.Dimension("vocab", 16), mx.Dimension("d", 8), mx.Dimension("n", 8)
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    table = mx.placeholder(mesh, "table", [vocab, d])
    ids = mx.placeholder(mesh, "ids", [n], "int32")
    w = mx.placeholder(mesh, "w", [n, d])
    (grad,) = mx.gradients(mx.reduce_sum(mx.gather(table, ids, vocab) * w), [table])
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "vocab:cols;n:rows")}).function(grad)
    ids_v = np.array([3, 3, 0, 15, 7, 8, 3, 12], np.int32)
    w_v = rand([8, 8], 1)
    want = np.zeros((16, 8), np.float32)
    np.add.at(want, ids_v, w_v)
    feeds = {table: rand([16, 8], 2), ids: ids_v, w: w_v}
    np.testing.assert_allclose(fn(feeds), want, rtol=1e-6)
    text = fn.compiled_text()
    # XLA:CPU runs the scatter-add natively, or (with its fusion emitters off, as in this suite)
    # as a loop of dynamic-update-slices named after it
    assert "scatter" in text and " dot(" not in text
    assert sum(fn.counters.flops.values()) < 2 * 8 * 8  # the adds (and the product with w), per device
