"""float16 computation with dynamic loss scaling (`optimize.LossScaleOptimizer`), and the
guard it holds a step's updates back with (`updates_only_where`)."""

import dataclasses
import json
from collections import Counter

import numpy as np
import pytest

import meshax as mx
from meshax.models.transformer import PRESETS, TransformerConfig
from meshax.optimize import AdamWeightDecayOptimizer, LossScaleOptimizer, SgdOptimizer
from meshax.train import LmTask, train
from meshax.train.loop import build, training_graph
from tests.conftest import new_mesh

SMALL = TransformerConfig(vocab_size=16, d_model=16, d_ff=32, num_heads=8, d_kv=4, num_layers=1)
F16 = dataclasses.replace(SMALL, dtype="float16")


def _task(config):
    return LmTask(model=config, source="markov", markov_vocab=16, batch_size=8, length=8)


def _run(config, optimizer, steps=4, mesh="all:8", layout="batch:all", backend="simd"):
    """(losses, logged loss scales, the program) of `steps` training steps."""
    task = _task(config)
    program = build(task, mesh, layout, backend, optimizer)
    out = [program.train_fn(task.train_batch(s), seed=s) for s in range(steps)]
    scales = [float(o[1 + program.logged_names.index("loss_scale")]) for o in out] if program.logged_names else []
    return [float(o[0]) for o in out], scales, program


def _variables(program) -> dict[str, np.ndarray]:
    return {v.name: np.asarray(program.lowering.variable_value(v)) for v in program.lowering.graph.all_variables}


# ---- the guard -----------------------------------------------------------------------------------
def test_updates_only_where_holds_back_every_update_made_inside_where_the_condition_fails():
    graph, mesh = new_mesh()
    w, u = (mx.get_variable(mesh, n, "a:8", initializer=mx.initializers.ones()) for n in "wu")
    n, c = (mx.get_variable(mesh, k, [], dtype="int32", initializer=mx.initializers.zeros()) for k in "nc")
    go, other = (mx.placeholder(mesh, k, [], dtype="bool") for k in ("go", "other"))
    with mx.updates_only_where(go):
        updates = [mx.assign(w, w * 3.0), mx.assign_add(n, 1)]
        with mx.updates_only_where(other):  # (nested: both must hold)
            updates.append(mx.assign_sub(u, mx.ones_like(u)))
    updates.append(mx.assign_add(c, 1))  # (outside: always)
    lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "a:all")})
    step = lowering.function([], updates=updates)
    values = lambda: [np.asarray(lowering.variable_value(v)).tolist() for v in (w, n, u, c)]  # noqa: E731
    step({"go": np.bool_(False), "other": np.bool_(True)})
    assert values() == [[1.0] * 8, 0, [1.0] * 8, 1]
    step({"go": np.bool_(True), "other": np.bool_(False)})
    assert values() == [[3.0] * 8, 1, [1.0] * 8, 2]
    step({"go": np.bool_(True), "other": np.bool_(True)})
    assert values() == [[9.0] * 8, 2, [0.0] * 8, 3]


def test_updates_only_where_refuses_what_it_cannot_hold_back():
    _, mesh = new_mesh()
    w = mx.get_variable(mesh, "w", "a:8")
    go = mx.placeholder(mesh, "go", [], dtype="bool")
    with pytest.raises(mx.GraphError, match="scalar bool"), mx.updates_only_where(w > 0.0):
        pass
    with mx.updates_only_where(go), pytest.raises(mx.GraphError, match=r"assign_fn .* cannot be held back"):
        mx.assign(w, w * 2.0, assign_fn=mx.assign_slice)


