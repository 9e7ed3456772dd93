"""Variables: layout-independent initialization, sharded storage, get/set, assignments (issue 3)."""

import numpy as np
import pytest

import meshax as mx
from meshax.lower import mesh_impl
from tests.conftest import IMPL_IDS, IMPLS

io, hidden = mx.Dimension("io", 8), mx.Dimension("hidden", 16)
INITS = {
    "zeros": mx.initializers.zeros(),
    "ones": mx.initializers.ones(),
    "normal": mx.initializers.normal(0.5),
    "truncated_normal": mx.initializers.truncated_normal(0.5),
    "uniform": mx.initializers.uniform(-2, 2),
    "glorot_uniform": mx.initializers.glorot_uniform(),
    "glorot_normal": mx.initializers.glorot_normal(),
}


def one_var(init=None, dtype="float32"):
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    w = mx.get_variable(mesh, "w", [io, hidden], initializer=init, dtype=dtype)
    return graph, mesh, w


@pytest.fixture(params=["made whole", "made split"])
def making(request, monkeypatch):
    """Both ways a variable is made: whole and then split (at most `_MADE_WHOLE` values: one
    program for every layout), or each device making its own slice (larger ones)."""
    if request.param == "made split":
        monkeypatch.setattr(mesh_impl, "_MADE_WHOLE", 0)
    return request.param


@pytest.mark.parametrize("name", INITS)
def test_initial_values_do_not_depend_on_the_layout(name, making):
    values = []
    for impl_cls in IMPLS:
        for mesh_shape, layout in [
            ("all:1", ""),
            ("all:8", "hidden:all"),
            ("rows:2;cols:4", "io:rows;hidden:cols"),
            ("rows:2;cols:4", "hidden:rows;hidden:cols"),
        ]:
            graph, mesh, w = one_var(INITS[name])
            values.append(mx.Lowering(graph, {mesh: impl_cls(mesh_shape, layout)}).variable_value(w))
    for v in values[1:]:
        np.testing.assert_array_equal(v, values[0])
    if name not in ("zeros", "ones"):
        assert values[0].std() > 0.05
    if name == "truncated_normal":
        # cut at two standard deviations of the underlying normal (rescaled to keep stddev 0.5)
        assert np.abs(values[0]).max() <= 2 * 0.5 / 0.87962566 + 1e-6


def test_different_variables_and_seeds_get_different_values():
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    a = mx.get_variable(mesh, "a", [io], initializer=mx.initializers.normal())
    b = mx.get_variable(mesh, "b", [io], initializer=mx.initializers.normal())
    lo = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "")})
    assert not np.allclose(lo.variable_value(a), lo.variable_value(b))
    lo2 = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "")}, seed=1)
    assert not np.allclose(lo.variable_value(a), lo2.variable_value(a))


def test_a_small_variable_is_made_by_one_program_for_every_layout(monkeypatch):
    mesh_impl._whole_initializer_program.cache_clear()
    values = []
    for impl_cls, mesh_shape, layout in [
        (mx.SimdMeshImpl, "all:8", ""),
        (mx.PlacementMeshImpl, "rows:2;cols:4", "io:rows"),
    ]:
        graph, mesh, w = one_var(mx.initializers.normal())
        values.append(mx.Lowering(graph, {mesh: impl_cls(mesh_shape, layout)}).variable_value(w))
    info = mesh_impl._whole_initializer_program.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    monkeypatch.setattr(mesh_impl, "_MADE_WHOLE", 0)  # made split, each device its slice: the same numbers
    graph, mesh, w = one_var(mx.initializers.normal())
    values.append(mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "io:rows;hidden:cols")}).variable_value(w))
    for v in values[1:]:
        np.testing.assert_array_equal(v, values[0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
def test_a_small_constant_variable_is_made_by_numpy_compiling_nothing(dtype):
    """Biases and the optimizer's slots: as many programs as shapes, each for a jnp.full, before."""
    info = mesh_impl._whole_initializer_program.cache_info()
    graph, mesh, w = one_var(mx.initializers.Constant(3.0), dtype=dtype)
    lo = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "io:rows;hidden:cols")})
    state = lo.variable_state(w)
    assert mesh_impl._whole_initializer_program.cache_info() == info
    assert str(state.dtype) == dtype and len(state.addressable_shards) == 8
    np.testing.assert_array_equal(lo.variable_value(w), np.full((8, 16), 3, dtype=state.dtype))


