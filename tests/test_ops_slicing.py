"""slice, concat, split, pad, stack, unstack, shift and cumsum vs NumPy.

Sizes are chosen so that every result stays legal under every layout of
LAYOUTS (split dims keep sizes divisible by their mesh dims).  Each test runs
a family of cases as one program per (impl, layout), see `check_cases`."""

import numpy as np
import pytest

import meshax as mx
from tests.conftest import LAYOUTS, B, D, H, check_cases, counted_and_compiled, names, rand

layouts = pytest.mark.parametrize("layout", LAYOUTS, ids=lambda s: s or "replicated")

XV = rand([8, 4, 8], seed=60)  # x[b, h, d]
AXIS = {"b": 0, "h": 1, "d": 2}


def Dim(name, size):
    return mx.Dimension(name, size)


def _x(mesh):
    return mx.placeholder(mesh, "x", [B, H, D])


# ------------------------------------------------ slice / concat / split / pad


def _slice_case(begin, size, dim_name):
    def build(mesh):
        x = _x(mesh)
        y = mx.slice(x, begin, size, dim_name)
        assert names(y) == ["b", "h", "d"]
        assert y.shape.get_dim_by_name(dim_name).size == size
        idx = [slice(None)] * 3
        idx[AXIS[dim_name]] = slice(begin, begin + size)
        return [(y, XV[tuple(idx)])], {x: XV}

    return build


def _concat_d(mesh):
    x = _x(mesh)
    y = mx.placeholder(mesh, "y", [B, H, Dim("d", 4)])
    z = mx.placeholder(mesh, "z", [B, H, Dim("d", 8)])
    c = mx.concat([x, y, z], "d")
    assert names(c) == ["b", "h", "d"]
    assert c.shape.get_dim_by_name("d").size == 20
    yv, zv = rand([8, 4, 4], 61), rand([8, 4, 8], 62)
    return [(c, np.concatenate([XV, yv, zv], axis=2))], {x: XV, y: yv, z: zv}


def _concat_b_h(mesh):
    x = _x(mesh)
    y = mx.placeholder(mesh, "y", [B, H, D])
    cb = mx.concat([x, y], "b")  # b: 16, still divisible by 8
    ch = mx.concat([x, y], "h")
    assert cb.shape.get_dim_by_name("b").size == 16
    assert ch.shape.get_dim_by_name("h").size == 8
    yv = rand([8, 4, 8], 63)
    return [(cb, np.concatenate([XV, yv], axis=0)), (ch, np.concatenate([XV, yv], axis=1))], {x: XV, y: yv}


def _split_case(dim, sizes):
    def build(mesh):
        x = _x(mesh)
        parts = mx.split(x, dim, sizes)
        assert len(parts) == len(sizes)
        for p, s in zip(parts, sizes):
            assert names(p) == ["b", "h", "d"]
            assert p.shape.get_dim_by_name(dim.name).size == s
        want = np.split(XV, np.cumsum(sizes)[:-1], axis=AXIS[dim.name])
        return list(zip(parts, want)), {x: XV}

    return build


def _split_concat_roundtrip(mesh):
    x = _x(mesh)
    a, b = mx.split(x, D, [4, 4])
    y = mx.concat([b, a], "d")
    return [(y, np.concatenate([XV[:, :, 4:], XV[:, :, :4]], axis=2))], {x: XV}


def _pad_case(paddings, dim_name):
    def build(mesh):
        x = _x(mesh)
        y = mx.pad(x, paddings, dim_name)
        axis = AXIS[dim_name]
        assert names(y) == ["b", "h", "d"]
        assert y.shape.get_dim_by_name(dim_name).size == XV.shape[axis] + sum(paddings)
        pad_width = [(0, 0)] * 3
        pad_width[axis] = tuple(paddings)
        return [(y, np.pad(XV, pad_width))], {x: XV}

    return build


SLICE_CASES = {
    "slice d[2:6]": _slice_case(2, 4, "d"),
    "slice d[4:8]": _slice_case(4, 4, "d"),
    "slice h[1:3]": _slice_case(1, 2, "h"),
    "slice h[3:4]": _slice_case(3, 1, "h"),
    "slice d[0:8]": _slice_case(0, 8, "d"),
    "concat d 8+4+8": _concat_d,
    "concat b, concat h": _concat_b_h,
    "split d [4,4]": _split_case(D, [4, 4]),
    "split h [1,3]": _split_case(H, [1, 3]),
    "split h [2,1,1]": _split_case(H, [2, 1, 1]),
    "split+concat": _split_concat_roundtrip,
    "pad d [4,0]": _pad_case([4, 0], "d"),
    "pad d [2,2]": _pad_case([2, 2], "d"),
    "pad d [0,4]": _pad_case([0, 4], "d"),
    "pad h [1,2]": _pad_case([1, 2], "h"),
    "pad b [0,8]": _pad_case([0, 8], "b"),
}


