"""mx.partition of primitives that a review (helper-13) found mishandled, each against jax.jit:
scatter-adds with their indices or updates split, lookups with indices out of bounds, narrow
integer sums, bool max and min, `stack` / `unstack` / `tile` (primitives since jax 0.10),
branches chosen by platform (`jnp.diagonal`), NamedShardings given as annotations, and a scan's
results no one reads; and collectives XLA merges.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshax as mx
from tests.test_partition import MESH, assert_counters_equal_hlo, assert_trees_close

T = jax.random.normal(jax.random.key(1), (32, 16))
ROWS = jax.random.randint(jax.random.key(2), (4, 6), 0, 32)


@pytest.mark.parametrize(
    "case",
    ["point, indices split", "point, updates split", "columns, updates split", "rows, indices split"],
)
def test_a_scatter_add_with_its_indices_or_updates_split_adds_the_operand_once(case):
    """Each device scatters its own updates into zeros; their sum is the updates' scatter, and the
    operand is added once after it (it was added on every device, then summed: n copies)."""
    u = jax.random.normal(jax.random.key(3), (4, 6))
    cols = jnp.array([1, 5, 5, 9, 0, 15, 2, 3])
    fn, args, specs = {
        "point, indices split": (lambda t, i: t.at[i, i % 16].add(1.0), (T, ROWS), (None, P("x", "y"))),
        "point, updates split": (lambda t, i, u: t.at[i, i % 16].add(u), (T, ROWS, u), (None, None, P("x", "y"))),
        "columns, updates split": (
            lambda t, c, v: t.at[:, c].add(v),
            (T, cols, jnp.ones((32, 8))),
            (None, None, P(None, "y")),
        ),
        "rows, indices split": (lambda t, r: t.at[r, 3].add(1.0), (T, cols * 3), (None, P("x"))),
    }[case]
    step = jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), argnums=0)
    g = mx.partition(step, MESH, in_shardings=specs)
    assert_trees_close(g(*args), jax.jit(step)(*args), rtol=1e-5, atol=1e-5)
    assert_counters_equal_hlo(g.lower(*args), *args)
    assert_trees_close(mx.partition(fn, MESH, in_shardings=specs)(*args), jax.jit(fn)(*args))


IDS = jnp.array([[0, 31, 32, 40], [5, 100, -1, 7]])


@pytest.mark.parametrize(
    "get",
    [
        lambda t, i: t[i],  # (JAX promises its indices in bounds, and XLA clamps)
        lambda t, i: jnp.take(t, i, axis=0, mode="clip"),
        lambda t, i: t.at[i].get(mode="fill", fill_value=-7.0),
        lambda t, i: t.at[i].get(mode="fill"),  # (NaN)
        lambda t, i: t.astype(jnp.int32).at[i].get(mode="fill"),  # (the lowest int32)
    ],
    ids=["default", "clip", "fill -7", "fill NaN", "fill int"],
)
@pytest.mark.parametrize("specs", [None, (P("y", None), P("x"))], ids=["whole", "split"])
def test_a_lookup_out_of_bounds_clamps_or_fills_as_jax_does(get, specs):
    """A row lookup's index out of bounds reads the clamped row, or the fill value in "fill"
    mode (it read zeros); the gradient (a scatter-add) drops an out-of-bounds row's cotangent
    unless the mode clamps, as jax.jit's does."""
    g = mx.partition(get, MESH, in_shardings=specs)
    np.testing.assert_array_equal(np.asarray(g(T, IDS)), np.asarray(jax.jit(get)(T, IDS)))
    if jnp.issubdtype(jax.eval_shape(get, T, IDS).dtype, jnp.floating):
        grad = jax.grad(lambda t, i: jnp.sum(jnp.nan_to_num(get(t, i)) * jnp.arange(16.0)))
        got = mx.partition(grad, MESH, in_shardings=specs)(T, IDS)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(grad)(T, IDS)))


