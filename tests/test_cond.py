"""mx.cond and mx.switch: one lax.switch in the SPMD program, only the branch taken running, with
gradients; checked against the same function written in JAX, on both backends."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshax as mx
from meshax.layout import convert_to_mesh_shape
from meshax.lower.hlo import hlo_collectives
from meshax.ops.cond import CondOperation
from meshax.search.program import model_of
from meshax.search.result import split_pairs
from tests.conftest import moved
from tests.test_loops import CASES

B, D, E = mx.Dimension("batch", 4), mx.Dimension("d", 6), mx.Dimension("e", 6)


def _model():
    """out = cond(sum(x) + s > 0, tanh(x @ w), 2x + sum_batch(x @ w)) and its loss and gradients;
    the true branch reads the weight w from outside, the false branch reduces over the batch
    (a collective when it is split): the branches' collectives differ."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x, s = mx.placeholder(mesh, "x", [B, D]), mx.placeholder(mesh, "s", [])
    w = mx.placeholder(mesh, "w", [D, E])

    def yes(h):
        return mx.tanh(mx.einsum(h, w, output_shape=[B, E]))

    def no(h):
        return mx.rename_dimension(h * 2.0, "d", "e") + mx.reduce_sum(h * w, output_shape=[E])

    out = mx.cond(mx.greater(mx.reduce_sum(x) + s, 0.0), yes, no, [x])
    loss = mx.reduce_sum(out * out)
    return graph, mesh, [loss, *mx.gradients(loss, [w, x])]


def _reference(x, s, w):
    def loss(w, x):
        out = jax.lax.cond(jnp.sum(x) + s > 0, lambda h: jnp.tanh(h @ w), lambda h: h * 2.0 + jnp.sum(h @ w, axis=0), x)
        return jnp.sum(out * out)

    return [loss(w, x), *jax.grad(loss, argnums=(0, 1))(w, x)]


@pytest.mark.parametrize("backend,mesh_shape,layout", CASES)  # (the loops' cases: dims of the same names)
def test_cond_equals_jax_forward_and_gradient_on_both_branches(backend, mesh_shape, layout):
    graph, mesh, outs = _model()
    fn = mx.Lowering(graph, {mesh: backend(mesh_shape, layout)}).function(outs)
    rng = np.random.RandomState(0)
    xv, wv = rng.randn(4, 6).astype(np.float32), (rng.randn(6, 6) * 0.4).astype(np.float32)
    for s in (100.0, -100.0):  # each branch, in one program
        got = fn({"x": xv, "s": np.float32(s), "w": wv})
        for a, b in zip(got, _reference(xv, np.float32(s), wv)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert not np.allclose(fn({"x": xv, "s": np.float32(100), "w": wv})[0], got[0])  # the branches differ


def test_one_conditional_in_the_program_and_its_collectives_counted_per_branch():
    """The compiled program has XLA conditionals (forward and backward), not both branches run
    and one picked; the counters hold each branch's collectives once, as the compiled text does."""
    graph, mesh, outs = _model()
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "batch:rows;e:cols")}).function(outs)
    text = fn.compiled_text()
    assert text.count(" conditional(") == 2
    found = hlo_collectives(text)
    assert fn.counters["allreduce"].count >= 2
    assert {k: v["count"] for k, v in found.items()} == {k: fn.counters[k].count for k in found}
    assert {k: v["values"] for k, v in found.items()} == {k: fn.counters[k].values for k in found}


def test_switch_clamps_its_index_and_passes_an_operand_through():
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x, i = mx.placeholder(mesh, "x", [B, D]), mx.placeholder(mesh, "i", [], dtype=np.int32)
    branches = [lambda h: h, lambda h: h * 3.0, lambda h: mx.exp(h)]
    out = mx.switch(i, branches, [x])
    (grad,) = mx.gradients(mx.reduce_sum(out * out), [x])
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "batch:rows;d:cols")}).function([out, grad])
    xv = np.random.RandomState(2).randn(4, 6).astype(np.float32)
    for index, want, dwant in [
        (-5, xv, 2 * xv),
        (0, xv, 2 * xv),
        (1, 3 * xv, 18 * xv),
        (2, np.exp(xv), 2 * np.exp(2 * xv)),
        (9, np.exp(xv), 2 * np.exp(2 * xv)),
    ]:
        got, dgot = fn({"x": xv, "i": np.int32(index)})
        np.testing.assert_allclose(got, want, rtol=1e-5)
        np.testing.assert_allclose(dgot, dwant, rtol=1e-5)


