"""mx.partition of plain JAX code as users write it (optax steps, Flax models, jax.checkpoint,
callbacks, scatters), where a sweep of such code (helper-32) found a primitive or a form that
failed: each against jax.jit, and its collectives against the compiled HLO.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import meshax as mx
from tests.test_partition import MESH, assert_counters_equal_hlo, assert_trees_close, one_device

X = jax.random.normal(jax.random.key(0), (16, 32))
W = jax.random.normal(jax.random.key(1), (32, 32)) * 0.2


def check(fn, args, in_shardings, rtol=2e-5, atol=2e-6):
    g = mx.partition(fn, MESH, in_shardings=in_shardings)
    assert_trees_close(g(*args), jax.jit(fn)(*args), rtol=rtol, atol=atol)
    assert_counters_equal_hlo(g.lower(*args))
    return g


def test_a_replicated_region_may_make_arrays_from_nothing():
    """An equation with no operands inside `mx.replicated_region` (an iota: `jnp.arange`, and the
    ones `jnp.linalg.inv`'s LU makes) is bound on each device like the rest of the region: it
    failed with 'SlicewiseOperation needs a mesh or at least one input'."""
    check(mx.replicated_region(lambda x: x + jnp.arange(32.0)), (X,), (P("x", "y"),))
    check(lambda w: mx.replicated_region(jnp.linalg.inv)(w + 3 * jnp.eye(32)) @ w, (W,), (P("x", "y"),))


def test_checkpoint_names_and_the_policies_that_read_them():
    """`checkpoint_name` (the `name` primitive) tags a value for a `jax.checkpoint` policy
    (`save_only_these_names`, ...), and is the identity on it: it was 'not supported', so any
    model that names its activations for remat failed to partition."""
    from jax.ad_checkpoint import checkpoint_name

    def loss(w, x, policy):
        def layer(w, h):
            h = checkpoint_name(jnp.sin(h @ w), "pre")
            return jnp.tanh(h @ w)

        f = jax.checkpoint(layer, policy=policy)
        return jnp.mean(f(w, f(w, x)) ** 2)

    for policy in [
        jax.checkpoint_policies.save_only_these_names("pre"),
        jax.checkpoint_policies.nothing_saveable,
    ]:
        step = jax.value_and_grad(lambda w, x, p=policy: loss(w, x, p))
        check(step, (W, X), (P(None, "y"), P("x")))
    check(lambda x: checkpoint_name(x * 2, "out"), (X,), (P("x", "y"),))  # (a result, outside any checkpoint)


def test_total_order_comparisons():
    """`lt_to`, `le_to` and `eq_to` (comparisons that order NaNs, as `jnp.searchsorted`,
    `jnp.digitize` and `jnp.histogram` bin with) are elementwise: they were 'not supported'."""
    edges = jnp.sort(X[0])

    def bins(x, edges):
        return (
            jnp.searchsorted(edges, x),
            jnp.searchsorted(edges, x, side="right", method="compare_all"),
            jnp.digitize(x, jnp.linspace(-1, 1, 5)),
            jnp.histogram(x, bins=5, range=(-2, 2))[0],
        )

    check(bins, (X, edges), (P("x", "y"), None))


def test_scatters_that_combine_by_min_max_mul_and_sub():
    """`jax.ops.segment_max`/`segment_min`, `x.at[i].max/min/multiply/subtract` (scatter-max,
    -min, -mul, -sub) were 'not supported'; they scatter as an overwriting scatter does (the
    axes written by index whole), and their gradients partition too."""
    seg = jnp.array([0, 1, 1, 2, 0, 3, 3, 3, 2, 1, 0, 0, 1, 2, 3, 3])

    def combine(x, s):
        return (
            jax.ops.segment_max(x, s, 4),
            jax.ops.segment_min(x, s, 4),
            x.at[s, 0].max(0.5),
            x.at[:, s].multiply(2.0),
            x.at[s].subtract(1.0),
        )

    check(combine, (X, seg), (P("x", "y"), None))
    check(jax.grad(lambda x, s: jnp.sum(jax.ops.segment_max(x, s, 4) ** 2)), (X, seg), (P("x", "y"), None))


def test_debug_prints_are_left_out_with_a_warning_that_says_so():
    """`jax.debug.print` / `jax.debug.callback` in a training step: the step runs, without them,
    and a warning names each and its line. Before, they were 'not supported', and inside the
    `mx.replicated_region` that error suggested they silently printed nothing."""

    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        jax.debug.print("loss {l}", l=loss)
        jax.debug.callback(lambda v: None, g.sum())
        mx.replicated_region(lambda v: jax.debug.print("norm {n}", n=v))(jnp.sum(g**2))
        return w - 0.1 * g, loss

    g = mx.partition(step, MESH, in_shardings=(P(None, "y"), P("x")))
    with pytest.warns(mx.DebugCallbackWarning) as warned:
        got = g(W, X)
        program = g.lower(W, X)  # (placed arguments: another trace, warned again)
    said = {str(w.message) for w in warned}
    assert any(re.search(r"debug_print .*test_partition_user_code.py:\d+.*return it", m) for m in said), said
    assert any(m.startswith("mx.partition leaves out debug_callback") for m in said), said
    assert_trees_close(got, jax.jit(step)(W, X))
    assert_counters_equal_hlo(program)


def test_explicit_sharding_annotations_are_refused_with_the_way_around():
    """`jax.sharding.reshard` (explicit sharding mode) and a NamedSharding on a mesh of Explicit
    axes (`jax.make_mesh`'s default) in `with_sharding_constraint` cannot be traced on the Auto
    mesh mx.partition annotates with (jax.jit refuses the second too): the error only quoted
    JAX's, which names axis types and not what to write instead."""
    explicit = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    for fn in [
        lambda x: jax.sharding.reshard(x * 2, P("y", None)),
        lambda x: jax.lax.with_sharding_constraint(x * 2, jax.sharding.NamedSharding(explicit, P("y"))),
    ]:
        with pytest.raises(mx.LayoutError, match=r"user_code.py:\d+ .*with_sharding_constraint\(x, spec\)"):
            mx.partition(fn, MESH)(X)
    auto = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    fn = lambda x: jax.lax.with_sharding_constraint(x * 2, jax.sharding.NamedSharding(auto, P("y")))  # noqa: E731
    check(fn, (X,), (P("x"),))
    # a sharding with no mesh to read names from: a StopIteration from deep inside the import
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with pytest.raises(mx.LayoutError, match=r"sharding_constraint at .* gives SingleDeviceSharding\(.*PartitionSpec"):
        mx.partition(lambda x: jax.lax.with_sharding_constraint(x * 2, one), MESH)(X)


def test_a_checkpoint_policy_that_offloads_to_the_host():
    """`save_and_offload_only_these_names` moves the named values to the host and back
    (`device_put` to a memory space): the identity on the values, and mx.partition keeps them on
    the device; it was 'not supported'. A `device_put` to a sharding inside the function is
    refused with what to write instead (the generic error suggested a replicated region)."""
    from jax.ad_checkpoint import checkpoint_name

    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=["a"],
        offload_src="device",
        offload_dst="pinned_host",
    )

    def loss(w, x):
        f = jax.checkpoint(lambda w, x: jnp.tanh(checkpoint_name(x @ w, "a") @ w), policy=policy)
        return jnp.sum(f(w, x) ** 2)

    check(jax.grad(loss), (W, X), (P(None, "y"), P("x")), rtol=1e-4, atol=1e-5)
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with pytest.raises(mx.GraphError, match=r"device_put .*user_code.py:\d+.*with_sharding_constraint"):
        mx.partition(lambda x: jax.device_put(x * 2, jax.sharding.NamedSharding(mesh, P("x"))), MESH)(X)


def test_a_replicated_region_binds_equations_traced_with_a_sharding():
    """Traced under the mesh, some equations record their result's sharding (the
    `broadcast_in_dim` inside `jnp.linalg.cholesky`, `pinv` and `lstsq`); bound on each device's
    slices in a replicated region that sharding named Auto axes where they are manual, and JAX
    refused it ('context mesh ... should match the aval mesh')."""
    spd = lambda w: w @ w.T + 32 * jnp.eye(32)  # noqa: E731
    check(mx.replicated_region(lambda w: jnp.linalg.cholesky(spd(w))), (W,), (P("x", "y"),), rtol=1e-4, atol=1e-5)
    check(mx.replicated_region(jnp.linalg.pinv), (W,), (P("x"),), rtol=1e-4, atol=1e-5)


def test_where_with_a_scalar_branch_keeps_an_argument_split():
    """`jnp.where(c, x, 0)` on an argument `x` (as `optax.lamb` and `optax.lars` do with the
    parameters and their norms) broadcasts the scalar with JAX's own `reshard` of `x` to its
    type's sharding, `P(None, None)` on the Auto mesh, which JAX lowers to nothing. It was read as
    an annotation that replicates `x`: the step gathered every parameter (lamb on x:2;y:4: 2
    allgathers of 384 values where jax.jit moves none)."""
    import optax

    for opt in [optax.lamb(1e-3), optax.lars(1e-3)]:

        def step(g, state, w, opt=opt):
            updates, state = opt.update(g, state, w)
            return optax.apply_updates(w, updates), state

        state = opt.init(W)
        specs = jax.tree_util.tree_map(lambda a: P("x", "y") if a.ndim == 2 else None, state)
        g = check(step, (X.T @ X, state, W), (P("x", "y"), specs, P("x", "y")), rtol=1e-4, atol=1e-6)
        assert g.lower(X.T @ X, state, W).counters["allgather"].count == 0
    g = check(lambda x: (jnp.where(x > 0, x, 0), jax.nn.hard_tanh(x), jnp.nan_to_num(x)), (X,), (P("x", "y"),))
    assert not g.lower(X).counters.sites()


def test_a_broadcast_read_in_another_layout_is_made_again_not_gathered():
    """The gradient of a mean is 1/n broadcast to the mean's operand; a contraction that reads
    it laid out otherwise than planned (`mean(tanh(x @ w) @ w)`, w's columns split) gathered the
    broadcast, which XLA simplifies away: 2 allgathers counted, 1 compiled. It is made again in
    the layout asked for from its input, where that input needs no move."""
    loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) @ w)  # noqa: E731
    check(jax.value_and_grad(loss), (W, X), (P(None, "y"), P("x")))


