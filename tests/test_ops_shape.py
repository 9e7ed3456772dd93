"""reshape, rename_dimension, replace_dimensions, transpose, broadcast,
tensor creation (import_tensor, constant, zeros, ones, range) and the
Lowering/function interface, vs NumPy."""

import jax
import numpy as np
import pytest

import meshax as mx
from tests.conftest import LAYOUTS, B, D, H, assert_close, check_cases, lower, names, new_mesh, rand

layouts = pytest.mark.parametrize("layout", LAYOUTS, ids=lambda s: s or "replicated")

XV = rand([8, 4, 8], seed=50)


def Dim(name, size):
    return mx.Dimension(name, size)


# name -> (builder(x[b,h,d]) -> tensor, expected names, numpy fn of XV)
CASES = {
    "reshape-merge": (lambda x: mx.reshape(x, [B, Dim("hd", 32)]), ["b", "hd"], lambda v: v.reshape(8, 32)),
    "reshape-split": (
        lambda x: mx.reshape(x, [Dim("b1", 2), Dim("b2", 4), H, D]),
        ["b1", "b2", "h", "d"],
        lambda v: v.reshape(2, 4, 4, 8),
    ),
    "reshape-flat": (lambda x: mx.reshape(x, [Dim("n", 256)]), ["n"], lambda v: v.reshape(256)),
    "reshape-same-names-reordered": (lambda x: mx.reshape(x, [B, D, H]), ["b", "d", "h"], lambda v: v.reshape(8, 8, 4)),
    "reshape-leading-h": (lambda x: mx.reshape(x, [H, B, D]), ["h", "b", "d"], lambda v: v.reshape(4, 8, 8)),
    "reshape-resize-split-dim": (
        lambda x: mx.reshape(x, [Dim("e", 16), Dim("d", 16)]),
        ["e", "d"],
        lambda v: v.reshape(16, 16),
    ),
    "reshape-string-shape": (lambda x: mx.reshape(x, "b:8;m:2;n:16"), ["b", "m", "n"], lambda v: v.reshape(8, 2, 16)),
    "rename": (lambda x: mx.rename_dimension(x, "h", "k"), ["b", "k", "d"], lambda v: v),
    "rename-split-dim": (lambda x: mx.rename_dimension(x, "b", "bb"), ["bb", "h", "d"], lambda v: v),
    "replace-one": (lambda x: mx.replace_dimensions(x, H, Dim("k", 4)), ["b", "k", "d"], lambda v: v),
    "replace-two-by-one": (
        lambda x: mx.replace_dimensions(x, [H, D], [Dim("hd", 32)]),
        ["b", "hd"],
        lambda v: v.reshape(8, 32),
    ),
    "replace-one-by-two": (
        lambda x: mx.replace_dimensions(x, D, [Dim("d1", 2), Dim("d2", 4)]),
        ["b", "h", "d1", "d2"],
        lambda v: v.reshape(8, 4, 2, 4),
    ),
    "transpose-dbh": (lambda x: mx.transpose(x, [D, B, H]), ["d", "b", "h"], lambda v: v.transpose(2, 0, 1)),
    "transpose-hdb": (lambda x: mx.transpose(x, [H, D, B]), ["h", "d", "b"], lambda v: v.transpose(1, 2, 0)),
    "transpose-identity": (lambda x: mx.transpose(x, [B, H, D]), ["b", "h", "d"], lambda v: v),
    # (names alone are x's dims: a name list failed, "cannot make a Dimension from 'd'")
    "transpose-names": (lambda x: mx.transpose(x, ["d", "b", "h"]), ["d", "b", "h"], lambda v: v.transpose(2, 0, 1)),
    "transpose-names-text": (lambda x: mx.transpose(x, "h;d;b"), ["h", "d", "b"], lambda v: v.transpose(1, 2, 0)),
    "reshape-names-and-sizes-text": (lambda x: mx.reshape(x, "b;hd : 32"), ["b", "hd"], lambda v: v.reshape(8, 32)),
    "reshape-names-and-dims": (
        lambda x: mx.reshape(x, ["b", Dim("hd", 32)]),
        ["b", "hd"],
        lambda v: v.reshape(8, 32),
    ),
    "broadcast-names-and-dims": (
        lambda x: mx.broadcast(x, ["b", Dim("k", 2), "h", "d"]),
        ["b", "k", "h", "d"],
        lambda v: np.broadcast_to(v[:, None], (8, 2, 4, 8)),
    ),
}


