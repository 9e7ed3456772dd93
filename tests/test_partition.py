"""mx.partition: plain single-device JAX training steps (jax.numpy, jax.grad, optax Adam) with
GSPMD Table 1's annotations only, partitioned on x:2;y:4 and checked against jax.jit on one
device, against the paper's collective formulas, and against the compiled HLO.

Notation as in the paper: B batch, S length, M d_model, H d_ff; mesh (X, Y) = (2, 4).
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import meshax as mx
from benchmarks import plain_jax as pj

X, Y = 2, 4
MESH = f"x:{X};y:{Y}"


def one_device(fn, *args):
    """jax.jit of fn on one device (a 1 x 1 mesh, so its sharding constraints mean nothing)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("x", "y"))
    with jax.set_mesh(mesh):
        return jax.jit(fn)(*args)


def assert_trees_close(got, want, rtol=2e-5, atol=2e-6):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert isinstance(g, jax.Array)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


def assert_counters_equal_hlo(program, *args):
    hlo = mx.hlo_collectives(program.compiled_text())
    c = program.counters
    assert {k: v["count"] for k, v in hlo.items()} == {k: c[k].count for k in hlo}
    assert {k: v["values"] for k, v in hlo.items()} == {k: c[k].values for k in hlo}


def sites_at(counters, line: int):
    """(kind, mesh dims, values) of every collective caused by `benchmarks/plain_jax.py:line`."""
    return sorted(
        (s.kind, s.mesh_axes, s.values) for s in counters.sites() if s.source.endswith(f"plain_jax.py:{line}")
    )