# ---- the optimizer -------------------------------------------------------------------------------
@pytest.mark.parametrize("inner,rtol", [(lambda: SgdOptimizer(0.5), 0), (lambda: AdamWeightDecayOptimizer(1e-2), 1e-6)])
def test_a_loss_scaled_step_is_the_unscaled_step(inner, rtol):
    """Scales are powers of two: scaling the loss and unscaling the float32 gradients is exact,
    and SGD's steps are the unscaled ones to the bit; with Adam, XLA fuses the unscaling into
    the update's kernels and rounds differently (4 steps: 1.5e-8 apart at most, in 7% of one
    weight's values)."""
    plain_losses, _, plain = _run(SMALL, inner())
    scaled_losses, scales, scaled = _run(SMALL, LossScaleOptimizer(inner(), initial_scale=2.0**10))
    np.testing.assert_allclose(scaled_losses, plain_losses, rtol=rtol)
    assert scales == [2.0**10] * 4
    want, got = _variables(plain), _variables(scaled)
    assert {k for k in got if k.startswith("loss_scale/")} == {"loss_scale/scale", "loss_scale/finite_steps"}
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=rtol, atol=rtol * 1e-2, err_msg=name)


@pytest.mark.parametrize("backend", ["simd", "placement"])
def test_an_overflowing_step_changes_nothing_and_halves_the_scale(backend):
    # float16 activation gradients scaled by 2**127 overflow: every step's gradients have infs
    optimizer = LossScaleOptimizer(AdamWeightDecayOptimizer(1e-2), initial_scale=2.0**127, growth_interval=3)
    task = _task(F16)
    program = build(task, "rows:2;cols:4", "batch:rows;vocab:cols;d_ff:cols;heads:cols", backend, optimizer)
    before = _variables(program)
    outs = [program.train_fn(task.train_batch(s)) for s in range(3)]
    after = _variables(program)
    assert all(np.isfinite(float(o[0])) for o in outs)  # (the loss reported is the unscaled one)
    assert [float(o[1]) for o in outs] == [2.0**127, 2.0**126, 2.0**125]  # the scale each step used
    for name, value in before.items():  # weights, Adam's moments, the step counter
        if not name.startswith("loss_scale/"):
            np.testing.assert_array_equal(after[name], value, err_msg=name)
    assert after["loss_scale/scale"] == 2.0**124 and after["loss_scale/finite_steps"] == 0


def test_the_scale_stays_at_its_floor_and_grows_each_growth_interval():
    optimizer = LossScaleOptimizer(SgdOptimizer(0.5), initial_scale=4.0, growth_interval=2, min_scale=4.0)
    _, scales, _ = _run(F16, optimizer, steps=6)
    assert scales == [4.0, 4.0, 8.0, 8.0, 16.0, 16.0]
    floor = LossScaleOptimizer(SgdOptimizer(0.5), initial_scale=2.0**127, min_scale=2.0**127)
    _, scales, program = _run(F16, floor, steps=2)
    assert scales == [2.0**127] * 2 and int(_variables(program)["global_step"]) == 0


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"initial_scale": 1000.0}, "initial_scale 1000.0 must be a power of two"),
        ({"min_scale": 0.5}, "min_scale 0.5 must be a power of two >= 1"),
        ({"initial_scale": 2.0, "min_scale": 4.0}, "initial_scale 2.0 is below min_scale 4.0"),
        ({"growth_interval": 0}, "growth_interval 0 must be a whole number of steps >= 1"),
        # (above 2**127 the float32 scale is inf: every step skipped, and inf halved stays inf)
        ({"initial_scale": 2.0**128}, r"initial_scale 3.4\S* must be a power of two >= 1 and <= 2\*\*127"),
        ({"min_scale": 2**200}, r"min_scale 1606\S* must be a power of two >= 1 and <= 2"),
        ({"initial_scale": "1024"}, "initial_scale '1024' must be a power of two"),
        ({"growth_interval": True}, "growth_interval True must be a whole number of steps >= 1"),
        # (the count is an int32: 2**31 wrapped to -2**31, and the scale doubled at every step)
        ({"growth_interval": 2**31}, r"growth_interval 2147483648 must be at most 2\*\*31 - 1"),
    ],
)
def test_loss_scale_settings_are_checked(kwargs, message):
    with pytest.raises(mx.ConfigError, match=message):
        LossScaleOptimizer(SgdOptimizer(0.1), **kwargs)