def _shape_case(name):
    build_fn, out_names, np_fn = CASES[name]

    def build(mesh):
        x = mx.placeholder(mesh, "x", [B, H, D])
        y = build_fn(x)
        assert names(y) == out_names
        assert y.dtype == np.float32
        return [(y, np_fn(XV))], {x: XV}

    return build


def _reshape_then_compute(mesh):
    """A reshaped tensor feeds further ops that depend on the new layout."""
    x = mx.placeholder(mesh, "x", [B, H, D])
    r = mx.reshape(x, [Dim("e", 16), Dim("d", 16)])
    y = mx.reduce_sum(r * 2.0, reduced_dim=Dim("e", 16))
    return [(y, (XV.reshape(16, 16).astype(np.float64) * 2.0).sum(axis=0))], {x: XV}


BCAST = {
    "bd->bhd": ([B, D], [B, H, D], lambda v: np.broadcast_to(v[:, None, :], (8, 4, 8))),
    "d->bd": ([D], [B, D], lambda v: np.broadcast_to(v[None, :], (8, 8))),
    "bd->dhb": ([B, D], [D, H, B], lambda v: np.broadcast_to(v.T[:, None, :], (8, 4, 8))),
    "h->hbd": ([H], [H, B, D], lambda v: np.broadcast_to(v[:, None, None], (4, 8, 8))),
    "scalar->bd": ([], [B, D], lambda v: np.broadcast_to(v, (8, 8))),
}


def _bcast_case(name, seed):
    in_dims, out_dims, np_fn = BCAST[name]

    def build(mesh):
        x = mx.placeholder(mesh, "x", in_dims)
        y = mx.broadcast(x, out_dims)
        assert names(y) == [d.name for d in out_dims]
        xv = rand([d.size for d in in_dims], seed=seed)
        return [(y, np_fn(xv))], {x: xv}

    return build


SHAPE_CASES = {name: _shape_case(name) for name in CASES}
SHAPE_CASES["reshape-then-compute"] = _reshape_then_compute
SHAPE_CASES.update({"broadcast " + name: _bcast_case(name, 51 + i) for i, name in enumerate(BCAST)})


@layouts
def test_shape_ops(layout, impl_cls):
    check_cases(SHAPE_CASES, impl_cls, layout)


# ------------------------------------------------------------------ creation


def _import_tensor(mesh):
    x = mx.import_tensor(mesh, XV, [B, H, D], name="imported")
    assert names(x) == ["b", "h", "d"]
    assert x.dtype == np.float32
    return [(x, XV), (x * 3.0, XV * 3.0)], {}


def _constants(mesh):
    c = mx.constant(mesh, 2.5, [B, D])
    ci = mx.constant(mesh, 7, [B], dtype="int32")
    ca = mx.constant(mesh, XV[:, 0, :], [B, D])
    z = mx.zeros(mesh, [B, H])
    zi = mx.zeros(mesh, [D], "int32")
    o = mx.ones(mesh, [H, D], "float32")
    assert ci.dtype == np.int32 and zi.dtype == np.int32 and o.dtype == np.float32
    return [
        (c, np.full((8, 8), 2.5, np.float32)),
        (ci, np.full((8,), 7, np.int32)),
        (ca, XV[:, 0, :]),
        (z, np.zeros((8, 4), np.float32)),
        (zi, np.zeros((8,), np.int32)),
        (o, np.ones((4, 8), np.float32)),
    ], {}


def _range(mesh):
    r = mx.range(mesh, B)
    rf = mx.range(mesh, D, dtype="float32")
    assert names(r) == ["b"]
    assert r.dtype == np.int32
    outer = mx.cast(r, "float32") * 10.0 + rf  # [b, d]
    return [
        (r, np.arange(8, dtype=np.int32)),
        (rf, np.arange(8, dtype=np.float32)),
        (outer, np.arange(8)[:, None] * 10.0 + np.arange(8)[None, :]),
    ], {}


@layouts
def test_creation(layout, impl_cls):
    check_cases({"import_tensor": _import_tensor, "constant/zeros/ones": _constants, "range": _range}, impl_cls, layout)


# ------------------------------------------------------ lowering / function API