@pytest.mark.parametrize("dtype", ["uint8", "int8", "int16"])
def test_a_narrow_integer_sum_wraps_in_its_own_dtype(dtype):
    """jnp.sum(..., dtype=uint8) wraps at 256 in XLA; meshax sums wider, then wraps to the
    jaxpr's dtype, so the result meets uint8 values downstream (it was a uint32 of the wide sum)."""
    a = (jnp.arange(8 * 16).reshape(8, 16) % 7 + 100).astype(dtype)

    def fn(a):
        s = jnp.sum(a, axis=1, dtype=dtype)
        return s + a[:, 0], jnp.sum(a, dtype=dtype)

    for specs in (None, (P("x", "y"),)):
        got = mx.partition(fn, MESH, in_shardings=specs)(a)
        want = jax.jit(fn)(a)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_bool_max_and_min_are_any_and_all():
    x = jax.random.normal(jax.random.key(4), (8, 16)) > 1.5

    def fn(x):
        return jnp.max(x, axis=1), jnp.min(x, axis=0), x.max(), (~x).min()

    for specs in (None, (P("x", "y"),)):
        got = mx.partition(fn, MESH, in_shardings=specs)(x)
        for g, w in zip(got, jax.jit(fn)(x)):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize(
    "fn",
    [
        lambda a, b: jnp.sum(jnp.sin(jnp.stack([a, b], axis=1)) ** 2),
        lambda a, b: jnp.sum(jnp.stack([a, 2 * b]) @ b.T),
        lambda a, b: jnp.sum(jnp.tanh(jnp.stack([a, b, a], axis=2))),
        lambda a, b: jnp.sum(jnp.sin(jnp.tile(a, (2, 1))) * jnp.tile(b, (2, 1))),
        lambda a, b: jnp.sum(jnp.sin(jnp.tile(a, (1, 3))) ** 2) + jnp.sum(jnp.tile(b, (2, 1, 1)) * 0.5),
    ],
    ids=["stack axis 1", "stack axis 0", "stack axis 2", "tile rows", "tile columns and a new axis"],
)
@pytest.mark.parametrize("spec", [P("x", "y"), P(None, "y")])
def test_stack_unstack_and_tile(fn, spec):
    """jnp.stack, jnp.tile and stack's gradient (unstack) are primitives since jax 0.10: the
    axes they keep stay split, the stacked or tiled axis is whole."""
    a, b = jax.random.normal(jax.random.key(5), (8, 12)), jax.random.normal(jax.random.key(6), (8, 12))
    step = jax.value_and_grad(fn, argnums=(0, 1))
    g = mx.partition(step, MESH, in_shardings=(spec, spec))
    assert_trees_close(g(a, b), jax.jit(step)(a, b), rtol=2e-5, atol=2e-5)
    assert_counters_equal_hlo(g.lower(a, b), a, b)


def test_a_branch_chosen_by_platform_is_the_one_for_this_platform():
    """jnp.diagonal (and lax.platform_dependent) choose a branch by platform: the branch for
    JAX's backend is inlined (the other, a Pallas one, was an unsupported `platform_index`)."""
    a = jax.random.normal(jax.random.key(7), (8, 8))

    def fn(a):
        here = jax.lax.platform_dependent(a, cpu=jnp.sin, cuda=jnp.cos, rocm=jnp.cos, default=jnp.tanh)
        return jnp.diag(a) * 2.0, jnp.diagonal(here @ a, offset=1), jnp.trace(a)

    step = jax.value_and_grad(lambda a: sum(jnp.sum(v) for v in fn(a)))
    g = mx.partition(step, MESH, in_shardings=(P("x", "y"),))
    assert_trees_close(g(a), jax.jit(step)(a), rtol=1e-5, atol=1e-5)
    assert_trees_close(mx.partition(fn, MESH)(a), jax.jit(fn)(a), rtol=1e-5, atol=1e-5)


