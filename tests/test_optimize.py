"""Optimizers against NumPy references, slots laid out like their variables, schedules (issue 3)."""

import numpy as np
import pytest

import meshax as mx

a, b = mx.Dimension("a", 8), mx.Dimension("b", 4)
STEPS = 3


def run(optimizer, layout="a:rows;b:cols"):
    """Minimise sum(w * target) + 0.5 |w|^2 for STEPS steps; returns the w after each step."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    w = mx.get_variable(mesh, "w", [a, b], initializer=mx.initializers.normal(1.0))
    target = mx.placeholder(mesh, "target", [a, b])
    loss = mx.reduce_sum(w * target) + 0.5 * mx.reduce_sum(mx.square(w))
    (g,) = mx.gradients(loss, [w])
    updates = optimizer.apply_grads([g], [w])
    lo = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", layout)})
    for var in graph.all_variables:  # every slot is laid out like its variable
        if var.shape == w.shape:
            assert lo.plan[var.value] == lo.plan[w]
    fn = lo.function([], updates=updates)
    t = np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4)
    w0 = lo.variable_value(w)
    history = []
    for _ in range(STEPS):
        fn({"target": t})
        history.append(lo.variable_value(w))
    return w0, t, history


def grad(w, t):
    return t + w


def test_sgd():
    w, t, hist = run(mx.optimize.SgdOptimizer(0.1))
    for got in hist:
        w = w - 0.1 * grad(w, t)
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)


def test_momentum():
    w, t, hist = run(mx.optimize.MomentumOptimizer(0.1, momentum=0.9))
    m = np.zeros_like(w)
    for got in hist:
        m = 0.9 * m + grad(w, t)
        w = w - 0.1 * m
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)


def test_adam_with_weight_decay():
    w, t, hist = run(mx.optimize.AdamWeightDecayOptimizer(0.05, weight_decay_rate=0.01))
    m = v = np.zeros_like(w)
    for step, got in enumerate(hist, start=1):
        g = grad(w, t)
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        update = (m / (1 - 0.9**step)) / (np.sqrt(v / (1 - 0.999**step)) + 1e-8) + 0.01 * w
        w = w - 0.05 * update
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout", ["", "a:rows;b:cols", "a:rows;a:cols"])
def test_adafactor_factored(layout):
    """Factored where both of the two largest dims reach min_dim_size_to_factor (4 here)."""
    w, t, hist = run(mx.optimize.AdafactorOptimizer(min_dim_size_to_factor=4), layout)
    vr, vc = np.zeros(8), np.zeros(4)  # factored over a (8, the largest) and b (4): vr is [a], vc is [b]
    for step, got in enumerate(hist, start=1):
        g = grad(w, t)
        decay = 1 - step**-0.8
        g2 = g * g + 1e-30
        vr = decay * vr + (1 - decay) * g2.mean(1)  # shape minus d1 (b): over a
        vc = decay * vc + (1 - decay) * g2.mean(0)  # shape minus d0 (a): over b
        x = g / np.sqrt(vr[:, None] / vr.mean()) / np.sqrt(vc[None, :])
        x = x / max(np.sqrt((x * x).mean()) / 1.0, 1.0)
        lr = min(0.01, 1 / np.sqrt(step)) * max(np.sqrt((w * w).mean()), 1e-3)
        w = w - lr * x
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("scaled", [True, False])
def test_adafactors_defaults_are_mesh_tensorflows(scaled):
    """Mesh-TensorFlow's defaults: an [8, 4] variable's second moment is not factored (its dims
    are under min_dim_size_to_factor, 128: one full slot), and without the parameter scale the
    default rate is min(0.01, 1/sqrt(step)) times 0.05."""
    w, t, hist = run(mx.optimize.AdafactorOptimizer(multiply_by_parameter_scale=scaled))
    _check_unfactored_adafactor(w, t, hist, lambda w: max(np.sqrt((w * w).mean()), 1e-3) if scaled else 0.05)


def _check_unfactored_adafactor(w, t, hist, scale):
    """`hist` is Adafactor's unfactored steps from w (NumPy's), the default rate times scale(w)."""
    v = np.zeros_like(w)
    for step, got in enumerate(hist, start=1):
        g = grad(w, t)
        decay = 1 - step**-0.8
        v = decay * v + (1 - decay) * (g * g + 1e-30)
        x = g / np.sqrt(v)
        x = x / max(np.sqrt((x * x).mean()), 1.0)
        w = w - min(0.01, 1 / np.sqrt(step)) * scale(w) * x
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-6)


def test_adam_as_mesh_tensorflows():
    """`bias_correction=False, epsilon=1e-6, exclude_from_weight_decay=()`: Mesh-TensorFlow's
    AdamWeightDecayOptimizer, formula for formula; the exclusions are regular expressions."""
    opt = mx.optimize.AdamWeightDecayOptimizer(
        0.05, weight_decay_rate=0.01, epsilon=1e-6, exclude_from_weight_decay=(), bias_correction=False
    )
    w, t, hist = run(opt)
    m = v = np.zeros_like(w)
    for got in hist:
        g = grad(w, t)
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
        w = w - 0.05 * (m / (np.sqrt(v) + 1e-6) + 0.01 * w)
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-5)
    excluded = run(mx.optimize.AdamWeightDecayOptimizer(0.05, weight_decay_rate=0.5, exclude_from_weight_decay=["^w$"]))
    plain = run(mx.optimize.AdamWeightDecayOptimizer(0.05))
    np.testing.assert_allclose(excluded[2][-1], plain[2][-1], rtol=1e-6)


@pytest.mark.parametrize("schedule", [False, True], ids=["constant", "warmup"])
def test_adafactor_momentum_is_of_the_scaled_update(schedule):
    """With beta1, the momentum slot keeps the update times the learning rate and the parameter
    scale (Mesh-TensorFlow's `subtrahend`, as tensor2tensor and optax): not the unscaled update
    multiplied by this step's rate (which differs as soon as the parameter RMS or the rate moves)."""
    lr = mx.optimize.linear_warmup(0.1, 3) if schedule else 0.5  # (the parameter RMS moves)
    w, t, hist = run(mx.optimize.AdafactorOptimizer(lr, beta1=0.9, min_dim_size_to_factor=4))
    vr, vc, m = np.zeros(8), np.zeros(4), np.zeros((8, 4))
    for step, got in enumerate(hist, start=1):
        g = grad(w, t)
        decay = 1 - step**-0.8
        g2 = g * g + 1e-30
        vr = decay * vr + (1 - decay) * g2.mean(1)
        vc = decay * vc + (1 - decay) * g2.mean(0)
        x = g / np.sqrt(vr[:, None] / vr.mean()) / np.sqrt(vc[None, :])
        x = x / max(np.sqrt((x * x).mean()), 1.0)
        rate = min(step / 3, 1.0) * 0.1 if schedule else 0.5
        m = 0.9 * m + 0.1 * (x * rate * max(np.sqrt((w * w).mean()), 1e-3))
        w = w - m
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-6)


