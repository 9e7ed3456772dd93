"""Op sharding rules as data: every op runs as its rule says, read in one place (`ctx.layouts`)."""

import numpy as np
import pytest

import meshax as mx
from meshax.core.graph import Operation
from meshax.layout import TensorLayout, convert_to_mesh_shape, rule_of
from meshax.layout.sharding_rule import LATENCY, choose, moved
from meshax.lower.context import LoweringContext
from meshax.ops.conv import make_window
from meshax.ops.pool import PoolTransposeOperation
from tests.conftest import assert_close, new_mesh, rand

A, B, C = mx.Dimension("A", 8), mx.Dimension("B", 4), mx.Dimension("C", 8)
K = mx.Dimension("K", 2)
# Ops that read no operand (sources take their planned layout) or produce no tensor (an
# assign writes its variable in the variable's planned layout).
SOURCES_AND_SINKS = {
    "PlaceholderOperation",
    "ImportTensorOperation",
    "ImportLaidOutTensorOperation",
    "ConstantOperation",
    "RangeOperation",
    "RandomOperation",
    "VariableOperation",
    "AssignOperation",
    "LoopVariableOperation",  # a loop body's input, bound by its loop
    "ScanOperation",  # a container: its body's ops run by their rules, its carries in their planned layouts
    "WhileOperation",  # a container too
    "RecomputeOperation",  # a container too (a loop of one iteration)
    "CondOperation",  # a container too (its branches)
    "CustomGradientOperation",  # a container too, whose gradient is the user's
}
BASES = {"Windowed"}  # (the convolutions' and pooling's base class, ops.conv: not an op itself)


def _op_classes() -> set[type]:
    found, todo = set(), [Operation]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return {
        c
        for c in found
        if c.__module__.startswith("meshax.ops") and not c.__name__.startswith("_") and c.__name__ not in BASES
    }


def test_every_op_with_operands_runs_as_its_sharding_rule_says(monkeypatch):
    """A new op that derives its layout in its kernel (does not ask `ctx.layouts`, or asks and
    then lays its results out another way) fails here."""
    runs: dict = {}
    produced: dict = {}
    real_layouts, real_set_output = LoweringContext.layouts, LoweringContext.set_output

    def spy(self, op):
        runs[op] = real_layouts(self, op)
        return runs[op]

    def spy_output(self, t, slices, layout=None, pending=()):
        produced[t] = layout or self.plan[t]
        return real_set_output(self, t, slices, layout, pending)

    monkeypatch.setattr(LoweringContext, "layouts", spy)
    monkeypatch.setattr(LoweringContext, "set_output", spy_output)
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [A, B])
    w = mx.placeholder(mesh, "w", [B, C])
    ids = mx.placeholder(mesh, "ids", [A], dtype="int32")
    h = mx.einsum(x, w, output_shape=[A, C])  # einsum
    h = mx.cast(mx.cast(mx.relu(h) * 2.0, "bfloat16"), "float32")  # unary, binary, cast
    h = mx.transpose(mx.shard(h, "A:x"), [C, A])  # shard, transpose
    h = mx.reshape(h, [mx.Dimension("C", 8), mx.Dimension("A2", 2), mx.Dimension("A3", 4)])
    h = mx.reshape(h, [C, A])  # reshape
    h = mx.cumsum(mx.shift(h, 1, A, wrap=False), A)  # shift, cumsum
    h = mx.concat([mx.slice(h, 0, 4, "A"), mx.pad(mx.slice(h, 4, 2, "A"), [0, 2], "A")], "A")  # slice, pad, concat
    g = mx.gather(h, ids, A)  # gather
    v, _ = mx.top_k(g, C, K)  # top_k
    v = mx.slicewise(lambda a: a * a, [v], splittable_dims=[A])  # slicewise
    out = mx.reduce_sum(mx.broadcast(v, [A, K, B]), output_shape=[B])  # broadcast, reduce
    img = mx.placeholder(mesh, "img", [A, B, C])  # conv and pool, with their gradients
    f = mx.placeholder(mesh, "f", "fb:3;C:8;o:2")
    conved = mx.conv1d(img, f, 1, "SAME")
    pooled = mx.max_pool1d(conved, 2)
    window = make_window("sum pooling", [conved.shape[1]], 2, 2, 1, "VALID")
    spread = PoolTransposeOperation(pooled, conved.shape, window).outputs[0]  # (mx.partition's avg-pool gradient)
    out += mx.reduce_sum(
        mx.conv2d_transpose(mx.broadcast(out, [A, B, mx.Dimension("o", 1)]), mx.ones(mesh, "fa:1;fb:2;C:2;o:1"), (1, 2))
    )
    q = mx.placeholder(mesh, "q", [A, B, C])  # fused attention (A: the queries' dim, M the keys')
    kv = mx.placeholder(mesh, "kv", [mx.Dimension("M", 8), B, C])
    attended = mx.recompute_grad(lambda q: mx.fused_attention(q, kv, kv, C, B), [q])  # and a recomputed region
    table = mx.placeholder(mesh, "table", [A, C])  # gather's gradient
    looked_up = mx.reduce_sum(mx.gather(table, ids, A))
    squared = mx.reduce_sum(mx.slicewise(lambda a: a * a, [q], splittable_dims=[A, B]))  # its gradient: a vjp
    printed = mx.Print(x, [ids], "ids")  # Print (data gathered whole, x passed through)
    total = mx.reduce_sum(pooled) + out + mx.reduce_sum(attended) + looked_up + squared + mx.reduce_sum(spread)
    grads = mx.gradients([total], [img, f, q, table])
    low = mx.Lowering(out.graph, {mesh: mx.SimdMeshImpl("x:2;y:4", "C:y;B:x")})
    low.function([out, pooled, attended, printed, spread, *grads])
    expected = {c for c in _op_classes() if c.__name__ not in SOURCES_AND_SINKS}
    assert len(expected) >= 15
    assert expected - {type(op) for op in runs} == set(), "these ops derive their layout outside their sharding rule"
    for op, run in runs.items():
        assert [produced[t] for t in op.outputs] == run.results, f"{op.name} lays its results out another way"