def test_named_shardings_stand_for_their_partition_specs():
    """in_shardings and out_shardings take a NamedSharding, as jax.jit does (it was `TypeError:
    'NamedSharding' object is not iterable`); its mesh axes name this mesh's dims."""
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    a = jax.random.normal(jax.random.key(8), (8, 8))

    def fn(a):
        return jnp.sin(a) @ a

    g = mx.partition(
        fn, MESH, in_shardings=(NamedSharding(mesh, P("x", "y")),), out_shardings=NamedSharding(mesh, P("x"))
    )
    assert_trees_close(g(a), jax.jit(fn)(a), rtol=1e-5, atol=1e-5)
    program = g.lower(a)
    assert (program.layout_of(program.placeholders[0]), program.layout_of(0)) == ("a[0]:x;a[1]:y", "a[0]:x")
    other = jax.make_mesh((8,), ("z",))
    with pytest.raises(mx.LayoutError, match="names mesh dim 'z', but the mesh has only"):
        mx.partition(fn, MESH, in_shardings=NamedSharding(other, P("z")))(a)


@pytest.mark.parametrize("length", [1, 3])
def test_a_scans_stacked_result_no_one_reads_is_not_computed(length):
    """XLA drops a loop's result no one reads, and the collective that computed it; meshax's
    scan did not, so its counters had an allreduce per iteration that never ran."""

    def fn(ws, x):
        def body(h, w):
            h = jnp.tanh(h @ w)
            return h, jnp.sum(h, axis=1)  # (a sum over the split axis: an allreduce; never read)

        return jax.lax.scan(body, x, ws)[0]

    ws = jax.random.normal(jax.random.key(9), (length, 16, 16)) * 0.2
    x = jax.random.normal(jax.random.key(10), (8, 16))
    g = mx.partition(fn, MESH, in_shardings=(P(None, None, "y"), P("x", None)))
    assert_trees_close(g(ws, x), jax.jit(fn)(ws, x), rtol=1e-5, atol=1e-5)
    program = g.lower(ws, x)
    assert program.counters["allreduce"].count == 0
    if length == 1:  # (a longer loop's body is in the HLO once, its collectives counted per iteration)
        assert_counters_equal_hlo(program, ws, x)


def _constant_block(w, w2, x):
    return jnp.tanh((jnp.full((16, 24), 0.01) * (x @ w)) @ w2)


def _wsc_transpose_matmul(a):
    return jax.lax.with_sharding_constraint(jnp.sin(a), P("y", "x")).T @ a


def _mlp(w, x):
    return jnp.sum(jnp.sin(jnp.tanh(x @ w) @ w) ** 2)


