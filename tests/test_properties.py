"""Property tests: results do not depend on the layout (nor on the impl)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import meshax as mx
from tests.conftest import IMPL_IDS, IMPLS, assert_close, new_mesh, run

impls = pytest.mark.parametrize("impl_cls", IMPLS, ids=IMPL_IDS)

MESH = {"rows": 2, "cols": 4}
SIZES = {"b": 8, "h": 4, "d": 8}
# what one tensor dim may be split over
CHOICES = [(), ("rows",), ("cols",), ("rows", "cols"), ("cols", "rows")]

SETTINGS = settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)


def _legal(assignment, sizes):
    used = [m for axes in assignment.values() for m in axes]
    if len(used) != len(set(used)):
        return False  # two tensor dims on one mesh dim
    for name, axes in assignment.items():
        split = int(np.prod([MESH[m] for m in axes])) if axes else 1
        if sizes[name] % split:
            return False
    return True


def _to_rules(assignment):
    return ";".join(f"{name}:{m}" for name, axes in assignment.items() for m in axes)


@st.composite
def layouts(draw, sizes=SIZES):
    assignment = {name: draw(st.sampled_from(CHOICES)) for name in sizes}
    # repair illegal draws deterministically instead of filtering them out
    used = set()
    for name in sizes:
        axes = assignment[name]
        split = int(np.prod([MESH[m] for m in axes])) if axes else 1
        if used & set(axes) or sizes[name] % split:
            assignment[name] = ()
        used |= set(assignment[name])
    assert _legal(assignment, sizes)
    return _to_rules(assignment)


def test_layout_strategy_helpers():
    assert _legal({"b": ("rows", "cols"), "h": (), "d": ()}, SIZES)
    assert not _legal({"b": ("rows",), "h": (), "d": ("rows",)}, SIZES)
    assert not _legal({"b": (), "h": ("rows", "cols"), "d": ()}, SIZES)
    assert _to_rules({"b": ("rows", "cols"), "h": (), "d": ("x",)}) == "b:rows;b:cols;d:x"


B = mx.Dimension("b", 8)
H = mx.Dimension("h", 4)
D = mx.Dimension("d", 8)
D1 = mx.Dimension("d1", 2)
D2 = mx.Dimension("d2", 4)


def _np_softmax(v, axis):
    e = np.exp(v - v.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@impls
@SETTINGS
@given(layout=layouts(), seed=st.integers(0, 2**16))
def test_small_model_any_layout(impl_cls, layout, seed):
    rng = np.random.default_rng(seed)
    xv = rng.uniform(-1, 1, (8, 4)).astype(np.float32)
    wv = rng.uniform(-1, 1, (4, 8)).astype(np.float32)
    vv = rng.uniform(-1, 1, (8,)).astype(np.float32)

    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, H])
    w = mx.placeholder(mesh, "w", [H, D])
    v = mx.placeholder(mesh, "v", [D])
    y = mx.einsum(x, w, output_shape=[B, D])  # contraction over h
    z = mx.relu(y + v) * 0.5 - y  # elementwise + broadcast
    r = mx.reshape(z, [B, D1, D2])  # reshape
    s = mx.reduce_sum(r, reduced_dim=D2)  # [b, d1]
    m = mx.reduce_max(z, reduced_dim=B)  # [d]
    sm = mx.softmax(z, D)  # [b, d]
    t = mx.einsum(sm, w, output_shape=[B, H])  # contraction over d
    total = mx.reduce_mean(t * t)  # scalar
    outs = run([y, s, m, sm, t, total], impl_cls, layout=layout, feeds={x: xv, w: wv, v: vv})

    x64, w64, v64 = (a.astype(np.float64) for a in (xv, wv, vv))
    ny = x64 @ w64
    nz = np.maximum(ny + v64, 0) * 0.5 - ny
    ns = nz.reshape(8, 2, 4).sum(axis=2)
    nm = nz.max(axis=0)
    nsm = _np_softmax(nz, 1)
    nt = nsm @ w64.T
    ntotal = (nt * nt).mean()
    for got, want in zip(outs, [ny, ns, nm, nsm, nt, ntotal]):
        assert_close(got, np.asarray(want, dtype=np.float32))


SHARD_SIZES = {"b": 8, "h": 4, "d": 8}


@impls
@SETTINGS
@given(
    rules=layouts(), shard_layouts=st.lists(layouts(SHARD_SIZES), min_size=1, max_size=3), seed=st.integers(0, 2**16)
)
def test_shard_chain_any_layouts(impl_cls, rules, shard_layouts, seed):
    """Random rules and random per-tensor shard layouts never change values."""
    rng = np.random.default_rng(seed)
    xv = rng.uniform(-1, 1, (8, 4, 8)).astype(np.float32)
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, H, D])
    y = x
    for i, lay in enumerate(shard_layouts):
        y = mx.shard(y, lay) * 2.0 + float(i)
    r = mx.reduce_sum(mx.shard(y, shard_layouts[0]), reduced_dim=[B, D])
    got_y, got_r = run([y, r], impl_cls, layout=rules, feeds={x: xv})
    want = xv.astype(np.float64)
    for i in range(len(shard_layouts)):
        want = want * 2.0 + i
    assert_close(got_y, want.astype(np.float32))
    assert_close(got_r, want.sum(axis=(0, 2)).astype(np.float32), atol=1e-4)