def test_annotations_propagate_into_the_branches_and_results_leave_in_one_layout():
    """An operand's annotation reaches each branch's variable; a branch whose result is laid out
    otherwise (an annotation inside it) moves it to the output's layout before it leaves; values
    unchanged on either branch. (The annotation's d:cols, 6 split 4 ways, reaches the output and
    the other branch as a split that divides would: they have its size.)"""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.mesh_split(mx.placeholder(mesh, "x", [B, D]), ["rows", None])
    out = mx.cond(
        mx.greater(mx.reduce_sum(x), 0.0),
        lambda h: mx.mesh_split(h * 2.0, [None, "cols"]),
        lambda h: h - 1.0,
        [x],
    )
    low = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4")})
    (op,) = [op for op in graph.operations if isinstance(op, CondOperation)]
    (true_var,), (false_var,) = op.branches[0][0], op.branches[1][0]
    (true_out,), (false_out,) = op.branches[0][1], op.branches[1][1]
    assert low.layout_of(x) == "batch:rows"
    assert [low.layout_of(t) for t in (false_var, true_var, false_out, out)] == ["batch:rows;d:cols"] * 4
    assert low.layout_of(true_out) == "d:cols"
    assert "the branch boundary" in low.explain()
    fn = low.function(out)
    xv = np.random.RandomState(3).randn(4, 6).astype(np.float32)
    for v in (np.abs(xv), -np.abs(xv)):
        want = v * 2.0 if v.sum() > 0 else v - 1.0
        np.testing.assert_allclose(fn({"x": v}), want, rtol=1e-6)
    assert fn.counters["alltoall"].count + fn.counters["allgather"].count >= 1  # (the true branch's move)


def test_random_ops_in_a_branch_run_and_differ_from_the_other_branch():
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    p = mx.placeholder(mesh, "p", [], dtype=np.bool_)
    out = mx.cond(p, lambda: mx.random_uniform(mesh, [D]), lambda: mx.random_uniform(mesh, [D]))
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "d:cols")}).function(out)
    a, b = fn({"p": np.bool_(True)}, seed=1), fn({"p": np.bool_(False)}, seed=1)
    assert a.shape == (6,) and a.min() >= 0 and a.max() < 1
    assert not np.allclose(a, b)


def test_cond_errors_name_the_cause():
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", [B, D])
    p = mx.greater(mx.reduce_sum(x), 0.0)
    with pytest.raises(mx.GraphError, match=r"predicate must be a scalar meshax Tensor, got a tensor of shape"):
        mx.cond(x, lambda h: h, lambda h: h, [x])
    with pytest.raises(mx.GraphError, match=r"same shapes and dtypes; branch true_fn returned .*false_fn"):
        mx.cond(p, lambda h: h, lambda h: mx.reduce_sum(h, [D]), [x])
    with pytest.raises(mx.GraphError, match="index must be an integer scalar, got dtype float32"):
        mx.switch(mx.reduce_sum(x), [lambda h: h], [x])
    with pytest.raises(mx.GraphError, match="non-empty list of functions"):
        mx.switch(mx.cast(p, np.int32), [], [x])
    with pytest.raises(mx.GraphError, match="branch true_fn returned no tensors"):
        mx.cond(p, lambda h: [], lambda h: [], [x])


def test_a_number_where_a_tensor_is_expected_is_named():
    """A branch (or a loop body) that returns a number, or a scan's init given as one, is named:
    it was a TypeError ('float' object is not iterable) from inside, and 0.0 'returned no tensors'."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", [B, D])
    s = mx.reduce_sum(x)
    p = mx.greater(s, 0.0)
    for value in (1.0, 0.0):
        with pytest.raises(mx.GraphError, match=rf"the values a branch returns must be meshax Tensors, got {value}$"):
            mx.cond(p, lambda v=value: v, lambda: s)
    with pytest.raises(mx.GraphError, match=r"while_loop: the values body_fn returns must be meshax Tensors, got 1.0"):
        mx.while_loop(lambda a: mx.greater(a, 0.0), lambda a: 1.0, [s])
    with pytest.raises(mx.GraphError, match=r"scan: init must be meshax Tensors, got 0.0"):
        mx.scan(lambda c, xs: (c, xs), 0.0, [x], B)


@pytest.mark.parametrize("layout", ["", "batch:rows;e:cols", "d:cols"])
def test_the_layout_search_estimate_counts_every_branch_as_the_trace_does(layout):
    """The search's fast estimate costs each branch's ops once, as the exact trace counts them
    (without the branches it saw only the ops outside them)."""
    graph, _, outs = _model()
    program = model_of(graph, outs).on(convert_to_mesh_shape("rows:2;cols:4"))
    est = program.estimator(mx.convert_to_layout_rules(layout))
    exact = program.exact(tuple(sorted(split_pairs(layout))))
    assert {k: v for k, v in est.flops.items() if v} == exact.flops

    assert moved(est) == moved(exact)


def test_a_sum_an_operand_owes_is_settled_once_outside_the_branches():
    """h = x @ w contracts the split d: a sum owed over cols. The cond's operand h is settled
    once, before the conditional, for the reader outside and the branch that reads it (it was
    settled again in each branch that moved it; the false branch does not read it). The tensor
    g the true branch reads from outside is settled there, as a loop body settles what it
    reads. XLA's compiled text holds what the counters count; the estimate counts the same."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x, w = mx.placeholder(mesh, "x", [B, D]), mx.placeholder(mesh, "w", [D, E])
    h = mx.einsum(x, w, output_shape=[B, E])
    g = mx.einsum(x, w * 2.0, output_shape=[B, E])
    out = mx.cond(mx.greater(mx.reduce_sum(x), 0.0), lambda a: mx.tanh(a) + g, lambda a: mx.ones_like(a), [h])
    outs = [mx.reduce_sum(out) + mx.reduce_sum(h)]
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "d:cols")}).function(outs)
    sums = sorted((s.values, s.op_name) for s in fn.counters.sites() if s.kind == "allreduce")
    assert sums == [(1, "reduce_sum"), (24, "einsum"), (24, "einsum_1")]  # (the predicate's, h's, g's)
    found = hlo_collectives(fn.compiled_text())
    assert {k: (v["count"], v["values"]) for k, v in found.items()} == {
        k: (fn.counters[k].count, fn.counters[k].values) for k in found
    }
    rng = np.random.RandomState(4)
    xv, wv = rng.randn(4, 6).astype(np.float32), rng.randn(6, 6).astype(np.float32)
    for v in (np.abs(xv), -np.abs(xv)):
        h2 = v @ wv
        want = (np.tanh(h2) + 2 * h2).sum() if v.sum() > 0 else 24.0
        np.testing.assert_allclose(fn({"x": v, "w": wv}), want + h2.sum(), rtol=1e-4)
    program = model_of(graph, outs).on(convert_to_mesh_shape("rows:2;cols:4"))
    est, exact = program.estimator(mx.convert_to_layout_rules("d:cols")), program.exact((("d", ("cols",)),))
    assert sorted((c.kind, c.mesh_dims, c.bytes * c.count) for c in est.collectives) == sorted(
        (c.kind, c.mesh_dims, c.bytes * c.count) for c in exact.collectives
    )