def test_adafactor_decay_rate_schedules():
    """Mesh-TensorFlow's decay-rate functions, as schedules: adafactor_decay_rate_pow(exponent,
    offset) is 1 - (step - offset + 1)^-exponent, adafactor_decay_rate_adam(beta2) is
    beta2 (1 - beta2^(t - 1)) / (1 - beta2^t) at t = step + 1."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    step = mx.placeholder(mesh, "step", [])
    opt = mx.optimize
    outs = [
        opt.adafactor_decay_rate_pow()(step),
        opt.adafactor_decay_rate_pow(0.5, offset=2)(step),
        opt.adafactor_decay_rate_adam(0.999)(step),
    ]
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:1", "")}).function(outs)
    for s in (2, 3, 6, 99, 5000):  # (from the offset on)
        t = s + 1.0
        want = (1 - t**-0.8, 1 - (t - 2) ** -0.5, 0.999 * (1 - 0.999 ** (t - 1)) / (1 - 0.999**t))
        np.testing.assert_allclose(fn({"step": np.float32(s)}), want, rtol=1e-4, atol=1e-6)  # (float32: 1 - 0.999^t)
    first = fn({"step": np.float32(0)})  # the first step keeps none of the zero-initialized moments
    assert first[0] == 0 and first[2] == 0
    with pytest.raises(mx.ConfigError, match="beta2"):
        opt.adafactor_decay_rate_adam(1.0)


def test_adafactor_with_adam_s_decay_rate_is_optax_adam():
    """decay_rate=adafactor_decay_rate_adam(beta2), not factored, clipped or scaled, without
    momentum: Adam's bias-corrected second moment, so optax's Adam with b1=0 and eps=0."""
    import jax.numpy as jnp
    import optax

    adafactor = mx.optimize.AdafactorOptimizer(
        0.05,
        decay_rate=mx.optimize.adafactor_decay_rate_adam(0.9),
        factored=False,
        clipping_threshold=None,
        multiply_by_parameter_scale=False,
    )
    w, t, hist = run(adafactor)
    adam = optax.adam(0.05, b1=0.0, b2=0.9, eps=0.0)
    w, state = jnp.asarray(w), adam.init(jnp.asarray(w))
    for got in hist:
        updates, state = adam.update(grad(w, t), state)
        w = optax.apply_updates(w, updates)
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("decay", ["schedule", "constant"])
def test_adafactor_takes_mesh_tensorflow_s_decay_rate(decay):
    """decay_rate as Mesh-TensorFlow's: a schedule (here adafactor_decay_rate_pow(0.5)) or a
    constant; given neither, decay_rate_exponent's 1 - (step + 1)^-0.8 (the default test's)."""
    rate = mx.optimize.adafactor_decay_rate_pow(0.5) if decay == "schedule" else 0.5
    w, t, hist = run(mx.optimize.AdafactorOptimizer(decay_rate=rate))
    v = np.zeros_like(w)
    for step, got in enumerate(hist, start=1):
        g = grad(w, t)
        d = 1 - step**-0.5 if decay == "schedule" else 0.5
        v = d * v + (1 - d) * (g * g + 1e-30)
        x = g / np.sqrt(v)
        x = x / max(np.sqrt((x * x).mean()), 1.0)
        w = w - min(0.01, 1 / np.sqrt(step)) * max(np.sqrt((w * w).mean()), 1e-3) * x
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-6)
    with pytest.raises(mx.ConfigError, match="not both"):
        mx.optimize.AdafactorOptimizer(decay_rate=rate, decay_rate_exponent=0.5)
    with pytest.raises(mx.ConfigError, match=r"decay_rate 1\.0 must be in \[0, 1\)"):
        mx.optimize.AdafactorOptimizer(decay_rate=1.0)
    with pytest.raises(mx.ConfigError, match="not a number or a schedule"):
        mx.optimize.AdafactorOptimizer(decay_rate="pow")


@pytest.mark.parametrize("stacked", [True, False])
def test_adafactor_stacked_dims_are_not_factored_and_scale_each_slice(stacked):
    """stacked_dim_names=["s"], as Mesh-TensorFlow's: w [s:16, a:8, b:4] is 16 independent
    [a, b] parameters: its second moments are factored over a and b (not over s and a, its two
    largest dims), and each slice's update is scaled by that slice's RMS (the slices' scales
    differ 16-fold); the clipping is over the whole update. Without: factored over s and a."""
    s = mx.Dimension("s", 16)
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    w = mx.get_variable(mesh, "w", [s, a, b])
    loss = mx.reduce_sum(mx.square(w)) * 0.5 + mx.reduce_sum(w)  # gradient w + 1
    opt = mx.optimize.AdafactorOptimizer(
        0.1, min_dim_size_to_factor=4, clipping_threshold=0.5, stacked_dim_names=["s"] if stacked else None
    )
    updates = opt.apply_grads(mx.gradients(loss, [w]), [w])
    lo = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "s:rows;a:cols")})
    slots = sorted(v.shape.to_integer_list for v in graph.all_variables if v.name.startswith("w/"))
    assert slots == ([[16, 4], [16, 8]] if stacked else [[8, 4], [16, 4]])
    rng = np.random.default_rng(0)
    w_np = (rng.normal(size=(16, 8, 4)) * np.arange(1, 17)[:, None, None]).astype(np.float32)
    lo.set_variable_value(w, w_np)
    fn = lo.function([], updates=updates)
    vr, vc = np.zeros((16, 8) if stacked else (16, 4)), np.zeros((16, 4) if stacked else (8, 4))
    for step in range(1, STEPS + 1):
        fn({})
        g = w_np + 1.0
        g2, d = g * g + 1e-30, 1 - step**-0.8
        if stacked:  # factored over a (the larger) and b
            vr = d * vr + (1 - d) * g2.mean(2)  # [s, a]
            vc = d * vc + (1 - d) * g2.mean(1)  # [s, b]
            x = g / np.sqrt(vr[:, :, None] / vr.mean(1)[:, None, None]) / np.sqrt(vc[:, None, :])
            scale = np.maximum(np.sqrt((w_np * w_np).mean((1, 2))), 1e-3)[:, None, None]
        else:  # factored over s (the largest) and a
            vr = d * vr + (1 - d) * g2.mean(1)  # [s, b]
            vc = d * vc + (1 - d) * g2.mean(0)  # [a, b]
            x = g / np.sqrt(vr[:, None, :] / vr.mean(0)[None, None, :]) / np.sqrt(vc[None, :, :])
            scale = max(np.sqrt((w_np * w_np).mean()), 1e-3)
        x = x / max(np.sqrt((x * x).mean()) / 0.5, 1.0)
        w_np = w_np - 0.1 * scale * x
        np.testing.assert_allclose(lo.variable_value(w), w_np, rtol=1e-4, atol=1e-5)


def test_adafactor_exclude_from_parameter_scale():
    """exclude_from_parameter_scale, as Mesh-TensorFlow's: a variable whose name contains one of
    the strings is updated at the learning rate alone (the default rate, without the 0.05 that
    multiply_by_parameter_scale=False brings); substrings, not regular expressions."""
    w, t, hist = run(mx.optimize.AdafactorOptimizer(exclude_from_parameter_scale=["x", "w"]))
    _check_unfactored_adafactor(w, t, hist, lambda w: 1.0)
    not_excluded = run(mx.optimize.AdafactorOptimizer(exclude_from_parameter_scale=["^w$"]))
    scaled = run(mx.optimize.AdafactorOptimizer())
    np.testing.assert_allclose(not_excluded[2][-1], scaled[2][-1], rtol=1e-6)
    with pytest.raises(mx.ConfigError, match="list of names"):
        mx.optimize.AdafactorOptimizer(exclude_from_parameter_scale="w")


def test_schedules():
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    step = mx.placeholder(mesh, "step", [])
    outs = [
        mx.optimize.linear_warmup(1.0, 10)(step),
        mx.optimize.rsqrt_decay(1.0, 10)(step),
        mx.optimize.linear_decay(1.0, 10, 110)(step),
    ]
    fn = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:1", "")}).function(outs)
    expect = {
        0: (0.1, 0.1, 0.1),
        4: (0.5, 0.5, 0.5),
        9: (1, 1, 1),
        39: (1, 0.5, 71 / 101),
        109: (1, 10**0.5 / 110**0.5, 1 / 101),  # (the last step of 110 still learns)
        110: (1, 10**0.5 / 111**0.5, 0),
    }
    for s, want in expect.items():
        np.testing.assert_allclose(fn({"step": np.float32(s)}), want, rtol=1e-4, atol=1e-6)  # (float32: 1 - 0.999^t)


def test_step_counter_and_clipping():
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    w = mx.get_variable(mesh, "w", [a], initializer=mx.initializers.constant(3.0))
    (g,) = mx.gradients(mx.reduce_sum(mx.square(w)), [w])  # 6 per element, norm 6 * sqrt(8)
    (clipped,) = mx.optimize.clip_by_global_norm([g], 1.0)
    opt = mx.optimize.SgdOptimizer(1.0)
    updates = opt.apply_grads([clipped], [w])
    lo = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "a:all")})
    norm = lo.function(mx.optimize.global_norm([clipped]), updates=updates)()
    np.testing.assert_allclose(norm, 1.0, rtol=1e-5)
    np.testing.assert_allclose(lo.variable_value(w), 3.0 - 1 / np.sqrt(8), rtol=1e-5)
    assert lo.variable_value(opt.step) == 1.0


def test_the_step_counter_is_exact_past_2_to_the_24():
    """The step counter is an int32 (Mesh-TensorFlow's global step is an int64): a float32 one
    stopped at 2^24, where 2^24 + 1 rounds back to 2^24, and the schedules stopped with it. The
    schedules still get the step as a float32."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    w = mx.get_variable(mesh, "w", [a], initializer=mx.initializers.zeros())
    seen = []
    opt = mx.optimize.SgdOptimizer(lambda step: seen.append(step.dtype) or 0.5)
    updates = opt.apply_grads(mx.gradients(mx.reduce_sum(w), [w]), [w])
    assert seen == [np.float32] and opt.step.dtype == np.int32
    lo = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "a:all")})
    lo.set_variable_value(opt.step, np.int32(2**24 - 1))
    fn = lo.function([], updates=updates)
    for _ in range(3):
        fn({})
    assert lo.variable_value(opt.step) == 2**24 + 2
    np.testing.assert_allclose(lo.variable_value(w), -1.5)


