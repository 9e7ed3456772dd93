"""Uneven splits (issue 11): a dim of size n split k ways holds ceil(n/k) per device, padded,
and every op stays exact. Property tests against jax.numpy (forward and gradient) for every op
family along the padded dim, n in 1..17 split 2, 4 and 8 ways, on both backends; the
Transformer under layouts that do not divide; checkpoints and values in the logical shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshax as mx
from meshax.train import CnnTask, LmTask, UNetTask, train
from tests.conftest import train_optimized

B = 3  # the other dim


def _program(n: int):
    """Ops of every family along dim `a` of size n; returns (graph, mesh, outputs, reference),
    reference(x, table) -> the same outputs in jnp (dims in the meshax tensors' order)."""
    g = mx.Graph()
    mesh = mx.Mesh(g, "m")
    a, b, c = mx.Dimension("a", n), mx.Dimension("b", B), mx.Dimension("c", 2)
    # (+ 1: the padding of a computed tensor is not zero, as a fed one's is)
    x = mx.placeholder(mesh, "x", [a, b]) + 1.0
    table = mx.placeholder(mesh, "table", [a, c]) + 1.0
    ids = mx.import_tensor(mesh, (np.arange(5) * 7 % n).astype(np.int32), [mx.Dimension("i", 5)])
    k = min(2, n)
    outs = {
        "sum": mx.reduce_sum(x, reduced_dim=a),
        "max": mx.reduce_max(x, reduced_dim=a),
        "min": mx.reduce_min(x, reduced_dim=a),
        "mean": mx.reduce_mean(x, reduced_dim=a),
        "softmax": mx.softmax(x, a),
        "logsumexp": mx.reduce_logsumexp(x, reduced_dim=a),
        "argmax": mx.argmax(x, a),
        "top_k": mx.top_k(x, a, k)[0],
        "einsum": mx.einsum(x, table, output_shape=[b, c]),
        "cumsum": mx.cumsum(x, a),
        "shift": mx.shift(x, 2, a, wrap=False),
        "shift_back": mx.shift(x, -3, a, wrap=False),
        "roll": mx.shift(x, 1, a, wrap=True),
        "concat": mx.concat([x, x * 2.0], "a"),
        "pad": mx.pad(x, [1, 2], "a"),
        "reshape": mx.reshape(x, [mx.Dimension("ab", n * B)]),
        "gather": mx.gather(table, ids, a),
        "one_hot": mx.one_hot(ids, a, dtype="float32") * 1.5,
        "range": mx.cast(mx.range(mesh, a, "int32"), "float32") + mx.reduce_sum(x, reduced_dim=b),
        "cast": mx.cast(x > 0.0, "float32") * x,
    }
    if n > 1:
        outs["slice"] = mx.slice(x, 1, n - 1, "a")

    def reference(xv, tv):
        xv, tv = xv + 1, tv + 1
        i = np.arange(5) * 7 % n
        r = {
            "sum": xv.sum(0),
            "max": xv.max(0),
            "min": xv.min(0),
            "mean": xv.mean(0),
            "softmax": jax.nn.softmax(xv, 0),
            "logsumexp": jax.scipy.special.logsumexp(xv, 0),
            "argmax": jnp.argmax(xv, 0),
            "top_k": jnp.moveaxis(jax.lax.top_k(xv.T, k)[0], -1, 0),
            "einsum": xv.T @ tv,
            "cumsum": jnp.cumsum(xv, 0),
            "shift": jnp.concatenate([jnp.zeros((min(2, n), B)), xv[: max(n - 2, 0)]])[:n],
            "shift_back": jnp.concatenate([xv[3:], jnp.zeros((min(3, n), B))])[-n:] if n > 3 else jnp.zeros((n, B)),
            "roll": jnp.roll(xv, 1, 0),
            "concat": jnp.concatenate([xv, xv * 2.0]),
            "pad": jnp.pad(xv, [(1, 2), (0, 0)]),
            "reshape": xv.reshape(-1),
            "gather": tv[i],
            "one_hot": jax.nn.one_hot(i, n) * 1.5,
            "cast": (xv > 0) * xv,
        }
        r["range"] = jnp.arange(n, dtype=jnp.float32) + xv.sum(1)
        if n > 1:
            r["slice"] = xv[1:n]
        return r

    return g, mesh, outs, reference


def _check(n: int, k: int, impl=mx.SimdMeshImpl, mesh_shape: str | None = None, rules: str = "a:all"):
    g, mesh, outs, reference = _program(n)
    rng = np.random.default_rng(n * 10 + k)
    xv = rng.normal(size=(n, B)).astype(np.float32)
    tv = rng.normal(size=(n, 2)).astype(np.float32)
    names = sorted(outs)
    weights = {m: rng.normal(size=outs[m].shape.to_integer_list).astype(np.float32) for m in names}
    floats = [m for m in names if outs[m].dtype == np.float32]
    x, table = (next(t for op in g.operations for t in op.outputs if t.name == nm) for nm in ("x", "table"))
    assert x.operation.is_placeholder and table.operation.is_placeholder
    loss = sum(
        (mx.reduce_sum(outs[m] * mx.import_tensor(mesh, weights[m], outs[m].shape)) for m in floats[1:]),
        mx.reduce_sum(outs[floats[0]] * mx.import_tensor(mesh, weights[floats[0]], outs[floats[0]].shape)),
    )
    gx, gt = mx.gradients([loss], [x, table])
    low = mx.Lowering(g, {mesh: impl(mesh_shape or f"all:{k}", rules)})
    got = low.function([outs[m] for m in names] + [gx, gt])({"x": xv, "table": tv})
    want = jax.jit(reference)(xv, tv)  # (jitted: one compile, where eager jnp compiles each op)

    def ref_loss(xv, tv):
        r = reference(xv, tv)
        return sum(jnp.sum(r[m] * weights[m]) for m in floats)

    want_gx, want_gt = jax.jit(jax.grad(ref_loss, argnums=(0, 1)))(xv, tv)
    for m, value in zip(names, got):
        np.testing.assert_allclose(value, want[m], rtol=1e-5, atol=1e-5, err_msg=f"{m}, n={n}, k={k}")
    np.testing.assert_allclose(got[-2], want_gx, rtol=1e-4, atol=1e-5, err_msg=f"d/dx, n={n}, k={k}")
    np.testing.assert_allclose(got[-1], want_gt, rtol=1e-4, atol=1e-5, err_msg=f"d/dtable, n={n}, k={k}")


# The default run: sizes that pad 2, 4 and 8 ways (and one that leaves whole slices of padding);
# the slow run (`-m slow`, in .ci/run): every n from 1 to 2k + 1 for each k (every remainder mod
# k, below, at and above k: whole slices of padding, none, and some), and the placement backend.
FULL_GRID = [(n, k) for k in (2, 4, 8) for n in range(1, 2 * k + 2)]


@pytest.mark.parametrize("n, k", [(1, 2), (5, 4), (7, 8)])
def test_every_op_family_is_exact_on_padded_dims(n, k):
    _check(n, k)


def test_every_op_family_is_exact_on_a_dim_padded_at_two_levels():
    """5 over x:2 then y:2: blocks of 3, then of 2 (3 = 2 + 1): padding in the middle of the dim."""
    _check(5, 4, mesh_shape="x:2;y:2", rules="a:x;a:y")


@pytest.mark.slow
@pytest.mark.parametrize("n, k", FULL_GRID)
def test_every_op_family_is_exact_on_padded_dims_full_grid(n, k):
    _check(n, k)


@pytest.mark.slow
def test_every_op_family_is_exact_on_padded_dims_placement():
    _check(5, 4, mx.PlacementMeshImpl)  # (the placement backend runs op by op: about a minute)


def test_values_variables_and_checkpoints_have_the_logical_shape(tmp_path):
    """A variable [a=5, b=3] split 4 ways: initial values as on one device, `variable_state` a
    logical jax.Array, a checkpoint written under the uneven layout restores under another."""
    from meshax.train import checkpoint

    def make(layout, mesh_shape):
        g = mx.Graph()
        mesh = mx.Mesh(g, "m")
        v = mx.get_variable(mesh, "v", "a:5;b:3", initializer=mx.initializers.normal(1.0))
        return mx.Lowering(g, {mesh: mx.SimdMeshImpl(mesh_shape, layout)}), v

    uneven, v = make("a:all", "all:4")
    one, w = make("", "all:1")
    np.testing.assert_array_equal(uneven.variable_value(v), one.variable_value(w))
    state = uneven.variable_state(v)
    assert state.shape == (5, 3)
    uneven.set_variable_value(v, np.arange(15, dtype=np.float32).reshape(5, 3))
    checkpoint.save_checkpoint(str(tmp_path), uneven, 1)
    other, u = make("a:x;b:y", "x:2;y:2")
    checkpoint.restore_checkpoint(str(tmp_path), other)
    np.testing.assert_array_equal(other.variable_value(u), np.arange(15).reshape(5, 3))
    assert "padded tensors" in uneven.report()


@pytest.mark.parametrize("impl_cls", [mx.SimdMeshImpl, mx.PlacementMeshImpl], ids=["simd", "placement"])
def test_an_empty_tensor_with_a_padded_dim_comes_out_empty(impl_cls):
    """[e=0, d=6] with d split 4 ways: taking the padding off reshaped with -1, which an empty
    array cannot infer (a ZeroDivisionError in JAX, a ValueError in NumPy; partitioning `a[:0] * 2`
    of a split [7, 9] met it)."""
    g = mx.Graph()
    mesh = mx.Mesh(g, "m")
    x = mx.placeholder(mesh, "x", "e:0;d:6")
    got = mx.Lowering(g, {mesh: impl_cls("all:4", "d:all")}).function(x * 2.0)({"x": np.zeros((0, 6), np.float32)})
    assert np.asarray(got).shape == (0, 6)


@pytest.mark.parametrize(
    "mesh_shape, layout",
    [
        ("all:8", "vocab:all;d_ff:all;heads:all"),
        pytest.param("all:3", "d_model:all", marks=pytest.mark.slow),
        pytest.param("r:3;c:2", "batch:c;heads:r;vocab:r", marks=pytest.mark.slow),
    ],
)
def test_the_tiny_transformer_trains_to_the_same_losses_under_uneven_layouts(mesh_shape, layout):
    task = LmTask(model="tiny", source="markov", batch_size=6, length=16)
    one = train(task, "all:1", "", steps=4).losses
    split = train(task, mesh_shape, layout, steps=4).losses
    np.testing.assert_allclose(split, one, rtol=2e-5, atol=2e-6)


def test_the_cnn_trains_under_a_spatial_layout_to_the_same_losses():
    task = CnnTask(channels=4)
    one = train(task, "all:1", "", steps=10).losses
    split = train(task, "rows:3;cols:2", "h:rows;w:cols", steps=10).losses
    np.testing.assert_allclose(split, one, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_the_cnn_reaches_95_percent_on_the_digits_under_a_spatial_layout():
    """The same training run split spatially and on one device. Sums over split dims add in
    another order, and training amplifies those rounding differences step by step (measured:
    relative 2e-7 over the first 50 steps, 2e-4 by step 150, 2e-3 by step 300), so the losses
    agree to 1e-4 over the first 100 steps and to 1e-2 over all 300, and both runs end at the
    same evaluation."""
    split = train_optimized(CnnTask(), "rows:2;cols:4", "h:rows;w:cols", 300)
    one = train_optimized(CnnTask(), "all:1", "", 300)
    np.testing.assert_allclose(split.losses[:100], one.losses[:100], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(split.losses, one.losses, rtol=1e-2)
    np.testing.assert_allclose(split.evals[-1][1]["loss"], one.evals[-1][1]["loss"], rtol=1e-2)
    assert split.evals[-1][1]["accuracy"] >= 0.95


@pytest.mark.slow
def test_the_unet_trains_under_spatial_layouts_like_on_one_device():
    task = UNetTask()
    one = train(task, "all:1", "", steps=20)
    for mesh_shape, layout in (("rows:2;cols:4", "h:rows;w:cols"), ("rows:3;cols:2", "batch:cols;h:rows")):
        split = train(task, mesh_shape, layout, steps=20)
        np.testing.assert_allclose(split.losses, one.losses, rtol=1e-3, atol=1e-4)


def test_an_alltoall_of_a_padded_transpose_compiles_and_is_counted_as_run():
    """A size-1 dim split over 2 devices by an alltoall from a dim split before: its padding is a
    whole part. XLA for the CPU split the all-to-all into its parts, made the padding part a
    broadcast whose layout differed from the transposed part's, and its verifier refused the
    program ("HLO all-to-all has operands with different shapes"): meshax passes the padded array
    through an optimization barrier first (found by comparing the fuzzer's programs with their HLO)."""
    c, b, a = mx.Dimension("c", 1), mx.Dimension("b", 4), mx.Dimension("a", 8)
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", [a, b, c])
    z = mx.shard(mx.einsum([x], output_shape=[c, b, a]), "c:all")  # (a transpose, then c over all)
    out = mx.reduce_sum(z * z, output_shape=[b])
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:2", "b:all")}).function([out, z])
    xv = np.arange(32, dtype=np.float32).reshape(8, 4, 1)
    got_out, got_z = fn({"x": xv})
    np.testing.assert_allclose(got_out, (xv**2).sum((0, 2)))
    np.testing.assert_array_equal(got_z, xv.transpose(2, 1, 0))
    hlo = mx.hlo_collectives(fn.compiled_text())
    assert {k: (v["count"], v["values"]) for k, v in hlo.items()} == {
        k: (fn.counters[k].count, fn.counters[k].values) for k in hlo
    }
    assert "alltoall" in hlo


@pytest.mark.parametrize("impl_cls", [mx.SimdMeshImpl, mx.PlacementMeshImpl], ids=["simd", "placement"])
def test_call_global_gathers_a_result_split_unevenly_in_the_step_and_counts_it(impl_cls, monkeypatch):
    """y [b=8, d=6] with d split 4 ways (padded). A jax.Array's shards must divide its dims, so
    call_global returns y replicated along d; that allgather ran in a program of its own after the
    step (`MeshImpl._unpad_global`), which no counters saw. Now the program call_global runs
    (`global_function`) gathers it at the end of the step and counts it (8 x 2 values a device);
    a host call (`fn(...)`), which fetches the slices, runs no allgather."""
    from meshax.lower.mesh_impl import MeshImpl

    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", "b:8;d:6")
    y = x * 2.0
    fn = mx.Lowering(graph, {mesh: impl_cls("all:4", "d:all")}).function([y, mx.reduce_sum(y)])
    a = np.arange(48.0, dtype=np.float32).reshape(8, 6)

    def outside(*_):
        raise AssertionError("a result of call_global was gathered by a program of its own, after the step")

    monkeypatch.setattr(MeshImpl, "_unpad_global", outside)
    got, total = fn.call_global({x: jnp.asarray(a)})
    np.testing.assert_array_equal(np.asarray(got), a * 2)
    np.testing.assert_array_equal(np.asarray(total), (a * 2).sum())
    assert got.sharding.is_fully_replicated
    program = fn.global_function
    assert [s.values for s in program.counters["allgather"].sites] == [8 * 2]
    assert fn.counters["allgather"].count == 0
    if impl_cls is mx.SimdMeshImpl:
        hlo = mx.hlo_collectives(program.compiled_text())
        assert {k: (v["count"], v["values"]) for k, v in hlo.items()} == {
            k: (program.counters[k].count, program.counters[k].values) for k in hlo
        }
    np.testing.assert_array_equal(fn({x: a})[0], a * 2)


def test_call_global_pads_an_input_split_unevenly_without_moving_a_value():
    """call_global's inputs come replicated along their uneven dims (a jax.Array's shards divide
    it) and are padded to their split layout by a program of their own, outside the step's
    counters: it only pads and slices on each device (no collective in its compiled HLO)."""
    from meshax.core.shape import convert_to_shape
    from meshax.lower.mesh_impl import _padding_program
    from meshax.lower.padding import pad

    impl = mx.SimdMeshImpl("rows:2;cols:4", "b:cols;d:rows")
    shape = convert_to_shape("b:10;d:6;e:3")  # (b, 10 over 4, pads; d, 6 over 2, does not)
    layout = impl.tensor_layout(shape)
    a = jax.device_put(np.ones(shape.to_integer_list, np.float32), impl.global_sharding(shape, layout))
    assert a.sharding.spec[0] is None  # (the uneven dim comes replicated)
    program = _padding_program(pad, shape, layout, impl.shape, impl.named_sharding(layout))
    hlo = mx.hlo_collectives(program.lower(a).compile().as_text())
    assert all(v["count"] == 0 for v in hlo.values()), hlo
    assert program(a).shape == (12, 6, 3)


def test_the_program_call_global_runs_is_its_own_global_function():
    """`global_function`, the program that gathers the padded outputs, already returns them as
    jax.Arrays take them: its own call_global runs it, where it built (and compiled) a third
    program, the same again, since its outputs' planned layouts still pad."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", "b:8;d:6")
    y = x * 2.0
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:4", "d:all")}).function(y)
    program = fn.global_function
    assert program is not fn and program.global_function is program
    a = np.arange(48.0, dtype=np.float32).reshape(8, 6)
    (got,) = program.call_global({x: jnp.asarray(a)})
    np.testing.assert_array_equal(np.asarray(got), a * 2)


def test_call_global_takes_feeds_by_name_and_names_a_missing_one():
    """call_global's feeds are keyed as a host call's are, by placeholder or by its name: a name
    (or a placeholder left out) was a KeyError naming the tensor, from inside; a misspelt name is
    named as a host call names it."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", "b:8;d:6")
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:4", "b:all")}).function(x * 2.0)
    a = np.arange(48.0, dtype=np.float32).reshape(8, 6)
    (got,) = fn.call_global({"x": jnp.asarray(a)})
    np.testing.assert_array_equal(np.asarray(got), a * 2)
    with pytest.raises(ValueError, match=r"placeholder 'x' Shape\(\[b=8, d=6\]\) is needed but was not fed"):
        fn.call_global({})
    with pytest.raises(mx.MeshaxError, match=r"feeds name 'xx', which is no placeholder of the graph"):
        fn.call_global({"xx": jnp.asarray(a)})


def test_call_global_and_a_host_call_share_the_imported_arrays_on_the_devices():
    """The program call_global runs (`global_function`) takes the same inputs as the host's: an
    imported array is put on the devices once for both, where each program put its own copy
    (twice the devices' memory for a large imported table)."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", "b:8;d:6")
    c = mx.import_tensor(mesh, np.full((8, 6), 3.0, np.float32), "b:8;d:6")
    y = x * c
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:4", "d:all")}).function(y)
    a = np.arange(48.0, dtype=np.float32).reshape(8, 6)
    np.testing.assert_array_equal(fn({x: a}), a * 3)
    (got,) = fn.call_global({x: jnp.asarray(a)})
    np.testing.assert_array_equal(np.asarray(got), a * 3)
    assert fn.global_function is not fn
    assert fn.global_function._constants[c] is fn._constants[c]
