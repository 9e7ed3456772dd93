"""Checkpoints: resuming is exact, restores re-lay variables out for a new mesh, retention, errors."""

import os
import re
from typing import NamedTuple

import jax
import numpy as np
import pytest

import meshax as mx
from meshax.models.mlp import two_layer
from meshax.train.checkpoint import check_restorable, damaged_steps, latest_step, restore_checkpoint, save_checkpoint
from tests.conftest import MESH_SHAPE, new_mesh

LAYOUT = "batch:rows;hidden:cols"
STEPS = 6


def build(impl, hidden=16, seed=0, optimizer=True, extra_variable=False):
    """A two-layer MLP learning the identity, trained by Adam; returns (lowering, train step fn)."""
    graph, mesh = new_mesh()
    x = mx.placeholder(mesh, "x", "batch:8;io:8")
    y = two_layer(x, mx.Dimension("hidden", hidden), name="mlp")
    if extra_variable:
        y = y + mx.get_variable(mesh, "new/bias", "io:8")
    loss = mx.reduce_mean(mx.square(y - x))
    params = [v.value for v in graph.all_variables]
    updates = []
    if optimizer:
        updates = mx.optimize.AdamWeightDecayOptimizer(0.01).apply_grads(mx.gradients(loss, params), params)
    lowering = mx.Lowering(graph, {mesh: impl}, seed=seed)
    return lowering, lowering.function(loss, updates=updates)


def train(fn, start, stop):
    """Losses of steps start+1 .. stop; the data and the seed depend only on the step."""
    return [
        fn({"x": np.random.default_rng(s).normal(size=(8, 8)).astype(np.float32)}, seed=s) for s in range(start, stop)
    ]


def values(lowering):
    return {v.name: lowering.variable_value(v) for v in lowering.graph.all_variables}


class Run(NamedTuple):
    directory: object  # holds the checkpoint of step 3
    losses: list  # of steps 1 .. STEPS
    at_save: dict  # variable values after step 3
    final: dict  # variable values after step STEPS


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`trained(impl_cls)`: a 2x4 run of STEPS steps, checkpointed after step 3 (once per module:
    the placement backend compiles slowly)."""
    runs = {}

    def get(impl_cls):
        if impl_cls not in runs:
            directory = tmp_path_factory.mktemp(impl_cls.__name__)
            lowering, fn = build(impl_cls(MESH_SHAPE, LAYOUT))
            losses = train(fn, 0, 3)
            path = save_checkpoint(directory, lowering, 3, extra={"data_step": 3, "mesh": MESH_SHAPE})
            assert path == os.path.join(directory, "3") and latest_step(directory) == 3
            at_save = values(lowering)
            losses += train(fn, 3, STEPS)
            runs[impl_cls] = Run(directory, losses, at_save, values(lowering))
        return runs[impl_cls]

    return get


@pytest.fixture
def saved_at_3(trained):
    """(directory, variable values) of the SIMD run's checkpoint after step 3."""
    run = trained(mx.SimdMeshImpl)
    return run.directory, run.at_save


@pytest.mark.parametrize("impl_cls", [mx.SimdMeshImpl], ids=["simd"])  # placement: the restore tests below
def test_resume_is_exact(impl_cls, trained):
    run = trained(impl_cls)
    fresh, fresh_fn = build(impl_cls(MESH_SHAPE, LAYOUT), seed=1)  # other initial values
    assert restore_checkpoint(run.directory, fresh) == {"step": 3, "data_step": 3, "mesh": MESH_SHAPE}
    restored = values(fresh)
    assert sorted(restored) == sorted(run.at_save) and restored["global_step"] == 3
    assert len(restored) == 1 + 3 * 3  # global_step; w, bias, v and two Adam slots each
    for name in run.at_save:
        np.testing.assert_array_equal(restored[name], run.at_save[name], err_msg=name)

    np.testing.assert_array_equal(train(fresh_fn, 3, STEPS), run.losses[3:])
    for name, value in values(fresh).items():
        np.testing.assert_array_equal(value, run.final[name], err_msg=name)