def test_any_and_all_over_a_split_axis_are_one_allreduce():
    """`jnp.any` / `jnp.all` (`reduce_or` / `reduce_and` of bools; `optax.apply_if_finite` asks
    `jnp.all(jnp.isfinite(g))` of every gradient) gathered their operand whole: the step gathered
    every gradient (x:2;y:4: 2 allgathers of 192 values where jax.jit allreduces 2 flags). They
    are meshax's any and all: a split reduced axis is one allreduce of the results."""
    import optax

    opt = optax.apply_if_finite(optax.adam(1e-2), 3)

    def step(g, state, w):
        updates, state = opt.update(g, state, w)
        return optax.apply_updates(w, updates), state

    state = opt.init(W)
    specs = jax.tree_util.tree_map(lambda a: P("x", "y") if a.ndim == 2 else None, state)
    g = check(step, (X.T @ X, state, W), (P("x", "y"), specs, P("x", "y")))
    assert g.lower(X.T @ X, state, W).counters["allgather"].count == 0
    ints = jnp.round(X * 10).astype(jnp.int32)
    fns = lambda a: (jnp.any(a > 0, axis=1), jnp.all(a > -20, axis=0), jnp.any(a), jax.lax.reduce_and(a, (1,)))  # noqa: E731
    g = mx.partition(fns, MESH, in_shardings=(P("x", "y"),))
    assert_trees_close(g(ints), jax.jit(fns)(ints))  # (the bitwise and: jax.jit of it split fails in XLA)
    assert g.lower(ints).counters["allgather"].count == 1  # (only the bitwise and gathers)