@pytest.mark.parametrize("impl_cls", IMPLS, ids=IMPL_IDS)
def test_split_variable_is_a_sharded_global_array_never_whole_on_a_device(impl_cls, monkeypatch):
    monkeypatch.setattr(mesh_impl, "_MADE_WHOLE", 0)  # (as a variable too large to be made whole is)
    graph, mesh, w = one_var(mx.initializers.normal())
    impl = impl_cls("rows:2;cols:4", "io:rows;hidden:cols")
    lo = mx.Lowering(graph, {mesh: impl})
    state = lo.variable_state(w)
    assert state.shape == (8, 16)
    assert state.sharding.spec == impl.partition_spec(lo.plan[w])
    assert {s.data.shape for s in state.addressable_shards} == {(4, 4)}
    assert len(state.addressable_shards) == 8
    np.testing.assert_array_equal(np.asarray(state), lo.variable_value(w))
    lo.set_variable_value(w, state * 2)  # a jax.Array: resharded on the devices
    np.testing.assert_allclose(lo.variable_value(w), 2 * np.asarray(state))


def test_the_placement_backend_keeps_cpu_slices_on_the_first_device_and_hands_them_out_on_their_own():
    """On CPU every slice stays on the first device while programs run (no copy per op); the
    variable handed out is laid out on the mesh's devices, one slice on each."""
    graph, mesh, w = one_var(mx.initializers.normal())
    impl = mx.PlacementMeshImpl("rows:2;cols:4", "io:rows;hidden:cols")
    lo = mx.Lowering(graph, {mesh: impl})
    lo.function(updates=[mx.assign(w, w * 2.0)])()
    assert {x.device for x in lo._variable_state(w.operation)} == {impl.devices[0]}
    state = lo.variable_state(w)
    assert {s.device for s in state.addressable_shards} == set(impl.devices) and len(impl.devices) == 8


@pytest.mark.parametrize("impl_cls", IMPLS, ids=IMPL_IDS)
def test_set_and_get_variable_value_reshards(impl_cls):
    graph, mesh, w = one_var()
    lo = mx.Lowering(graph, {mesh: impl_cls("rows:2;cols:4", "hidden:rows;io:cols")})
    value = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    lo.set_variable_value(w, value)
    np.testing.assert_array_equal(lo.variable_value(w), value)
    np.testing.assert_array_equal(lo.function(w * 2.0)(), value * 2)
    with pytest.raises(ValueError, match=r"shape \[8, 16\]"):
        lo.set_variable_value(w, np.zeros((16, 8)))


@pytest.mark.parametrize("impl_cls", IMPLS, ids=IMPL_IDS)
def test_assignments_read_old_values_and_apply_after_the_step(impl_cls):
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    a = mx.get_variable(mesh, "a", [hidden], initializer=mx.initializers.constant(1.0))
    b = mx.get_variable(mesh, "b", [hidden], initializer=mx.initializers.constant(10.0))
    c = mx.get_variable(mesh, "c", [hidden], initializer=mx.initializers.constant(5.0), dtype="int32")
    read = a + b
    updates = [mx.assign(a, b * 2.0), mx.assign_add(b, a), mx.assign_sub(c, mx.ones(mesh, [hidden], "int32"))]
    lo = mx.Lowering(graph, {mesh: impl_cls("all:8", "hidden:all")})
    fn = lo.function(read, updates=updates)
    np.testing.assert_allclose(fn(), 11.0)
    np.testing.assert_allclose(lo.variable_value(a), 20.0)  # b * 2 with the old b
    np.testing.assert_allclose(lo.variable_value(b), 11.0)  # old b + old a
    np.testing.assert_array_equal(lo.variable_value(c), 4)
    np.testing.assert_allclose(fn(), 31.0)
    assert lo.variable_value(c).dtype == np.int32