@pytest.mark.parametrize(
    "saved_by,impl_cls",
    [
        (mx.SimdMeshImpl, mx.SimdMeshImpl),
        (mx.SimdMeshImpl, mx.PlacementMeshImpl),
        pytest.param(mx.PlacementMeshImpl, mx.SimdMeshImpl, marks=pytest.mark.slow),  # 28 s: the slow run
    ],
    ids=["simd-to-simd", "simd-to-placement", "placement-to-simd"],
)
def test_restore_under_another_mesh_and_layout(trained, saved_by, impl_cls):
    run = trained(saved_by)
    lowering, fn = build(impl_cls("all:8", "hidden:all"), seed=1)
    assert restore_checkpoint(run.directory, lowering)["step"] == 3
    for name, value in values(lowering).items():
        np.testing.assert_array_equal(value, run.at_save[name], err_msg=name)  # moving data is exact
    np.testing.assert_allclose(train(fn, 3, STEPS), run.losses[3:], rtol=1e-5, atol=1e-6)
    for name, value in values(lowering).items():
        np.testing.assert_allclose(value, run.final[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_restored_simd_variable_has_the_new_sharding(saved_at_3):
    directory, _ = saved_at_3
    lowering, _ = build(mx.SimdMeshImpl("all:8", "hidden:all"), seed=1)
    restore_checkpoint(directory, lowering)
    for var in lowering.graph.all_variables:
        state = lowering.variable_state(var)
        assert isinstance(state, jax.Array)
        assert state.sharding == lowering.impl.named_sharding(lowering.plan[var.value]), var.name
    w = lowering.variable_state(next(v for v in lowering.graph.all_variables if v.name == "mlp/w"))
    assert w.sharding.spec == jax.sharding.PartitionSpec(None, "all")  # [io, hidden], hidden split 8 ways
    assert {s.data.shape for s in w.addressable_shards} == {(8, 2)}


def test_reading_a_checkpoint_logs_no_read_only_notes(saved_at_3, caplog):
    """Orbax warns that a manager opened to read is read only, several times a read (12 lines for
    the checkpoints guide's first example, in a writable folder): meshax drops those notes."""
    import logging

    directory, _ = saved_at_3
    lowering, _ = build(mx.SimdMeshImpl("all:8", "hidden:all"), seed=1)
    with caplog.at_level(logging.INFO):
        assert latest_step(directory) == 3
        restore_checkpoint(directory, lowering)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in said if "read only" in m or "read_only" in m], said


def test_keeps_only_the_newest_and_ignores_unfinished(tmp_path):
    lowering, fn = build(mx.SimdMeshImpl(MESH_SHAPE, LAYOUT))
    for step in range(1, 4):
        train(fn, step - 1, step)
        save_checkpoint(tmp_path, lowering, step, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["2", "3"]
    assert latest_step(tmp_path) == 3
    # A save that died half-way leaves only Orbax's temporary directory: never the latest.
    os.makedirs(tmp_path / "4.orbax-checkpoint-tmp-1234567" / "state")
    assert latest_step(tmp_path) == 3
    fresh, _ = build(mx.SimdMeshImpl(MESH_SHAPE, LAYOUT), seed=1)
    assert restore_checkpoint(tmp_path, fresh)["step"] == 3
    assert restore_checkpoint(tmp_path, fresh, step=2)["step"] == 2
    assert values(fresh)["global_step"] == 2


def test_a_folder_of_digits_that_is_no_whole_checkpoint_is_not_one(tmp_path):
    """A user's `5/`, or a step that lost an item, is not the latest step (restoring it raised
    Orbax's KeyError); a non-JSON `extra` is refused before anything is written (it left a
    temporary folder that blocked the step for the rest of the process)."""
    lowering, fn = build(mx.SimdMeshImpl(MESH_SHAPE, LAYOUT))
    train(fn, 0, 2)
    os.makedirs(tmp_path / "1")  # (no items: not a checkpoint)
    save_checkpoint(tmp_path, lowering, 2)
    assert latest_step(tmp_path) == 2
    os.rename(tmp_path / "1", tmp_path / "9")
    assert latest_step(tmp_path) == 2
    os.rename(tmp_path / "9", tmp_path / "1")
    with pytest.raises(mx.ConfigError, match="extra must be JSON"):
        save_checkpoint(tmp_path, lowering, 3, extra={"data_position": np.int64(3)})
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]
    save_checkpoint(tmp_path, lowering, 3, extra={"data_position": 3})
    import shutil

    shutil.rmtree(tmp_path / "3" / "state")  # (an item lost)
    assert latest_step(tmp_path) == 2
    with pytest.raises(FileNotFoundError, match="is not a whole checkpoint"):
        restore_checkpoint(tmp_path, lowering, step=3)
    # the latest, by default: not step 2 in silence, which would give up step 3's training
    with pytest.raises(
        FileNotFoundError,
        match=r"newest checkpoint in .* is not whole: .*3 \(no state/\); move it away to restore step 2",
    ):
        restore_checkpoint(tmp_path, lowering)
    assert restore_checkpoint(tmp_path, lowering, step=2)["step"] == 2
    assert damaged_steps(tmp_path) == [f"{tmp_path / '3'} (no state/)"] and damaged_steps(tmp_path, after=3) == []


def test_a_run_resumed_where_the_only_step_was_cut_short_is_refused_before_it_trains(tmp_path):
    """It started afresh, trained to that step and failed to save it (the folder was there)."""
    from meshax.train import MlpTask, train

    os.makedirs(tmp_path / "2" / "state")
    with pytest.raises(FileNotFoundError, match=r"is not whole: .*2 \(no meta/\); there is no older whole one"):
        train(MlpTask(), MESH_SHAPE, LAYOUT, steps=4, checkpoint_dir=str(tmp_path), resume=True)


@pytest.mark.parametrize(
    "damage,said",
    [
        # (a bare 'Expecting value: line 1 column 1 (char 0)' from the JSON reader, naming nothing)
        (lambda step: (step / "meta" / "metadata").write_text("garbage"), r"its meta/ is not JSON: Expecting value"),
        (lambda step: (step / "meta" / "metadata").write_text("[1, 2]"), "its meta/ is no step and extra metadata"),
        # (a TypeError: "argument of type 'NoneType' is not iterable", Orbax's metadata of an empty state/)
        (lambda step: [_remove(f) for f in (step / "state").iterdir()], "its state/ is holding no variables"),
    ],
    ids=["meta not JSON", "meta not an object", "state emptied"],
)
def test_a_damaged_checkpoint_is_named(saved_at_3, tmp_path, damage, said):
    import shutil

    from meshax.train.checkpoint import checkpoint_info

    directory = tmp_path / "ck"
    shutil.copytree(saved_at_3[0], directory)
    damage(directory / "3")
    lowering, _ = build(mx.SimdMeshImpl(MESH_SHAPE, LAYOUT))
    before = values(lowering)
    message = rf"the checkpoint of step 3 in .*ck is damaged: {said}.*; move .*ck/3 away"
    first = checkpoint_info if "meta" in said else lambda d: check_restorable(d, lowering)  # (reads the item)
    for read in (first, lambda d: restore_checkpoint(d, lowering)):
        with pytest.raises(mx.ConfigError) as e:
            read(directory)
        assert re.search(message, str(e.value)), e.value
    for name, value in values(lowering).items():
        np.testing.assert_array_equal(value, before[name])  # (nothing restored from it)


def _remove(path):
    import shutil

    shutil.rmtree(path) if path.is_dir() else path.unlink()


def test_no_checkpoint(tmp_path):
    lowering, _ = build(mx.SimdMeshImpl(MESH_SHAPE, LAYOUT))
    missing = tmp_path / "missing"
    assert latest_step(missing) is None and latest_step(tmp_path) is None
    with pytest.raises(FileNotFoundError, match=r"no checkpoint in .*missing"):
        restore_checkpoint(missing, lowering)
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        restore_checkpoint(tmp_path, lowering)
    assert not missing.exists()  # looking did not create it


def test_saving_into_a_file_is_refused_before_orbax_writes(tmp_path, caplog):
    """A path that is a file, or under one: Orbax logged a traceback at ERROR and raised
    NotADirectoryError."""
    lowering, _ = build(mx.SimdMeshImpl(MESH_SHAPE, LAYOUT))
    (tmp_path / "afile").write_text("hi")
    with pytest.raises(mx.ConfigError, match=r"'.*afile' is a file: give a folder to save checkpoints in"):
        save_checkpoint(tmp_path / "afile", lowering, 1)
    with pytest.raises(mx.ConfigError, match=r"'.*afile/ck' is under the file '.*afile'"):
        save_checkpoint(tmp_path / "afile" / "ck", lowering, 1)
    assert os.listdir(tmp_path) == ["afile"] and caplog.records == []


def test_saving_beside_a_folder_named_as_a_step_that_holds_something_else_is_refused(tmp_path):
    """Orbax counts a folder "1" as step 1 and deletes it, with what it holds, once `keep` newer
    checkpoints are saved."""
    lowering, _ = build(mx.SimdMeshImpl(MESH_SHAPE, LAYOUT))
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "photo.txt").write_text("precious")
    with pytest.raises(mx.ConfigError, match=r"save_checkpoint: .*/1 is named as a checkpoint's step but holds"):
        save_checkpoint(tmp_path, lowering, 5, keep=1)
    assert sorted(os.listdir(tmp_path)) == ["1"] and (tmp_path / "1" / "photo.txt").read_text() == "precious"


