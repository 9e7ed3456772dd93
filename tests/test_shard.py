"""mx.shard: an identity that forces a per-tensor layout."""

import numpy as np
import pytest

import meshax as mx
from tests.conftest import LAYOUTS, B, D, H, assert_close, check_cases, names, new_mesh, rand, run

SHARD_LAYOUTS = ["", "b:cols", "d:rows;b:cols", "b:rows;b:cols", "d:cols", "d:rows;d:cols", "b:rows;d:cols"]

layouts = pytest.mark.parametrize("layout", LAYOUTS, ids=lambda s: s or "replicated")


def _shard_case(shard_layout, seed):
    def build(mesh):
        x = mx.placeholder(mesh, "x", [B, D])
        y = mx.shard(x, shard_layout)
        assert names(y) == ["b", "d"]
        z = y * 2.0 + 1.0  # follows the rules again
        xv = rand([8, 8], seed=seed)
        return [(y, xv), (z, xv * 2.0 + 1.0)], {x: xv}

    return build


@layouts
def test_shard_is_identity(layout, impl_cls):
    cases = {f"shard({lay!r})": _shard_case(lay, 90 + i) for i, lay in enumerate(SHARD_LAYOUTS)}
    check_cases(cases, impl_cls, layout)


@layouts
def test_shard_of_partial_sums(layout, impl_cls):
    """Shard the result of a contraction and keep computing with it."""
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, H])
    w = mx.placeholder(mesh, "w", [H, D])
    y = mx.einsum(x, w, output_shape=[B, D])
    ys = mx.shard(y, "d:cols")
    z = mx.reduce_sum(mx.shard(mx.relu(ys), "b:rows;b:cols"), reduced_dim=B)
    xv, wv = rand([8, 4], 91), rand([4, 8], 92)
    gys, gz = run([ys, z], impl_cls, layout=layout, feeds={x: xv, w: wv})
    want = xv.astype(np.float64) @ wv
    assert_close(gys, want.astype(np.float32))
    assert_close(gz, np.maximum(want, 0).sum(axis=0).astype(np.float32))


@layouts
def test_shard_chain(layout, impl_cls):
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [B, H, D])
    y = x
    for lay in ["b:rows", "b:cols", "d:rows;h:cols", "b:rows;b:cols", "", "d:cols;b:rows"]:
        y = mx.shard(y, lay) + 1.0
    xv = rand([8, 4, 8], seed=93)
    assert_close(run(y, impl_cls, layout=layout, feeds={x: xv}), xv + 6.0)