def test_variable_errors_are_clear():
    graph, mesh, w = one_var()
    with pytest.raises(mx.GraphError, match="already exists"):
        mx.get_variable(mesh, "w", [io])
    with pytest.raises(mx.GraphError, match="does not match"):
        mx.assign(w, mx.zeros(mesh, [io]))
    lo = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "")})
    with pytest.raises(ValueError, match="more than once"):
        lo.function([], updates=[mx.assign(w, w * 2.0), mx.assign(w, w * 3.0)])
    with pytest.raises(TypeError, match="not a variable"):
        lo.variable_value(w * 2.0)
    with pytest.raises(TypeError, match=r"updates take assign operations \(mx.assign\(variable, value\)\), got the"):
        lo.function([], updates=w * 2.0)
    with pytest.raises(mx.GraphError, match=r"got an array of shape \(8,\) \(float64\): .* mx.import_tensor"):
        _ = w + np.ones(8)


def test_a_variable_of_another_graph_is_refused_by_the_lowering():
    """A Lowering asked for (or given) a variable of another graph refuses it: it was initialized
    as if it were the lowering's own, from its name (variable_value of the other graph's 'w'
    returned this graph's initial 'w', and kept it), and set_variable_value stored it unseen.
    initialize() given a name or a tensor said what it is, not an AttributeError."""
    graph, mesh, w = one_var()
    _, _, other = one_var()
    lo = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "")})
    for call in (
        lambda: lo.variable_value(other),
        lambda: lo.set_variable_value(other, np.ones(other.shape.to_integer_list, np.float32)),
        lambda: lo.variable_state(other),
        lambda: lo.initialize([other.operation]),
    ):
        with pytest.raises(mx.GraphError, match=r"variable 'w' belongs to another graph than the one lowered"):
            call()
    assert list(lo._variables) == []
    for bad in ("w", w * 2.0):
        with pytest.raises(TypeError, match="not a variable"):
            lo.initialize([bad])
    lo.initialize([w])
    assert list(lo._variables) == [w.operation]


def test_a_single_assign_is_an_update():
    graph, mesh, w = one_var()
    lo = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "")})
    before = np.asarray(lo.variable_value(w))
    lo.function([], updates=mx.assign(w, w * 2.0))()
    np.testing.assert_allclose(lo.variable_value(w), 2 * before)


@pytest.mark.parametrize("layout", ["", "io:all"])
def test_an_initializer_that_is_not_one_or_makes_another_shape_is_refused(layout):
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    for init in ["zeros", 0.5, np.arange(8.0)]:
        with pytest.raises(mx.ConfigError, match=r"get_variable 'w': the initializer must be a function"):
            mx.get_variable(mesh, "w", [io], initializer=init)
    w = mx.get_variable(mesh, "w", [io], initializer=lambda key, shape, dtype: np.zeros(3, dtype))
    lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", layout)})
    with pytest.raises(mx.ConfigError, match=r"variable 'w' .*made an array of shape \(3,\), not \(8,\)"):
        lowering.function(w * 2.0)({})


def test_donate_takes_only_the_graphs_placeholders():
    """lowering.function(donate=...) took anything: a variable the function reads (its buffer
    then handed to the program to consume, where the backend donates: its value lost after the
    step), a name, an output, another graph's placeholder (all left out, silently)."""
    graph, mesh, w = one_var()
    x = mx.placeholder(mesh, "x", [io])
    y = mx.reduce_sum(mx.einsum(x, w, output_shape=[hidden]))
    lo = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "")})
    _, other_mesh, _ = one_var()
    for bad, hint in (
        (w, r": a variable's buffer is donated already where the function updates it"),
        ("x", ""),
        (y, ""),
        (mx.placeholder(other_mesh, "x", [io]), ""),
    ):
        with pytest.raises(mx.GraphError, match=r"donate takes placeholders of the lowered graph .*got .*" + hint):
            lo.function(y, donate=[bad])
    lo.function(y, donate=[x])


def test_seeds_that_jax_would_refuse_or_confuse_are_named():
    """mx.Lowering's seed was handed to JAX as given: 'a' or 1.5 failed inside JAX at the first
    run, and 2**40 was seed 0 (JAX keeps a seed's low 32 bits). A call's seed: 1.5 was taken as
    1, -1 and 2**40 an OverflowError from NumPy's uint32."""
    graph, mesh, w = one_var()
    y = mx.reduce_sum(w)
    for seed in ("a", 1.5, 2**40, None):
        with pytest.raises(mx.ConfigError, match=r"mx.Lowering's seed .* is not a whole number from -2147483648"):
            mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "")}, seed=seed)
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "")}, seed=-1).function(y)
    for seed in (1.5, -1, 2**40):
        with pytest.raises(mx.ConfigError, match=r"the seed of a call .* is not a whole number from 0 to 2\*\*32 - 1"):
            fn({}, seed=seed)
    fn({}, seed=np.uint32(2**32 - 1))