def test_a_numpy_integer_growth_interval_is_a_whole_number():
    """np.int64(100) (read from a config array, say) was refused: 'growth_interval np.int64(100)
    must be a whole number of steps >= 1'."""
    assert LossScaleOptimizer(SgdOptimizer(0.1), growth_interval=np.int64(100)).growth_interval == 100
    with pytest.raises(mx.ConfigError, match=r"growth_interval 2\.5 must be a whole number"):
        LossScaleOptimizer(SgdOptimizer(0.1), growth_interval=2.5)


def test_a_second_loss_scale_optimizer_in_one_graph_is_refused_by_name():
    """It failed as "a variable named 'loss_scale/scale' already exists"."""
    _, mesh = new_mesh()
    w, u = (mx.get_variable(mesh, n, "a:4") for n in "wu")
    LossScaleOptimizer(SgdOptimizer(0.1)).scale_loss(mx.reduce_sum(w * w))
    with pytest.raises(mx.GraphError, match="another LossScaleOptimizer scales a loss of this graph already"):
        LossScaleOptimizer(SgdOptimizer(0.1)).scale_loss(mx.reduce_sum(u * u))


def test_loss_scaling_needs_an_optimizer_and_the_scaled_loss():
    with pytest.raises(mx.ConfigError, match="wraps a meshax optimizer"):
        LossScaleOptimizer(LossScaleOptimizer(SgdOptimizer(0.1)))
    _, mesh = new_mesh()
    w = mx.get_variable(mesh, "w", "a:8")
    with pytest.raises(mx.GraphError, match=r"take the gradients of scale_loss\(loss\)"):
        LossScaleOptimizer(SgdOptimizer(0.1)).apply_grads(mx.gradients(mx.reduce_sum(w), [w]), [w])


def test_gradients_of_the_loss_unscaled_or_scaled_twice_are_refused():
    """Gradients of the loss itself (scale_loss called, its result not differentiated) were
    unscaled all the same: the step was the scale times too small (w 1 - 3e-5 where 0 was due);
    a loss scaled twice gave gradients scale**2 times, unscaled once (4 times the step)."""
    for mistake in ("unscaled", "twice", "another graph"):
        _, mesh = new_mesh()
        w = mx.get_variable(mesh, "w", "a:8", initializer=mx.initializers.ones())
        loss = mx.reduce_sum(mx.square(w)) * 0.5
        optimizer = LossScaleOptimizer(SgdOptimizer(1.0), initial_scale=4.0)
        scaled = optimizer.scale_loss(loss)
        if mistake == "unscaled":
            with pytest.raises(mx.GraphError, match=r"gradients of w are not those of scale_loss\(loss\)"):
                optimizer.apply_grads(mx.gradients(loss, [w]), [w])
        elif mistake == "twice":
            with pytest.raises(mx.GraphError, match=r"scale_loss: multiply_\d+ is scaled already"):
                optimizer.scale_loss(scaled)
        else:  # (the scale is the first graph's)
            _, other = new_mesh()
            v = mx.get_variable(other, "v", "a:8")
            with pytest.raises(mx.GraphError, match="gradients of v are not those of scale_loss"):
                optimizer.apply_grads(mx.gradients(mx.reduce_sum(v), [v]), [v])
    # a gradient made otherwise beside those of the scaled loss (a frozen weight's zeros) passes
    _, mesh = new_mesh()
    w, u = (mx.get_variable(mesh, n, "a:8") for n in "wu")
    optimizer = LossScaleOptimizer(SgdOptimizer(1.0))
    (gw,) = mx.gradients(optimizer.scale_loss(mx.reduce_sum(w * u)), [w])
    optimizer.apply_grads([gw, mx.zeros_like(u)], [w, u])