def test_missing_step_and_repeated_save(saved_at_3):
    directory, _ = saved_at_3
    lowering, _ = build(mx.SimdMeshImpl(MESH_SHAPE, LAYOUT))
    with pytest.raises(FileNotFoundError, match=r"no checkpoint of step 7 .*\[3\]"):
        restore_checkpoint(directory, lowering, step=7)
    with pytest.raises(ValueError, match="step 3 not saved"):
        save_checkpoint(directory, lowering, 3)
    with pytest.raises(ValueError, match="'step' key"):
        save_checkpoint(directory, lowering, 4, extra={"step": 4})


@pytest.mark.parametrize("step", [-1, 3.7, "5"])
def test_a_step_that_is_no_natural_number_is_refused(tmp_path, step):
    """A step of -1 was written to a folder '-1' that latest_step and restore_checkpoint never
    found ("no checkpoint in ..."); 3.7 was saved as step 3 and "5" as step 5."""
    lowering, _ = build(mx.SimdMeshImpl(MESH_SHAPE, LAYOUT))
    with pytest.raises(ValueError, match=r"step must be an int of at least 0, got " + repr(step).replace(".", r"\.")):
        save_checkpoint(tmp_path, lowering, step)
    assert os.listdir(tmp_path) == []
    save_checkpoint(tmp_path, lowering, np.int64(0))
    assert latest_step(tmp_path) == 0