@pytest.mark.parametrize(
    "optimizer",
    [
        lambda: mx.optimize.AdamWeightDecayOptimizer(0.01),
        lambda: mx.optimize.AdafactorOptimizer(0.01, multiply_by_parameter_scale=False),
    ],
    ids=["adam", "adafactor"],
)
@pytest.mark.parametrize("shape", ["a:8", "a:8;b:4"], ids=["vector", "matrix"])
def test_a_float16_variable_s_statistics_are_taken_in_float32(optimizer, shape):
    """A float16 variable's gradient of 1e-4 squares to 0 in float16 (its smallest value is 6e-8):
    Adam's second moment, kept in a float32 slot, must not be 0 (an update of m / eps = 1e4
    instead of ~1), nor Adafactor's (0 / 0: NaN). The step is the float32 variable's."""
    after = {}
    for dtype in ("float32", "float16"):
        graph = mx.Graph()
        mesh = mx.Mesh(graph, "mesh")
        w = mx.get_variable(mesh, "w", shape, dtype=dtype, initializer=mx.initializers.ones())
        loss = mx.reduce_sum(mx.cast(w, "float32") * 1e-4)
        updates = optimizer().apply_grads(mx.gradients(loss, [w]), [w])
        lo = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "a:rows")})
        lo.function([], updates=updates)({})
        assert {str(v.dtype) for v in graph.all_variables if v.name not in ("w", "global_step")} == {"float32"}
        after[dtype] = np.asarray(lo.variable_value(w))
    assert after["float16"].dtype == np.float16
    np.testing.assert_allclose(after["float16"].astype(np.float32), after["float32"], rtol=1e-3)
    np.testing.assert_allclose(after["float32"], 0.99, rtol=1e-4)