def test_tensor_attributes():
    _graph, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, D])
    assert x.shape == mx.Shape([B, D])
    assert x.dtype == np.float32
    assert x.mesh is mesh
    assert isinstance(x.name, str)
    assert mx.placeholder(mesh, "i", [B], dtype="int32").dtype == np.int32
    assert mx.placeholder(mesh, "s", "b:8;d:8").shape == mx.Shape([B, D])


def test_feeds_by_name_and_single_vs_list(impl_cls):
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "xin", [B, D])
    y = x + 1.0
    xv = rand([8, 8], seed=52)
    _, fn = lower(y, impl_cls, layout="b:rows;d:cols")
    out = fn({"xin": xv})
    assert isinstance(out, np.ndarray)
    assert_close(out, xv + 1.0)
    _, fn2 = lower([y], impl_cls, layout="b:rows;d:cols")
    out2 = fn2({x: xv})
    assert isinstance(out2, list) and len(out2) == 1
    assert_close(out2[0], xv + 1.0)
    # a function can be called again with other feeds
    assert_close(fn({x: 2 * xv}), 2 * xv + 1.0)


def test_two_functions_share_a_lowering(impl_cls):
    graph, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, D])
    y = mx.exp(x)
    z = mx.reduce_sum(x, reduced_dim=B)
    lowering = mx.Lowering(graph, {mesh: impl_cls("rows:2;cols:4", "b:rows")})
    xv = rand([8, 8], seed=53)
    assert_close(lowering.function(y)({x: xv}), np.exp(xv))
    assert_close(lowering.function(z)({x: xv}), xv.sum(axis=0))


@pytest.mark.parametrize("mesh_shape,layout,moves", [("rows:2;cols:4", "h:cols", 0), ("all:8", "h:all", None)])
def test_reshape_keeps_a_merged_dims_split_on_its_major_part(mesh_shape, layout, moves):
    """[b, h, d] -> [b, (h d)] -> [b, h, d]: h and the merged hd are one compound factor, so h
    split over cols propagates to hd and stays split with no communication; where the split does not divide h
    (8 devices, 4 heads: padded) the reshape gathers instead, and the values are right either way."""
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, H, D])
    y = mx.reshape(x, [B, Dim("hd", 32)])
    z = mx.reshape(y * 2.0, [B, H, D])
    low, fn = lower((y, z), mx.SimdMeshImpl, mesh_shape, layout)
    got_y, got_z = fn({x: XV})
    assert_close(got_y, XV.reshape(8, 32))
    assert_close(got_z, XV * 2.0)
    if moves is not None:
        assert low.layout_of(y) == "hd:cols"
        assert sum(fn.counters[k].count for k in ("allgather", "alltoall", "allreduce")) == moves


@pytest.mark.parametrize("impl_cls", [mx.SimdMeshImpl, mx.PlacementMeshImpl], ids=["simd", "placement"])
def test_reshape_dropping_a_size_one_dim_keeps_the_others_split(impl_cls):
    """[a=1, n1=1] -> [a=1] with a split over all:2 (padded: device 1 holds no value of a): both
    dims of size 1 line up with the result's a, and both were paired with it, so a's split was a
    factor of no result and the reshape read each device's slice as the whole a; the pad then
    took device 1's padding ([0, 0, 0, 0], not [0, 0, 0, 10]). The fuzzer found it as a lost
    gradient (a slice of a split dim, stacked: stack reshapes in a dim of size 1)."""
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", "a:1;n1:1")
    y = mx.pad(mx.reshape(x * 2.0, "a:1"), [3, 0], "a")
    got = mx.Lowering(mesh.graph, {mesh: impl_cls("all:2", "a:all")}).function(y)({"x": np.full([1, 1], 5, np.float32)})
    np.testing.assert_array_equal(got, [0, 0, 0, 10])