def _shift_counters(offset, layout, mesh_shape="x:2;y:4"):
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [A, B])
    y = mx.shift(x, offset, A, wrap=True)
    low = mx.Lowering(y.graph, {mesh: mx.SimdMeshImpl(mesh_shape, layout)})
    xv = rand([8, 4], 1)
    assert_close(low.function(y)({"x": xv}), np.roll(xv, offset, 0))
    assert rule_of(y.operation).kind("A") == "windowed"
    return low.counters


@pytest.mark.parametrize("offset", [1, -2])
def test_a_windowed_dim_stays_split_where_its_halo_fits(offset):
    c = _shift_counters(offset, "A:y")  # 2 rows per device, a halo of |offset| <= 2 rows
    assert (c["permute"].count, c["allgather"].count) == (1, 0)
    assert c["permute"].values == abs(offset) * 4


def test_a_halo_wider_than_a_slice_takes_several_hops():
    # a shift by 3 over slices of 2 rows: 1 row from the device before and 1 from the one before
    # it (its slice lands on those two; the halo of every hop between would be sent and not read)
    c = _shift_counters(3, "A:y")
    assert (c["permute"].count, c["allgather"].count) == (2, 0)
    assert c["permute"].values == (1 + 1) * 4


@pytest.mark.parametrize(
    "size, offset, wrap, mesh_shape",
    [(16, 7, False, "all:8"), (11, -7, False, "all:8"), (16, 5, True, "all:8"), (32, 9, False, "all:8"),
     (24, 6, False, "all:8"), (24, -7, True, "all:4"), (16, 20, False, "all:8"), (16, -20, True, "all:8")],
)  # fmt: skip
def test_a_shift_by_a_slice_or_more_sends_only_what_it_lands_on(size, offset, wrap, mesh_shape):
    """Values as numpy's; the permutes counted are those XLA runs (the halo of every hop between
    was sent and not read, which XLA drops: 4 counted where the program runs 2)."""
    _, mesh = new_mesh()
    t = mx.Dimension("time", size)
    x = mx.placeholder(mesh, "x", [t, B])
    y = mx.shift(x, offset, t, wrap=wrap)
    fn = mx.Lowering(y.graph, {mesh: mx.SimdMeshImpl(mesh_shape, "time:all")}).function(y)
    xv = rand([size, 4], 1)
    want = np.roll(xv, offset, 0) if wrap else np.zeros_like(xv)
    if not wrap and offset > 0:
        want[offset:] = xv[: max(size - offset, 0)]
    elif not wrap:
        want[: max(size + offset, 0)] = xv[-offset:]
    assert_close(fn({"x": xv}), want)
    hlo = mx.hlo_collectives(fn.compiled_text())["permute"]
    assert (fn.counters["permute"].count, fn.counters["permute"].values) == (hlo["count"], hlo["values"])