def test_ffts_and_batched_linear_algebra_keep_their_batch_split():
    """`jnp.fft` (the `fft` primitive, and `real`/`imag`/`complex`/`conj`) and `jnp.linalg`'s
    decompositions and solves (`cholesky`, `qr`, `eigh`, `svd`, `lu`, `triangular_solve`, and
    `custom_linear_solve`, which `jnp.linalg.solve` and `inv` are written with) were 'not
    supported' even batched over a split axis, where jax.jit moves nothing. They transform their
    trailing axes whole, batched over the split axes before them."""
    a = jax.random.normal(jax.random.key(2), (8, 6, 6)) + 4 * jnp.eye(6)
    b = jax.random.normal(jax.random.key(3), (8, 6, 3))

    def signals(x):
        f = jnp.fft.rfft(x)
        return jnp.fft.irfft(f * jnp.conj(f)), jnp.fft.fft(x).imag, jnp.abs(jnp.fft.fft2(x.reshape(16, 4, 8)))

    def linalg(a, b):
        spd = a @ jnp.swapaxes(a, -1, -2)
        return (
            jnp.linalg.cholesky(spd),
            jnp.linalg.qr(a)[1],
            jnp.linalg.eigh(spd)[0],
            jnp.linalg.svd(a, compute_uv=False),
            jnp.linalg.slogdet(a)[1],
            jnp.linalg.solve(a, b),
            jnp.linalg.inv(a),
            jax.scipy.linalg.solve_triangular(jnp.triu(a), b),
        )

    for fn, args, specs in [
        (signals, (X,), (P(("x", "y")),)),
        (linalg, (a, b), (P("x"), P("x"))),
        (jax.grad(lambda a, b: jnp.sum(jnp.linalg.solve(a, b) ** 2), argnums=(0, 1)), (a, b), (P("y"), P("y"))),
    ]:
        g = check(fn, args, specs, rtol=1e-4, atol=1e-4)
        assert not g.lower(*args).counters.sites()