def test_the_wrapped_optimizer_refuses_the_gradients_of_the_scaled_loss():
    """The gradients of scale_loss(loss) given to the wrapped optimizer itself (or to any other)
    carry the scale: the step was the scale times too far (w 1 - 4 where 1 - 1 was due). They are
    computed from the scale, as no gradient of an unscaled loss is: refused, clipped or not. The
    LossScaleOptimizer's own apply_grads, which unscales them, still hands them on."""
    from meshax.optimize import clip_by_global_norm

    graph, mesh = new_mesh()
    w = mx.get_variable(mesh, "w", "a:8", initializer=mx.initializers.ones())
    u = mx.get_variable(mesh, "u", "a:8", initializer=mx.initializers.ones())
    optimizer = LossScaleOptimizer(SgdOptimizer(1.0), initial_scale=4.0)
    grads = mx.gradients(optimizer.scale_loss(mx.reduce_sum(mx.square(w)) * 0.5), [w])
    message = r"Optimizer.apply_grads: the gradients of w are those of a loss scaled by a LossScaleOptimizer"
    for given in (grads, clip_by_global_norm(grads, 1.0)):
        with pytest.raises(mx.GraphError, match=message):
            optimizer.optimizer.apply_grads(given, [w])
        with pytest.raises(mx.GraphError, match=message):
            AdamWeightDecayOptimizer(1e-3).apply_grads([*given, mx.zeros_like(u)], [w, u])
    SgdOptimizer(1.0).apply_grads(mx.gradients(mx.reduce_sum(u), [u]), [u])  # (an unscaled loss's: taken)
    updates = optimizer.apply_grads(grads, [w])
    lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "a:all")})
    lowering.function([], updates=updates)({})
    np.testing.assert_array_equal(lowering.variable_value(w), np.zeros(8))


def test_the_wrapped_optimizers_own_apply_grads_is_the_one_called():
    """A subclass that overrides apply_grads (to add updates of its own, say) is called by the
    LossScaleOptimizer with the unscaled gradients, and takes them. It was bypassed: the
    LossScaleOptimizer called the base class's private body."""
    calls = []

    class Recording(SgdOptimizer):
        def apply_grads(self, grads, variables):
            calls.append(len(grads))
            return super().apply_grads(grads, variables)

    graph, mesh = new_mesh()
    w = mx.get_variable(mesh, "w", "a:8", initializer=mx.initializers.ones())
    optimizer = LossScaleOptimizer(Recording(1.0), initial_scale=4.0)
    updates = optimizer.apply_grads(mx.gradients(optimizer.scale_loss(mx.reduce_sum(mx.square(w)) * 0.5), [w]), [w])
    assert calls == [1]
    lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "a:all")})
    lowering.function([], updates=updates)({})
    np.testing.assert_array_equal(lowering.variable_value(w), np.zeros(8))


def test_accumulated_microbatches_are_loss_scaled_each_and_unscaled_once():
    """serialize_training_step(scale_loss=optimizer.scale_loss) takes the gradients of each
    microbatch's scaled loss, as a float16 model needs (unscaled, its small gradients underflow):
    the LossScaleOptimizer's step is the unscaled float32 step, and the outputs keep the loss
    itself. It had no way to scale the loss but model_fn's, which scaled the loss returned too."""
    x0 = np.linspace(-1.0, 1.0, 32, dtype=np.float32).reshape(8, 4)
    runs = []
    for dtype, optimizer in (("float32", SgdOptimizer(0.1)), ("float16", LossScaleOptimizer(SgdOptimizer(0.1)))):
        graph, mesh = new_mesh()
        batch, d = mx.Dimension("batch", 8), mx.Dimension("d", 4)
        x = mx.cast(mx.import_fully_replicated(mesh, x0, [batch, d]), dtype)
        w = mx.get_variable(mesh, "w", [d], initializer=mx.initializers.constant(0.5))

        def model_fn(features, dtype=dtype, w=w, d=d):
            y = mx.reduce_sum(features["x"] * mx.cast(w, dtype), reduced_dim=d)
            return {"loss": mx.cast(mx.reduce_sum(mx.square(y)), "float32") * 1e-3}

        grads, outputs = mx.serialize_training_step(
            {"x": x}, model_fn, batch, num_splits=2, scale_loss=optimizer.scale_loss
        )
        updates = optimizer.apply_grads(grads, [w])
        lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "batch:all")})
        loss = lowering.function(outputs["loss"], updates=updates)({})
        runs.append((float(loss), np.asarray(lowering.variable_value(w))))
    (loss32, w32), (loss16, w16) = runs
    np.testing.assert_allclose(loss16, loss32, rtol=2e-3)  # (the loss, not the scaled loss)
    np.testing.assert_allclose(w16, w32, rtol=2e-3)
    assert np.all(w32 != 0.5)


