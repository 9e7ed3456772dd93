"""mx.scan: a loop in the IR, lowered to one lax.scan, with gradients; checked against the same
body unrolled by hand, on both backends."""

import numpy as np
import pytest

import meshax as mx
from meshax.lower.hlo import hlo_collectives
from tests.conftest import counted_and_compiled

B, D, E = mx.Dimension("batch", 4), mx.Dimension("d", 6), mx.Dimension("e", 6)


def _layer(h, w):
    return mx.rename_dimension(mx.tanh(mx.einsum(h, w, output_shape=[B, E])), "e", "d")


def _model(layers: int):
    """A scanned stack of `layers` tanh layers and the same layers unrolled, with losses and grads."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    L = mx.Dimension("layers", layers)
    x = mx.placeholder(mesh, "x", [B, D])
    w = mx.get_variable(mesh, "w", [L, D, E], initializer=mx.initializers.normal(0.4))

    def body(carry, xs):
        y = _layer(carry[0], xs[0])
        return [y], [mx.reduce_sum(y)]

    (out,), (sums,) = mx.scan(body, [x], [w], dim="layers")
    loss = mx.reduce_sum(out * out) + mx.reduce_sum(sums)
    h, total = x, None
    for i in range(layers):
        h = _layer(h, mx.reshape(mx.slice(w, i, 1, "layers"), [D, E]))
        total = mx.reduce_sum(h) if total is None else total + mx.reduce_sum(h)
    unrolled = mx.reduce_sum(h * h) + total
    return graph, mesh, [loss, *mx.gradients(loss, [w, x])], [unrolled, *mx.gradients(unrolled, [w, x])]


def _check_against_unrolled(graph, mesh, mesh_shape: str, layout: str, scanned, unrolled, feeds) -> None:
    """The scanned outputs equal the unrolled ones, and the scanned program's counters the HLO's."""
    got = mx.Lowering(graph, {mesh: mx.SimdMeshImpl(mesh_shape, layout)}).function([*scanned, *unrolled])(feeds)
    for a, want in zip(got[: len(scanned)], got[len(scanned) :]):
        np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-6)
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl(mesh_shape, layout)}).function(scanned)
    fn(feeds)
    counted, compiled = counted_and_compiled(fn)
    assert counted == compiled


CASES = [
    (mx.SimdMeshImpl, "rows:2;cols:4", ""),
    (mx.SimdMeshImpl, "rows:2;cols:4", "batch:rows;e:cols"),
    (mx.SimdMeshImpl, "rows:2;cols:4", "d:cols"),
    (mx.PlacementMeshImpl, "rows:2;cols:2", "batch:rows;e:cols"),  # (one layout: it is slow; SIMD runs all)
]


@pytest.mark.parametrize("backend,mesh_shape,layout", CASES)
def test_scan_equals_unrolled(backend, mesh_shape, layout):
    graph, mesh, scanned, unrolled = _model(3)
    fn = mx.Lowering(graph, {mesh: backend(mesh_shape, layout)}).function([*scanned, *unrolled])
    got = fn({"x": np.random.RandomState(0).randn(4, 6).astype(np.float32)})
    for a, b in zip(got[:3], got[3:]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert np.abs(got[1]).max() > 0.01  # the weights' gradient is not trivially zero


def test_program_does_not_grow_with_iterations():
    sizes = []
    for layers in (2, 16):
        graph, mesh, scanned, _ = _model(layers)
        lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "batch:rows;e:cols")})
        sizes.append(len(lowering.trace_program(scanned)[1].jaxpr.eqns))
    assert sizes[0] == sizes[1]


def test_counters_per_iteration_equal_compiled_hlo():
    """meshax counts a loop body's collectives once per iteration; XLA's text holds the body
    once. So with c(n) the counters for n iterations, per iteration p = (c(5) - c(2)) / 3 and
    outside the loops c(2) - 2p, the compiled program must hold (c(2) - 2p) + p of each kind."""
    counts = {}
    for layers in (2, 5):
        graph, mesh, scanned, _ = _model(layers)
        lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "batch:rows;e:cols")})
        fn = lowering.function(scanned)
        counts[layers] = {k: (fn.counters[k].count, fn.counters[k].values) for k in ("allreduce", "allgather")}
    hlo = hlo_collectives(fn.compiled_text())
    for kind, (c5, v5) in counts[5].items():
        c2, v2 = counts[2][kind]
        per = ((c5 - c2) // 3, (v5 - v2) // 3)
        assert per[0] > 0 and (c5 - c2) % 3 == 0
        assert hlo[kind]["count"] == c2 - per[0], kind
        assert hlo[kind]["values"] == v2 - per[1], kind


@pytest.mark.parametrize("layers", [2, 5])
@pytest.mark.parametrize("layout", ["batch:rows;e:cols", "d:cols"])
def test_counters_equal_the_hlo_run_per_run(layers, layout):
    """`hlo_collectives(text, per_run=True)` counts a loop body's collectives times the trip
    count XLA knows, as meshax's counters count them: the two are equal, kind by kind."""
    graph, mesh, scanned, _ = _model(layers)
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", layout)}).function(scanned)
    counted, compiled = counted_and_compiled(fn)
    assert counted == compiled
    once = hlo_collectives(fn.compiled_text())
    assert compiled["allreduce"][0] > once["allreduce"]["count"] > 0  # (the bodies hold some)


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("grad", [False, True])
def test_a_scanned_result_nothing_reads_is_not_computed(layers, grad):
    """The per-step sums nobody reads: XLA drops their work, and the counters counted their
    allreduces anyway (1 and 2 layers under d:cols, forward: 3 allreduces of 26 values and 5 of
    51 counted, 2 of 25 and 3 of 49 compiled). Values as when they are read."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", [B, D])
    w = mx.get_variable(mesh, "w", [mx.Dimension("layers", layers), D, E], initializer=mx.initializers.normal(0.4))

    def body(carry, xs):
        y = _layer(carry[0], xs[0])
        return [y], [mx.reduce_sum(y)]

    (out,), (sums,) = mx.scan(body, [x], [w], dim="layers")
    loss = mx.reduce_sum(out * out)
    outs = [loss, *mx.gradients(loss, [w, x])] if grad else [loss]
    lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "d:cols")})
    fn, both = lowering.function(outs), lowering.function([*outs, sums])
    feeds = {"x": np.random.RandomState(0).randn(4, 6).astype(np.float32)}
    for a, b in zip(fn(feeds), both(feeds)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    counted, compiled = counted_and_compiled(fn)
    assert counted == compiled
    assert fn.counters["allreduce"].count < both.counters["allreduce"].count


def test_a_loop_differentiates_for_what_the_gradient_reaches_alone():
    """A constant the body reads (a per-feature scale) needs no gradient. The backward loop
    summed one anyway, an allreduce over the batch's rows per iteration that XLA drops as dead
    and the counters counted: 4 allreduces of 27 values against the compiled program's 3 of 25."""
    counts = {}
    for layers in (2, 5):
        graph = mx.Graph()
        mesh = mx.Mesh(graph, "m")
        x = mx.placeholder(mesh, "x", [B, D])
        w = mx.get_variable(mesh, "w", [mx.Dimension("layers", layers), D, E])
        scale = mx.import_tensor(mesh, np.linspace(0.5, 1.5, 6, dtype=np.float32), [E])

        def body(carry, xs, scale=scale):
            y = mx.tanh(mx.einsum(carry[0], xs[0], output_shape=[B, E]) * scale)
            return [mx.rename_dimension(y, "e", "d")], []

        (out,), _ = mx.scan(body, [x], [w], dim="layers")
        loss = mx.reduce_sum(out * out)
        lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "batch:rows;e:cols")})
        fn = lowering.function([loss, *mx.gradients(loss, [w, x])])
        counts[layers] = (fn.counters["allreduce"].count, fn.counters["allreduce"].values)
    hlo = hlo_collectives(fn.compiled_text())["allreduce"]
    (c2, v2), (c5, v5) = counts[2], counts[5]
    assert (hlo["count"], hlo["values"]) == (c2 - (c5 - c2) // 3, v2 - (v5 - v2) // 3)


@pytest.mark.parametrize("layers", [1, 3])
def test_a_scanned_tensor_the_body_does_not_read_is_not_moved(layers):
    """A scanned tensor is laid out for the loop (its dim whole) only if the body reads it: u
    [layers, d], layers split over cols, scanned beside w but never read, was gathered all the
    same, and XLA dropped the gather (the loss and its gradients, 1 layer or 3: 2 allgathers
    of 42 values counted, w's and u's, 1 of 36 compiled, w's)."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    L = mx.Dimension("layers", layers)
    x = mx.placeholder(mesh, "x", [B, D])
    w = mx.placeholder(mesh, "w", [L, D, E])
    u = mx.placeholder(mesh, "u", [L, D])

    def body(carry, xs):
        return [_layer(carry[0], xs[0])], []

    (out,), _ = mx.scan(body, [x], [w, u], dim="layers")
    loss = mx.reduce_sum(out * out)
    h = x
    for i in range(layers):
        h = _layer(h, mx.reshape(mx.slice(w, i, 1, "layers"), [D, E]))
    unrolled = mx.reduce_sum(h * h)
    rng = np.random.RandomState(0)
    feeds = {"x": rng.randn(4, 6), "w": rng.randn(layers, 6, 6) * 0.4, "u": rng.randn(layers, 6)}
    feeds = {k: v.astype(np.float32) for k, v in feeds.items()}
    scanned = [loss, *mx.gradients(loss, [w, x])]
    _check_against_unrolled(
        graph, mesh, "rows:2;cols:4", "layers:cols", scanned, [unrolled, *mx.gradients(unrolled, [w, x])], feeds
    )


@pytest.mark.parametrize("layout", ["d:cols", "batch:rows;e:cols"])
def test_a_one_trip_loops_gradient_goes_on_from_its_forward_trip(layout):
    """XLA inlines a loop of one trip, and the backward loop's recomputation of the forward trip
    then repeats the forward's ops on the same values: XLA merged them (d split over cols: the
    einsum's allreduce of 24 values, counted twice, ran once: 4 allreduces of 50 counted, 3 of
    26 compiled). A backward loop of one trip goes on from its forward trip's values instead.
    Outside values alone reach a collective too (a scale from w)."""
    graph, mesh, scanned, unrolled = _model(1)
    feeds = {"x": np.random.RandomState(0).randn(4, 6).astype(np.float32)}
    _check_against_unrolled(graph, mesh, "rows:2;cols:4", layout, scanned, unrolled, feeds)

    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", [mx.Dimension("layers", 1), B, D])
    w = mx.get_variable(mesh, "w", [D, E], initializer=mx.initializers.normal(0.4))

    def body(carry, xs):
        scale = mx.reduce_sum(mx.tanh(w), reduced_dim=D)  # (of w alone: an allreduce over cols)
        return [], [mx.tanh(mx.einsum(xs[0], w, output_shape=[B, E])) * scale]

    _, (ys,) = mx.scan(body, [], [x], dim="layers")
    loss = mx.reduce_sum(ys * ys)
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", layout)}).function(
        [loss, *mx.gradients(loss, [w, x])]
    )
    fn({"x": np.random.RandomState(0).randn(1, 4, 6).astype(np.float32)})
    counted, hlo = counted_and_compiled(fn)
    assert counted == hlo


def test_a_one_trip_loops_gradient_is_not_held_apart_by_a_barrier():
    """The first fix passed the backward trip's inputs through an optimization barrier (as
    recompute_grad does), but XLA for the CPU merges computations across one: with d (3) split
    unevenly over rows (4), a centred layer, an einsum and a softmax, the backward trip's gather
    of w merged with the forward's (11 allgathers of 42 values counted, 10 of 39 compiled)."""
    b, d, e = mx.Dimension("batch", 4), mx.Dimension("d", 3), mx.Dimension("e", 3)
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", [b, d])
    w = mx.placeholder(mesh, "w", [mx.Dimension("layers", 1), d, e])

    def body(carry, xs):
        h = mx.shard(carry[0] - mx.reduce_mean(carry[0], reduced_dim=b), "")
        h = mx.shard(mx.rename_dimension(mx.einsum(h, xs[0], output_shape=[b, e]), "e", "d") * 0.5, "")
        h = mx.shard(mx.softmax(h, d), "")
        return [h], [mx.reduce_sum(h)]

    (out,), (sums,) = mx.scan(body, [x], [w], dim="layers")
    loss = mx.reduce_sum(out * out) + mx.reduce_sum(sums)
    h = mx.shard(x - mx.reduce_mean(x, reduced_dim=b), "")
    h = mx.rename_dimension(mx.einsum(h, mx.reshape(w, [d, e]), output_shape=[b, e]), "e", "d") * 0.5
    h = mx.softmax(h, d)
    unrolled = mx.reduce_sum(h * h) + mx.reduce_sum(h)
    rs = np.random.RandomState(0)
    feeds = {"x": rs.randn(4, 3).astype(np.float32), "w": rs.randn(1, 3, 3).astype(np.float32)}
    scanned, unrolled = [loss, *mx.gradients(loss, [x, w])], [unrolled, *mx.gradients(unrolled, [x, w])]
    _check_against_unrolled(graph, mesh, "rows:4;cols:2", "d:rows", scanned, unrolled, feeds)