def test_global_norm_of_float16_gradients_does_not_overflow():
    """1024 float16 gradients of 300: their norm (9600) is a float16, the sum of their squares
    (9.2e7) is not; clipping to norm 1 scales them to 300 / 9600, not to 0."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    w = mx.get_variable(mesh, "w", "a:1024", dtype="float16", initializer=mx.initializers.ones())
    grads = mx.gradients(mx.reduce_sum(mx.cast(w, "float32") * 300.0), [w])
    (clipped,) = mx.optimize.clip_by_global_norm(grads, 1.0)
    assert clipped.dtype == np.float16
    lo = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "a:cols")})
    norm, got = lo.function([mx.optimize.global_norm(grads), clipped])({})
    np.testing.assert_allclose(float(norm), 9600.0, rtol=1e-3)
    np.testing.assert_allclose(np.asarray(got, np.float32), 1 / 32, rtol=1e-3)


def test_one_optimizer_builds_the_training_steps_of_several_graphs():
    """An optimizer keeps its step counter's tensor: given to a second graph, it makes that
    graph's (it gave the first graph's: 'updates must be assign operations of this graph')."""
    from meshax.models.transformer import TransformerConfig
    from meshax.train import LmTask
    from meshax.train.loop import build

    config = TransformerConfig(vocab_size=16, d_model=16, d_ff=32, num_heads=8, d_kv=4, num_layers=1)
    task = LmTask(model=config, source="markov", markov_vocab=16, batch_size=8, length=8)
    optimizer = mx.optimize.SgdOptimizer(0.5)
    first, second = (build(task, "all:8", "batch:all", "simd", optimizer) for _ in range(2))
    losses = [float(p.train_fn(task.train_batch(0))[0]) for p in (first, second)]
    assert losses[0] == losses[1]
    for p in (first, second):
        (counter,) = [v for v in p.lowering.graph.all_variables if v.name == "global_step"]
        assert int(p.lowering.variable_value(counter)) == 1


def test_clipping_at_a_norm_that_is_no_number_above_0_is_refused():
    """clip_by_global_norm at a max_norm <= 0 or NaN is refused: a negative one scaled the
    gradients by a negative factor, so a step went up the loss, silently; NaN made them NaN."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    w = mx.get_variable(mesh, "w", [a], initializer=mx.initializers.constant(3.0))
    (g,) = mx.gradients(mx.reduce_sum(mx.square(w)), [w])
    for bad in (-1.0, 0, float("nan"), "1"):
        with pytest.raises(mx.ConfigError, match=r"clip_by_global_norm: max_norm .* must be a number > 0"):
            mx.optimize.clip_by_global_norm([g], bad)
    for fine in (np.float32(2.0), 3, float("inf"), mx.constant(mesh, 1.0)):
        mx.optimize.clip_by_global_norm([g], fine)


