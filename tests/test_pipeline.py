"""mx.pipeline: GPipe and circular schedules over a stage dim, checked against the same layers
run one after another; the schedule's bubbles against the formulas; the shift's permutes
against the compiled HLO."""

import numpy as np
import pytest

import meshax as mx
from meshax.lower.hlo import hlo_collectives
from meshax.ops.variables import global_step, reuse_variables
from meshax.pipeline import Schedule

B, D, E = mx.Dimension("batch", 8), mx.Dimension("d", 6), mx.Dimension("e", 6)


def _layer(h, w, b, side):
    rows = [d for d in h.shape if d.name != "d"]
    y = mx.einsum(h, w, output_shape=[*rows, E]) + b
    if side is not None:
        y = y + mx.rename_dimension(side, "d", "e")
    return mx.rename_dimension(mx.tanh(y), "e", "d")


def _model(stages, microbatches, repeats=1, side=False):
    """A pipelined stack of tanh layers and the same layers run one after another (layer
    r*S + s is stage s's weights on pass r): (graph, mesh, [loss, grads], [loss, grads])."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    stage = mx.Dimension("stage", stages)
    x = mx.placeholder(mesh, "x", [B, D])
    memory = mx.placeholder(mesh, "memory", [B, D])

    def stage_fn(h, *sides):
        w = mx.get_variable(mesh, "w", [D, E], initializer=mx.initializers.normal(0.5))
        b = mx.get_variable(mesh, "b", [E], initializer=mx.initializers.normal(0.5))
        return _layer(h, w, b, sides[0] if sides else None)

    schedule = "circular" if repeats > 1 else "gpipe"
    out = mx.pipeline(stage_fn, [x, memory] if side else x, stage, microbatches, schedule, repeats)
    loss = mx.reduce_sum(out * out)
    w, b = (v.value for v in graph.trainable_variables)
    h = x
    for layer in range(stages * repeats):
        r, s = divmod(layer, stages)

        def pick(v, r=r, s=s):
            if repeats > 1:
                v = mx.reshape(mx.slice(v, r, 1, "repeat"), v.shape.dims[1:])
            return mx.reshape(mx.slice(v, s, 1, "stage"), v.shape.dims[1:])

        h = _layer(h, pick(w), pick(b), memory if side else None)
    reference = mx.reduce_sum(h * h)
    return graph, mesh, [loss, *mx.gradients(loss, [w, b, x])], [reference, *mx.gradients(reference, [w, b, x])]


def _feeds():
    rs = np.random.RandomState(0)
    return {"x": rs.randn(8, 6).astype(np.float32), "memory": rs.randn(8, 6).astype(np.float32)}


CASES = [
    # (backend, mesh, layout, stages, microbatches, repeats, side input)
    (mx.SimdMeshImpl, "rows:2;cols:4", "", 2, 4, 1, False),
    (mx.SimdMeshImpl, "rows:2;cols:4", "stage:rows;batch:cols", 2, 2, 1, True),
    (mx.SimdMeshImpl, "rows:2;cols:4", "stage:cols;e:rows", 4, 4, 2, False),
    (mx.SimdMeshImpl, "rows:2;cols:4", "stage:rows", 2, 4, 3, True),
    # the placement backend: the case with repeats and a side input (SIMD runs the others)
    pytest.param(mx.PlacementMeshImpl, "rows:2;cols:2", "stage:cols", 2, 2, 2, True, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("backend,mesh_shape,layout,stages,microbatches,repeats,side", CASES)
def test_pipeline_equals_layers_in_sequence(backend, mesh_shape, layout, stages, microbatches, repeats, side):
    graph, mesh, piped, reference = _model(stages, microbatches, repeats, side)
    lowering = mx.Lowering(graph, {mesh: backend(mesh_shape, layout)})
    got = lowering.function([*piped, *reference])(_feeds())
    for a, b in zip(got[:4], got[4:]):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    assert all(np.abs(g).max() > 1e-3 for g in got[1:4])
    w = graph.trainable_variables[0].value
    assert w.shape.dimension_names == (["repeat"] if repeats > 1 else []) + ["stage", "d", "e"]
    if "stage" in layout:
        assert lowering.layout_of(w).startswith("stage:")


SCHEDULES = [(2, 4, 1), (4, 4, 1), (4, 16, 1), (3, 5, 1), (4, 4, 2), (4, 8, 3)]


@pytest.mark.parametrize("stages,microbatches,repeats", SCHEDULES)
def test_bubbles_equal_the_formulas(stages, microbatches, repeats):
    s = Schedule(stages, microbatches, repeats)
    assert s.iterations == repeats * microbatches + stages - 1
    assert s.bubble_fraction == pytest.approx((stages - 1) / (repeats * microbatches + stages - 1))
    items = s.items
    for stage in range(stages):  # every stage runs every item once, in order
        assert list(items[:, stage][items[:, stage] >= 0]) == list(range(repeats * microbatches))
    if repeats > 1:  # a microbatch re-enters stage 0 only after it left the last stage
        left = {k: t for t, k in enumerate(items[:, -1]) if k >= 0}
        entered = {k: t for t, k in enumerate(items[:, 0]) if k >= 0}
        assert all(entered[k] > left[k - microbatches] for k in entered if k >= microbatches)


def test_program_does_not_grow_with_microbatches():
    sizes = []
    for microbatches in (2, 8):
        graph, mesh, piped, _ = _model(2, microbatches)
        lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "stage:rows")})
        sizes.append(len(lowering.trace_program(piped)[1].jaxpr.eqns))
    assert sizes[0] == sizes[1]


def test_permutes_per_iteration_equal_the_stage_activation_and_the_hlo():
    stages, microbatches = 2, 4
    graph, mesh, piped, _ = _model(stages, microbatches)
    lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "stage:rows;batch:cols")})
    fn = lowering.function(piped)
    permutes = fn.counters["permute"]
    iterations = microbatches + stages - 1
    # each device's slice of one stage's activation [batch 8 / 4 microbatches = 2, d 6], the
    # batch split over cols (4, so padded to 1 row each): 6 values; the forward shift, and in
    # the backward loop the recomputed shift and the gradient's shift back, once per iteration
    assert permutes.count == 3 * iterations
    assert {s.values for s in permutes.sites} == {1 * 6}
    hlo = hlo_collectives(fn.compiled_text())["permute"]
    assert hlo["count"] == 3  # XLA's text holds each loop body once
    assert hlo["values"] == permutes.values // iterations
    per_run = hlo_collectives(fn.compiled_text(), per_run=True)  # (the bodies times their trip counts)
    assert {k: (v["count"], v["values"]) for k, v in per_run.items()} == {
        k: (fn.counters[k].count, fn.counters[k].values) for k in per_run
    }


@pytest.mark.parametrize("layout", ["d:cols", "stage:rows;d:cols"])
def test_a_one_step_pipelines_gradient_is_counted_as_compiled(layout):
    """One stage and one microbatch: a loop of one trip, which XLA inlines; its backward loop's
    recomputation merged with the forward (d:cols: 3 allreduces of 97 values counted, 2 of 49
    compiled). Its backward loop goes on from the forward trip's values (see tests/test_loops.py)."""
    graph, mesh, piped, reference = _model(1, 1)
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", layout)}).function(piped)
    got = fn(_feeds())
    want = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "")}).function(reference)(_feeds())
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    counted = {k: (fn.counters[k].count, fn.counters[k].values) for k in fn.counters if fn.counters[k].count}
    hlo = {k: (v["count"], v["values"]) for k, v in hlo_collectives(fn.compiled_text()).items() if v["count"]}
    assert counted == hlo