def test_a_loop_in_a_branch_reads_the_branch_operands():
    """A loop inside a `lax.cond` branch that reads the branch's operand (as
    `jax.scipy.linalg.expm` squares its Pade approximant a number of times its cond was given)
    failed with a KeyError: the branch moved in only the operands its own ops read, and a loop
    reads what it captures in its body."""

    def f(a, s):
        def branch(s, a):
            return jax.lax.fori_loop(0, 4, lambda i, h: jnp.tanh(h * a) * s, a)

        return jax.lax.cond(s > 0.5, branch, lambda s, a: a, s, a)

    check(f, (W, jnp.float32(1.5)), (P("x", "y"), None))
    check(jax.scipy.linalg.expm, (W,), (P("x"),), rtol=1e-4, atol=1e-5)


def test_a_loops_invariant_moves_are_made_and_counted_once():
    """A sampling loop (`fori_loop` of a model whose weights are split FSDP-style over the batch's
    mesh dim) gathers each weight in the body; XLA hoists those loop-invariant gathers out of the
    loop, so the program runs them once, and meshax counted them once per iteration (20
    allgathers of 20480 values counted, 2 of 2048 run). They are moved once before the loop now,
    and the gradient's loop takes the same moves."""
    w1, w2 = W, W.T

    def sample(w1, w2, x):
        return jax.lax.fori_loop(0, 10, lambda i, x: x - 0.1 * jnp.tanh(x @ w1) @ w2, x)

    grad = jax.grad(lambda w1, w2, x: jnp.sum(sample(w1, w2, x) ** 2), argnums=(0, 1))
    for fn in [sample, grad]:
        g = mx.partition(fn, MESH, in_shardings=(P("x"), P(None, "x"), P("x")))
        assert_trees_close(g(w1, w2, X), jax.jit(fn)(w1, w2, X), rtol=1e-4, atol=1e-5)
        program = g.lower(w1, w2, X)
        ran = mx.hlo_collectives(program.compiled_text(), per_run=True)  # (a loop's body times its trips)
        assert {k: (v["count"], v["values"]) for k, v in ran.items() if v["count"]} == {
            k: (program.counters[k].count, program.counters[k].values) for k in ran if program.counters[k].count
        }
    assert program.counters["allgather"].count == 2  # (each weight once: the backward loop takes the forward's)


def test_a_scatter_keeps_the_axes_it_does_not_index_split():
    """`cache.at[:, i].set(x)` (a decoding loop's KV cache write, with the batch split) is a
    scatter whose updates carry the batch as a window axis; the updates were kept whole, and
    with them the operand's batch: each step gathered the cache and the update (data:8: 2
    allgathers of 208 values per run, where jax.jit moves nothing). Only the axes written by
    index, and the updates' axes that index, stay whole."""
    cache0 = jnp.zeros((16, 6, 32))

    def decode(w, x, n):
        def body(i, c):
            x, cache = c
            cache = cache.at[:, i].set(x)
            return jnp.tanh(x @ w + cache.sum(1)), cache

        return jax.lax.fori_loop(0, n, body, (x, cache0))

    g = mx.partition(decode, "data:8", in_shardings=(None, P("data"), None))
    args = (W, X, jnp.int32(5))
    assert_trees_close(g(*args), jax.jit(decode)(*args), rtol=1e-4, atol=1e-5)
    assert not g.lower(*args).counters.sites()
    rows = jnp.array([3, 0, 7])
    check(lambda x, u: (x.at[:, rows].set(u), x.at[:, 1].max(u[:, 0])), (X, X[:, :3]), (P("x"), P("x")))


