"""GSPMD's half: mesh_split annotations, sharding propagation, explain, weight-update sharding."""

import numpy as np
import pytest

import meshax as mx
from tests.conftest import assert_close, new_mesh, rand

A, Bd, C = mx.Dimension("A", 8), mx.Dimension("B", 4), mx.Dimension("C", 8)


def _lowering(t, mesh_shape="x:2;y:4", layout="", impl_cls=mx.SimdMeshImpl):
    return mx.Lowering(t.graph, {t.mesh: impl_cls(mesh_shape, layout)})


def test_figure3_merges_compatible_shardings_of_both_operands():
    """A_y B . B C_x -> A_y C_x: each operand gives the result one dim's split."""
    _, mesh = new_mesh()
    a = mx.mesh_split(mx.placeholder(mesh, "a", [A, Bd]), ["y", None])
    b = mx.mesh_split(mx.placeholder(mesh, "b", [Bd, C]), [None, "x"])
    out = mx.einsum(a, b, output_shape=[A, C])
    low = _lowering(out)
    assert low.layout_of(out) == "A:y;C:x"
    assert "propagated forward through einsum" in low.explain()


def _figure4(mesh):
    """A linear layer with a bias, then relu, whose output is annotated on D; the input is split
    on the batch dim over the same mesh dim."""
    Bt, Ci, D = mx.Dimension("batch", 8), mx.Dimension("c", 4), mx.Dimension("d", 8)
    x = mx.mesh_split(mx.placeholder(mesh, "x", [Bt, Ci]), ["x", None])
    w = mx.placeholder(mesh, "w", [Ci, D])
    bias = mx.placeholder(mesh, "bias", [D])
    h = mx.einsum(x, w, output_shape=[Bt, D])
    y = h + bias
    r = mx.mesh_split(mx.relu(y), [None, "x"])
    return [h, y, r.operation.inputs[0], r], (x, w, bias)


def test_figure4_elementwise_first_gives_every_bd_tensor_the_same_sharding():
    _, mesh = new_mesh()
    bd, _ = _figure4(mesh)
    low = _lowering(bd[-1])
    assert {low.layout_of(t) for t in bd} == {"d:x"}


def test_figure4_values_equal_numpy_on_both_backends(impl_cls):
    _, mesh = new_mesh()
    bd, (_x, _w, _bias) = _figure4(mesh)
    xv, wv, bv = rand([8, 4], 1), rand([4, 8], 2), rand([8], 3)
    low = _lowering(bd[-1], impl_cls=impl_cls)
    got = low.function(bd[-1])({"x": xv, "w": wv, "bias": bv})
    assert_close(got, np.maximum(xv @ wv + bv, 0))


def test_open_dims_are_refined_and_replicated_dims_are_not():
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [A, C])
    opened = mx.mesh_split(x, [mx.OPEN, "x"])  # A left to propagation
    closed = mx.mesh_split(mx.placeholder(mesh, "z", [A, C]), [None, "x"])  # A replicated, said so
    y = mx.mesh_split(opened + closed, ["y", "x"])
    low = _lowering(y)
    assert low.layout_of(opened) == "A:y;C:x"
    assert low.layout_of(closed) == "C:x"
    assert low.layout_of(x) == "A:y;C:x"  # backward through the annotation, as GSPMD does


def test_rules_act_as_annotations_by_name_and_are_never_overridden():
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [A, C])
    s = mx.mesh_split(x, ["y", None])
    y = s * 2.0
    low = _lowering(y, layout="C:x")
    assert low.layout_of(x) == "A:y;C:x"
    assert low.layout_of(s) == "A:y"  # the annotation says C is replicated, whatever the rule
    assert low.layout_of(y) == "A:y;C:x"
    text = low.explain()
    assert "rule C:x" in text


def test_tuples_split_one_dim_over_two_mesh_dims_major_to_minor():
    _, mesh = new_mesh()
    x = mx.mesh_split(mx.placeholder(mesh, "x", [A, C]), [("y", "x"), None])
    y = mx.relu(x)
    low = _lowering(y)
    assert low.layout_of(y) == "A:y;A:x"
    xv = rand([8, 8], 5)
    assert_close(low.function(y)({"x": xv}), np.maximum(xv, 0))


# ---- gradients, variables and the optimizer follow the annotation ------------------------------
def _issue_example(rules="batch:rows;d_ff:cols", annotate=True):
    graph, mesh = new_mesh()
    b, dm, dff = mx.Dimension("batch", 8), mx.Dimension("d_model", 16), mx.Dimension("d_ff", 32)
    x = mx.placeholder(mesh, "x", [b, dm])
    y = mx.placeholder(mesh, "y", [b, dff])
    w = mx.get_variable(mesh, "w", [dm, dff], initializer=mx.initializers.normal(0.3))
    wr = mx.shard(w, "d_model:rows;d_ff:cols") if annotate else w
    h = mx.tanh(mx.einsum(x, wr, output_shape=[b, dff]))
    loss = mx.reduce_mean(mx.square(h - y))
    (gw,) = mx.gradients(loss, [w])
    updates = mx.optimize.AdamWeightDecayOptimizer(0.05).apply_grads([gw], [w])
    return graph, mesh, w, loss, updates