def test_a_one_trip_loop_inside_a_one_trip_loop_goes_on_from_its_forward_trip_too():
    """The backward trip of the outer loop goes on from the outer forward trip, so the inner
    backward loop it lowers must find the inner forward trip there too: it recomputed it, and
    XLA merged the copies (d split over cols: 5 allreduces of 74 values counted, 4 of 50 compiled)."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", [B, D])
    w = mx.get_variable(mesh, "w", [mx.Dimension("layers", 1), D, E], initializer=mx.initializers.normal(0.4))

    def body(carry, xs):
        def inner(c, xx):
            return [_layer(c[0], xx[0])], []

        (y,), _ = mx.scan(
            inner, [_layer(carry[0], xs[0])], [mx.reshape(xs[0], [mx.Dimension("l2", 1), D, E])], dim="l2"
        )
        return [y], [mx.reduce_sum(y)]

    (out,), (sums,) = mx.scan(body, [x], [w], dim="layers")
    loss = mx.reduce_sum(out * out) + mx.reduce_sum(sums)
    w1 = mx.reshape(w, [D, E])
    h = _layer(_layer(x, w1), w1)
    unrolled = mx.reduce_sum(h * h) + mx.reduce_sum(h)
    scanned, unrolled = [loss, *mx.gradients(loss, [w, x])], [unrolled, *mx.gradients(unrolled, [w, x])]
    feeds = {"x": np.random.RandomState(0).randn(4, 6).astype(np.float32)}
    _check_against_unrolled(graph, mesh, "rows:2;cols:4", "d:cols", scanned, unrolled, feeds)


def test_random_ops_draw_new_values_each_iteration():
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    n = mx.Dimension("n", 3)

    def body(carry, xs):
        return carry, [mx.random_uniform(mesh, [D])]

    _, (draws,) = mx.scan(body, [mx.zeros(mesh, [B])], dim=n)
    got = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "d:cols")}).function(draws)({}, seed=1)
    assert got.shape == (3, 6)
    assert len({tuple(r) for r in got.round(6)}) == 3


def test_scan_errors():
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", [B, D])
    with pytest.raises(mx.GraphError, match="keep its shape and dtype"):
        mx.scan(lambda c, t: ([mx.reduce_sum(c[0])], []), [x], dim=mx.Dimension("n", 2))
    with pytest.raises(mx.GraphError, match="lacks it"):
        mx.scan(lambda c, t: (c, []), [x], [x], dim=mx.Dimension("n", 2))
    with pytest.raises(mx.GraphError, match="needs dim="):
        mx.scan(lambda c, t: (c, []), [x])


def test_annotations_propagate_across_the_loop_boundary():
    """An annotation on the scanned input reaches the loop's body (the carry's variable, the
    body's ops, the new carry) and the final value, as through an identity; values unchanged."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    L = mx.Dimension("layers", 3)
    x = mx.mesh_split(mx.placeholder(mesh, "x", [B, D]), ["rows", None])
    w = mx.get_variable(mesh, "w", [L, D, E], initializer=mx.initializers.normal(0.4))
    (out,), _ = mx.scan(lambda c, xs: ([_layer(c[0], xs[0])], []), [x], [w], dim="layers")
    low = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4")})
    (scan,) = [op for op in graph.operations if type(op).__name__ == "ScanOperation"]
    inside = [scan.carry_vars[0], *(t for op in scan.body for t in op.outputs if B in t.shape)]
    assert [low.layout_of(t) for t in [*inside, out]] == ["batch:rows"] * (len(inside) + 1)
    assert "the loop boundary" in low.explain()
    v = np.random.RandomState(0).randn(4, 6).astype(np.float32)
    unsplit = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:1")})
    np.testing.assert_allclose(low.function(out)({"x": v}), unsplit.function(out)({"x": v}), rtol=1e-6)