def test_clipping_the_scaled_gradients_at_the_scaled_norm_is_clipping_the_unscaled_ones():
    """apply_grads takes the gradients of scale_loss(loss), times the scale: clipped at max_norm
    they would be clipped far below it (a gradient of norm 0.28, 2**15 times that, clipped to 1);
    clipped at max_norm times the scale, the steps are the unscaled ones to the bit."""
    from meshax.optimize import clip_by_global_norm

    for max_norm in (1.0, 0.01):  # (the norm is 0.28: clipped by the second only)
        runs = []
        for scaled, at_scale in ((False, False), (True, False), (True, True)):
            graph, mesh = new_mesh()
            w = mx.get_variable(mesh, "w", "a:8", initializer=mx.initializers.ones())
            optimizer = LossScaleOptimizer(SgdOptimizer(1.0)) if scaled else SgdOptimizer(1.0)
            grads = mx.gradients(optimizer.scale_loss(mx.reduce_sum(mx.square(w)) * 0.05), [w])
            limit = max_norm * optimizer.scale if at_scale else max_norm
            updates = optimizer.apply_grads(clip_by_global_norm(grads, limit), [w])
            lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "a:all")})
            lowering.function([], updates=updates)({})
            runs.append(np.asarray(lowering.variable_value(w)))
        plain, naive, clipped = runs
        np.testing.assert_array_equal(clipped, plain)
        assert np.all(np.abs(1.0 - naive) < 1e-3 * np.abs(1.0 - plain))  # (the scaled norm clipped to 1)


@pytest.mark.parametrize(
    "dtype,recomputed,scale",
    [("float16", False, 2**10), ("bfloat16", False, 2**10), ("float16", True, 2**10), ("float32", False, 2**100)],
    ids=["float16", "bfloat16", "float16-recomputed", "float32-at-2**100"],
)
def test_an_activation_gradient_clipped_in_a_scaled_loss_is_clipped_unscaled(dtype, recomputed, scale):
    """clip_activation_gradient sits in the backward pass, where the gradients carry the loss's
    scale: it clips the unscaled gradient's RMS, taken in float32. It took the RMS of the scaled
    float16 gradient in float16: its squares (2**24 here) overflowed, the RMS was inf and the
    gradient 0, a finite step that changed nothing; in bfloat16 the scaled RMS was clipped to the
    limit, the step 2**10 times too small. At a scale of 2**100 a float32 gradient's squares overflow:
    it is unscaled first. A recomputed layer's gradient is
    built within the loss's (`body_gradients`): it sees the scale too."""
    runs = []
    for scaled in (False, True):
        graph, mesh = new_mesh()
        w = mx.get_variable(mesh, "w", "a:8", initializer=mx.initializers.ones())
        optimizer = LossScaleOptimizer(SgdOptimizer(0.1), initial_scale=float(scale)) if scaled else SgdOptimizer(0.1)
        clip = lambda v: mx.layers.clip_activation_gradient(mx.cast(v, dtype) * 2.0, clip_rms_norm=0.5)  # noqa: E731
        h = mx.recompute_grad(clip, [w]) if recomputed else clip(w)  # (its gradient's RMS: 4)
        loss = mx.reduce_sum(mx.cast(mx.square(h), "float32"))
        updates = optimizer.apply_grads(mx.gradients(optimizer.scale_loss(loss), [w]), [w])
        lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "a:all")})
        lowering.function([], updates=updates)({})
        runs.append(np.asarray(lowering.variable_value(w)))
    np.testing.assert_allclose(runs[0], 1.0 - 0.1 * 2.0 * 0.5, rtol=1e-6)  # (dh clipped from 4 to 0.5, times 2)
    np.testing.assert_array_equal(runs[1], runs[0])