def test_issue_example_shards_the_variable_its_slots_and_its_update():
    graph, mesh, _w, loss, updates = _issue_example()
    low = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "batch:rows;d_ff:cols")})
    for name in ("w", "w/adam_m", "w/adam_v"):
        (var,) = [v for v in graph.all_variables if v.name == name]
        assert low.layout_of(var.value) == "d_model:rows;d_ff:cols", name
    step = low.function(loss, updates)
    c = step.counters
    # Forward: w is gathered over rows right before use (16*32/8 = 64 values per device). Backward:
    # its gradient, summed over the batch split over rows, is reduce-scattered (16*32/4 = 128
    # values in per device); nothing is gathered to write the update back.
    assert [(s.kind, s.mesh_axes, s.values) for s in c.sites() if s.kind != "allreduce"] == [
        ("allgather", ("rows",), 64),
        ("reduce_scatter", ("rows",), 128),
    ]
    assert c["alltoall"].count == 0
    xv, yv = rand([8, 16], 7), rand([8, 32], 8)
    for i in range(3):
        step({"x": xv, "y": yv}, seed=i)
    # each device holds 1/8 of each slot
    m = low.variable_state(next(v for v in graph.all_variables if v.name == "w/adam_m"))
    assert {s.data.shape for s in m.addressable_shards} == {(8, 8)}


def test_issue_example_trains_to_the_same_values_as_one_device(impl_cls):
    results = []
    for mesh_shape, rules, annotate in (("rows:1", "", False), ("rows:2;cols:4", "batch:rows;d_ff:cols", True)):
        graph, mesh, w, loss, updates = _issue_example(annotate=annotate)
        low = mx.Lowering(graph, {mesh: impl_cls(mesh_shape, rules)})
        step = low.function(loss, updates)
        xv, yv = rand([8, 16], 7), rand([8, 32], 8)
        losses = [step({"x": xv, "y": yv}) for _ in range(4)]
        results.append((losses, low.variable_value(w)))
    assert_close(np.array(results[1][0]), np.array(results[0][0]), rtol=1e-5, atol=1e-6)
    assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-6)


def test_gradient_of_an_annotated_tensor_carries_the_annotation():
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [A, C])
    y = mx.mesh_split(x, ["x", mx.OPEN])
    (_gx,) = mx.gradients(mx.reduce_sum(mx.square(y)), [x])
    grads = [op for op in y.graph.operations if isinstance(op, mx.ops.layout_ops.ShardOperation)]
    assert len(grads) == 2 and grads[1].annotation == grads[0].annotation
    assert grads[1].grad_of is y.operation


@pytest.mark.parametrize("layout", ["", "B:y", "A:y"])
def test_a_tensor_laid_out_two_ways_and_added_back_has_a_gradient(layout):
    """x annotated as it is and as a copy (as the refusal of two annotations says to), then added
    back: one gradient reaches both annotations, and annotating it for each was refused as
    'conflicting annotations on add_1' while building the gradient. Each annotates a copy."""
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [A, Bd, C])
    out = mx.shard(x, "A:x") + mx.shard(mx.identity(x), "C:x")
    (gx,) = mx.gradients(mx.reduce_sum(out * out), [x])
    lowering = _lowering(out, layout=layout)
    fn = lowering.function([out, gx])
    value = rand(x.shape, 0)
    got = fn({"x": value})
    assert_close(got[0], 2 * value)
    assert_close(got[1], 8 * value)
    counted = {k: (fn.counters[k].count, fn.counters[k].values) for k in fn.counters if fn.counters[k].count}
    hlo = {k: (v["count"], v["values"]) for k, v in mx.hlo_collectives(fn.compiled_text()).items() if v["count"]}
    assert counted == hlo