def test_variable_missing_from_checkpoint(saved_at_3):
    directory, _ = saved_at_3
    lowering, _ = build(mx.SimdMeshImpl(MESH_SHAPE, LAYOUT), extra_variable=True)
    with pytest.raises(mx.ConfigError, match=r"another model: 3 of its 13 variables are not there \('new/bias', "):
        restore_checkpoint(directory, lowering)


def test_variable_of_another_shape(saved_at_3):
    directory, _ = saved_at_3
    lowering, _ = build(mx.SimdMeshImpl(MESH_SHAPE, LAYOUT), hidden=8)
    with pytest.raises(mx.ConfigError, match=r"have other shapes \('mlp/w' \(\[8, 8\] here, \[8, 16\] there\)"):
        restore_checkpoint(directory, lowering)


def test_variable_of_another_dtype(tmp_path):
    """Orbax casts what it reads to the dtype asked for: a float32 checkpoint restored into int32
    variables of the same names and shapes was cut to integers, without a word."""

    def lowering(dtype):
        graph, mesh = new_mesh()
        mx.get_variable(mesh, "w", "a:4;b:3", dtype, initializer=mx.initializers.normal(1.0))
        return mx.Lowering(graph, {mesh: mx.SimdMeshImpl(MESH_SHAPE, "a:rows")})

    save_checkpoint(tmp_path, lowering("float32"), 1)
    for dtype in ("int32", "bfloat16"):
        with pytest.raises(mx.ConfigError, match=rf"1 have other dtypes \('w' \({dtype} here, float32 there\)\)"):
            restore_checkpoint(tmp_path, lowering(dtype))