def test_an_operand_no_branch_reads_is_not_moved():
    """h owes a sum over cols, and no branch reads it: nothing settles it (a move the branch
    does not read was counted, and XLA drops it)."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x, w = mx.placeholder(mesh, "x", [B, D]), mx.placeholder(mesh, "w", [D, E])
    h = mx.einsum(x, w, output_shape=[B, E])
    out = mx.cond(mx.greater(mx.reduce_sum(x), 0.0), lambda a, b: a * 2.0, lambda a, b: a - 1.0, [x, h])
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "d:cols")}).function(out)
    assert [s.op_name for s in fn.counters.sites()] == ["reduce_sum"]
    found = hlo_collectives(fn.compiled_text())
    assert {k: v["count"] for k, v in found.items()} == {k: fn.counters[k].count for k in found}


def test_a_cond_differentiates_for_what_the_gradient_reaches_alone():
    """The gradient of w alone: x (an operand) and a constant the true branch reads (a
    per-feature scale) need none. The backward conditional computed both anyway, an allreduce
    over the batch's rows for the scale and one over cols and an allgather for x that XLA drops
    as dead and the counters counted: 5 allreduces of 28 values and 1 allgather against the
    compiled program's 3 of 14 and none. (The rule's e:cols, 6 split 4 ways, reaches x's d
    backward through the false branch's rename, as a split that divides would: the true branch's
    einsum allgathers x's d, forward and for w's gradient, 2 allgathers XLA runs too.)"""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x, w = mx.placeholder(mesh, "x", [B, D]), mx.placeholder(mesh, "w", [D, E])
    scale = mx.import_tensor(mesh, np.linspace(0.5, 1.5, 6, dtype=np.float32), [E])

    def yes(h):
        return mx.tanh(mx.einsum(h, w, output_shape=[B, E]) * scale)

    out = mx.cond(mx.greater(mx.reduce_sum(x), 0.0), yes, lambda h: mx.rename_dimension(h * 2.0, "d", "e"), [x])
    loss = mx.reduce_sum(out * out)
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "batch:rows;e:cols")}).function(
        [loss, mx.gradients(loss, [w])[0]]
    )
    rng = np.random.RandomState(0)
    xv, wv = np.abs(rng.randn(4, 6)).astype(np.float32), (rng.randn(6, 6) * 0.4).astype(np.float32)
    sv = np.linspace(0.5, 1.5, 6, dtype=np.float32)
    want = jax.grad(lambda w: jnp.sum(jnp.tanh(xv @ w * sv) ** 2))(wv)
    np.testing.assert_allclose(fn({"x": xv, "w": wv})[1], want, rtol=1e-5, atol=1e-5)
    found = hlo_collectives(fn.compiled_text())
    assert {k: (v["count"], v["values"]) for k, v in found.items()} == {
        k: (fn.counters[k].count, fn.counters[k].values) for k in found
    }
    assert (fn.counters["allreduce"].count, fn.counters["allgather"].count) == (3, 2)