@layouts
def test_slice_concat_split_pad(layout, impl_cls):
    check_cases(SLICE_CASES, impl_cls, layout)


# ------------------------------------------------------------ stack / unstack


def _stack_case(axis):
    def build(mesh):
        x = _x(mesh)
        y = mx.placeholder(mesh, "y", [B, H, D])
        s = mx.stack([x, y, x * 2.0], "s", axis=axis)
        expected_names = ["b", "h", "d"]
        expected_names.insert(axis, "s")
        assert names(s) == expected_names
        assert s.shape.get_dim_by_name("s").size == 3
        yv = rand([8, 4, 8], 64 + axis)
        return [(s, np.stack([XV, yv, XV * 2.0], axis=axis))], {x: XV, y: yv}

    return build


def _unstack_case(dim):
    def build(mesh):
        x = _x(mesh)
        parts = mx.unstack(x, dim)
        assert len(parts) == dim.size
        for p in parts:
            assert names(p) == [n for n in ["b", "h", "d"] if n != dim.name]
        axis = AXIS[dim.name]
        return [(p, np.take(XV, i, axis=axis)) for i, p in enumerate(parts)], {x: XV}

    return build


STACK_CASES = {f"stack axis={a}": _stack_case(a) for a in range(4)}
STACK_CASES.update({f"unstack {d.name}": _unstack_case(d) for d in (H, B, D)})


@layouts
def test_stack_unstack(layout, impl_cls):
    check_cases(STACK_CASES, impl_cls, layout)


# ---------------------------------------------------------- shift / cumsum


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


def test_np_shift_reference():
    v = np.arange(5.0)
    np.testing.assert_array_equal(np_shift(v, 2, 0, False), [0, 0, 0, 1, 2])
    np.testing.assert_array_equal(np_shift(v, -2, 0, False), [2, 3, 4, 0, 0])
    np.testing.assert_array_equal(np_shift(v, 2, 0, True), [3, 4, 0, 1, 2])


def _shift_case(dim, offset, wrap):
    def build(mesh):
        x = _x(mesh)
        y = mx.shift(x, offset, dim, wrap)
        assert names(y) == ["b", "h", "d"]
        return [(y, np_shift(XV, offset, AXIS[dim.name], wrap))], {x: XV}

    return build


def _cumsum_case(dim, exclusive):
    def build(mesh):
        x = _x(mesh)
        y = mx.cumsum(x, dim, exclusive=exclusive)
        assert names(y) == ["b", "h", "d"]
        axis = AXIS[dim.name]
        want = np.cumsum(XV.astype(np.float64), axis=axis)
        if exclusive:
            want = np_shift(want, 1, axis, wrap=False)
        return [(y, want)], {x: XV}

    return build


SHIFT_CASES = {}
for _dim, _offset in [(D, 3), (D, -2), (B, 2), (B, -5)]:
    for _wrap in (True, False):
        SHIFT_CASES[f"shift {_dim.name}{_offset:+d} wrap={_wrap}"] = _shift_case(_dim, _offset, _wrap)
SHIFT_CASES["shift h+1 wrap=False"] = _shift_case(H, 1, False)
for _dim in (D, B):
    for _excl in (False, True):
        SHIFT_CASES[f"cumsum {_dim.name} exclusive={_excl}"] = _cumsum_case(_dim, _excl)
SHIFT_CASES["cumsum h exclusive=False"] = _cumsum_case(H, False)


@layouts
def test_shift_cumsum(layout, impl_cls):
    check_cases(SHIFT_CASES, impl_cls, layout)