@pytest.mark.parametrize("layers", [1, 3])
def test_a_gradient_the_same_at_every_step_is_made_in_the_backward_body(layers):
    """The per-step results summed into the loss have a constant gradient, a broadcast over the
    loop's dim: scanned into the backward loop, its slices were gathered where the body wants
    them laid out otherwise, once per step, and XLA folds a gather of a constant (x [b=8, h=4,
    w=4, c=4] over c:cols, the final carry annotated w:cols, 3 layers: 6 allgathers of 480
    values counted, 3 of 384 compiled). Values against jax.grad of the same loop."""
    import jax
    import jax.numpy as jnp

    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    b, h, w_, c, k = (mx.Dimension(n, s) for n, s in [("b", 8), ("h", 4), ("w", 4), ("c", 4), ("k2", 4)])
    x = mx.placeholder(mesh, "x", [b, h, w_, c])
    w = mx.get_variable(mesh, "w", [mx.Dimension("L", layers), c, k], initializer=mx.initializers.normal(0.5))

    def body(carry, xs):
        y = mx.rename_dimension(mx.tanh(mx.einsum(carry[0], xs[0], output_shape=[b, h, w_, k])), "k2", "c")
        return [y], [mx.reduce_sum(y, reduced_dim=c)]

    (out,), (ys,) = mx.scan(body, [x], [w], dim="L")
    loss = mx.reduce_sum(mx.shard(out, "w:cols")) + mx.reduce_sum(ys) * 0.01
    outputs = [loss, *mx.gradients(loss, [x, w])]
    lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "c:cols")})
    fn = lowering.function(outputs)
    xv = np.random.RandomState(0).randn(8, 4, 4, 4).astype(np.float32)
    got = fn({"x": xv})

    def reference(xv, wv):
        hv, total = xv, 0.0
        for i in range(layers):
            hv = jnp.tanh(jnp.einsum("bhwc,ck->bhwk", hv, wv[i]))
            total = total + hv.sum() * 0.01
        return hv.sum() + total

    wv = jnp.asarray(lowering.variable_value(w))
    want = [reference(xv, wv), *jax.grad(reference, argnums=(0, 1))(xv, wv)]
    for a, e in zip(got, want):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5)
    counted, compiled = counted_and_compiled(fn)
    assert counted == compiled


