"""mx.shard: an identity that forces a per-tensor layout."""

import numpy as np
import pytest

import meshax as mx
from tests.conftest import LAYOUTS, B, D, H, assert_close, check_cases, counted_and_compiled, names, new_mesh, rand, run

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


def test_an_annotated_constant_is_made_where_a_reader_wants_it():
    """The gradient of a plain sum into the loss is a broadcast of a constant; where the summed
    tensor was annotated, so is that gradient, and a reader that wants it laid out otherwise
    gets it made there, as XLA folds the gather of a constant (x [b=8, w=4, c=4] over c:cols,
    summed over c and annotated w:cols: 1 allgather of 8 values counted, none compiled)."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", "b:8;w:4;c:4")
    y = mx.shard(mx.reduce_sum(mx.tanh(x), reduced_dim=x.shape[2]), "w:cols")
    loss = mx.reduce_sum(y)
    (grad,) = mx.gradients(loss, [x])
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "c:cols")}).function([loss, grad])
    xv = rand([8, 4, 4], seed=5)
    got_loss, got_grad = fn({"x": xv})
    np.testing.assert_allclose(got_loss, np.tanh(xv).sum(), rtol=1e-5)
    np.testing.assert_allclose(got_grad, 1 - np.tanh(xv) ** 2, rtol=1e-5, atol=1e-6)
    counted, compiled = counted_and_compiled(fn)
    assert counted == compiled
    assert fn.counters["allgather"].count == 0


def test_an_annotated_broadcast_moved_into_its_layout_is_read_as_moved():
    """Where an annotated broadcast had to be moved into its annotated layout (counted), a reader
    that wants it as its input is laid out reads that move, not a broadcast made again, which
    left the move dead for XLA to drop (x [b=5, h=3, c=4] over b:all of all:2, reshaped to
    [b, o=1, h, c] annotated o:all and summed over o, with the gradient: the gradient's broadcast
    over o, annotated o:all and read by the reshape back to b:all, made again: 3 alltoalls of 216
    values counted, 2 of 144 compiled)."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", "b:5;h:3;c:4")
    y = mx.shard(mx.reshape(x, "b:5;o:1;h:3;c:4"), "o:all")
    z = mx.reduce_sum(y, reduced_dim=y.shape[1])
    (grad,) = mx.gradients(mx.reduce_sum(z * z), [x])
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:2", "b:all")}).function([z, grad])
    xv = rand([5, 3, 4], seed=8)
    got_z, got_grad = fn({"x": xv})
    np.testing.assert_allclose(got_z, xv, rtol=1e-6)
    np.testing.assert_allclose(got_grad, 2 * xv, rtol=1e-6)
    counted, compiled = counted_and_compiled(fn)
    assert counted == compiled