def test_stack_aligns_dims_by_name_and_names_a_mismatch():
    """A tensor whose dims come in another order is stacked by name (it was reshaped by position:
    its values scrambled); tensors of other dims are refused, naming both shapes."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", "a:2;b:3")
    y = mx.placeholder(mesh, "y", "b:3;a:2")
    s = mx.stack([x, y], "s")
    xv = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    got = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:1", "")}).function(s)({"x": xv, "y": xv.T})
    np.testing.assert_array_equal(got, np.stack([xv, xv]))
    with pytest.raises(mx.GraphError, match=r"stack needs tensors of one shape: x is Shape\(\[a=2, b=3\]\), z is"):
        mx.stack([x, mx.placeholder(mesh, "z", "a:2;b:4")], "s")


@pytest.mark.parametrize("offset", [8, -8, 11])
def test_a_shift_past_the_whole_dim_moves_nothing(offset):
    """Without wrapping, a shift by the dim's size or more is all zeros and reads no value: its
    counters (forward and gradient) must hold no gather, as XLA's compiled program holds none."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", "b:2;t:8;c:3")
    y = mx.shift(x * 2.0, offset, "t", wrap=False)
    (grad,) = mx.gradients(mx.reduce_sum(mx.square(y + 1.0)), [x])
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "t:cols;b:rows")}).function([y, grad])
    got_y, got_grad = fn({"x": rand([2, 8, 3], seed=1)})
    np.testing.assert_array_equal(got_y, np.zeros((2, 8, 3)))
    np.testing.assert_array_equal(got_grad, np.zeros((2, 8, 3)))
    found = mx.hlo_collectives(fn.compiled_text())
    assert {k: v["count"] for k, v in found.items() if v["count"]} == {}
    assert not list(fn.counters.sites())


def test_a_shift_past_the_whole_dim_is_zeros_in_any_layout():
    """Its zeros are made where a reader wants them, as a constant's: concatenated along a split
    dim, they were gathered (x [e=5, b=1], e over rows, shifted out along b: 2 allgathers of 5
    values counted, 1 of 3 compiled; with the gradient 4 of 12 against 2 of 8)."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", "e:5;b:1")
    y = mx.concat([mx.shift(mx.slice(x, 1, 4, "e"), 1, "b", wrap=False), x], "e")
    (grad,) = mx.gradients(mx.reduce_sum(y * y), [x])
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "e:rows")}).function([y, grad])
    xv = rand([5, 1], seed=3)
    got_y, got_grad = fn({"x": xv})
    np.testing.assert_array_equal(got_y, np.concatenate([np.zeros([4, 1]), xv]))
    np.testing.assert_allclose(got_grad, 2 * xv)
    hlo = mx.hlo_collectives(fn.compiled_text())
    assert {k: (v["count"], v["values"]) for k, v in hlo.items() if v["count"]} == {"allgather": (2, 8)}
    assert (fn.counters["allgather"].count, fn.counters["allgather"].values) == (2, 8)


def test_a_halo_as_wide_as_the_block_gathers_once():
    """halo_exchange with a halo as wide as the block sends all of each block to both
    neighbours: both shifts read x, not two slices of all of it that each gather. With b=5 over
    all:2 and wrap, each shift gathered its own slice (2 allgathers of 24 values counted, 1 of
    12 compiled: both gathered the same x)."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", "b:5;a:4")
    y = mx.halo_exchange(x, "b", "a", 4, wrap=True)
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:2", "b:all")}).function(y)
    xv = rand([5, 4], seed=2)
    np.testing.assert_array_equal(fn({"x": xv}), np.concatenate([np.roll(xv, 1, 0), xv, np.roll(xv, -1, 0)], 1))
    hlo = mx.hlo_collectives(fn.compiled_text())
    assert {k: (v["count"], v["values"]) for k, v in hlo.items() if v["count"]} == {"allgather": (1, 12)}
    assert (fn.counters["allgather"].count, fn.counters["allgather"].values) == (1, 12)