def test_call_global_takes_and_returns_global_arrays(impl_cls):
    """LoweredFunction.call_global: jax.Arrays in (any sharding; moved to the plan's), logical
    jax.Arrays out, also where the layout pads (d:6 over 4 devices); an output fed back as it
    came out is taken as it is."""
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", "b:8;d:6")
    y = mx.reduce_sum(x * 2.0, output_shape="d:6")
    fn = mx.Lowering(mesh.graph, {mesh: impl_cls("rows:2;cols:4", "b:rows;d:cols")}).function([y, x * 1.0])
    a = np.arange(48.0, dtype=np.float32).reshape(8, 6)
    got_y, got_x = fn.call_global({x: jax.numpy.asarray(a)})
    assert isinstance(got_y, jax.Array) and got_x.shape == (8, 6)
    assert_close(got_y, (a * 2.0).sum(0))
    assert_close(fn.call_global({x: got_x})[0], (a * 2.0).sum(0))
    # a host array of another shape: it failed inside JAX (a TypeError naming the padded shape
    # [8, 8]) or NumPy (an AxisError, of a scalar)
    for wrong, shape in ((np.ones((4, 6), np.float32), r"\[4, 6\]"), (3.0, r"\[\]")):
        with pytest.raises(ValueError, match=r"placeholder 'x' expects shape \[8, 6\], got " + shape):
            fn.call_global({x: wrong})


def test_call_global_checks_the_shape_of_a_jax_array_already_laid_out_as_planned(impl_cls):
    """A jax.Array of another shape whose sharding is the plan's (replicated, say, which any
    shape has) was taken as laid out and failed inside JAX's executable ('Argument types differ
    from the types for which this computation was compiled'); a host array was named."""
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", "b:8;d:4")
    fn = mx.Lowering(mesh.graph, {mesh: impl_cls("rows:2;cols:4", "")}).function([mx.reduce_sum(x * 2.0, "d")])
    wrong = jax.device_put(jax.numpy.ones((4, 4)), fn.global_function._global_shardings[x])
    with pytest.raises(mx.GraphError, match=r"placeholder 'x' expects shape \[8, 4\], got \[4, 4\]"):
        fn.call_global({x: wrong})


def test_a_constant_that_is_not_a_number_is_refused_when_built():
    _, mesh = new_mesh()
    for bad in (None, "one"):
        with pytest.raises(mx.GraphError, match=r"constant: the value must be a number or an array, got"):
            mx.constant(mesh, bad, "b:4")


def test_tensors_of_two_graphs_are_refused_naming_the_graphs():
    meshes = [mx.Mesh(mx.Graph(), "mesh") for _ in range(2)]
    x, y = (mx.placeholder(m, "x", [B]) for m in meshes)
    with pytest.raises(mx.GraphError, match=r"input x belongs to another mx\.Graph than this op's mesh 'mesh'"):
        x + y
    graph = mx.Graph()
    other = mx.placeholder(mx.Mesh(graph, "other"), "z", [B])
    with pytest.raises(mx.GraphError, match="is on mesh 'other', not 'main'"):
        mx.placeholder(mx.Mesh(graph, "main"), "w", [B]) + other


def test_rename_dimension_takes_dimensions_for_the_names():
    """rename_dimension(x, Dimension('h', 4), 'q') renamed nothing, silently: the Dimension was
    found in x's shape, then compared with each dim's name, which no Dimension equals. A new name
    given as a Dimension of another size is refused (a rename keeps the size)."""
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, H])
    assert mx.rename_dimension(x, H, "q").shape == mx.Shape([B, mx.Dimension("q", H.size)])
    assert mx.rename_dimension(x, "h", mx.Dimension("q", H.size)).shape == mx.Shape([B, mx.Dimension("q", H.size)])
    with pytest.raises(mx.GraphError, match=r"tensor x has Dimension\('h', 4\), not Dimension\('h', 5\)"):
        mx.rename_dimension(x, mx.Dimension("h", 5), "q")
    with pytest.raises(mx.GraphError, match=r"rename_dimension: Dimension\('q', 5\) is not the size of"):
        mx.rename_dimension(x, "h", mx.Dimension("q", 5))


def test_a_name_without_a_size_that_x_lacks_is_named():
    x = mx.placeholder(mx.Mesh(mx.Graph(), "m"), "x", [B, H, D])
    with pytest.raises(mx.GraphError, match=r"no input has a dimension 'q' \(inputs: x Shape\(\[b=8, h=4, d=8\]\)\)"):
        mx.transpose(x, ["d", "q", "h"])
    with pytest.raises(
        mx.GraphError, match=r"no input has a dimension 'k' .*a dim of its own needs its size, e.g. 'k:4'"
    ):
        mx.broadcast(x, ["b", "k", "h", "d"])