def test_clipped_gradients_whose_norm_overflows_skip_the_step_and_halve_the_scale():
    """At a scale past 2**64 the squares of the scaled gradients overflow float32: the norm was
    inf and the gradients clipped to 0, so every step was taken and moved nothing while the scale
    grew on (w stayed 1.0 at 2**70, 2**71, 2**72); now the step is skipped and the scale halves."""
    from meshax.optimize import clip_by_global_norm

    graph, mesh = new_mesh()
    w = mx.get_variable(mesh, "w", "a:8", initializer=mx.initializers.ones())
    optimizer = LossScaleOptimizer(SgdOptimizer(0.1), initial_scale=2.0**70, growth_interval=1)
    grads = mx.gradients(optimizer.scale_loss(mx.reduce_sum(mx.square(w)) * 0.5), [w])
    updates = optimizer.apply_grads(clip_by_global_norm(grads, 1.0 * optimizer.scale), [w])
    lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "a:all")})
    step = lowering.function([optimizer.scale], updates=updates)
    assert [float(step({})[0]) for _ in range(9)] == [2.0**e for e in (70, 69, 68, 67, 66, 65, 64, 63, 62)]
    assert float(lowering.variable_value(optimizer.scale)) == 2.0**63  # (the step at 2**62 was taken)
    np.testing.assert_allclose(lowering.variable_value(w), np.full(8, 1.0 - 0.1 / np.sqrt(8)), rtol=1e-6)


# ---- float16 training ----------------------------------------------------------------------------
def test_a_float16_model_trains_loss_scaled_and_follows_float32():
    graph, _, _, _ = training_graph(_task(F16), SgdOptimizer(0.5))
    assert "loss_scale/scale" in {v.name for v in graph.all_variables}  # (wrapped: the model computes in float16)
    assert {str(v.value.dtype) for v in graph.trainable_variables} == {"float32"}  # the master weights
    assert "loss_scale" not in training_graph(_task(SMALL), SgdOptimizer(0.5))[0].logged_scalars
    for mesh, layout in [("all:8", "batch:all"), ("rows:2;cols:4", "batch:rows;vocab:cols;d_ff:cols;heads:cols")]:
        f32, _, _ = _run(SMALL, SgdOptimizer(0.5), steps=10, mesh=mesh, layout=layout)
        f16, scales, _ = _run(F16, SgdOptimizer(0.5), steps=10, mesh=mesh, layout=layout)
        assert f32[-1] < f32[0] - 0.5 and scales == [2.0**15] * 10
        np.testing.assert_allclose(f16, f32, rtol=0.005)


def test_a_float16_run_logs_its_loss_scale_and_checkpoints_it(tmp_path):
    import orbax.checkpoint as ocp

    metrics = tmp_path / "metrics.jsonl"
    train(_task(F16), "all:1", "", steps=2, checkpoint_dir=str(tmp_path / "ckpt"), metrics_path=str(metrics))
    saved = ocp.PyTreeCheckpointer().metadata(str(tmp_path / "ckpt" / "2" / "state")).item_metadata
    assert {"loss_scale/scale", "loss_scale/finite_steps"} <= set(dict(saved))
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["loss_scale"] for line in lines if "loss_scale" in line] == [2.0**15] * 2