def line_of(fn, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


# ---- the MLP: Table 1's feed-forward block ---------------------------------------------------
B, S, M, H = 8, 4, 16, 32


def table_1_formulas(sharding: str, b, s, m, h, mlp: bool) -> tuple[list, list]:
    """Per layer, step and device, the collectives of the W_in line and of the W_out line, each
    with its backward pass (JAX gives the gradient ops the forward line), as GSPMD section 5's
    Table 1 discussion and Figure 7 describe them:

    - Attempt 1: W_in's output BSH is allreduced over X (it summed M, split over X), W_out's
      output BSM over Y (it summed H); in the backward the mirror images: W_out's input
      gradient BSH over X, W_in's input gradient BSM over Y.
    - Attempt 2: each weight is all-gathered over X (M*H/(XY)) and its gradient, a partial sum
      over the batch split over X, reduce-scattered over X (M*H/Y: weight-update sharding); BSM
      after W_out and W_in's input gradient are still allreduced over Y.
    - Finalized: BSM is also all-gathered over Y before W_in (B*S*M/(XY)), and W_out's output
      is reduce-scattered over Y instead of allreduced (B*S*M/X); backward: W_out's output
      gradient all-gathered over Y, W_in's input gradient reduce-scattered over Y.

    The MLP differs in two places: its input needs no gradient (no backward of W_in's input),
    and W_in's bias, which Table 1 does not annotate, follows BSH's H, so its gradient (summed
    over the batch split over X) is allreduced over X (H/Y)."""
    bsm_x, bsm_xy, bsh_y = b * s * m // X, b * s * m // (X * Y), b * s * h // Y
    w_gather, w_grad = ("allgather", ("x",), m * h // (X * Y)), ("reduce_scatter", ("x",), m * h // Y)
    if sharding == "attempt1":
        w_in = [("allreduce", ("x",), bsh_y)] + ([] if mlp else [("allreduce", ("y",), bsm_x)])
        w_out = [("allreduce", ("y",), bsm_x), ("allreduce", ("x",), bsh_y)]
    elif sharding == "attempt2":
        w_in = [w_gather, w_grad] + ([] if mlp else [("allreduce", ("y",), bsm_x)])
        w_out = [w_gather, w_grad, ("allreduce", ("y",), bsm_x)]
    else:
        w_in = [("allgather", ("y",), bsm_xy), w_gather, w_grad] + ([] if mlp else [("reduce_scatter", ("y",), bsm_x)])
        w_out = [w_gather, w_grad, ("reduce_scatter", ("y",), bsm_x), ("allgather", ("y",), bsm_xy)]
    if mlp and sharding != "attempt1":
        w_in.append(("allreduce", ("x",), h // Y))
    return sorted(w_in), sorted(w_out)


@pytest.fixture(scope="module")
def mlp_case():
    params = pj.mlp_params(jax.random.key(0), M, H)
    opt = optax.adam(1e-2)
    x = jax.random.normal(jax.random.key(1), (B, S, M))
    y = jax.random.normal(jax.random.key(2), (B, S, M))
    return params, opt, opt.init(params), x, y


@pytest.mark.parametrize("sharding", sorted(pj.SHARDINGS))
def test_mlp_step_equals_one_device_and_table_1(mlp_case, sharding):
    params, opt, state, x, y = mlp_case
    step = pj.train_step(pj.mlp_loss, opt, sharding=sharding)
    f = mx.partition(step, MESH, in_shardings=pj.MLP_WEIGHTS)
    got = f(params, state, x, y)
    assert_trees_close(got, one_device(step, params, state, x, y))
    program = f.lower(params, state, x, y)
    w_in, w_out = table_1_formulas(sharding, B, S, M, H, mlp=True)
    assert sites_at(program.counters, line_of(pj.mlp_loss, '@ params["win"]')) == w_in
    assert sites_at(program.counters, line_of(pj.mlp_loss, '@ params["wout"]')) == w_out
    assert_counters_equal_hlo(program, params, state, x, y)
    # the weights (and their Adam slots) come back split X*Y ways, as annotated, and every updated
    # leaf laid out as the program takes it in: a training loop moves nothing between steps
    new_params, new_state, _ = got
    placed = f.place(params, state, x, y)[0]
    for a, b in zip(jax.tree_util.tree_leaves((new_params, new_state)), jax.tree_util.tree_leaves(placed[:2])):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    assert new_params["win"].sharding.shard_shape((M, H)) == (M // X, H // Y)
    assert new_state[0].mu["wout"].sharding.shard_shape((H, M)) == (H // Y, M // X)


def test_reduce_scatters_as_allreduce_and_slice_where_asked(mlp_case):
    """`reduce_scatter_as="allreduce"` (faster on CPU, as XLA's partitioner chooses there): the
    same step; each of the finalized sharding's reduce-scatters runs as an all-reduce of the
    same input, the counters record those, and they still equal the compiled HLO."""
    params, opt, state, x, y = mlp_case
    step = pj.train_step(pj.mlp_loss, opt, sharding="finalized")
    args = (params, state, x, y)
    native = mx.partition(step, MESH, in_shardings=pj.MLP_WEIGHTS).lower(*args).counters
    f = mx.partition(step, MESH, in_shardings=pj.MLP_WEIGHTS, reduce_scatter_as="allreduce")
    assert_trees_close(f(*args), one_device(step, *args))
    program = f.lower(*args)
    got = program.counters
    assert native["reduce_scatter"].count == 3 and got["reduce_scatter"].count == 0
    for what in ("count", "values"):
        summed = getattr(native["allreduce"], what) + getattr(native["reduce_scatter"], what)
        assert getattr(got["allreduce"], what) == summed
        assert getattr(got["allgather"], what) == getattr(native["allgather"], what)
    assert_counters_equal_hlo(program, *args)
    assert " reduce-scatter(" not in program.compiled_text()


# ---- the decoder Transformer ---------------------------------------------------------------------
CONFIG = pj.Config()


@pytest.fixture(scope="module")
def lm_case():
    params = pj.transformer_params(jax.random.key(0), CONFIG)
    opt = optax.adam(1e-3)
    ids = jax.random.randint(jax.random.key(1), (CONFIG.batch, CONFIG.length), 0, CONFIG.vocab)
    return params, opt, opt.init(params), ids, jnp.roll(ids, -1, axis=1)


@pytest.mark.parametrize("sharding", sorted(pj.SHARDINGS))
def test_transformer_step_equals_one_device_and_table_1(lm_case, sharding):
    params, opt, state, ids, targets = lm_case
    step = pj.train_step(pj.transformer_loss, opt, sharding=sharding)
    f = mx.partition(step, MESH, in_shardings=pj.TRANSFORMER_WEIGHTS, donate_argnums=(0, 1))
    program = f.lower(params, state, ids, targets)
    assert_counters_equal_hlo(program, params, state, ids, targets)
    c = CONFIG
    w_in, w_out = table_1_formulas(sharding, c.batch, c.length, c.d_model, c.d_ff, mlp=False)
    layers = CONFIG.layers
    assert sites_at(program.counters, line_of(pj.transformer_loss, '@ layer["win"]')) == sorted(w_in * layers)
    assert sites_at(program.counters, line_of(pj.transformer_loss, '@ layer["wout"]')) == sorted(w_out * layers)
    want = one_device(step, params, state, ids, targets)
    donated = jax.tree_util.tree_map(jnp.copy, (params, state))  # (the call consumes its copies)
    got = f(*donated, ids, targets)
    assert_trees_close(got, want, rtol=1e-4, atol=2e-5)
    assert got[0]["layers"][0]["wq"].sharding.shard_shape(got[0]["layers"][0]["wq"].shape) == (
        CONFIG.d_model // X,
        CONFIG.heads // Y,
        CONFIG.d_kv,
    )


@pytest.mark.slow
def test_transformer_trains_like_one_device_step_for_step(lm_case):
    params, opt, state, ids, targets = lm_case
    step = pj.train_step(pj.transformer_loss, opt, sharding="finalized")
    f = mx.partition(step, MESH, in_shardings=pj.TRANSFORMER_WEIGHTS)
    p1, s1, p2, s2 = params, state, params, state
    losses = []
    for _ in range(3):
        p1, s1, l1 = f(p1, s1, ids, targets)
        p2, s2, l2 = one_device(step, p2, s2, ids, targets)
        losses.append((float(l1), float(l2)))
    np.testing.assert_allclose(*zip(*losses), rtol=1e-5)
    assert losses[-1][0] < losses[0][0]
    assert_trees_close(p1, p2, rtol=1e-4, atol=2e-5)


# ---- names, rules, explain ---------------------------------------------------------------------
def test_dim_names_come_from_the_program_and_rules_use_them(mlp_case):
    """Axes an op ties share a name (x's last axis and W_in's first; W_in's second, the bias and
    W_out's first: H; W_out's second and the target's last), named after the first argument
    axis in the class (arguments in pytree order: the bias comes first); nothing ties x's M to
    the output's. A layout rule on those names splits every tensor that has them, the Adam
    slots included."""
    params, opt, state, x, y = mlp_case
    step = pj.train_step(pj.mlp_loss, opt)
    f = mx.partition(step, MESH, layout="params/bin[0]:y;batch/0[0]:x")
    program = f.lower(params, state, x, y)
    placeholders = dict(zip(program.paths, program.placeholders))
    assert placeholders["params/win"].shape.dimension_names == ["params/win[0]", "params/bin[0]"]
    assert placeholders["params/wout"].shape.dimension_names == ["params/bin[0]", "params/wout[1]"]
    # (step's *batch: its elements are batch/0 and batch/1)
    assert placeholders["batch/0"].shape.dimension_names == ["batch/0[0]", "batch/0[1]", "params/win[0]"]
    assert placeholders["batch/1"].shape.dimension_names == ["batch/0[0]", "batch/0[1]", "params/wout[1]"]
    assert f.layout_of("params/win") == "params/bin[0]:y"
    assert f.layout_of("opt_state/0/mu/wout") == "params/bin[0]:y"
    assert f.layout_of("batch/0") == "batch/0[0]:x"
    text = f.explain()
    assert "params/bin[0]  size 32" in text and "params/win[1]" in text and "plain_jax.py:" in text
    assert_trees_close(f(params, state, x, y), one_device(step, params, state, x, y))


def test_a_union_that_would_name_two_axes_alike_is_a_rename(mlp_case):
    """x @ x.T ties x's two axes to one output's two axes: refused, so the second operand is
    renamed where it is used; values equal the one-device ones under a split layout."""

    def f(a):
        return jnp.tanh(a @ a.T + a.sum())

    a = jax.random.normal(jax.random.key(3), (8, 8))
    g = mx.partition(f, MESH, in_shardings=(P("x", "y"),))
    np.testing.assert_allclose(np.asarray(g(a)), np.asarray(jax.jit(f)(a)), rtol=1e-5, atol=1e-5)
    assert g.lower(a).names.refused >= 1


def test_merged_heads_stay_split_through_the_reshapes():
    """Attention written with W_Q [M, N*D] and reshapes to [B, S, N, D] (no union-find tie: the
    sizes differ): reshape's compound factor carries N's split over y onto the merged N*D and
    back, so with heads annotated nothing is gathered; the only collectives are W_O's sum over
    the heads (y) and the data-parallel gradient and loss sums (x)."""
    n, d, m = 4, 8, 32

    def attention(wq, wo, x):
        q = (x @ wq).reshape(x.shape[0], x.shape[1], n, d)
        q = jax.lax.with_sharding_constraint(q, P("x", None, "y", None))
        s = jnp.einsum("bsnd,btnd->bnst", q, q)
        o = jnp.einsum("bnst,btnd->bsnd", jax.nn.softmax(s, -1), q)
        return jnp.mean((o.reshape(x.shape[0], x.shape[1], n * d) @ wo) ** 2)

    step = jax.value_and_grad(attention, argnums=(0, 1))
    wq = jax.random.normal(jax.random.key(0), (m, n * d)) * 0.1
    wo = jax.random.normal(jax.random.key(1), (n * d, m)) * 0.1
    x = jax.random.normal(jax.random.key(2), (8, 16, m))
    g = mx.partition(step, MESH, in_shardings=(P(None, "y"), P("y", None), P("x")))
    assert_trees_close(g(wq, wo, x), one_device(step, wq, wo, x))
    c = g.counters
    assert c["allgather"].count == c["alltoall"].count == c["reduce_scatter"].count == 0
    assert {(s.mesh_axes, s.values) for s in c.sites()} == {
        (("y",), 8 * 16 * m // X),  # o @ W_O: a partial sum over the heads on y
        (("x",), m * n * d // Y),  # each weight's gradient: a sum over the batch on x
        (("x",), 1),  # the loss
    }


def test_pytrees_static_arguments_and_out_shardings():
    def f(tree, scale, *, power):
        return {"y": tree["a"] * scale + tree["b"][0] ** power, "n": jnp.sum(tree["b"][1])}

    tree = {"a": jnp.arange(16.0).reshape(4, 4), "b": (jnp.ones((4, 4)), jnp.arange(8.0))}
    g = mx.partition(
        f,
        MESH,
        in_shardings=({"a": P("x"), "b": None}, None),
        out_shardings={"y": P(None, "y"), "n": P()},
        static_argnames="power",
    )
    out = g(tree, 2.0, power=3)
    want = f(tree, 2.0, power=3)
    assert_trees_close(out, want)
    assert out["y"].sharding.spec == P(None, "y")
    assert g.layout_of(0) == "" and "y" in g.lower(tree, 2.0, power=3).layout_of(1)
    with pytest.raises(mx.ConfigError, match=r"no output 2: the function returns 2 arrays"):
        g.layout_of(2)  # (was an IndexError)
    g(tree, 2.0, power=2)
    assert len(g._programs) == 2  # one per static value


def test_donated_arguments_are_consumed_and_others_kept():
    f = mx.partition(lambda w, x: (w - 0.1 * x.sum(0), x * 2), MESH, in_shardings=(P("y"), P("x")), donate_argnums=0)
    w, x = f.place(jnp.ones((8,)), jnp.ones((4, 8)))[0]
    new_w, _ = f(w, x)
    assert w.is_deleted() and not x.is_deleted()
    np.testing.assert_allclose(np.asarray(new_w), np.full(8, 0.6), rtol=1e-6)


def test_an_array_donated_and_passed_again_is_refused_not_run():
    """A donated array also passed as another argument had its buffer given up while read: on a
    mesh of several devices XLA crashed the process (a segmentation fault; jax.jit of 0.10 too)."""
    f = mx.partition(lambda a, b: (a + b, a * b), MESH, donate_argnums=0)
    (a, _), _ = f.place(jnp.ones((8, 4)), jnp.ones((8, 4)))
    with pytest.raises(mx.ConfigError, match=r"argument 'a' is donated .* same array is passed as 'b'.*jnp.copy"):
        f(a, a)
    assert not a.is_deleted()
    np.testing.assert_allclose(np.asarray(f(a, jnp.copy(a))[0]), np.full((8, 4), 2.0))


def test_with_sharding_constraint_and_mesh_split_priorities_are_annotations():
    """Both become mx.mesh_split annotations at the user's line; mx.mesh_split's priority and
    OPEN entries are kept, and its gradient carries the same annotation (GSPMD section 3.4)."""

    def f(a, w):
        h = mx.mesh_split(a @ w, ["x", mx.OPEN], priority=1)
        h = jax.lax.with_sharding_constraint(jnp.tanh(h), P(None, "y"))
        return h.sum()

    a, w = jnp.ones((8, 16)), jnp.ones((16, 8)) * 0.1
    step = jax.grad(f, argnums=1)
    g = mx.partition(step, MESH)
    np.testing.assert_allclose(np.asarray(g(a, w)), np.asarray(one_device(step, a, w)), rtol=1e-6)
    shards = [op for op in g.lower(a, w).graph.operations if getattr(op, "annotation", None) is not None]
    found = {(op.annotation, op.priority) for op in shards}
    assert found == {((("x",), mx.OPEN), 1), (((), ("y",)), 0)}
    assert len(shards) == 4  # each annotation and its gradient's
    assert all("test_partition.py" in op.source for op in shards)
    assert "priority 1" in g.explain()


def test_embedding_lookup_and_its_gradient_with_the_table_split():
    """table[ids] becomes mx.gather and its gradient a one-hot einsum, both with the vocab split."""

    def loss(table, ids):
        return jnp.sum(jnp.tanh(table[ids]) ** 2)

    step = jax.value_and_grad(loss)
    table = jax.random.normal(jax.random.key(0), (32, 8))
    ids = jax.random.randint(jax.random.key(1), (4, 6), 0, 32)
    g = mx.partition(step, MESH, in_shardings=(P("y", None), P("x")))
    assert_trees_close(g(table, ids), jax.jit(step)(table, ids))
    kinds = {type(op).__name__ for op in g.lower(table, ids).graph.operations}
    assert {"GatherOperation", "EinsumOperation"} <= kinds


def test_random_keys_dropout_and_noise_equal_jax_jit():
    """PRNG keys in, split, folded and out (carried as their uint32 data, every op on them run
    whole): dropout and noise draw the very bits jax.jit draws, under a split layout."""

    def f(w, x, key):
        k1, k2 = jax.random.split(key)
        keep = jax.random.bernoulli(k1, 0.8, x.shape)
        h = jnp.where(keep, x, 0) / 0.8 @ w
        return h + jax.random.normal(jax.random.fold_in(k2, 3), h.shape), k2

    w, x = jnp.ones((16, 8)), jnp.arange(32 * 16.0).reshape(32, 16) / 100
    g = mx.partition(f, MESH, in_shardings=(P(None, "y"), P("x"), None))
    (a, ka), (b, kb) = g(w, x, jax.random.key(0)), jax.jit(f)(w, x, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(jax.random.key_data(ka), jax.random.key_data(kb))


def test_convolution_and_pooling_with_batch_and_features_split():
    """conv_general_dilated keeps batch and output features split and sums input features (its
    filter gradient: a partial sum over the batch split over x, allreduced); max pooling and its
    gradient keep the batch split (space split: tests/test_partition_windows.py)."""

    def loss(w, x):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        y = jax.lax.reduce_window(jax.nn.relu(y), -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        return jnp.mean(y**2)

    w, x = jax.random.normal(jax.random.key(0), (3, 3, 4, 8)), jax.random.normal(jax.random.key(1), (8, 8, 8, 4))
    step = jax.value_and_grad(loss)
    g = mx.partition(step, MESH, in_shardings=(P(None, None, None, "y"), P("x")))
    assert_trees_close(g(w, x), jax.jit(step)(w, x), rtol=1e-5, atol=1e-6)
    sites = [(s.kind, s.mesh_axes, s.values) for s in g.counters.sites()]
    assert ("allreduce", ("x",), 3 * 3 * 4 * 8 // Y) in sites


@pytest.mark.parametrize("specs", [(None, None), (None, P("x", "y")), (P(None, None, None, "y"), P(None, "x"))])
def test_a_reshape_that_transposes_first_and_a_grouped_convolution(specs):
    """lax.reshape's `dimensions` transposes its operand before the reshape; JAX writes a grouped
    (depthwise) convolution's input gradient with one. It was read as a plain reshape: wrong
    values, silently, even on one device."""

    def loss(w, x):
        y = jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=2
        )
        z = jax.lax.reshape(x, (8, 8 * 2 * 4), dimensions=(1, 0, 2, 3))
        return jnp.sum(y**2) + jnp.sum(jnp.sin(z) * jnp.arange(64.0))

    w, x = jax.random.normal(jax.random.key(0), (3, 3, 2, 4)), jax.random.normal(jax.random.key(1), (2, 8, 8, 4))
    step = jax.value_and_grad(loss, argnums=(0, 1))
    assert_trees_close(mx.partition(step, MESH, in_shardings=specs)(w, x), jax.jit(step)(w, x), rtol=1e-5, atol=1e-4)


def test_values_no_one_reads_are_not_built():
    """JAX leaves values no one reads in a gradient's jaxpr (relu's zeros); they were built on
    every device whole and warned about as "replicated", though XLA drops them."""

    def loss(x):
        return jnp.sum(jax.nn.relu(x) * x)

    x = jnp.arange(64.0).reshape(8, 8) - 30
    step = jax.grad(loss)
    jaxpr = jax.make_jaxpr(step)(x).jaxpr
    read = {a for e in jaxpr.eqns for a in e.invars if isinstance(a, jax.extend.core.Var)} | set(jaxpr.outvars)
    assert any(not set(e.outvars) & read for e in jaxpr.eqns)  # (JAX's relu zeros)
    g = mx.partition(step, MESH, in_shardings=(P("x", "y"),))
    np.testing.assert_allclose(np.asarray(g(x)), np.asarray(jax.jit(step)(x)))
    program = g.lower(x)
    read = {t for op in program.graph.operations for t in op.inputs}
    built = [t for op in program.graph.operations if type(op).__name__ == "ConstantOperation" for t in op.outputs]
    assert len([t for t in built if t.shape.rank]) == 2 and all(t in read for t in built if t.shape.rank)


def test_scan_and_fori_loop_become_one_meshax_loop():
    """jax.lax.scan over stacked layer weights (and its gradient, a reverse scan) and a
    fori_loop with a static trip count become mx.scan loops: values equal jax.jit's. The
    arguments' annotations propagate into the loop body (the batch split over x there too), and
    layout rules on the loop's dim names do the same."""

    def loss(ws, x):
        def layer(h, w):
            h = jnp.tanh(h @ w)
            return h, jnp.sum(h)

        h, sums = jax.lax.scan(layer, x, ws)
        return jnp.mean(h**2) + 0.01 * jnp.sum(sums)

    ws = jax.random.normal(jax.random.key(0), (3, 16, 16)) * 0.3
    x = jax.random.normal(jax.random.key(1), (8, 16))
    step = jax.value_and_grad(loss)
    want = jax.jit(step)(ws, x)
    annotated = mx.partition(step, MESH, in_shardings=(P(None, None, "y"), P("x")))
    ruled = mx.partition(step, MESH, layout="x[0]:x;ws[2]:y")
    for g in (annotated, ruled):
        assert_trees_close(g(ws, x), want)
        program = g.lower(ws, x)
        loops = [op for op in program.graph.operations if type(op).__name__ == "ScanOperation"]
        assert len(loops) == 2  # the forward loop and its gradient's
        inside = [t for op in loops[0].body for t in op.outputs if "x[0]" in t.shape.dimension_names]
        assert inside and all(program.lowering.layout_of(t).startswith("x[0]:x") for t in inside)

    def fori(x):
        return jax.lax.fori_loop(0, 4, lambda i, c: jnp.sin(c) * 2 + i, x)

    np.testing.assert_allclose(
        np.asarray(mx.partition(fori, MESH, in_shardings=(P("x"),))(jnp.ones((8, 4)))),
        np.asarray(jax.jit(fori)(jnp.ones((8, 4)))),
        rtol=1e-6,
    )


def test_while_loop_with_a_data_dependent_trip_count():
    """jax.lax.while_loop (and a fori_loop with bounds known only when it runs) becomes one
    mx.while_loop: the condition, a sum over the split x (a collective), is the same on every
    device, so all stop together; values equal jax.jit's, the annotation reaches the loop's
    carries, and the counters (one iteration's collectives) equal the compiled HLO."""

    def halve(x, w):
        def cond(c):
            return jnp.sum(c[0] ** 2) >= 1.0

        def body(c):
            h, n = c
            return jnp.tanh(h @ w) * 0.5 + 0.01, n + 1

        return jax.lax.while_loop(cond, body, (x, 0))

    x = jax.random.normal(jax.random.key(0), (8, 16)) * 3
    w = jax.random.normal(jax.random.key(1), (16, 16)) * 0.3
    want = jax.jit(halve)(x, w)
    assert int(want[1]) >= 3
    f = mx.partition(halve, MESH, in_shardings=(P("x", "y"), P("y", None)))
    assert_trees_close(f(x, w), want, rtol=1e-5, atol=1e-6)
    program = f.lower(x, w)
    (loop,) = [op for op in program.graph.operations if type(op).__name__ == "WhileOperation"]
    assert program.lowering.layout_of(loop.carry_vars[0]).startswith("x[0]:x")
    assert program.counters["allreduce"].count >= 1
    assert_counters_equal_hlo(program, x, w)

    def fori(x, n):
        return jax.lax.fori_loop(0, n, lambda i, c: jnp.sin(c) * 2 + i, x)

    g = mx.partition(fori, MESH, in_shardings=(P("x"), None))
    for n in (0, 3):
        np.testing.assert_allclose(
            np.asarray(g(jnp.ones((8, 4)), n)), np.asarray(jax.jit(fori)(jnp.ones((8, 4)), n)), rtol=1e-6
        )


def test_cond_and_switch_become_one_conditional():
    """jax.lax.cond (its predicate a sum over the split x: a collective) and jax.lax.switch become
    mx.switch: values and gradients equal jax.jit's on every branch, the compiled program holds
    XLA conditionals (not every branch run and one picked), the annotation reaches the
    branches, and the counters (each branch's collectives once) equal the compiled HLO."""

    def loss(w, x, k):
        h = x @ w
        h = jax.lax.cond(jnp.sum(h) > 0, lambda a: jnp.tanh(a) * 2.0, lambda a: a - jnp.sum(a, axis=0), h)
        h = jax.lax.switch(k, [jnp.sin, lambda a: a * w[0], lambda a: jnp.exp(-(a**2))], h)
        return jnp.mean(h**2)

    w = jax.random.normal(jax.random.key(0), (16, 16)) * 0.3
    x = jax.random.normal(jax.random.key(1), (8, 16))
    step = jax.value_and_grad(loss, argnums=(0, 1))
    f = mx.partition(step, MESH, in_shardings=(P(None, "y"), P("x"), None))
    for sign in (1.0, -1.0):  # each side of the cond, and each switch branch (3 clamps to 2)
        for k in (0, 1, 3):
            assert_trees_close(f(w, sign * x, k), jax.jit(step)(w, sign * x, k), rtol=1e-5, atol=1e-6)
    assert float(jnp.sum(x @ w)) * float(jnp.sum(-x @ w)) < 0  # (both signs of the predicate were run)
    program = f.lower(w, x, 0)
    conds = [op for op in program.graph.operations if type(op).__name__ == "CondOperation"]
    assert len(conds) == 4  # two forward, two backward
    assert program.compiled_text().count(" conditional(") == 4
    first = conds[0].branches[0][0][0]  # (the first branch's first variable)
    assert program.lowering.layout_of(first).startswith("x[0]:x")
    assert program.counters["allreduce"].count >= 2
    assert_counters_equal_hlo(program, w, x, 0)


@pytest.mark.parametrize("shardings", [(P("y", None), P("x", "y")), (P("y", "x"), P(None, "y"))])
def test_a_branch_returning_a_partial_sum_counts_what_xla_runs(shardings):
    """b @ w sums over y; the branch's result is renamed to the cond's names. The rename moves
    nothing of its own (it had settled the sum once more, counted, though XLA dropped it)."""

    def f(w, x):
        return jax.lax.cond(jnp.sum(x) > 0, lambda b: b @ w, jnp.sin, x)

    w = jax.random.normal(jax.random.key(0), (16, 16)) * 0.3
    x = jax.random.normal(jax.random.key(1), (8, 16))
    g = mx.partition(f, MESH, in_shardings=shardings)
    assert_trees_close(g(w, x), jax.jit(f)(w, x), rtol=1e-5, atol=1e-5)
    program = g.lower(w, x)
    assert program.counters["reduce_scatter"].count == 1
    assert_counters_equal_hlo(program, w, x)


@pytest.mark.parametrize("wrap", ["MultiSteps", "apply_if_finite"])
def test_optax_wrappers_that_branch_train_like_jax_jit(wrap):
    """optax's gradient accumulation (MultiSteps) and its skipping of non-finite updates
    (apply_if_finite) branch with lax.cond on the step count and on the gradients: step for
    step, the weights and optimizer state equal jax.jit's."""
    inner = optax.adam(1e-2)
    opt = optax.MultiSteps(inner, every_k_schedule=2) if wrap == "MultiSteps" else optax.apply_if_finite(inner, 2)

    def step(params, state, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (16, 32)) * 0.3, "w2": jax.random.normal(k2, (32, 8)) * 0.3}
    x = jax.random.normal(k3, (8, 16))
    got = want = (params, opt.init(params))
    f = mx.partition(step, MESH, in_shardings={"params/w1": P(None, "y"), "params/w2": P("y", None), "x": P("x")})
    for i in range(4):
        bad = x.at[0, 0].set(jnp.nan) if i == 1 else x  # (apply_if_finite skips this step's update)
        *got, _ = f(*got, bad)
        *want, _ = jax.jit(step)(*want, bad)
        assert_trees_close(tuple(got), tuple(want), rtol=1e-5, atol=1e-6)


def test_a_function_jax_shares_between_calls_gives_each_call_its_own_result():
    """jnp.where, jnp.remainder and the like are jitted functions: two calls of one with the same
    shapes share one jaxpr, inlined at each call. Each call's result is its own, also where the
    first is read after the second call (it read the second's value before)."""

    def f(a, b):
        o = jnp.where(a < 3, a + 1, 7)
        s = jnp.where(b < 3, b + 5, 9)
        u = jnp.where(a > 0, a, b)
        return o, s, o % 2, u + jnp.where(b > 0, b, a)

    for a, b in [(jnp.int32(0), jnp.int32(1)), (jnp.arange(8.0) - 4, jnp.ones(8) * 2)]:
        assert_trees_close(mx.partition(f, MESH)(a, b), jax.jit(f)(a, b))


# ---- bad input ----------------------------------------------------------------------------------
def test_unsupported_primitive_names_it_its_line_and_the_way_around():
    def f(a):
        return jax.lax.approx_max_k(a, 2)[0].sum()

    a = jnp.eye(4)
    with pytest.raises(mx.GraphError, match=r"primitive '\w+'.*test_partition.py:\d+.*replicated_region"):
        mx.partition(f, MESH)(a)
    g = mx.partition(mx.replicated_region(f), MESH)
    np.testing.assert_allclose(np.asarray(g(a)), np.asarray(f(a)), rtol=1e-5)


def test_bad_annotations_and_argument_trees_are_named():
    a = jnp.ones((8, 8))
    with pytest.raises(
        mx.LayoutError, match=r"test_partition.py:\d+: \['x', None, None\] for an array of shape \[8, 8\]"
    ):
        mx.partition(lambda x: mx.mesh_split(x * 2, ["x", None, None]), MESH)(a)
    with pytest.raises(mx.LayoutError, match=r"annotation at .*test_partition.py:\d+ does not fit mesh x:2;y:4.*rank"):
        mx.partition(lambda x: jax.lax.with_sharding_constraint(x * 2, P("x", None, None)), MESH)(a)
    with pytest.raises(mx.LayoutError, match=r"annotation at .*test_partition.py:\d+ does not fit mesh.*'z'"):
        mx.partition(lambda x: jax.lax.with_sharding_constraint(x * 2, P("z")), MESH)(a)
    with pytest.raises(
        mx.LayoutError, match=r"mx.partition at .*test_partition.py:\d+\) names mesh dim 'z'.*\['x', 'y'\]"
    ):
        mx.partition(lambda x: x * 2, MESH, in_shardings=(P("z"),))(a)
    with pytest.raises(mx.LayoutError, match=r"names mesh dim 'q'"):
        mx.partition(lambda x: mx.mesh_split(x * 2, ["q", None]), MESH)(a)
    with pytest.raises(mx.ConfigError, match=r"in_shardings\[0\] does not match argument 0"):
        mx.partition(lambda t: t["a"] * 2, MESH, in_shardings=({"b": P("x")},))({"a": a})
    with pytest.raises(mx.ConfigError, match=r"matches no argument.*params/w"):
        mx.partition(lambda params: params["w"] * 2, MESH, in_shardings={"params/v": P("x")})({"w": a})
    with pytest.raises(mx.ConfigError, match="one entry per positional"):
        mx.partition(lambda x, y: x + y, MESH, in_shardings=(P("x"),))(a, a)


def test_one_value_laid_out_two_ways_as_jax_jit_allows():
    """Two constraints on one value, or one value returned twice with two out_shardings, are two
    values in JAX (each constraint returns its own): not 'conflicting annotations' on one tensor."""
    a = jnp.arange(64.0).reshape(8, 8)

    def two(a):
        h = a * 2
        return jax.lax.with_sharding_constraint(h, P("x", None)) + jax.lax.with_sharding_constraint(h, P(None, "x"))

    np.testing.assert_array_equal(np.asarray(mx.partition(two, MESH)(a)), np.asarray(one_device(two, a)))
    f = mx.partition(lambda a: (a * 2, a * 2), MESH, out_shardings=(P("x", None), P(None, "x")))
    first, second = f(a)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(a * 2))
    np.testing.assert_array_equal(np.asarray(second), np.asarray(a * 2))
    assert first.sharding.spec == P("x") and second.sharding.spec == P(None, "x")
    ident = mx.partition(lambda a: (a, a), MESH, in_shardings=(P("y"),), out_shardings=(P("x"), P(None, "x")))
    assert [o.sharding.spec for o in ident(a)] == [P("x"), P(None, "x")]
    with pytest.raises(mx.LayoutError, match=r"test_partition.py:\d+: entry 0 is 3; give a mesh dim name"):
        mx.partition(lambda x: mx.mesh_split(x * 2, [3, None]), MESH)(a)
    for priority in (1.7, "1", -1):  # (once truncated by int(): 1.7 ran as priority 1)
        with pytest.raises(mx.LayoutError, match=r"test_partition.py:\d+: priority must be an int >= 0"):
            mx.partition(lambda x, p=priority: mx.mesh_split(x * 2, ["x", None], priority=p), MESH)(a)


def test_a_result_split_unevenly_is_gathered_in_the_step_and_counted():
    """w [8, 13] annotated split 4 ways (padded): propagation carries the split to the logits and
    the gradient, dims of its size. A jax.Array's shards must divide it, so they come back
    replicated along it; that allgather ran in a program of its own after the step, counted
    nowhere (0 values, where the logits' 6 x 4 and the gradient's 8 x 4 are moved)."""
    w, x = jnp.arange(104.0).reshape(8, 13) / 50, jnp.arange(48.0).reshape(6, 8) / 40

    def f(w, x):
        logits = x @ w
        return logits, jax.grad(lambda w: jnp.sum(jax.nn.softmax(x @ w) ** 2))(w)

    partitioned = mx.partition(f, "x:4", in_shardings=(P(None, "x"), None))
    assert_trees_close(partitioned(w, x), one_device(f, w, x))
    program = partitioned.lower(w, x)
    assert sorted(s.values for s in program.counters["allgather"].sites) == [6 * 4, 8 * 4]
    assert_counters_equal_hlo(program, w, x)


@pytest.mark.parametrize("vocab", [1000, 1001])
def test_a_gradients_sum_is_settled_on_its_slices_before_they_are_gathered(vocab):
    """The gradient of w [64, vocab] split y, the batch split x, returned replicated: its sum over
    the batch is owed over x and carried through the gradient's transpose (a linear op), which
    the result's gather reads. It was gathered over y first and its sum settled on the gathered
    tensor: an allreduce of 64 x vocab values a device, 4 times the slice's, where XLA settles
    first. Now the slice's sum is settled, then gathered (vocab 1001: padded slices of 251)."""
    x, w, ids = jnp.ones((16, 64)), jnp.ones((64, vocab)) / 100, jnp.arange(16) % vocab

    def loss(x, w, ids):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(x @ w), ids[:, None], axis=1))

    grad = jax.grad(loss, argnums=1)
    partitioned = mx.partition(grad, MESH, (P("x", None), P(None, "y"), P("x")), P())
    assert_trees_close(partitioned(x, w, ids), one_device(grad, x, w, ids))
    program = partitioned.lower(x, w, ids)
    slice_values = 64 * -(-vocab // Y)
    big = sorted((s.kind, s.mesh_axes, s.values) for s in program.counters.sites() if s.values > 1000)
    assert big == [("allgather", ("y",), slice_values), ("allreduce", ("x",), slice_values)]
    assert_counters_equal_hlo(program, x, w, ids)


def test_a_training_step_with_an_uneven_hidden_dim_moves_less_than_jax_jit():
    """A momentum step of an MLP whose hidden dim (250) is annotated split 4 ways: its updated
    weights and momenta come back replicated along it (a jax.Array's shards must divide), so
    both meshax and jax.jit gather them each step. meshax gathers the slices it updated, once
    each; XLA's compiled step moves 3 times the values (its gathers and permutes)."""
    k = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(k[0], (32, 64))
    w1, w2 = jax.random.normal(k[1], (64, 250)) / 8, jax.random.normal(k[2], (250, 64)) / 16
    specs = (P("x", None), P(None, "y"), P("y", None), P(None, "y"), P("y", None))

    def step(*args):
        x, w1, w2, m1, m2 = (jax.lax.with_sharding_constraint(a, s) for a, s in zip(args, specs))
        g1, g2 = jax.grad(lambda w1, w2: jnp.sum(jax.nn.relu(x @ w1) @ w2), argnums=(0, 1))(w1, w2)
        m1, m2 = 0.9 * m1 + g1, 0.9 * m2 + g2
        return w1 - 0.1 * m1, w2 - 0.1 * m2, m1, m2

    args = (x, w1, w2, w1 * 0, w2 * 0)
    partitioned = mx.partition(step, MESH)
    assert_trees_close(partitioned(*args), one_device(step, *args), rtol=1e-4, atol=1e-5)
    program = partitioned.lower(*args)
    assert_counters_equal_hlo(program, *args)
    mine = sum(v["values"] for v in mx.hlo_collectives(program.compiled_text()).values())
    with jax.set_mesh(jax.make_mesh((X, Y), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)):
        compiled = jax.jit(step).lower(*args).compile().as_text()
    xla = sum(v["values"] for v in mx.hlo_collectives(compiled).values())
    slices = 2 * 64 * -(-250 // Y)  # w1's and w2's padded slices: 2 x 64 x 63 values
    assert program.counters["allgather"].values == 2 * slices  # the weights and their momenta
    assert mine <= 0.4 * xla


def test_a_weights_gradient_keeps_the_weights_split_where_the_batch_wants_its_mesh_dim():
    """The gradient of a 2-layer MLP, w split on its hidden dim over x and x on its batch over x,
    no out_shardings. The forward x @ w takes w's split (w is the larger), so the batch is
    gathered once (4096 values) and both gradients come out split like the weights, as jax.jit
    does. The gradients' contractions over the batch had carried x's split to the activations
    before the forward pass reached them: the batch won mesh dim x, w was gathered (16384) and
    both gradients, partial sums over the batch, were allreduced (65536)."""
    k = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(k[0], (64, 128))
    w, w2 = jax.random.normal(k[1], (128, 256)) * 0.1, jax.random.normal(k[2], (256, 128)) * 0.1
    g = jax.grad(lambda w, w2, x: jnp.sum(jnp.tanh(x @ w) @ w2), argnums=(0, 1))
    f = mx.partition(g, MESH, in_shardings=(P(None, "x"), None, P("x", None)))
    assert_trees_close(f(w, w2, x), one_device(g, w, w2, x), rtol=1e-4, atol=1e-5)
    program = f.lower(w, w2, x)
    moved = {k: (program.counters[k].count, program.counters[k].values) for k in mx.lower.counters.KINDS}
    assert {k: v for k, v in moved.items() if v[0]} == {"allgather": (1, 64 * 128 // 2)}
    assert [program.layout_of(i) for i in (0, 1)] == ["w[1]:x", "w[1]:x"]
    assert_counters_equal_hlo(program, w, w2, x)


# ---- random programs ------------------------------------------------------------------------------
SPECS = [P("x", None), P(None, "y"), P("y", "x"), P(None, None), P(P.UNCONSTRAINED, "y"), P(("x", "y"), None)]


def _apply(step: int, x, y):
    """One random step of a program over two [8, 12] arrays, from the supported primitives."""
    if step == 0:
        return x * y + 1.0
    if step == 1:
        return jnp.tanh(x) - jnp.exp(-jnp.abs(y))
    if step == 2:
        return (x @ y.T) @ y / 12.0  # dot_general both ways
    if step == 3:
        return x - x.max(axis=1, keepdims=True)
    if step == 4:
        return jnp.where(x > 0, x, 0.1 * y)
    if step == 5:
        return jnp.cumsum(x, axis=0) / 8.0
    if step == 6:
        return jnp.concatenate([x[:, :6], y[:, 6:]], axis=1)  # slice, concatenate
    if step == 7:
        return x.reshape(4, 2, 12).sum(1).repeat(2, axis=0)  # reshape (split), reduce, broadcast
    if step == 8:
        return x + jax.nn.softmax(y, axis=0)
    if step == 9:
        return x.T.reshape(12, 8).T * jnp.arange(12.0) / 12.0  # transpose, iota
    if step == 10:
        return x + jnp.mean(x, axis=0) - jnp.min(y)
    if step == 11:
        return jnp.take_along_axis(x, jnp.argsort(y, axis=1), axis=1)  # sort, gather
    if step == 12:
        return x.reshape(96).reshape(8, 12) + jnp.pad(y[1:, :], ((0, 1), (0, 0)))  # merge, pad
    if step == 13:
        return jax.lax.dynamic_update_slice(x, y[:2] * 3.0, (2, 0)) + jnp.argmax(y, axis=1)[:, None]
    if step == 14:
        return x[jnp.arange(8) % 3] * 0.5 + jnp.sign(y)  # a row lookup (gather)
    if step == 15:  # one jitted function called twice, the first call's results read after the second's
        (u, v), (p, q) = _helper(x, y), _helper(y, x)
        return u + q * 0.5 - p * v
    if step == 16:  # a branch on a sum over split dims
        return jax.lax.cond(jnp.sum(x) > jnp.sum(y), lambda a, b: a * 2 - b, lambda a, b: jnp.sin(a) + b.sum(0), x, y)
    if step == 17:  # a dilated convolution along the rows (split: halos), then padded sum pooling
        w = y[:3, :, None] * y[3:6, None, :] / 12.0  # [3, 12, 12]
        h = jax.lax.conv_general_dilated(
            x[None], w, (1,), "SAME", rhs_dilation=(2,), dimension_numbers=("NWC", "WIO", "NWC")
        )
        return jax.lax.reduce_window(h[0], 0.0, jax.lax.add, (2, 1), (1, 1), ((1, 0), (0, 0)))
    if step == 18:  # a strided convolution, max pooling, and back to 8 rows
        w = y[5:8, :, None] * y[:3, None, :] / 12.0
        h = jax.lax.conv_general_dilated(x[None], w, (2,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))[0]
        return jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (2, 1), (2, 1), "VALID").repeat(4, axis=0) + x
    c, ys = jax.lax.scan(lambda c, r: (c * 0.9 + r, jnp.tanh(c)), jnp.zeros(12), x)  # a loop over the rows
    return ys + c


@jax.jit
def _helper(a, b):
    return jnp.tanh(a) * b, a - b


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(st.tuples(st.integers(0, 19), st.sampled_from([None, *SPECS])), min_size=2, max_size=6),
    layout=st.sampled_from([P("x", None), P(None, "y"), None, P("y", "x")]),
)
def test_random_programs_equal_jax_jit(steps, layout):
    """Random jax.numpy programs from the supported primitives, with random partial
    annotations (with_sharding_constraint after some steps, some of their dims unconstrained)
    and a random layout of the first input: value and gradient equal jax.jit's on one device."""

    def f(a, b):
        x = a
        for step, spec in steps:
            x = _apply(step, x, b)
            if spec is not None:
                x = jax.lax.with_sharding_constraint(x, spec)
        return jnp.sum(x**2), x

    rng = np.random.default_rng(len(steps))
    a = jnp.asarray(rng.normal(size=(8, 12)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(8, 12)), jnp.float32)
    step_fn = jax.value_and_grad(f, has_aux=True)
    g = mx.partition(step_fn, MESH, in_shardings=(layout, P()))
    assert_trees_close(g(a, b), one_device(step_fn, a, b), rtol=2e-4, atol=2e-4)


# ---- a model this project did not write ---------------------------------------------------------
@pytest.mark.slow  # (10 s; the Table 1 tests cover the same path in the default run)
def test_flax_transformer_trains_like_one_device_step_for_step():
    """A decoder LM from flax.linen's own modules (Embed, MultiHeadDotProductAttention with a
    causal mask, LayerNorm, Dense), optax Adam, annotated on its parameters only (heads and the
    feed-forward hidden dim over y, the data left to propagation): the same losses and
    parameters as jax.jit on one device, step for step."""
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=4, deterministic=True)(h, h, mask=mask)
            h = nn.gelu(nn.Dense(64)(nn.LayerNorm()(x)))  # Dense_0 [M, H]
            return x + nn.Dense(x.shape[-1])(h)  # Dense_1 [H, M]

    class LM(nn.Module):
        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(64, 32)(ids)
            mask = nn.make_causal_mask(ids)
            for _ in range(2):
                x = Block()(x, mask)
            return nn.Dense(64)(nn.LayerNorm()(x))

    model, opt = LM(), optax.adam(1e-3)
    ids = jax.random.randint(jax.random.key(1), (8, 16), 0, 64)
    params = model.init(jax.random.key(0), ids)

    def step(params, opt_state, ids):
        def loss_fn(p):
            logits = model.apply(p, ids[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    specs = {
        "params/params/*/MultiHeadDotProductAttention_0/*/kernel": P("x", "y", None),
        "params/params/*/MultiHeadDotProductAttention_0/out/kernel": P("y", None, "x"),
        "params/params/Block_*/Dense_0/kernel": P("x", "y"),
        "params/params/Block_*/Dense_1/kernel": P("y", "x"),
    }
    f = mx.partition(step, MESH, in_shardings=specs)
    got = want = (params, opt.init(params))
    for _ in range(3):
        *got_state, got_loss = f(*got, ids)
        *want_state, want_loss = jax.jit(step)(*want, ids)
        np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
        got, want = tuple(got_state), tuple(want_state)
    # (the key projection's bias has a gradient of exactly zero in exact arithmetic: softmax over
    # keys ignores a constant per query; Adam scales its rounding noise up to the learning rate)
    noise = jax.tree_util.tree_map_with_path(
        lambda p, _: "key" in jax.tree_util.keystr(p) and "bias" in jax.tree_util.keystr(p), got
    )
    drop = lambda tree: [x for x, n in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(noise)) if not n]  # noqa: E731
    assert_trees_close(drop(got), drop(want), rtol=1e-4, atol=5e-5)  # (5% of an Adam step)
    kernel = got[0]["params"]["Block_0"]["Dense_0"]["kernel"]
    assert kernel.sharding.shard_shape(kernel.shape) == (32 // X, 64 // Y)