# ---- while_loop: a trip count the data decide ---------------------------------------------------
def _halving(layout_dims=("batch", "d")):
    """Halve x until its squared norm (a sum over the split dims: a collective in the condition)
    is below 1, counting the halvings; a weight built outside is read by the body."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", [B, D])
    w = mx.placeholder(mesh, "w", [D, E])
    n0 = mx.zeros(mesh, [], dtype=np.int32)

    def cond(h, n):
        return mx.less(mx.reduce_sum(h * h), 1.0)

    def body(h, n):
        return [mx.rename_dimension(mx.einsum(h, w, output_shape=[B, E]), "e", "d") * 0.5, n + 1]

    h, n = mx.while_loop(lambda h, n: mx.logical_not(cond(h, n)), body, [x, n0])
    return graph, mesh, h, n


def _halving_numpy(x, w):
    h, n = x.astype(np.float64), 0
    while (h * h).sum() >= 1.0:
        h, n = h @ w * 0.5, n + 1
    return h, n


@pytest.mark.parametrize(
    "backend,mesh_shape,layout",
    [
        (mx.SimdMeshImpl, "rows:2;cols:4", ""),
        (mx.SimdMeshImpl, "rows:2;cols:4", "batch:rows;d:cols"),
        (mx.SimdMeshImpl, "rows:2;cols:4", "batch:rows;e:cols"),
        (mx.PlacementMeshImpl, "rows:2;cols:2", "batch:rows;d:cols"),
    ],
)
def test_while_loop_runs_until_its_condition_fails(backend, mesh_shape, layout):
    rng = np.random.RandomState(1)
    xv, wv = (rng.randn(4, 6) * 3).astype(np.float32), (rng.randn(6, 6) * 0.4).astype(np.float32)
    graph, mesh, h, n = _halving()
    after = mx.reduce_sum(h * h)  # an op after the loop: its program position must not shift
    fn = mx.Lowering(graph, {mesh: backend(mesh_shape, layout)}).function([h, n, after])
    trips = set()
    for scale in (1, 10, 0.01):  # run again with other trip counts (0 included): the same program
        got_h, got_n, got_after = fn({"x": xv * scale, "w": wv})
        want_h, want_n = _halving_numpy(xv * scale, wv)
        assert int(got_n) == want_n
        np.testing.assert_allclose(got_h, want_h, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(got_after, (want_h**2).sum(), rtol=1e-4)
        trips.add(want_n)
    assert len(trips) == 3 and 0 in trips and max(trips) >= 3
    if layout:  # the condition's sum over split dims is an allreduce, counted once (one iteration)
        assert fn.counters["allreduce"].count >= 1
    if backend is mx.SimdMeshImpl:
        found = hlo_collectives(fn.compiled_text())
        assert {k: v["count"] for k, v in found.items()} == {k: fn.counters[k].count for k in found}
        assert {k: v["values"] for k, v in found.items()} == {k: fn.counters[k].values for k in found}


@pytest.mark.parametrize(
    "backend,mesh_shape,layout",
    [
        (mx.SimdMeshImpl, "rows:2;cols:4", ""),
        (mx.SimdMeshImpl, "rows:2;cols:4", "batch:rows;d:cols"),
        (mx.PlacementMeshImpl, "rows:2;cols:2", "batch:rows;d:cols"),
    ],
)
def test_while_loop_accumulators_are_summed_over_the_iterations_and_settled_once(backend, mesh_shape, layout):
    """Mesh-TensorFlow's `has_accumulators`: the body's values after the new loop variables are
    summed over the iterations and returned after them. A sum the body owes (x's sum over the
    batch split over rows, its product with h's d split over cols) is carried owed and settled
    once, after the loop: one allreduce per accumulator, not one per iteration."""
    rng = np.random.RandomState(2)
    xv, wv = (rng.randn(4, 6) * 3).astype(np.float32), (rng.randn(6, 6) * 0.4).astype(np.float32)
    graph, mesh, _, _ = _halving()  # (x and w, and a loop this test does not run)
    x = graph.operations[0].outputs[0]

    def body(h, i):
        scaled = x * mx.cast(i + 1, "float32")
        return [h * 0.5, i + 1, mx.reduce_sum(scaled, reduced_dim=B), mx.reduce_sum(h * scaled), scaled]

    _, trips, by_d, total, whole = mx.while_loop(
        lambda h, i: mx.greater_equal(mx.reduce_sum(h * h), 1.0),
        body,
        [x, mx.zeros(mesh, [], np.int32)],
        has_accumulators=True,
    )
    fn = mx.Lowering(graph, {mesh: backend(mesh_shape, layout)}).function([trips, by_d, total, whole])
    got_trips, got_by_d, got_total, got_whole = fn({"x": xv, "w": wv})
    h, weights, dots = xv.astype(np.float64), [], []
    while (h * h).sum() >= 1.0:
        weights.append(len(weights) + 1)
        dots.append((h * xv * weights[-1]).sum())
        h = h * 0.5
    assert int(got_trips) == len(weights) >= 3
    np.testing.assert_allclose(got_by_d, xv.sum(0) * sum(weights), rtol=1e-5)
    np.testing.assert_allclose(got_total, sum(dots), rtol=1e-4)
    np.testing.assert_allclose(got_whole, xv * sum(weights), rtol=1e-5)
    if backend is mx.SimdMeshImpl:
        counted, compiled = counted_and_compiled(fn)
        assert counted == compiled
        # the condition's sum (in the loop: once, as XLA holds it) and one per owed accumulator
        assert counted.get("allreduce", (0, 0))[0] == (3 if layout else 0)


def test_an_owed_accumulator_is_settled_after_the_loop_not_in_it():
    """Three trips (XLA knows the count, and counts a collective in the loop three times): the
    batch sum owed over rows is summed owed, then allreduced once (before: each trip's value was
    settled in the loop, 3 allreduces of 6 values run against 1 counted)."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", [B, D])

    def body(i):
        return [i + 1, mx.reduce_sum(x * mx.cast(i + 1, "float32"), reduced_dim=B)]

    _, by_d = mx.while_loop(lambda i: mx.less(i, 3), body, [mx.zeros(mesh, [], np.int32)], has_accumulators=True)
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "batch:rows")}).function([by_d])
    xv = np.random.RandomState(3).randn(4, 6).astype(np.float32)
    np.testing.assert_allclose(fn({"x": xv})[0], xv.sum(0) * 6, rtol=1e-5)
    counted, compiled = counted_and_compiled(fn)
    assert counted == compiled == {"allreduce": (1, 6)}


