"""slice, concat, split, pad, stack, unstack, shift and cumsum vs NumPy.

Sizes are chosen so that every result stays legal under every layout of
LAYOUTS (split dims keep sizes divisible by their mesh dims)."""
import numpy as np
import pytest

import meshax as mx
from tests.conftest import B, D, H, LAYOUTS, assert_close, names, new_mesh, rand, run

layouts = pytest.mark.parametrize("layout", LAYOUTS, ids=lambda s: s or "replicated")

XV = rand([8, 4, 8], seed=60)  # x[b, h, d]


def Dim(name, size):
    return mx.Dimension(name, size)


def _x(mesh):
    return mx.placeholder(mesh, "x", [B, H, D])


# --------------------------------------------------------------------- slice

SLICES = {
    "d[2:6]": ((2, 4, "d"), lambda v: v[:, :, 2:6], ["b", "h", "d"], [8, 4, 4]),
    "d[4:8]": ((4, 4, "d"), lambda v: v[:, :, 4:8], ["b", "h", "d"], [8, 4, 4]),
    "h[1:3]": ((1, 2, "h"), lambda v: v[:, 1:3, :], ["b", "h", "d"], [8, 2, 8]),
    "h[3:4]": ((3, 1, "h"), lambda v: v[:, 3:4, :], ["b", "h", "d"], [8, 1, 8]),
    "d[0:8]": ((0, 8, "d"), lambda v: v, ["b", "h", "d"], [8, 4, 8]),
}


@layouts
@pytest.mark.parametrize("case", list(SLICES))
def test_slice(case, layout, impl_cls):
    (begin, size, dim_name), np_fn, out_names, out_sizes = SLICES[case]
    _, mesh = new_mesh()
    x = _x(mesh)
    y = mx.slice(x, begin, size, dim_name)
    assert names(y) == out_names
    assert list(y.shape.to_integer_list) == out_sizes
    assert_close(run(y, impl_cls, layout=layout, feeds={x: XV}), np_fn(XV))


# ----------------------------------------------------------- concat / split

@layouts
def test_concat(layout, impl_cls):
    _, mesh = new_mesh()
    x = _x(mesh)
    y = mx.placeholder(mesh, "y", [B, H, Dim("d", 4)])
    z = mx.placeholder(mesh, "z", [B, H, Dim("d", 8)])
    c = mx.concat([x, y, z], "d")
    assert names(c) == ["b", "h", "d"]
    assert c.shape.get_dim_by_name("d").size == 20
    yv, zv = rand([8, 4, 4], 61), rand([8, 4, 8], 62)
    got = run(c, impl_cls, layout=layout, feeds={x: XV, y: yv, z: zv})
    assert_close(got, np.concatenate([XV, yv, zv], axis=2))


@layouts
def test_concat_along_b_and_h(layout, impl_cls):
    _, mesh = new_mesh()
    x = _x(mesh)
    y = mx.placeholder(mesh, "y", [B, H, D])
    cb = mx.concat([x, y], "b")  # b: 16, still divisible by 8
    ch = mx.concat([x, y], "h")
    assert cb.shape.get_dim_by_name("b").size == 16
    assert ch.shape.get_dim_by_name("h").size == 8
    yv = rand([8, 4, 8], 63)
    gb, gh = run([cb, ch], impl_cls, layout=layout, feeds={x: XV, y: yv})
    assert_close(gb, np.concatenate([XV, yv], axis=0))
    assert_close(gh, np.concatenate([XV, yv], axis=1))


@layouts
@pytest.mark.parametrize("dim,sizes,axis", [
    (D, [4, 4], 2),
    (H, [1, 3], 1),
    (H, [2, 1, 1], 1),
], ids=["d-4-4", "h-1-3", "h-2-1-1"])
def test_split(dim, sizes, axis, layout, impl_cls):
    _, mesh = new_mesh()
    x = _x(mesh)
    parts = mx.split(x, dim, sizes)
    assert len(parts) == len(sizes)
    for p, s in zip(parts, sizes):
        assert names(p) == ["b", "h", "d"]
        assert p.shape.get_dim_by_name(dim.name).size == s
    got = run(list(parts), impl_cls, layout=layout, feeds={x: XV})
    want = np.split(XV, np.cumsum(sizes)[:-1], axis=axis)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_close(g, w)


@layouts
def test_split_then_concat_roundtrip(layout, impl_cls):
    _, mesh = new_mesh()
    x = _x(mesh)
    a, b = mx.split(x, D, [4, 4])
    y = mx.concat([b, a], "d")
    assert_close(run(y, impl_cls, layout=layout, feeds={x: XV}),
                 np.concatenate([XV[:, :, 4:], XV[:, :, :4]], axis=2))


# ----------------------------------------------------------------------- pad