def test_take_along_axis_over_a_split_axis_looks_up_the_rows_each_device_holds():
    """`jnp.take_along_axis` (a gather with batching axes: the label logit of
    `optax.softmax_cross_entropy_with_integer_labels`) was bound on each device's slices with the
    looked-up axis whole, so classes split over a mesh dim (a vocabulary-parallel output layer)
    were gathered whole (x:2;y:4: 1 allgather of 64 values in the step). It is a lookup of the
    rows each device holds in its own batch slice, and a sum over the devices that split them,
    as an embedding lookup is; out-of-bounds indices filled or clipped as JAX does."""
    import optax

    labels = jax.random.randint(jax.random.key(3), (16,), 0, 32)

    def step(w, x, labels):
        loss = lambda w: optax.softmax_cross_entropy_with_integer_labels(x @ w, labels).mean()  # noqa: E731
        return jax.value_and_grad(loss)(w)

    g = check(step, (W, X, labels), (P(None, "y"), P("x"), P("x")))
    assert g.lower(W, X, labels).counters["allgather"].count == 0
    x3, ids = jnp.stack([X, -X]), jnp.stack([labels - 2, labels + 2])  # (some out of bounds)

    def along(x, ids):
        return (
            jnp.take_along_axis(x, ids[..., None], axis=-1),
            jnp.take_along_axis(x, ids[..., None], axis=-1, mode="clip"),
            jnp.take_along_axis(x > 0, ids[..., None] % 32, axis=-1),
        )

    g = check(along, (x3, ids), (P(None, "x", "y"), P(None, "x")))
    assert g.lower(x3, ids).counters["allgather"].count == 0


def test_argmax_over_a_split_axis_is_two_allreduces():
    """`jnp.argmax` / `argmin` (greedy decoding's token, `jax.random.categorical`'s sample) over
    an axis split over a mesh dim gathered the operand whole first (the vocabulary, gathered to
    pick one token: x:2;y:4, 1 allgather of 64 values per argmax). They are a max (min) and the
    first position that has it, a min: two allreduces of the results. Ties give the first
    position and a NaN wins, as in JAX."""
    x = jnp.round(X * 2).at[3, 5].set(jnp.nan).at[3, 20].set(jnp.nan).at[7, 0].set(jnp.inf)

    def pick(x):
        return (
            jnp.argmax(x, 1),
            jnp.argmin(x, 0),
            jnp.argmin(jnp.nan_to_num(-x).astype(jnp.int32), 1),
            jnp.argmax(x > 0, 1),
            jax.random.categorical(jax.random.key(1), jnp.nan_to_num(x), axis=-1),
        )

    g = check(pick, (x,), (P("x", "y"),))
    assert g.lower(x).counters["allgather"].count == 0
    # bfloat16 (no inexact type to NumPy) took the integers' path: a NaN matched no position, and
    # argmax gave n, an index out of range (8 of 8 rows), on any layout
    for spec in (None, P("x", "y")):
        check(lambda a: (jnp.argmax(a, 0), jnp.argmin(a, 1)), (x.astype(jnp.bfloat16),), (spec,))


def test_max_and_min_over_no_values_are_their_identity():
    """reduce_max / reduce_min over a zero-size axis give -inf / +inf in the jaxpr (what
    `jnp.max(x, initial=...)` of an empty array starts from): each device's local max was
    jnp.max, which raised "zero-size array to reduction operation max which has no identity"."""

    def f(z):
        return z.max(axis=0, initial=-1.0), z.min(axis=0, initial=2.0), jnp.max(z, axis=0, initial=3)

    for spec in (None, P(None, "y")):
        check(f, (jnp.zeros((0, 12)),), (spec,))