@pytest.mark.parametrize("begin", [0, 1, 2])
def test_a_slice_of_a_concat_reads_only_the_pieces_it_covers(begin):
    """A slice of a halo exchange's result that leaves out a halo does not compute that halo's
    shift, as XLA drops it (x [b=5, n=1, s=6, c=3], n over all:2 unevenly, halo 1 with wrap, the
    first 6 of s and the gradient: 4 allgathers of 60 values counted, 2 of 30 compiled; the
    middle 6: 4 of 60 counted, none compiled). The slice reads only the concat's pieces it covers."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", "b:5;n:1;s:6;c:3")
    y = mx.slice(mx.halo_exchange(x * 2.0, "n", "s", 1, wrap=True), begin, 6, "s")
    (grad,) = mx.gradients(mx.reduce_sum(y * y), [x])
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:2", "n:all")}).function([y, grad])
    xv = rand([5, 1, 6, 3], seed=4)
    got_y, got_grad = fn({"x": xv})
    padded = np.concatenate([2 * xv[:, :, -1:], 2 * xv, 2 * xv[:, :, :1]], 2)
    want = padded[:, :, begin : begin + 6]
    np.testing.assert_allclose(got_y, want, rtol=1e-6)
    want_grad = np.zeros_like(xv)  # d sum(y^2) / dx: 2 y_j x 2 for each position j of y that x reaches
    for j in range(begin, begin + 6):
        want_grad[:, :, (j - 1) % 6] += 4 * padded[:, :, j]
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-6)
    counted, compiled = counted_and_compiled(fn)
    assert counted == compiled


def test_what_only_a_shift_past_the_whole_dim_reads_is_not_computed():
    """A shift that moves every value out reads none of its input: a tensor only it reads is
    not computed, nor moved (x [b=8, n=1, c=6] over b:rows of rows:4;cols:2, 2x annotated
    c:rows and shifted out along n: 1 alltoall of 16 values counted, none compiled)."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", "b:8;n:1;c:6")
    y = mx.shift(mx.shard(x * 2.0, "c:rows"), 1, "n", wrap=False) + x
    (grad,) = mx.gradients(mx.reduce_sum(y * y), [x])
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:4;cols:2", "b:rows")}).function([y, grad])
    xv = rand([8, 1, 6], seed=6)
    got_y, got_grad = fn({"x": xv})
    np.testing.assert_allclose(got_y, xv, rtol=1e-6)
    np.testing.assert_allclose(got_grad, 2 * xv, rtol=1e-6)
    hlo = mx.hlo_collectives(fn.compiled_text())
    assert {k: v["count"] for k, v in hlo.items() if v["count"]} == {}
    assert not list(fn.counters.sites())


@pytest.mark.parametrize("offset", [3, -3, 6])
def test_a_roll_by_whole_turns_is_the_tensor_itself(offset):
    """shift with wrap by a multiple of the dim's size is x: as an op it moved x's values, which
    XLA, seeing a roll by whole turns, did not (x [b=3, h=6, c=8] over b:all of all:8, tanh of it
    annotated c:all, rolled along b and added to itself, with the gradient: 5 alltoalls of 240
    values counted, 4 of 192 compiled, beside 1 allgather of 48 in both; now no allgather)."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", "b:3;h:6;c:8")
    y = mx.shard(mx.tanh(x), "c:all")
    out = mx.shift(y, offset, "b", wrap=True) + y
    (grad,) = mx.gradients(mx.reduce_sum(out * out), [x])
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "b:all")}).function([out, grad])
    xv = rand([3, 6, 8], seed=7)
    got_out, got_grad = fn({"x": xv})
    np.testing.assert_allclose(got_out, 2 * np.tanh(xv), rtol=1e-6)
    np.testing.assert_allclose(got_grad, 8 * np.tanh(xv) * (1 - np.tanh(xv) ** 2), rtol=1e-5, atol=1e-6)
    counted, compiled = counted_and_compiled(fn)
    assert counted == compiled


def test_an_axis_number_for_a_dim_is_refused_naming_the_dims():
    """Dims are named: an axis number (as NumPy takes it) for the dim of cumsum, shift, unstack,
    softmax, ... is refused naming the tensor's dims (it was an AttributeError: 'int' object has
    no attribute 'name')."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", "b:2;t:8")
    for make in (
        lambda: mx.cumsum(x, 1),
        lambda: mx.shift(x, 1, 0, wrap=True),
        lambda: mx.unstack(x, 0),
        lambda: mx.softmax(x, 1),
    ):
        with pytest.raises(mx.GraphError, match=r"names no dimension of x .*\['b', 't'\].*not an axis number"):
            make()