@layouts
@pytest.mark.parametrize("paddings,dim_name,axis", [
    ([4, 0], "d", 2),
    ([2, 2], "d", 2),
    ([0, 4], "d", 2),
    ([1, 2], "h", 1),
    ([0, 8], "b", 0),
])
def test_pad(paddings, dim_name, axis, layout, impl_cls):
    _, mesh = new_mesh()
    x = _x(mesh)
    y = mx.pad(x, paddings, dim_name)
    assert names(y) == ["b", "h", "d"]
    assert y.shape.get_dim_by_name(dim_name).size == XV.shape[axis] + sum(paddings)
    pad_width = [(0, 0)] * 3
    pad_width[axis] = tuple(paddings)
    assert_close(run(y, impl_cls, layout=layout, feeds={x: XV}), np.pad(XV, pad_width))


# ------------------------------------------------------------ stack / unstack

@layouts
@pytest.mark.parametrize("axis", [0, 1, 2, 3])
def test_stack(axis, layout, impl_cls):
    _, mesh = new_mesh()
    x = _x(mesh)
    y = mx.placeholder(mesh, "y", [B, H, D])
    s = mx.stack([x, y, x * 2.0], "s", axis=axis)
    expected_names = ["b", "h", "d"]
    expected_names.insert(axis, "s")
    assert names(s) == expected_names
    assert s.shape.get_dim_by_name("s").size == 3
    yv = rand([8, 4, 8], 64)
    got = run(s, impl_cls, layout=layout, feeds={x: XV, y: yv})
    assert_close(got, np.stack([XV, yv, XV * 2.0], axis=axis))


@layouts
@pytest.mark.parametrize("dim,axis", [(H, 1), (B, 0), (D, 2)], ids=["h", "b", "d"])
def test_unstack(dim, axis, layout, impl_cls):
    _, mesh = new_mesh()
    x = _x(mesh)
    parts = mx.unstack(x, dim)
    assert len(parts) == dim.size
    for p in parts:
        assert names(p) == [n for n in ["b", "h", "d"] if n != dim.name]
    got = run(list(parts), impl_cls, layout=layout, feeds={x: XV})
    for i, g in enumerate(got):
        assert_close(g, np.take(XV, i, axis=axis))


# --------------------------------------------------------------------- shift

def np_shift(v, offset, axis, wrap):
    if wrap:
        return np.roll(v, offset, axis=axis)
    out = np.zeros_like(v)
    n = v.shape[axis]
    for i in range(n):
        j = i - offset
        if 0 <= j < n:
            idx_out = [slice(None)] * v.ndim
            idx_in = [slice(None)] * v.ndim
            idx_out[axis] = i
            idx_in[axis] = j
            out[tuple(idx_out)] = v[tuple(idx_in)]
    return out


@layouts
@pytest.mark.parametrize("wrap", [True, False], ids=["wrap", "nowrap"])
@pytest.mark.parametrize("dim,axis,offset", [
    (D, 2, 1), (D, 2, 3), (D, 2, -2), (B, 0, 2), (B, 0, -5), (H, 1, 1),
], ids=["d+1", "d+3", "d-2", "b+2", "b-5", "h+1"])
def test_shift(dim, axis, offset, wrap, layout, impl_cls):
    _, mesh = new_mesh()
    x = _x(mesh)
    y = mx.shift(x, offset, dim, wrap)
    assert names(y) == ["b", "h", "d"]
    assert_close(run(y, impl_cls, layout=layout, feeds={x: XV}), np_shift(XV, offset, axis, wrap))


def test_np_shift_reference():
    v = np.arange(5.0)
    np.testing.assert_array_equal(np_shift(v, 2, 0, False), [0, 0, 0, 1, 2])
    np.testing.assert_array_equal(np_shift(v, -2, 0, False), [2, 3, 4, 0, 0])
    np.testing.assert_array_equal(np_shift(v, 2, 0, True), [3, 4, 0, 1, 2])


# -------------------------------------------------------------------- cumsum

@layouts
@pytest.mark.parametrize("exclusive", [False, True], ids=["inclusive", "exclusive"])
@pytest.mark.parametrize("dim,axis", [(D, 2), (B, 0), (H, 1)], ids=["d", "b", "h"])
def test_cumsum(dim, axis, exclusive, layout, impl_cls):
    _, mesh = new_mesh()
    x = _x(mesh)
    y = mx.cumsum(x, dim, exclusive=exclusive)
    assert names(y) == ["b", "h", "d"]
    want = np.cumsum(XV.astype(np.float64), axis=axis)
    if exclusive:
        want = np_shift(want, 1, axis, wrap=False)
    assert_close(run(y, impl_cls, layout=layout, feeds={x: XV}), want.astype(np.float32))