def test_a_variable_or_placeholder_name_that_is_no_text_is_refused():
    """get_variable(mesh, '', ...) made a variable named 'variable', and a name of 3 one that no
    checkpoint could name; placeholder(mesh, '', ...) was said to exist already, and a placeholder
    named 5 could not be fed by name."""
    _, mesh, _ = one_var()
    for bad in ("", 3, None):
        with pytest.raises(mx.GraphError, match=rf"get_variable: the name must be a non-empty string .*got {bad!r}"):
            mx.get_variable(mesh, bad, [io])
        with pytest.raises(mx.GraphError, match=rf"placeholder: the name must be a non-empty string .*got {bad!r}"):
            mx.placeholder(mesh, bad, [io])


def test_a_uniform_initializer_with_no_room_between_its_bounds_is_refused():
    """uniform(2.0) (jax.nn.initializers.uniform's one argument, the top) is minval 2.0 below
    maxval 1.0 here: every value was 2.0, silently."""
    for args in ((2.0,), (1, 1)):
        with pytest.raises(mx.ConfigError, match=r"initializers.uniform: minval .* must be less than maxval"):
            mx.initializers.uniform(*args)
    graph, mesh, w = one_var(mx.initializers.uniform(0, 2.0))
    value = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "")}).variable_value(w)
    assert value.min() >= 0 and value.max() < 2.0 and value.std() > 0.3


def test_a_negative_stddev_is_refused():
    """normal(-1.0) drew with stddev 1.0 without a word (numpy and torch refuse a negative scale)."""
    for make in (mx.initializers.normal, mx.initializers.truncated_normal):
        with pytest.raises(mx.ConfigError, match=r"stddev -1.0 is negative"):
            make(-1.0)
        with pytest.raises(mx.ConfigError, match=r"stddev nan is NaN: a spread"):  # (it said 'negative')
            make(float("nan"))
    graph, mesh, w = one_var(mx.initializers.normal(0.0, mean=3.0))
    assert np.all(mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "")}).variable_value(w) == 3.0)


def test_a_constant_initializer_that_does_not_fill_its_variable_is_named():
    """initializers.constant of an array of another shape was NumPy's 'could not broadcast'
    from inside, with no variable named; of 2**40 for an int32 variable NumPy's OverflowError (a
    small variable) or 0, silently (a large one, made by jnp.full)."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    a = mx.get_variable(mesh, "a", [io, hidden], initializer=mx.initializers.constant(np.ones(5, np.float32)))
    b = mx.get_variable(mesh, "b", [io], dtype="int32", initializer=mx.initializers.constant(2**40))
    big = mx.Dimension("big", 2**21)
    c = mx.get_variable(mesh, "c", [big], dtype="int32", initializer=mx.initializers.constant(2**40))
    lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "")})
    with pytest.raises(mx.ConfigError, match=r"variable 'a' .*a value of shape \[5\] does not fill a variable"):
        lowering.variable_value(a)
    for v in (b, c):
        with pytest.raises(mx.ConfigError, match=rf"variable '{v.name}' .*1099511627776 is outside int32's"):
            lowering.variable_value(v)


def test_a_constant_initializer_of_an_array_makes_a_large_variable():
    """initializers.constant(array) failed for a variable large enough to be made by a compiled
    program ('unhashable type: numpy.ndarray': the program is cached by its initializer); a small
    one was made. Equal constants are one initializer (one program), as before."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    big, row = mx.Dimension("big", 2**11), mx.Dimension("row", 2**10)
    values = np.arange(row.size, dtype=np.float32)
    v = mx.get_variable(mesh, "v", [big, row], initializer=mx.initializers.constant(values))
    got = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "big:all")}).variable_value(v)
    np.testing.assert_array_equal(got, np.broadcast_to(values, (big.size, row.size)))
    assert mx.initializers.constant(values) == mx.initializers.constant(values.copy())
    assert hash(mx.initializers.zeros()) == hash(mx.initializers.constant(0.0))
    assert mx.initializers.constant(values) != mx.initializers.constant(values + 1)