def test_bad_paddings_split_counts_and_pool_sizes_are_named():
    """pad's paddings that are no pair [before, after] (an int, three numbers) or hold a fraction,
    split into 0 pieces or 2.0 pieces, and a pool size of 0 are refused naming the argument: they
    were a ValueError from unpacking, a TypeError ('int' object is not iterable), ZeroDivisionErrors,
    and a fraction of a padding was dropped silently (pad(x, [1.5, 1], 'b') padded 1 and 1)."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", "b:8;c:2")
    with pytest.raises(mx.GraphError, match=r"pad: paddings must be a pair \[before, after\].*got 2"):
        mx.pad(x, 2, "b")
    with pytest.raises(mx.GraphError, match=r"pad: paddings must be a pair \[before, after\].*got \[1, 1, 1\]"):
        mx.pad(x, [1, 1, 1], "b")
    with pytest.raises(mx.GraphError, match=r"pad: paddings' before 1.5 \(float\) is not a whole number"):
        mx.pad(x, [1.5, 1], "b")
    with pytest.raises(mx.GraphError, match=r"cannot split Dimension\('b', 8\) into 0 equal pieces"):
        mx.split(x, "b", 0)
    with pytest.raises(mx.GraphError, match=r"split: the number of pieces 2.0 \(float\) is not a whole number"):
        mx.split(x, "b", 2.0)
    for pool in (lambda: mx.pool_tensor_1d(x, "b", mx.reduce_max, 0), lambda: mx.stride_tensor_1d(x, "b", 0)):
        with pytest.raises(mx.GraphError, match=r"pool_size 0 does not divide Dimension\('b', 8\)"):
            pool()
    assert mx.pad(x, (np.int32(1), 2), "b").shape == mx.convert_to_shape("b:11;c:2")
    assert [t.shape for t in mx.split(x, "b", np.int64(2))] == [mx.convert_to_shape("b:4;c:2")] * 2


def test_a_fraction_for_a_slice_shift_halo_or_top_k_count_is_refused():
    """slice's begin and size, shift's offset, halo_exchange's halo_size and top_k's k take whole
    numbers: a fraction (n / 3 for n // 3) was dropped silently by int(), slice(x, 0.5, 2, 'b')
    reading entries 0 and 1, halo_exchange by 1.5 growing the block by 2 of 3."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", "b:8;c:4")
    for make, what in (
        (lambda: mx.slice(x, 0.5, 2, "b"), r"slice: begin 0.5"),
        (lambda: mx.slice(x, 0, 8 / 3, "b"), r"slice: size 2.6+5"),
        (lambda: mx.shift(x, 1.5, "b", wrap=False), r"shift: offset 1.5"),
        (lambda: mx.halo_exchange(x, "b", "c", 1.5), r"halo_size 1.5"),
        (lambda: mx.top_k(x, "c", 1.5), r"top_k: k 1.5"),
    ):
        with pytest.raises(mx.GraphError, match=what + r" \(float\) is not a whole number"):
            make()
    assert mx.slice(x, np.int64(1), np.int32(2), "b").shape == mx.convert_to_shape("b:2;c:4")


def test_slice_pad_and_concat_take_a_dimension_for_the_dim():
    """slice and pad given the Dimension rather than its name kept the dim's size in the output's
    shape (slice(x, 1, 3, Dimension('b', 8)) was [b=8, c=2], holding rows 1..8 and past the end,
    silently), and concat failed with a KeyError; a slice of a concat, given the Dimension, reads
    its pieces as given the name."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    b, c = mx.Dimension("b", 8), mx.Dimension("c", 2)
    x = mx.placeholder(mesh, "x", [b, c])
    y = mx.concat([x, x * 2.0], b)
    outs = [mx.slice(x, 1, 3, b), mx.pad(x, [1, 2], b), y, mx.slice(y, 9, 2, mx.Dimension("b", 16))]
    assert [t.shape.to_integer_list for t in outs] == [[3, 2], [11, 2], [16, 2], [2, 2]]
    xv = rand([8, 2], seed=3)
    got = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:2", "c:all")}).function(outs)({"x": xv})
    for g, want in zip(got, [xv[1:4], np.pad(xv, [(1, 2), (0, 0)]), np.concatenate([xv, 2 * xv]), 2 * xv[1:3]]):
        np.testing.assert_allclose(g, want, rtol=1e-6)


def test_stack_takes_the_new_dimension_itself_and_a_whole_number_axis():
    """stack's new dim given as a Dimension was a ConfigError about a 'Dimension(Dimension('s',
    2), 1)'; it is taken where its size is the number of tensors, and named where it is not. An
    axis of 1.0 was a TypeError from slicing a list."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", "b:8;c:2")
    assert mx.stack([x, x], mx.Dimension("s", 2)).shape == mx.convert_to_shape("s:2;b:8;c:2")
    with pytest.raises(mx.GraphError, match=r"stack: the new dim Dimension\('s', 3\) would have 2 entries"):
        mx.stack([x, x], mx.Dimension("s", 3))
    with pytest.raises(mx.GraphError, match=r"stack: axis 1.0 \(float\) is not a whole number"):
        mx.stack([x, x], "s", axis=1.0)