def test_an_older_checkpoint_s_float32_step_counter_is_restored_as_the_int32_one(tmp_path):
    """Checkpoints written before the step counter was an int32 hold a float32 `global_step`:
    it is restored (and checked) as the int32 counter, at its value, and the schedule goes on
    from it; another float32 variable read into an int32 one is still refused (above)."""
    graph, mesh = new_mesh()
    mx.get_variable(mesh, "w", "a:4", initializer=mx.initializers.ones())
    counter = mx.get_variable(mesh, "global_step", [], "float32", initializer=mx.initializers.zeros(), trainable=False)
    old = mx.Lowering(graph, {mesh: mx.SimdMeshImpl(MESH_SHAPE, "a:rows")})
    old.set_variable_value(counter, np.float32(5))
    save_checkpoint(tmp_path, old, 5)

    graph, mesh = new_mesh()
    w = mx.get_variable(mesh, "w", "a:4", initializer=mx.initializers.zeros())
    opt = mx.optimize.SgdOptimizer(mx.optimize.linear_warmup(1.0, 10))
    updates = opt.apply_grads(mx.gradients(mx.reduce_sum(w), [w]), [w])
    lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl(MESH_SHAPE, "a:rows")})
    check_restorable(tmp_path, lowering)
    assert restore_checkpoint(tmp_path, lowering)["step"] == 5
    step = lowering.variable_value(opt.step)
    assert step == 5 and step.dtype == np.int32
    lowering.function([], updates=updates)({})
    assert lowering.variable_value(opt.step) == 6
    np.testing.assert_allclose(lowering.variable_value(w), 1 - 0.6)  # the warmup's rate at step 5


def test_extra_checkpoint_variables_warn(saved_at_3):
    directory, at_save = saved_at_3
    lowering, _ = build(mx.SimdMeshImpl(MESH_SHAPE, LAYOUT), seed=1, optimizer=False)  # no slots, no step
    with pytest.warns(UserWarning, match=r"variables the graph lacks.*'global_step'"):
        assert restore_checkpoint(directory, lowering)["step"] == 3
    for name, value in values(lowering).items():
        np.testing.assert_array_equal(value, at_save[name], err_msg=name)


def test_latest_step_reads_the_folder_without_an_orbax_manager(tmp_path, monkeypatch):
    """Orbax's manager syncs every process of a job as it opens (a collective): the line of a
    Ctrl-C, which each process of a job prints as it stops, waited there for processes that were
    elsewhere or gone. latest_step reads the folder alone; a save's temporary folder is no step."""
    import orbax.checkpoint as ocp

    lowering, _ = build(mx.SimdMeshImpl(MESH_SHAPE, LAYOUT))
    save_checkpoint(tmp_path, lowering, 2)
    os.makedirs(tmp_path / "4.orbax-checkpoint-tmp-1234567" / "state")

    def no_manager(*args, **kwargs):
        raise AssertionError("latest_step opened an Orbax manager")

    monkeypatch.setattr(ocp, "CheckpointManager", no_manager)
    assert latest_step(tmp_path) == 2