@pytest.mark.parametrize("second", ["split the other way", "whole"])
def test_a_constant_is_made_in_each_readers_layout_and_passes_no_split_on(second):
    """One constant read by two ops that want it laid out two ways: each device fills it in the
    layout each reader wants (nothing moves, as in XLA, which splits such a constant per user), and
    it carries no split from one reader to the other (which would split x2, then gather it)."""
    _, mesh = new_mesh()
    x1, x2 = mx.placeholder(mesh, "x1", [A, C]), mx.placeholder(mesh, "x2", [A, C])
    c = mx.ones(mesh, [A, C])
    y1 = mx.mesh_split(c * x1, ["x", None])
    y2 = mx.mesh_split(c * x2, [None, "x"]) if second != "whole" else mx.cumsum(c * x2, A)
    low = _lowering(y1)
    assert low.layout_of(x2) == ("C:x" if second != "whole" else "")
    fn = low.function([y1, y2])
    v1, v2 = rand([8, 8], 1), rand([8, 8], 2)
    got = fn({"x1": v1, "x2": v2})
    assert_close(got[0], v1)
    assert_close(got[1], v2 if second != "whole" else np.cumsum(v2, 0))
    assert all(fn.counters[k].count == 0 for k in ("allgather", "alltoall", "allreduce")), low.report(fn.counters)


# ---- explain --------------------------------------------------------------------------------
def test_explain_names_origins_and_warns_about_replication_and_forced_reshards():
    graph, mesh, _w, _loss, _updates = _issue_example()
    low = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "batch:rows")})
    text = low.explain(threshold=100)
    lines = {line.split()[0]: line for line in text.splitlines() if line and not line.startswith(" ")}
    assert "d_model:rows;d_ff:cols" in lines["w"] and "d_model: propagated backward through" in lines["w"]
    assert "annotation at" in lines["shard"] and "test_propagation.py" in lines["shard"]
    assert "rule batch:rows" in lines["x"]
    warn = text[text.index("warnings") :]
    assert "x [batch=8, d_model=16] (128 values" in warn and "replicated over mesh dim(s) cols" in warn
    assert "reshards" not in warn  # w arrives already in the annotated layout
    # an annotation that disagrees with its input's layout is a forced reshard, and says so
    _, mesh2 = new_mesh()
    z = mx.placeholder(mesh2, "z", [A, C])
    zz = mx.shard(z, "C:rows")
    low2 = _lowering(zz, "rows:2;cols:4", layout="A:rows")
    assert "reshards z from 'A:rows' to 'C:rows'" in low2.explain()


@pytest.mark.parametrize("impl_cls", [mx.SimdMeshImpl, mx.PlacementMeshImpl], ids=["simd", "placement"])
def test_a_split_that_does_not_divide_passes_to_dims_of_its_size_only(impl_cls):
    """An annotation split V=10 four ways (padded): the einsum's and softmax's V, the same size,
    take it (their padding is the annotation's); W=6, another size, is not padded for it. The
    split stopped at the annotation: the logits were computed whole on every device (4 times
    the FLOPs) and the annotated weight allgathered back."""
    _, mesh = new_mesh()
    V, W, E = mx.Dimension("V", 10), mx.Dimension("W", 6), mx.Dimension("E", 4)
    w = mx.mesh_split(mx.placeholder(mesh, "w", [E, V]), [None, "y"])
    x = mx.placeholder(mesh, "x", [A, E])
    logits = mx.einsum(x, w, output_shape=[A, V])
    probs = mx.softmax(logits, reduced_dim=V)
    other = mx.einsum(probs, mx.placeholder(mesh, "u", [V, W]), output_shape=[A, W])
    low = _lowering(other, impl_cls=impl_cls)
    assert [low.layout_of(t) for t in (logits, probs, other)] == ["V:y", "V:y", ""]
    fn = low.function([probs, other])
    feeds = {"w": rand([4, 10], seed=1), "x": rand([8, 4], seed=2), "u": rand([10, 6], seed=3)}
    want = np.exp(feeds["x"] @ feeds["w"])
    want /= want.sum(axis=1, keepdims=True)
    got_probs, got_other = fn(feeds)
    assert_close(got_probs, want)
    assert_close(got_other, want @ feeds["u"])
    assert fn.counters["allgather"].count == 0


def test_layout_of_is_empty_for_replicated_tensors():
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [A])
    assert _lowering(x).layout_of(x) == ""


# ---- bad input -----------------------------------------------------------------------------
def test_mesh_split_errors_name_the_tensor_and_the_line():
    _, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", [A, C])
    with pytest.raises(mx.LayoutError, match=r"mesh_split of 'x'.*test_propagation.py:\d+.*2 dims"):
        mx.mesh_split(x, ["x"])
    with pytest.raises(mx.LayoutError, match=r"'x'.*test_propagation.py:\d+.*\['x'\] used more than once"):
        mx.mesh_split(x, ["x", "x"])
    with pytest.raises(mx.LayoutError, match=r"entry 1 \('C'\) is 3"):
        mx.mesh_split(x, ["x", 3])
    mx.mesh_split(x, ["x", None])
    with pytest.raises(
        mx.LayoutError,
        match=r"conflicting annotations on 'x'.*\['x', None\] at .*test_propagation"
        r".py:\d+ and \[None, 'x'\] at .*test_propagation.py:\d+",
    ):
        mx.mesh_split(x, [None, "x"])
    assert mx.mesh_split(x, ["x", None]) is mx.mesh_split(x, ("x", None))  # the same annotation twice is one