def test_a_windowed_dim_is_gathered_where_its_halo_cannot_be_exchanged():
    assert _shift_counters(1, "A:x;A:y")["allgather"].count >= 1  # split over two mesh dims
    assert _shift_counters(9, "A:y")["allgather"].count == 1  # the whole dim (a roll by 8 of 8 is x itself)


def test_a_cyclic_window_stays_split_only_where_the_split_divides():
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [mx.Dimension("A", 7), B])
    for wrap, halos in ((True, 0), (False, 1)):
        y = mx.shift(x, 1, "A", wrap=wrap)
        low = mx.Lowering(y.graph, {mesh: mx.SimdMeshImpl("y:4", "A:y")})
        xv = rand([7, 4], 1)
        want = np.roll(xv, 1, 0) if wrap else np.concatenate([np.zeros((1, 4)), xv[:-1]])
        assert_close(low.function(y)({"x": xv}), want)
        assert low.trace_step([y])["permute"].count == halos


def test_gather_owes_a_sum_over_the_mesh_dims_that_split_the_table_rows():
    _, mesh = new_mesh()
    table = mx.placeholder(mesh, "table", [A, C])
    ids = mx.placeholder(mesh, "ids", [B], dtype="int32")
    out = mx.gather(table, ids, A)
    op = out.operation
    rule = rule_of(op)
    rows = rule.operands[0][0]
    assert rows != "A" and rule.kind(rows) == "reduced" and rule.kind("C") == "passed"
    mesh_shape = convert_to_mesh_shape("x:2;y:4")
    run = choose(op, [TensorLayout([(1,), ()]), TensorLayout([()])], [TensorLayout([(), (0,)])], mesh_shape)
    assert run.pending == {1}  # rows over y: each device holds a quarter, the lookup sums over y
    assert run.operands == [TensorLayout([(1,), (0,)]), TensorLayout([()])]
    assert run.results == [TensorLayout([(), (0,)])]


def test_the_cost_estimate_counts_reshards_owed_sums_and_latency():
    """The estimate the lowering picks by, from the rule alone: an einsum x[A,B] w[B,C] ->
    [A,C] with B split over y owes a sum of its [A,C] slice over y."""
    _, mesh = new_mesh()
    out = mx.einsum(mx.placeholder(mesh, "x", [A, B]), mx.placeholder(mesh, "w", [B, C]), output_shape=[A, C])
    rule, mesh_shape = rule_of(out.operation), convert_to_mesh_shape("x:2;y:4")
    y = (1,)
    ins = [(mx.Shape([A, B]), TensorLayout([(), y])), (mx.Shape([B, C]), TensorLayout([y, ()]))]
    outs = [(mx.Shape([A, C]), TensorLayout([(), ()]))]
    assert moved(rule, ins, outs, {"A": (), "B": y, "C": ()}, mesh_shape) == 64 + LATENCY
    # with B gathered instead: x's [8, 4] and w's [4, 8], each over y
    assert moved(rule, ins, outs, {"A": (), "B": (), "C": ()}, mesh_shape) == 32 + 32 + 2 * LATENCY