@pytest.mark.parametrize("backend", [mx.SimdMeshImpl, mx.PlacementMeshImpl])
def test_a_while_loop_of_no_trip_sums_its_accumulators_to_zeros(backend):
    """The placement backend runs a loop's body only while the condition holds, so a loop of no
    trip never lowered its body, and the sums it owes (found there) were missing: KeyError on
    the accumulator (x [batch=4, d=6] over batch:rows, the accumulator a sum over the batch)."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", [B, D])
    n = mx.placeholder(mesh, "n", [], dtype=np.int32)

    def body(i):
        return [i + 1, mx.reduce_sum(x * mx.cast(i + 1, "float32"), reduced_dim=B)]

    _, by_d = mx.while_loop(lambda i: mx.less(i, n), body, [mx.zeros(mesh, [], np.int32)], has_accumulators=True)
    fn = mx.Lowering(graph, {mesh: backend("rows:2;cols:2", "batch:rows")}).function([by_d])
    xv = np.random.RandomState(4).randn(4, 6).astype(np.float32)
    for trips, weight in [(0, 0), (2, 3)]:
        np.testing.assert_allclose(fn({"x": xv, "n": np.int32(trips)})[0], xv.sum(0) * weight, rtol=1e-5)


def test_while_loop_errors_name_the_cause():
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", [B, D])
    with pytest.raises(mx.GraphError, match=r"cond_fn must return a scalar meshax Tensor \(shape \[\]\), got"):
        mx.while_loop(lambda h: h, lambda h: [h], [x])
    with pytest.raises(mx.GraphError, match="keep its shape and dtype"):
        mx.while_loop(lambda h: mx.reduce_sum(h) > 0, lambda h: [mx.reduce_sum(h, reduced_dim=D)], [x])
    with pytest.raises(mx.GraphError, match=r"returned 2 values for 1 inputs; .* pass has_accumulators=True"):
        mx.while_loop(lambda h: mx.reduce_sum(h) > 0, lambda h: [h, h], [x])
    w = mx.get_variable(mesh, "w", [D], initializer=mx.initializers.ones())
    (out,) = mx.while_loop(lambda h: mx.reduce_sum(h) > 0, lambda h: [h * 0.5], [x * w])
    with pytest.raises(mx.GraphError, match=r"not differentiable.*mx\.scan"):
        mx.gradients(mx.reduce_sum(out), [w])


def test_the_plans_activation_memory_counts_one_iteration_of_a_loop_body():
    """The backward loop recomputes each iteration's body and holds its internals while that
    iteration's gradient runs (a pipeline's stage among them): the plan counts the body's
    tensors once, as it counts a rematerialized layer's. Without them its activation memory,
    its 'upper bound', was 1/97 of XLA's temporaries here: a pipelined model's search under a
    memory budget could pick a layout that does not fit."""
    from meshax.plan import memory_per_device

    n, b, d, h = mx.Dimension("layers", 4), mx.Dimension("b", 64), mx.Dimension("d", 16), mx.Dimension("h", 2048)
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", [b, d])
    w1, w2 = mx.get_variable(mesh, "w1", [n, d, h]), mx.get_variable(mesh, "w2", [n, h, d])

    def body(c, ws):
        inner = mx.tanh(mx.einsum(c[0], ws[0], reduced_dims=[d]))  # [b, h]: the body's large tensors
        return [mx.tanh(mx.einsum(mx.exp(inner) * inner, ws[1], reduced_dims=[h])) + c[0]], []

    (out,), _ = mx.scan(body, [x], [w1, w2], dim="layers")
    loss = mx.reduce_sum(mx.square(out))
    lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:1", "")})
    fn = lowering.function([loss, *mx.gradients(loss, [w1, w2])])
    (scan,) = [op for op in graph.operations if type(op).__name__ == "ScanOperation" and op.grad_of is None]
    inside = sum(t.shape.size * t.dtype.itemsize for op in scan.body for t in op.outputs)
    activations = memory_per_device(lowering, [loss])["activations"]
    assert activations > inside > 4 * b.size * h.size  # (one iteration's internals: several [b, h])
    temp = fn._run.compiled().memory_analysis().temp_size_in_bytes
    assert temp / 2 < activations < 2 * temp


def test_constants_and_placeholders_made_in_a_body_are_the_programs_inputs():
    """An import_tensor or placeholder made inside a scan's body (mx.pipeline's own tables, when a
    stage runs a pipeline of its own) was lowered as part of the body, where inputs have no
    lowering: NotImplementedError 'ImportTensorOperation has no lowering'."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    b, d, steps = mx.Dimension("batch", 8), mx.Dimension("d", 4), mx.Dimension("steps", 3)
    x = mx.placeholder(mesh, "x", [b, d])
    xs = mx.placeholder(mesh, "xs", [steps, d])

    def body(carry, per_step):
        (h,), (row,) = carry, per_step
        scale = mx.import_tensor(mesh, np.arange(1.0, 5.0, dtype=np.float32), [d])
        shift = mx.placeholder(mesh, "shift", [d])
        return [h * scale + row + shift], []

    (out,), _ = mx.scan(body, [x], [xs], dim="steps")
    (grad,) = mx.gradients(mx.reduce_sum(out), [x])
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "batch:rows;d:cols")}).function([out, grad])
    rng = np.random.default_rng(0)
    feeds = {"x": rng.normal(size=(8, 4)), "xs": rng.normal(size=(3, 4)), "shift": rng.normal(size=4)}
    want, scale = feeds["x"], np.arange(1.0, 5.0)
    for row in feeds["xs"]:
        want = want * scale + row + feeds["shift"]
    got, g = fn({k: v.astype(np.float32) for k, v in feeds.items()})
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(g, np.broadcast_to(scale**3, (8, 4)), rtol=1e-6)

    graph = mx.Graph()  # a pipeline whose stage runs a pipeline of its own: 2 x 2 doublings
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", [b, d])

    def stage(h):
        return mx.pipeline(lambda g: g * 2.0, h, mx.Dimension("inner", 2), 2, name="inner", batch_dim="batch")

    out = mx.pipeline(stage, x, mx.Dimension("stage", 2), 2)
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "stage:rows")}).function(out)
    np.testing.assert_array_equal(fn({"x": np.ones((8, 4), np.float32)}), np.full((8, 4), 16.0))