def test_an_empty_axis_split_over_a_mesh_dim_is_gathered_as_nothing():
    """A zero-size axis split over a mesh dim and needed whole (a concatenation, a cumulative
    sum, a sort along it) failed to compile: XLA's verifier refuses an all-gather along an axis
    of no values ('dimension size of operand at all_gather_dim cannot be zero')."""
    z, x = jnp.zeros((0, 12)), jnp.ones((8, 12))

    def f(z, x):
        return jnp.concatenate([z, x]), jnp.cumsum(z, axis=0), jnp.sort(z, axis=0), jnp.pad(z, ((1, 1), (0, 0)))

    for spec in (P("x", "y"), P("y")):
        check(f, (z, x), (spec, spec))


def test_a_collective_of_no_values_is_not_counted():
    """A sum over a split axis of an array with no values is an all-reduce of nothing: XLA drops
    it from the program, and the counters had it (one all-reduce of 0 values)."""

    def f(x):
        return x.sum(0), x.T @ x

    g = mx.partition(f, MESH, in_shardings=(P("x", None),))
    x = jnp.ones((8, 0))
    got = g(x)
    assert got[0].shape == (0,) and got[1].shape == (0, 0)
    assert all(c.count == 0 for c in g.lower(x).counters.values())
    assert_counters_equal_hlo(g.lower(x))


def test_an_annotation_of_prng_keys_lays_them_out():
    """`with_sharding_constraint` (or `mx.mesh_split`) of a key array ran whole on each device as
    every op on keys does: the constraint was bound inside the SPMD program, and JAX refused it
    ('pspec P('y',) contains a manual axes')."""

    def f(key, x):
        keys = jax.lax.with_sharding_constraint(jax.random.split(key, 16), P("y"))
        keys = mx.mesh_split(keys, ["x"])
        return x + jax.vmap(lambda k: jax.random.normal(k, (32,)))(keys), keys

    g = mx.partition(f, MESH, in_shardings=(None, P("x", "y")))
    got, want = g(jax.random.key(7), X), one_device(f, jax.random.key(7), X)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(jax.random.key_data(got[1]), jax.random.key_data(want[1]))
    assert_counters_equal_hlo(g.lower(jax.random.key(7), X))


def test_an_annotation_of_prng_keys_has_an_entry_per_key_axis_at_most():
    """A key array is carried as its key data, with axes of its own: in_shardings / out_shardings
    of more entries than the keys' rank were accepted silently (P("x") of one key split its key
    data), where jax.jit refuses them."""
    one, eight = jax.random.key(0), jax.random.split(jax.random.key(0), 8)
    with pytest.raises(mx.LayoutError, match=r"has 1 entry for an array of rank 0 \(shape \[\]\)"):
        mx.partition(lambda k: jax.random.normal(k, (4,)), MESH, in_shardings=P("x"))(one)
    with pytest.raises(
        mx.LayoutError, match=r"out_shardings\[0\] .* has 2 entries for an array of rank 1 \(shape \[8\]\)"
    ):
        mx.partition(lambda k: jax.random.split(k, 8), MESH, out_shardings=P("x", "y"))(one)
    keys = mx.partition(lambda k: jax.random.split(k[0], 8), MESH, in_shardings=P("x"), out_shardings=P("x"))(eight)
    np.testing.assert_array_equal(jax.random.key_data(keys), jax.random.key_data(jax.random.split(eight[0], 8)))


def test_mesh_split_under_vmap_splits_the_per_example_axes():
    """`mx.mesh_split` inside `jax.vmap` (per-example code) failed with an AttributeError: its
    batching rule asked for `jax.interpreters.batching.not_mapped`, which jax 0.10 no longer has.
    The mapped axis is left to propagation, the others split as annotated."""

    def f(x, w):
        return jax.vmap(lambda r: jnp.tanh(mx.mesh_split(r @ w, ["y"])) @ mx.mesh_split(w, [None, "y"]).T)(x)

    assert check(f, (X, W), (None, None)).layout_of("w") == "w[1]:y"
    check(jax.grad(lambda x, w: f(x, w).sum(), argnums=(0, 1)), (X, W), (P("x"), None))
    g = check(lambda x: jax.vmap(mx.mesh_split, in_axes=(1, None), out_axes=1)(x, ["x"]), (X,), (None,))
    assert g.layout_of(0) == "x[0]:x"