@pytest.mark.parametrize("loss_scaled", [False, True])
def test_a_gradient_that_is_no_tensor_is_named(loss_scaled):
    """apply_grads given a number or an array for a gradient says so; it was an AttributeError
    from inside the update ('float' object has no attribute 'dtype', or 'operation' for a
    LossScaleOptimizer)."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    w = mx.get_variable(mesh, "w", [a])
    optimizer = mx.optimize.SgdOptimizer(0.1)
    if loss_scaled:
        optimizer = mx.optimize.LossScaleOptimizer(optimizer)
        optimizer.scale_loss(mx.reduce_sum(w))
    name = type(optimizer).__name__
    for bad in (1.0, np.ones(8, np.float32)):
        with pytest.raises(
            mx.GraphError, match=rf"{name}.apply_grads: a gradient is (float|ndarray) .*not a meshax Tensor"
        ):
            optimizer.apply_grads([bad], [w])


@pytest.mark.parametrize(
    "optimizer",
    [
        mx.optimize.AdamWeightDecayOptimizer(0.1),
        mx.optimize.AdafactorOptimizer(),
        mx.optimize.LossScaleOptimizer(mx.optimize.SgdOptimizer(0.1)),
    ],
    ids=["adam", "adafactor", "loss scale"],
)
def test_an_optimizers_ops_are_blamed_on_the_line_that_applied_it(optimizer):
    """The ops an optimizer builds (its slots' updates, the counters' collectives) point at the
    user's line, not at meshax/optimize/: the package's modules are meshax's machinery, as
    optimize.py was before it was split."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    w = mx.get_variable(mesh, "w", [a, b])
    loss = mx.reduce_sum(mx.square(w))
    (g,) = mx.gradients(optimizer.scale_loss(loss) if hasattr(optimizer, "scale_loss") else loss, [w])
    built = len(graph.operations)
    optimizer.apply_grads([g], [w])
    sources = {op.source.rsplit(":", 1)[0] for op in graph.operations[built:]}
    assert sources == {__file__}, sources