def test_a_stage_reuses_a_variable_made_outside_whole():
    """A stage that reuses a variable made before the pipeline (a weight every stage shares, the
    global step that annealed dropout reads) gets it whole, as before stacked variables were
    reusable (f0fe643: "exists with shape [d=6], not [stage=2, d=6]"); one the stage makes is
    stacked, one index per stage."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", [B, D])
    mx.get_variable(mesh, "shared", [D], initializer=mx.initializers.constant(2.0))
    global_step(mesh)

    def stage(h):
        with reuse_variables():
            shared = mx.get_variable(mesh, "shared", [D], initializer=mx.initializers.zeros())
            step = mx.cast(global_step(mesh), "float32")
        return h * shared * mx.get_variable(mesh, "own", [D], initializer=mx.initializers.ones()) + step

    y = mx.pipeline(stage, x, mx.Dimension("stage", 2), 2)
    assert {v.name: v.shape.dimension_names for v in graph.all_variables} == {
        "shared": ["d"],
        "global_step": [],
        "own": ["stage", "d"],
    }
    v = np.random.RandomState(0).randn(B.size, D.size).astype(np.float32)
    got = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:1", "")}).function([y])({"x": v})[0]
    np.testing.assert_allclose(got, v * 4, rtol=1e-6)


def test_pipeline_errors():
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", [B, D])
    stage = mx.Dimension("stage", 4)
    with pytest.raises(mx.GraphError, match="3 microbatches do not divide"):
        mx.pipeline(lambda h: h, x, stage, 3)
    with pytest.raises(mx.GraphError, match=r"num_microbatches=2\.5 is not a whole number"):
        mx.pipeline(lambda h: h, x, stage, 2.5)  # (it ran as 2 microbatches)
    with pytest.raises(mx.GraphError, match=r"repeats=1\.5 is not a whole number"):
        mx.pipeline(lambda h: h, x, stage, 4, "circular", repeats=1.5)  # (it ran as GPipe)
    with pytest.raises(mx.GraphError, match="at least as many microbatches as stages"):
        mx.pipeline(lambda h: h, x, stage, 2, "circular", repeats=2)
    with pytest.raises(mx.GraphError, match="needs schedule='circular'"):
        mx.pipeline(lambda h: h, x, stage, 2, repeats=2)
    with pytest.raises(mx.GraphError, match="choose one of"):
        mx.pipeline(lambda h: h, x, stage, 2, "1f1b")
    with pytest.raises(mx.GraphError, match="must return a tensor of its input's shape"):
        mx.pipeline(lambda h: mx.reduce_sum(h), x, stage, 2)
    with pytest.raises(mx.GraphError, match="has no stages; give it a size of at least 1"):
        mx.pipeline(lambda h: h, x, mx.Dimension("stage", 0), 2)  # (a pad's "pad amounts must be >= 0")
    with pytest.raises(mx.GraphError, match="is a scalar; it needs a batch dim"):
        mx.pipeline(lambda h: h, mx.reduce_sum(x), stage, 2)  # (an IndexError)


def test_pipeline_refuses_bad_inputs_by_name():
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", [B, D])
    stage = mx.Dimension("stage", 2)
    for bad in (2, "stage"):  # (AttributeError: 'int' object has no attribute 'size')
        with pytest.raises(mx.GraphError, match="stage_dim must be a Dimension"):
            mx.pipeline(lambda h: h, x, bad, 2)
    with pytest.raises(mx.GraphError, match="inputs must be the activation x"):
        mx.pipeline(lambda h: h, [], stage, 2)  # (IndexError)
    with pytest.raises(mx.GraphError, match=r"activation tokens is int32.*cast it to a float dtype"):
        mx.pipeline(lambda h: h, mx.placeholder(mesh, "tokens", [B, D], dtype="int32"), stage, 2)
    with pytest.raises(mx.GraphError, match=r"shape and dtype .* float32, got .* bfloat16"):
        mx.pipeline(lambda h: mx.cast(h, "bfloat16"), x, stage, 2)  # (the scan's carry message)
    with pytest.raises(mx.GraphError, match=r"input y .* has a dim 'microbatch'"):
        mx.pipeline(lambda h: h, mx.placeholder(mesh, "y", [B, mx.Dimension("microbatch", 6)]), stage, 2)
    with pytest.raises(mx.GraphError, match=r"side input memory's batch dim .*16.* differs from x's"):
        memory = mx.placeholder(mesh, "memory", [mx.Dimension("batch", 16), D])
        mx.pipeline(lambda h, m: h, [x, memory], stage, 2)  # (accepted, as long as stage_fn ignored it)
    for taken in ("microbatch", "pipeline_iteration"):
        with pytest.raises(mx.GraphError, match=rf"stage dim .*'{taken}'.* has a name the pipeline gives"):
            mx.pipeline(lambda h: h, x, mx.Dimension(taken, 2), 2)
    with pytest.raises(mx.GraphError, match=r"stage dim .*'repeat'.* has a name the pipeline gives"):
        mx.pipeline(lambda h: h, x, mx.Dimension("repeat", 2), 2, "circular", repeats=2)


@pytest.mark.parametrize("repeats", [1, 2])
def test_integer_and_bool_side_inputs_reach_the_stages_in_their_dtype(repeats):
    """Each stage's microbatch of a side input was selected by a float32 one-hot table, so int32
    ids reached stage_fn as float32 (2**24 + 1 rounded to 2**24)."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", [B, D])
    ids = mx.placeholder(mesh, "ids", [B], "int32")
    keep = mx.placeholder(mesh, "keep", [B], "bool")
    seen = []

    def stage_fn(h, s, k):
        seen.append((s.dtype, k.dtype))
        return h + mx.cast(s - 2**24, "float32") * mx.cast(k, "float32")

    schedule = "circular" if repeats > 1 else "gpipe"
    out = mx.pipeline(stage_fn, [x, ids, keep], mx.Dimension("stage", 2), 2, schedule, repeats)
    assert set(seen) == {(np.dtype("int32"), np.dtype("bool"))}
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "stage:rows;batch:cols")}).function(out)
    feeds = {"x": np.zeros((8, 6), np.float32), "ids": np.full(8, 2**24 + 1, np.int32), "keep": np.arange(8) % 2 == 0}
    np.testing.assert_array_equal(np.asarray(fn(feeds))[:, 0], 2 * repeats * (np.arange(8) % 2 == 0))