def test_skipped_steps_keep_the_kept_float16_copies_right():
    """A step that reads kept float16 copies of its weights (a GPU's default: forced here) and
    skips its update writes the copies of the weights it kept: the steps are the ones without."""
    runs = []
    for copies in (False, True):
        task = _task(F16)
        optimizer = LossScaleOptimizer(AdamWeightDecayOptimizer(1e-2), initial_scale=2.0**127)
        program = build(
            task, "rows:2;cols:4", "batch:rows;vocab:cols;d_ff:cols;heads:cols", "simd", optimizer, cast_copies=copies
        )
        outs = [[float(v) for v in program.train_fn(task.train_batch(s), seed=s)] for s in range(3)]
        runs.append((outs, _variables(program), program.train_fn.copies_bytes()))
    (plain, plain_vars, none), (kept, kept_vars, some) = runs
    assert none == 0 < some and plain == kept and plain[-1][1] == 2.0**125
    for name, value in plain_vars.items():
        np.testing.assert_array_equal(kept_vars[name], value, err_msg=name)


@pytest.mark.parametrize("weight_layout", [None, "d_model:rows;heads:cols;d_ff:cols"])
def test_the_finiteness_check_settles_one_scalar_sum_per_split_gradient_shape(weight_layout):
    """The check sums every gradient; the sums of gradients of one shape owe the same partial
    sums and are settled together: one scalar allreduce per shape of split weights (for the tiny
    LM under the paper's 2-D layout, 6 more than float32's 43; it was one per split weight, 15)."""
    sites, lowering = [], None
    for dtype in ("float32", "float16"):
        task = LmTask(model=dataclasses.replace(PRESETS["tiny"], dtype=dtype), batch_size=8, length=16)
        layout = "batch:rows;vocab:cols;d_ff:cols;heads:cols"
        lowering, outputs, updates = build(
            task, "rows:2;cols:4", layout, "simd", SgdOptimizer(0.1), compile=False, weight_layout=weight_layout
        )
        found = lowering.trace_step(outputs, updates).sites()
        sites.append(Counter((s.values, s.mesh_axes) for s in found if s.kind == "allreduce"))
    weights = lowering.graph.trainable_variables
    split = [v for v in weights if lowering.layout_of(v.value)]
    extra = sites[1] - sites[0]
    assert not sites[0] - sites[1] and {values for values, _ in extra} == {1}  # (scalars only)
    assert sum(extra.values()) == len({v.value.shape for v in split}) < len(split)


def test_a_bfloat16_checkpoint_resumes_in_float16_and_back(tmp_path):
    """The same model in another 16-bit dtype: a bfloat16 run's checkpoint lacks the loss scale's
    state, which the float16 run starts afresh (it was refused: 'it holds another model'); the
    float16 checkpoint's extra state is skipped, with a warning, going back."""
    bf16, ckpt = dataclasses.replace(F16, dtype="bfloat16"), str(tmp_path / "ckpt")
    train(_task(bf16), "all:8", "batch:all", steps=2, checkpoint_dir=ckpt)
    resumed = train(_task(F16), "all:8", "batch:all", steps=4, checkpoint_dir=ckpt, resume=True)
    assert resumed.first_step == 2 and len(resumed.losses) == 2 and np.isfinite(resumed.losses).all()
    variables = _variables(resumed)
    assert variables["loss_scale/scale"] == 2.0**15 and variables["loss_scale/finite_steps"] == 2
    with pytest.warns(UserWarning, match="variables the graph lacks.*loss_scale/finite_steps"):
        back = train(_task(bf16), "all:8", "batch:all", steps=5, checkpoint_dir=ckpt, resume=True)
    assert back.first_step == 4 and len(back.losses) == 1