def test_unknown_mesh_dim_is_refused_at_lowering_with_the_line():
    _, mesh = new_mesh()
    y = mx.mesh_split(mx.placeholder(mesh, "x", [A, C]), ["z", None])
    with pytest.raises(mx.LayoutError, match=r"annotation on 'x'.*test_propagation.py:\d+.*mesh dim 'z'"):
        _lowering(y)


def test_priorities_settle_lower_ones_first():
    """x's batch and w's f both ask for mesh dim x in h = x . w: the lower priority wins h."""

    def build(px, pw):
        _, mesh = new_mesh()
        b, d, f = mx.Dimension("batch", 8), mx.Dimension("d", 4), mx.Dimension("f", 8)
        x = mx.mesh_split(mx.placeholder(mesh, "x", [b, d]), ["x", None], priority=px)
        w = mx.mesh_split(mx.placeholder(mesh, "w", [d, f]), [None, "x"], priority=pw)
        h = mx.relu(mx.einsum(x, w, output_shape=[b, f]))
        return _lowering(h), h

    low, h = build(0, 1)
    assert low.layout_of(h) == "batch:x"
    low, h = build(1, 0)
    assert low.layout_of(h) == "f:x"
    assert "priority 1" in low.explain()
    xv, wv = rand([8, 4], 1), rand([4, 8], 2)
    assert_close(low.function(h)({"x": xv, "w": wv}), np.maximum(xv @ wv, 0))


@pytest.mark.parametrize("larger", ["w", "x"])
def test_where_two_factors_want_one_mesh_dim_the_larger_tensors_split_wins(larger):
    """x's batch and w's f both ask for mesh dim x in h = x . w, at one priority: h takes the split
    of the larger of x and w, so that the smaller one is gathered (Shardy's aggressive
    propagation). It went by h's dim order: batch won, and w, 4x x's size, was gathered."""
    _, mesh = new_mesh()
    nb, nf = (8, 32) if larger == "w" else (32, 8)
    b, d, f = mx.Dimension("batch", nb), mx.Dimension("d", 4), mx.Dimension("f", nf)
    x = mx.mesh_split(mx.placeholder(mesh, "x", [b, d]), ["x", None])
    w = mx.mesh_split(mx.placeholder(mesh, "w", [d, f]), [None, "x"])
    h = mx.relu(mx.einsum(x, w, output_shape=[b, f]))
    low = _lowering(h)
    assert low.layout_of(h) == ("f:x" if larger == "w" else "batch:x")
    fn = low.function(h)
    xv, wv = rand([nb, 4], 1), rand([4, nf], 2)
    assert_close(fn({"x": xv, "w": wv}), np.maximum(xv @ wv, 0))
    assert fn.counters["allgather"].values == 8 * 4 // 2  # (the smaller one's other half)


@pytest.mark.parametrize(
    "mesh,layout,weight_layout,config",
    [
        ("x:2;y:4", "", None, {"sharding": "gspmd-2d-attempt1"}),
        ("rows:2;cols:4", "batch:rows", "d_model:cols", {}),  # weights split one way, activations another
        ("x:2;y:4", "", None, {"sharding": "gspmd-2d-finalized"}),  # annotations, the rest propagated
        ("stage:2;x:2;y:2", "stage:stage", None, {"sharding": "gspmd-2d-finalized", "pipeline_stages": 2}),  # a loop
    ],
)
def test_the_worklist_plans_a_training_step_as_full_sweeps_do(mesh, layout, weight_layout, config):
    """Propagation visits only the ops next to a tensor that changed (and, as the level rises,
    the ops with pairs at it); sweeping every op every time gives the same plan and origins."""
    from meshax.models.transformer import TransformerConfig
    from meshax.optimize import AdamWeightDecayOptimizer
    from meshax.train import LmTask
    from meshax.train.loop import build
    from tests.fuzz import same_as_full_sweeps

    model = TransformerConfig(vocab_size=32, d_model=16, d_ff=32, num_heads=4, d_kv=4, num_layers=2, **config)
    task = LmTask(model=model, source="markov", markov_vocab=32, batch_size=8, length=8, sharding=model.sharding)
    lowering, _, _ = build(
        task, mesh, layout, "simd", AdamWeightDecayOptimizer(1e-3), compile=False, weight_layout=weight_layout
    )
    assert any(o.startswith("propagated") for origins in lowering.plan.propagation.origin.values() for o in origins)
    same_as_full_sweeps(lowering.plan)