def test_a_pipeline_in_a_stage_refuses_variables_the_outer_stages_would_share():
    """A variable made in an inner pipeline's stage got the inner stage dim alone: every outer
    stage shared it, without a word. Made in the outer stage_fn, each outer stage has its own."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", [B, D])

    def inner_stage(h):
        return _layer(h, mx.get_variable(mesh, "w", [D, E], initializer=mx.initializers.normal(0.5)), 0.0, None)

    def stage(h):
        return mx.pipeline(inner_stage, h, mx.Dimension("inner", 2), 2, name="inner", batch_dim="batch")

    with pytest.raises(mx.GraphError, match="made inside two stacked_variables at once"):
        mx.pipeline(stage, x, mx.Dimension("stage", 2), 2)

    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", [B, D])

    def outer_stage(h):
        w = mx.get_variable(mesh, "w", [D, E], initializer=mx.initializers.normal(0.5))
        return mx.pipeline(
            lambda g: _layer(g, w, 0.0, None), h, mx.Dimension("inner", 2), 2, name="inner", batch_dim="batch"
        )

    out = mx.pipeline(outer_stage, x, mx.Dimension("stage", 2), 2)
    (w,) = (v.value for v in graph.trainable_variables)
    assert w.shape.dimension_names == ["stage", "d", "e"]
    h = x
    for s in range(2):
        for _ in range(2):
            h = _layer(h, mx.reshape(mx.slice(w, s, 1, "stage"), [D, E]), 0.0, None)
    got, want = mx.reduce_sum(out * out), mx.reduce_sum(h * h)
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "stage:rows;batch:cols")}).function(
        [got, want, *mx.gradients(got, [w, x]), *mx.gradients(want, [w, x])]
    )
    values = fn({"x": _feeds()["x"]})
    for a, b in zip(values[:1] + values[2:4], values[1:2] + values[4:]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