def test_the_scale_of_a_float16_loss_grows_no_further_than_float16_holds():
    """A float16 loss's gradient is the scale itself, in float16: 2**16 would overflow it and
    skip every growth interval's step; the scale stops at 2**15."""
    graph, mesh = new_mesh()
    w = mx.get_variable(mesh, "w", "a:8", initializer=mx.initializers.ones())
    x = mx.placeholder(mesh, "x", "a:8", dtype="float16")
    loss = mx.reduce_sum(mx.cast(w, "float16") * x)
    optimizer = LossScaleOptimizer(SgdOptimizer(0.1), initial_scale=2.0**14, growth_interval=1)
    updates = optimizer.apply_grads(mx.gradients(optimizer.scale_loss(loss), [w]), [w])
    lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "a:all")})
    step = lowering.function([optimizer.scale], updates=updates)
    scales = [float(step({"x": np.full(8, 0.5, np.float16)})[0]) for _ in range(4)]
    assert scales == [2.0**14, 2.0**15, 2.0**15, 2.0**15]
    np.testing.assert_allclose(lowering.variable_value(w), np.full(8, 1.0 - 4 * 0.05), rtol=1e-6)  # (4 steps)


@pytest.mark.parametrize("backend", [mx.SimdMeshImpl, mx.PlacementMeshImpl])
def test_gradients_scaled_at_the_largest_scale_are_unscaled_not_zeroed(backend):
    """A float32 loss's scale grows up to 2**127. Multiplying by 1 / 2**127, a float32 subnormal
    XLA flushes to zero, made every gradient 0 there: each step counted as finite and taken, and
    no weight moved (w stayed 1.0, 0.9 due); the gradients are divided by the scale."""
    graph, mesh = new_mesh()
    w = mx.get_variable(mesh, "w", "a:8", initializer=mx.initializers.ones())
    optimizer = LossScaleOptimizer(SgdOptimizer(0.1), initial_scale=2.0**127)
    loss = mx.reduce_sum(mx.square(w)) * 0.5
    updates = optimizer.apply_grads(mx.gradients(optimizer.scale_loss(loss), [w]), [w])
    lowering = mx.Lowering(graph, {mesh: backend("all:8", "a:all")})
    lowering.function([], updates=updates)({})
    np.testing.assert_array_equal(lowering.variable_value(w), np.full(8, 0.9, np.float32))
    assert float(lowering.variable_value(optimizer.scale)) == 2.0**127


def test_a_min_scale_above_what_a_float16_loss_holds_is_refused():
    """min_scale 2**16 with a float16 loss: its gradient, the scale in float16, was inf at every
    step, each skipped, the scale held at its floor: nothing ever trained, and nothing said so."""
    for min_scale in (2.0**16, 2.0**15):  # (2**15: the largest it holds)
        _, mesh = new_mesh()
        loss = mx.reduce_sum(mx.cast(mx.get_variable(mesh, "w", "a:8"), "float16"))
        optimizer = LossScaleOptimizer(SgdOptimizer(0.1), initial_scale=min_scale, min_scale=min_scale)
        if min_scale > 2.0**15:
            with pytest.raises(mx.ConfigError, match=r"min_scale 65536.0 is above 2\*\*15, the largest scale a"):
                optimizer.scale_loss(loss)
        else:
            optimizer.scale_loss(loss)


def test_a_bfloat16_loss_is_scaled_up_to_what_bfloat16_holds():
    """The largest scale of a bfloat16 loss was looked up with np.finfo, which knows no bfloat16:
    scale_loss of a bfloat16 loss failed ('data type bfloat16 not inexact'). It is 2**127."""
    graph, mesh = new_mesh()
    w = mx.get_variable(mesh, "w", "a:8", initializer=mx.initializers.ones())
    loss = mx.reduce_sum(mx.cast(w, "bfloat16")) * 0.5
    optimizer = LossScaleOptimizer(SgdOptimizer(0.1), initial_scale=2.0**126, growth_interval=1)
    updates = optimizer.apply_grads(mx.gradients(optimizer.scale_loss(loss), [w]), [w])
    lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "a:all")})
    step = lowering.function([optimizer.scale], updates=updates)
    assert [float(step({})[0]) for _ in range(3)] == [2.0**126, 2.0**127, 2.0**127]
    np.testing.assert_allclose(lowering.variable_value(w), np.full(8, 1.0 - 3 * 0.05), rtol=1e-6)  # (3 steps taken)