def test_a_custom_vmap_function_runs_its_function():
    """A `jax.custom_batching.custom_vmap` function called unmapped (the `custom_vmap_call`
    primitive) was 'not supported'; it is a call of its function, as it runs under jax.jit, and
    is inlined (mapped, JAX has already applied its rule)."""

    @jax.custom_batching.custom_vmap
    def f(x):
        return jnp.sin(x) * 2

    f.def_vmap(lambda axis_size, in_batched, x: (jnp.sin(x) * 2, in_batched[0]))
    check(lambda x, w: f(x @ w), (X, W), (P("x", "y"), None))
    check(lambda x: jax.vmap(f)(x), (X,), (P("x", "y"),))


def test_gamma_draws_and_the_distributions_built_on_them():
    """`jax.random.gamma` (the `random_gamma` primitive, under beta, dirichlet, t, ball) was 'not
    supported'; it draws each value from the key split by the value's position, so it runs whole
    on each device as every op on keys does, and draws what jax.jit draws."""

    def draws(a, key):
        k1, k2, k3 = jax.random.split(key, 3)
        alpha = jnp.abs(a) + 0.5
        return jax.random.gamma(k1, alpha), jax.random.beta(k2, alpha, 2.0), jax.random.dirichlet(k3, alpha)

    check(draws, (X, jax.random.key(1)), (P("x", "y"), None), rtol=1e-5, atol=1e-6)
    grad = jax.grad(lambda a, k: jax.random.gamma(k, jnp.abs(a) + 0.5).sum())
    check(grad, (X, jax.random.key(1)), (P("x", "y"), None))


def test_an_annotation_inside_a_replicated_region_is_read_through():
    """`with_sharding_constraint` in `mx.replicated_region` (a library function that annotates its
    values, run whole) was bound on each device's slices and failed inside JAX with
    AttributeError: 'NoneType' object has no attribute '_device_assignment'. The region's values
    are whole on each device: an annotation there is the identity, as `mx.mesh_split` was."""

    def f(x, w):
        return mx.replicated_region(lambda a: jnp.tanh(jax.lax.with_sharding_constraint(a @ w, P("x", "y"))))(x)

    step = jax.value_and_grad(lambda x, w: f(x, w).sum(), argnums=(0, 1))
    for fn, specs in ((f, (P("x", "y"), None)), (step, (P("x", "y"), P(None, "y")))):
        g = mx.partition(fn, MESH, in_shardings=specs)
        assert_trees_close(g(X, W), one_device(fn, X, W))
        assert_counters_equal_hlo(g.lower(X, W))


def test_a_shard_map_inside_is_refused_with_the_way_around():
    """jax.shard_map inside the function was 'not supported' with the hint to wrap it in
    mx.replicated_region, where it failed with a KeyError ('subfuns') binding it on slices."""
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def mapped(x):
        return jax.shard_map(lambda a: jax.lax.psum(a, "y"), mesh=mesh, in_specs=P("x", "y"), out_specs=P("x"))(x)

    for fn in (mapped, mx.replicated_region(mapped)):
        with pytest.raises(mx.GraphError, match=r"does not support jax.shard_map .* lay it out with jax.lax.with_sh"):
            mx.partition(fn, MESH)(X)


def test_a_max_over_a_split_axis_keeps_a_nan():
    """XLA's all-reduce max and min drop NaNs, so jnp.max over a split axis holding a NaN gave the
    largest number (jnp.max(x, 0) with x's rows split over x: 1.62 where jax.jit gives nan). The
    max and min allreduces now run over the floats' order as integers, a NaN the extreme: the same
    collective, values and bytes (counters equal the HLO)."""
    x = X.at[1, 3].set(jnp.nan).at[2].set(-jnp.inf).at[5, 7].set(jnp.inf).at[3].set(-0.0)

    def f(a):
        return a.max(0), a.min(0), a.max(1), jnp.max(a), jax.nn.logsumexp(a[::2], 0)

    for dtype in (jnp.float32, jnp.bfloat16):
        for spec in (P("x", "y"), P(("x", "y"))):
            check(f, (x.astype(dtype),), (spec,))