@pytest.mark.parametrize(
    "case",
    ["two reshards start alike", "uneven gradient", "checkpoint recomputes", "checkpoint saves dots", "constants"],
)
def test_what_xla_merges_is_gathered_once(case):
    """Two reshards of one tensor that start with the same gather gather once; a forward that
    `jax.checkpoint` recomputes is the forward (the repeat of an equation is merged), so what
    the forward gathered is not gathered again. XLA merges both, and the counters counted both
    (one allgather more than the compiled program holds)."""
    a = jax.random.normal(jax.random.key(11), (7, 13))
    w, x = jax.random.normal(jax.random.key(12), (16, 16)) * 0.3, jax.random.normal(jax.random.key(13), (8, 16))
    policy = jax.checkpoint_policies
    fn, args, specs = {
        "two reshards start alike": (_wsc_transpose_matmul, (jnp.ones((8, 16)),), (P("x", "y"),)),
        "uneven gradient": (
            jax.grad(lambda a, b: jnp.sum(jnp.tanh(a @ b)), argnums=1),
            (a, a.T),
            (P("x", "y"), P("y", "x")),
        ),
        "checkpoint recomputes": (
            jax.grad(jax.checkpoint(_mlp, policy=policy.nothing_saveable), argnums=(0, 1)),
            (w, x),
            (P(None, "y"), P("x", None)),
        ),
        "checkpoint saves dots": (
            jax.grad(jax.checkpoint(_mlp, policy=policy.dots_saveable), argnums=(0, 1)),
            (w, x),
            (P(None, "y"), P("x", None)),
        ),
        "constants": (  # (equal constants are equal operands: what follows them merges)
            jax.value_and_grad(lambda *a: jnp.sum(jax.checkpoint(_constant_block)(*a) ** 2), argnums=(0, 1)),
            tuple(jax.random.normal(jax.random.key(14 + i), s) for i, s in enumerate([(32, 24), (24, 8), (16, 32)])),
            (P("x", "y"), P("y", None), P("x", "y")),
        ),
    }[case]
    g = mx.partition(fn, MESH, in_shardings=specs)
    mesh = jax.make_mesh((1, 1), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        want = jax.jit(fn)(*args)
    assert_trees_close(g(*args), want, rtol=1e-5, atol=1e-5)
    assert_counters_equal_hlo(g.lower(*args), *args)


def test_static_argnums_beyond_the_call_are_named():
    """(It was accepted silently: the argument it names does not exist.)"""
    g = mx.partition(lambda a, b: a * b, MESH, static_argnums=(5,))
    with pytest.raises(mx.ConfigError, match=r"static_argnums \[5\] name argument 5, but the call gives 2"):
        g(jnp.ones(8), 2.0)


def test_argnums_from_the_end_count_as_jax_jit_counts_them_and_donations_beyond_the_call_are_named():
    """static_argnums=-1 is the last parameter, as jax.jit takes it: it was compared with the
    arguments' positions as it was, matched none, and the argument was traced (a shape from it
    failed inside the function); a donation beyond the arguments was left out silently, where
    jax.jit refuses it. A position from the end of a function of *args is refused."""

    def rows(a, n):
        assert isinstance(n, int), f"n is {type(n).__name__}, not static"
        return jnp.reshape(a, (n, -1)).sum(axis=1)

    got = mx.partition(rows, MESH, static_argnums=-1)(jnp.ones((8, 4)), 4)
    np.testing.assert_array_equal(np.asarray(got), np.full(4, 8.0))
    with pytest.raises(mx.ConfigError, match=r"static_argnums \[-3\] name argument -3, but the function takes 2"):
        mx.partition(rows, MESH, static_argnums=-3)
    with pytest.raises(mx.ConfigError, match=r"a position from the end needs a function of a fixed number"):
        mx.partition(lambda *a: a[0], MESH, static_argnums=-1)
    g = mx.partition(lambda a: a * 2, MESH, donate_argnums=(3,))
    with pytest.raises(mx.ConfigError, match=r"donate_argnums \[3\] name argument 3, but the call gives 1"):
        g(jnp.ones(8))


def test_an_argument_both_static_and_donated_is_refused():
    """static_argnums overlapping donate_argnums was accepted, the donation passed over silently
    (jax.jit refuses it): a static argument is no array on the devices."""
    with pytest.raises(mx.ConfigError, match=r"argument 1 is in static_argnums and in donate_argnums"):
        mx.partition(lambda a, n: a * n, MESH, static_argnums=1, donate_argnums=(0, -1))


def test_static_argnames_the_function_does_not_take_are_named():
    """A misspelt static_argnames was accepted silently (jax.jit refuses it), its argument traced,
    and the shape made from it failed inside the user's function."""

    def f(a, n=2, *, mode="sum"):
        return a.reshape(n, -1).sum(0) if mode == "sum" else a

    with pytest.raises(
        mx.ConfigError, match=r"static_argnames \['m'\] name no parameter of f; its parameters are: a, n, mode"
    ):
        mx.partition(f, MESH, static_argnames=("n", "m"))
    g = mx.partition(f, MESH, static_argnames=("n", "mode"))
    np.testing.assert_allclose(np.asarray(g(jnp.ones(8), n=4, mode="sum")), np.full(2, 4.0))
    assert mx.partition(lambda **kw: kw["a"] * 2, MESH, static_argnames="b")(a=jnp.ones(2), b=1).shape == (2,)


def test_a_lowered_program_called_on_arguments_of_other_shapes_says_so():
    """`g.lower(x)` is the program for x's shapes: called on others it failed in JAX's executable
    (a TypeError, 'Argument types differ from the types for which this computation was
    compiled', of a NumPy array) or in meshax's feeding (a ValueError)."""
    program = mx.partition(lambda a, b: a @ b, MESH, in_shardings=(P("x"), None)).lower(
        jnp.ones((8, 4)), jnp.ones((4, 2))
    )
    for a in (jnp.ones((16, 4)), np.ones((16, 4), np.float32)):
        with pytest.raises(
            mx.ConfigError, match=r"argument 'a' has shape \[16, 4\], but this program was traced for \[8, 4\]"
        ):
            program(a, jnp.ones((4, 2)))
    np.testing.assert_allclose(np.asarray(program(np.ones((8, 4)), jnp.ones((4, 2)))), np.full((8, 2), 4.0))


def test_a_sharding_written_as_text_is_refused():
    """A mesh dim name given where a PartitionSpec goes was read letter by letter: "yx" split the
    argument over y and x, silently, and "rows" had 4 entries for an array of rank 2."""
    for kwargs in ({"in_shardings": ("yx",)}, {"in_shardings": {"a": "yx"}}, {"out_shardings": "yx"}):
        with pytest.raises(mx.LayoutError, match=r"sharding annotation 'yx' at .* is text: give a PartitionSpec"):
            mx.partition(lambda a: a * 2, MESH, **kwargs)(jnp.ones((8, 4)))


def test_a_result_that_is_no_array_is_named():
    """A function returning text (or an object) failed in JAX's tracing with a TypeError naming
    meshax's own wrapper ('function pure at meshax/jaxpr/partition.py:216 traced for jit returned
    a value of type str')."""

    def f(a):
        return {"y": a * 2, "note": "doubled"}

    with pytest.raises(mx.ConfigError, match=r"f returns 'doubled' \(str\) at \['note'\]: a partitioned function ret"):
        mx.partition(f, MESH)(jnp.ones(8))
    out = mx.partition(lambda a: (a, 2, None, np.float32(1)), MESH)(jnp.ones(8))
    assert out[1] == 2 and out[2] is None


def test_an_argument_that_is_no_array_is_named():
    """Text (or an object) given as an argument that is not static: it said "static arguments
    must be hashable (data type 'abc' not understood)", of an argument neither static nor unhashable."""
    g = mx.partition(lambda a, b: a * 2, MESH)
    with pytest.raises(
        mx.ConfigError, match=r"an argument is 'abc' \(str\), not an array or a number: pass arrays, or"
    ):
        g(jnp.ones(8), "abc")
    with pytest.raises(mx.ConfigError, match=r"an argument is <object object at .*> \(object\)"):
        g(jnp.ones(8), object())
    assert float(mx.partition(lambda a, b: a * 2, MESH, static_argnums=(1,))(jnp.ones(8), "abc")[0]) == 2.0


def test_a_call_under_a_jax_transformation_is_refused_with_the_way_around():
    """A partitioned function called inside jax.jit, jax.grad or jax.vmap was traced on the
    tracers and failed running with an AttributeError ('sharding' attribute is not available on
    traced array)."""
    g = mx.partition(lambda a: jnp.sin(a) * 2, MESH, in_shardings=P("x"))
    for transform in (jax.jit, jax.grad, jax.vmap):
        with pytest.raises(mx.ConfigError, match=r"called with a traced value .* mx.partition\(jax.grad\(fn\)"):
            transform(lambda a: g(a).sum())(jnp.ones((8, 4)))
    np.testing.assert_allclose(np.asarray(mx.partition(jax.grad(lambda a: g.fn(a).sum()), MESH)(jnp.zeros(8))), 2.0)


def test_one_computation_written_twice_and_laid_out_two_ways_stays_two():
    """Two equal computations in a checkpoint (where repeats are merged), each under its own
    annotation, are not merged (merged, they were one tensor with two conflicting annotations: a
    LayoutError)."""
    x, w = jax.random.normal(jax.random.key(15), (16, 32)), jax.random.normal(jax.random.key(16), (32, 24))
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    @jax.checkpoint
    def fn(x, w):
        a = jax.lax.with_sharding_constraint(x @ w, P("x", "y"))
        return a, jax.lax.with_sharding_constraint(x @ w, P(None, None))

    g = mx.partition(fn, MESH)
    with jax.set_mesh(mesh):
        want = jax.jit(fn)(x, w)
    assert_trees_close(g(x, w), want, rtol=1e-5, atol=1e-5)
    program = g.lower(x, w)
    assert [type(op).__name__ for op in program.graph.operations].count("EinsumOperation") == 2
    assert (program.layout_of(0), program.layout_of(1)) == ("x[0]:x;w[1]:y", "")


def test_an_optimization_barrier_is_one_per_program_and_lays_out_each_operand_as_its_result():
    """`jax.lax.optimization_barrier` in the user's function (it was not supported): its results
    are its operands, laid out pair by pair; values and counters as jax.jit's."""

    def fn(x, w):
        a, b = jax.lax.optimization_barrier((x, w))
        return jnp.sum(jnp.tanh(a @ b) ** 2)

    x, w = jax.random.normal(jax.random.key(17), (8, 16)), jax.random.normal(jax.random.key(18), (16, 24))
    grad = jax.grad(fn, argnums=(0, 1))
    g = mx.partition(grad, MESH, in_shardings=(P("x", None), P(None, "y")))
    assert_trees_close(g(x, w), jax.jit(grad)(x, w), rtol=1e-5, atol=1e-5)
    assert_counters_equal_hlo(g.lower(x, w), x, w)


def test_where_xla_keeps_a_checkpoints_recomputation_so_does_partition(monkeypatch):
    """On a GPU, XLA removes the optimization barriers `jax.jit` puts before a checkpoint's
    recomputation only after scheduling: the recomputation stays apart from the forward (that
    is the memory it saves). There `flatten` passes the checkpoint's operands through a barrier
    and merges nothing; on the CPU, where XLA merges the recomputation into the forward, it
    merges the repeats itself. Both give jax.jit's values; the recomputed forward's FLOPs and
    its allgather are counted only where they are kept (checked here on the CPU, whose HLO holds
    that allgather too: this program's barrier keeps it there)."""
    from meshax.jaxpr import flatten

    def fn(w, x):
        return jnp.sum(jax.checkpoint(lambda w, x: jnp.tanh(jnp.tanh(x @ w) @ w))(w, x) ** 2)

    w, x = jax.random.normal(jax.random.key(12), (16, 16)) * 0.3, jax.random.normal(jax.random.key(13), (8, 16))
    step = jax.value_and_grad(fn, argnums=(0, 1))
    want = jax.jit(step)(w, x)
    counted = {}
    for keep in (False, True):
        monkeypatch.setattr(flatten, "_keeps_recomputation", lambda platform, keep=keep: keep)
        g = mx.partition(step, MESH, in_shardings=(P(None, "y"), P("x", None)))
        assert_trees_close(g(w, x), want, rtol=1e-5, atol=1e-5)
        program = g.lower(w, x)
        barriers = [op for op in program.graph.operations if op.name.startswith("optimization_barrier")]
        assert len(barriers) == keep
        assert_counters_equal_hlo(program, w, x)
        counted[keep] = (program.counters.total_flops, program.counters["allgather"].count)
    assert counted[True][0] > counted[False][0] and counted[True][1] == counted[False][1] + 1


def test_a_cpu_mesh_merges_a_checkpoints_recomputation_where_jax_defaults_to_a_gpu(monkeypatch):
    """Whether a checkpoint's recomputation is kept apart is XLA's choice for the devices the
    program runs on: a CPU mesh's, though JAX's default backend is a GPU. It followed the
    default backend: a barrier was put in that XLA:CPU would not have kept."""
    w, x = jax.random.normal(jax.random.key(12), (16, 16)) * 0.3, jax.random.normal(jax.random.key(13), (8, 16))
    step = jax.grad(lambda w, x: jnp.sum(jax.checkpoint(lambda w, x: jnp.tanh(x @ w) @ w)(w, x) ** 2))
    want = jax.jit(step)(w, x)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    g = mx.partition(step, MESH, in_shardings=(P(None, "y"), P("x", None)))
    assert_trees_close(g(w, x), want, rtol=1e-5, atol=1e-5)
    program = g.lower(w, x)
    assert not [op for op in program.graph.operations if op.name.startswith("optimization_barrier")]
    assert_counters_equal_hlo(program, w, x)


def test_a_checkpoints_memory_under_partition_follows_jax_jit_where_the_recomputation_is_kept(monkeypatch, tmp_path):
    """`python -m benchmarks.remat_memory`: the peak memory of a checkpointed stack's gradient by
    XLA's memory analysis, under jax.jit and mx.partition. With the recomputation kept apart (a
    GPU's choice, forced here) the barrier makes partition's program need what jax.jit's does,
    to the byte on the CPU; with the CPU's choice, partition merges it and needs no more than
    the plain stack."""
    from benchmarks import remat_memory
    from meshax.jaxpr import flatten

    size = dict(layers=4, width=64, batch=256)
    jit = [remat_memory.peak_bytes("jax.jit", **size, checkpoint=c) for c in (False, True)]
    merged = [remat_memory.peak_bytes("mx.partition", **size, checkpoint=c) for c in (False, True)]
    assert merged[1] == merged[0] and jit[1] != jit[0]  # (the CPU's jax.jit keeps what its barrier held apart)
    monkeypatch.setattr(flatten, "_keeps_recomputation", lambda platform: True)
    assert [remat_memory.peak_bytes("mx.partition", **size, checkpoint=c) for c in (False, True)] == jit
    records = remat_memory.main(["--layers", "2", "--width", "32", "--batch", "64", "--out", str(tmp_path / "r.json")])
    assert [r["front_end"] for r in records] == ["jax.jit", "mx.partition"] and all(r["ratio"] > 0 for r in records)


POSITIVE = jnp.abs(T) + 0.5


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: jax.lax.bessel_i0e(x) + jax.lax.bessel_i1e(x),
        lambda x: jax.lax.igamma(x, x * x) + jax.lax.igammac(x, 2.0 * x),
        lambda x: jax.lax.igamma_grad_a(x, 2.0 * x) + jax.lax.random_gamma_grad(x, 2.0 * x),
        lambda x: jax.lax.polygamma(jnp.ones_like(x), x) + jax.lax.zeta(x + 1.0, x),
        lambda x: jax.lax.betainc(x, 2.0 * x, jnp.tanh(x)),
        lambda x: jax.lax.clz((x * 1000).astype(jnp.int32)),
        lambda x: getattr(jax.lax, "one_minus_square", jnp.square)(jnp.tanh(x)),  # (a primitive since jax 0.11)
    ],
    ids=["bessel", "igamma", "gamma gradients", "polygamma zeta", "betainc", "clz", "one_minus_square"],
)
def test_elementwise_special_functions_partition_as_jax_jit_runs_them(fn):
    """Elementwise primitives besides arithmetic (the special functions `jax.random`'s gamma and
    beta samplers use, bit counts, and tanh's derivative, `one_minus_square` since jax 0.11) are
    split like any elementwise op: they were "not supported", and a tanh's gradient under
    jax 0.11 failed to partition."""
    g = mx.partition(fn, MESH, in_shardings=(P("x", "y"),))
    np.testing.assert_allclose(np.asarray(g(POSITIVE)), np.asarray(jax.jit(fn)(POSITIVE)), rtol=1e-5, atol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(jnp.tanh(x) * x))
    np.testing.assert_allclose(
        np.asarray(mx.partition(grad, MESH, in_shardings=(P("x", "y"),))(T)), np.asarray(jax.jit(grad)(T)), rtol=1e-6
    )
