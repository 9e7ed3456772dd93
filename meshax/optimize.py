"""Optimizers and learning-rate schedules, built as graph operations.

`optimizer.apply_grads(grads, variables)` returns assign operations to pass to
`lowering.function(..., updates=...)`. Optimizer state (slots) are variables with the same dims
as their parameter, so they are laid out like it: a split parameter has split slots.
"""

from __future__ import annotations

import contextvars
import math
import numbers
import re
from collections.abc import Callable, Sequence

import ml_dtypes

from meshax.autodiff import gradients
from meshax.core.errors import ConfigError, GraphError, as_flag
from meshax.core.graph import Tensor, is_floating
from meshax.core.shape import Dimension
from meshax.ops import elementwise as ew
from meshax.ops.reduce import reduce_mean, reduce_sum
from meshax.ops.shape_ops import replace_dimensions
from meshax.ops.slicing import entry, stack
from meshax.ops.variables import (
    VariableOperation,
    _variable_of,
    assign,
    assign_add,
    get_variable,
    reuse_variables,
    updates_only_where,
)

Schedule = Callable[[Tensor], "Tensor | float"]


# ---- schedules: functions of the step (the int32 counter as a float32 scalar tensor, 0 at the first step) ----
def constant_schedule(learning_rate: float) -> Schedule:
    """A learning-rate schedule that is `learning_rate` at every step."""
    return lambda step: learning_rate


def linear_warmup(learning_rate: float, warmup_steps: int) -> Schedule:
    """Rises linearly to `learning_rate` over warmup_steps, then stays."""
    return lambda step: ew.minimum((step + 1.0) * (1.0 / max(1, warmup_steps)), 1.0) * learning_rate


def rsqrt_decay(learning_rate: float, warmup_steps: int) -> Schedule:
    """Linear warmup to `learning_rate`, then decay as 1/sqrt(step) (the Transformer's schedule)."""
    w = float(max(1, warmup_steps))

    def schedule(step):
        s = step + 1.0
        return ew.minimum(s * (1.0 / w), ew.rsqrt(ew.maximum(s, w) * (1.0 / w))) * learning_rate

    return schedule


def linear_decay(learning_rate: float, warmup_steps: int, total_steps: int) -> Schedule:
    """Linear warmup to `learning_rate` at step warmup_steps - 1, then linear decay to zero at
    step total_steps: the first step (0) runs at learning_rate / warmup_steps, the last one that
    runs (total_steps - 1) at learning_rate / (total_steps - warmup_steps + 1), not at zero."""
    if callable(learning_rate):
        raise ConfigError(f"linear_decay: learning_rate {learning_rate!r} is a schedule; give the peak rate, a number")
    _as_schedule(learning_rate)  # (a ConfigError for a rate that is no finite number >= 0, as optimizers give)
    for name, steps in (("warmup_steps", warmup_steps), ("total_steps", total_steps)):
        if isinstance(steps, bool) or not isinstance(steps, numbers.Real) or not 0 <= steps < math.inf:
            raise ConfigError(f"linear_decay: {name} {steps!r} is not a number of steps >= 0")
    w, t = float(max(1, warmup_steps)), float(max(total_steps, warmup_steps))

    def schedule(step):
        s = step + 1.0
        up = s * (1.0 / w)
        down = (t + 1.0 - s) * (1.0 / (t + 1.0 - w))
        return ew.maximum(ew.minimum(up, down), 0.0) * learning_rate

    return schedule


def _as_schedule(lr) -> Schedule:
    if callable(lr):
        return lr
    try:
        value = float(lr)
    except (TypeError, ValueError):
        raise ConfigError(f"learning_rate {lr!r} is not a number or a schedule (a function of the step)") from None
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"learning_rate {lr!r} must be a finite number >= 0")
    if value > float(ml_dtypes.finfo("float32").max):  # (it became inf in the step: a NumPy warning, then nan losses)
        raise ConfigError(f"learning_rate {lr!r} is more than a float32 holds (3.4e38): the step computes in float32")
    return constant_schedule(value)


def _fraction(name: str, value: float) -> float:
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"{name} {value!r} must be in [0, 1)")
    return value


def _names(variables: Sequence) -> str:
    """The names of the variables, the first three and how many more."""
    more = f" and {len(variables) - 3} more" if len(variables) > 3 else ""
    return ", ".join(_variable_of(v).name for v in variables[:3]) + more


def _computed_from(scale: Tensor, tensors: Sequence) -> list[bool]:
    """Whether each tensor is computed from `scale` (tensors of another graph are not)."""
    reading = {scale.operation}
    for op in scale.graph.operations:
        if op not in reading and any(t.operation in reading for t in op.inputs):
            reading.add(op)
    return [t.operation in reading for t in tensors]


# Whether the gradients given to apply_grads are a LossScaleOptimizer's, unscaled (set while it
# hands them on to the optimizer it wraps, whose apply_grads a subclass may override)
_handing_on: contextvars.ContextVar[bool] = contextvars.ContextVar("meshax_unscaled_gradients", default=False)


def _refuse_scaled(optimizer, grads: Sequence, variables: Sequence) -> None:
    """Gradients of a loss scaled by a `LossScaleOptimizer` (`scale_loss`) given to an optimizer
    directly, the one it wraps say: they carry the scale, so the step would be the scale times too
    far. They are told by being computed from a scale of their graph (`graph.loss_scales`), as no
    gradient of an unscaled loss is; the LossScaleOptimizer hands its unscaled ones on
    (`_handing_on`). (So are gradients unscaled by hand: that skips its overflow check and its scale's
    changes, so they are refused as well.)"""
    given = [(g, v) for g, v in zip(grads, variables) if isinstance(g, Tensor)]
    scales = {s for g, _ in given for s in g.graph.loss_scales.values()}
    scaled = [v for s in scales for (_, v), read in zip(given, _computed_from(s, [g for g, _ in given])) if read]
    if scaled:
        raise GraphError(
            f"{type(optimizer).__name__}.apply_grads: the gradients of {_names(scaled)} are those of a loss scaled "
            "by a LossScaleOptimizer (scale_loss(loss)): they carry its scale, and a step with them would be the "
            "scale times too far: apply them with the LossScaleOptimizer (its apply_grads unscales them, skips "
            "the steps that overflow and adjusts the scale)"
        )


def _check_grads(optimizer, grads: Sequence) -> None:
    """Refuse a gradient that is no meshax Tensor (nor None), which failed deep in the update."""
    for g in grads:
        if g is not None and not isinstance(g, Tensor):
            raise GraphError(
                f"{type(optimizer).__name__}.apply_grads: a gradient is {type(g).__name__} {g!r:.80}, not a meshax "
                "Tensor: give the gradients mx.gradients(loss, variables) returns (None leaves its variable alone)"
            )


class Optimizer:
    """Base class: keeps a step counter and slot variables next to each parameter."""

    # Whether the optimizer has a rate of its own for `learning_rate=None` (Adafactor's).
    _own_learning_rate = False

    def __init__(self, learning_rate=None):
        if learning_rate is None and not self._own_learning_rate:  # (was a TypeError at apply_grads)
            raise ConfigError(
                f"{type(self).__name__} needs a learning_rate: a number >= 0 or a schedule (a function of the "
                f"step), e.g. {type(self).__name__}(1e-3)"
            )
        self._schedule = _as_schedule(learning_rate) if learning_rate is not None else None
        self.step: Tensor | None = None

    def _slot(self, var: VariableOperation, suffix: str, shape=None) -> Tensor:
        from meshax import initializers

        return get_variable(
            var.mesh,
            f"{var.name}/{suffix}",
            shape if shape is not None else var.shape,
            initializer=initializers.zeros(),
            dtype="float32",
            trainable=False,
        )

    def _step(self, mesh) -> Tensor:
        if self.step is None or self.step.graph is not mesh.graph:  # (an optimizer used for another graph)
            from meshax.ops.variables import global_step

            self.step = global_step(mesh)
        return self.step

    def learning_rate(self, step: Tensor):
        """The learning rate at `step` (a scalar tensor), from the schedule."""
        return self._schedule(step)

    def scale_loss(self, loss: Tensor) -> Tensor:
        """The loss whose gradients `apply_grads` takes: the loss itself (`LossScaleOptimizer` scales it)."""
        return loss

    def apply_grads(self, grads: Sequence[Tensor | None], variables: Sequence) -> list:
        """The update ops of one step: each variable's from its gradient (None: left alone), and
        the step counter's. Gradients of a loss-scaled loss are refused (`_refuse_scaled`), but
        those a `LossScaleOptimizer` hands on, unscaled."""
        _check_grads(self, grads)
        if not _handing_on.get():
            _refuse_scaled(self, grads, variables)
        variables = [_variable_of(v) for v in variables]
        if len(grads) != len(variables):
            raise GraphError(f"apply_grads got {len(grads)} gradients for {len(variables)} variables")
        if not variables:
            return []
        counter = self._step(variables[0].mesh)
        step = ew.cast(counter, "float32")  # (the schedules' step; the int32 counter itself stays exact)
        lr = self.learning_rate(step)
        updates = []
        for g, var in zip(grads, variables):
            if g is None:
                continue
            updates.extend(self.apply_grad(g, var, lr, step))
        updates.append(assign_add(counter, 1))
        return updates

    def apply_grad(self, grad: Tensor, var: VariableOperation, lr, step: Tensor) -> list:
        """The update ops (assigns) of one variable from its gradient; subclasses implement it."""
        raise NotImplementedError(f"{type(self).__name__} must define apply_grad")


class SgdOptimizer(Optimizer):
    def __init__(self, learning_rate):
        super().__init__(learning_rate)

    def apply_grad(self, grad, var, lr, step):
        return [assign(var, var.value - ew.cast(grad * lr, var.dtype))]


class MomentumOptimizer(Optimizer):
    """Heavy-ball momentum: m = momentum * m + g; w -= lr * m."""

    def __init__(self, learning_rate, momentum: float = 0.9):
        super().__init__(learning_rate)
        self.momentum = _fraction("momentum", momentum)

    def apply_grad(self, grad, var, lr, step):
        m = self._slot(var, "momentum")
        new_m = m * self.momentum + grad
        return [assign(m, new_m), assign(var, var.value - ew.cast(new_m * lr, var.dtype))]


class AdamWeightDecayOptimizer(Optimizer):
    """Adam with decoupled weight decay, as BERT's and Mesh-TensorFlow's, but by default with
    bias correction, epsilon 1e-8 and no decay of the variables whose names match "bias" or
    "norm". Mesh-TensorFlow's exactly: `bias_correction=False, epsilon=1e-6,
    exclude_from_weight_decay=()`. `exclude_from_weight_decay`: regular expressions searched
    in each variable's name, as Mesh-TensorFlow's."""

    def __init__(
        self,
        learning_rate,
        weight_decay_rate: float = 0.0,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-8,
        exclude_from_weight_decay: Sequence[str] | None = ("bias", "norm"),
        bias_correction: bool = True,
    ):
        super().__init__(learning_rate)
        self.weight_decay_rate = weight_decay_rate
        self.beta_1, self.beta_2, self.epsilon = _fraction("beta_1", beta_1), _fraction("beta_2", beta_2), epsilon
        self.exclude = tuple(exclude_from_weight_decay or ())
        self.bias_correction = as_flag(bias_correction, "AdamWeightDecayOptimizer: bias_correction")

    def apply_grad(self, grad, var, lr, step):
        m, v = self._slot(var, "adam_m"), self._slot(var, "adam_v")
        grad = ew.widened(grad)
        new_m = m * self.beta_1 + grad * (1.0 - self.beta_1)
        new_v = v * self.beta_2 + ew.square(grad) * (1.0 - self.beta_2)
        m_hat, v_hat = new_m, new_v
        if self.bias_correction:
            t = step + 1.0
            m_hat, v_hat = new_m / (1.0 - ew.pow(self.beta_1, t)), new_v / (1.0 - ew.pow(self.beta_2, t))
        update = m_hat / (ew.sqrt(v_hat) + self.epsilon)
        if self.weight_decay_rate and not any(re.search(e, var.name) for e in self.exclude):
            update = update + var.value * self.weight_decay_rate
        return [assign(m, new_m), assign(v, new_v), assign(var, var.value - ew.cast(update * lr, var.dtype))]


def adafactor_decay_rate_pow(exponent: float = 0.8, offset: int = 0) -> Schedule:
    """Adafactor's second-moment decay rate whose memory grows as step^exponent, as a schedule:
    1 - (step - offset + 1)^-exponent (0 at step `offset`, the first step of a fine-tuning run).
    Mesh-TensorFlow's function of the same name, and Adafactor's default (exponent 0.8)."""
    return lambda step: 1.0 - ew.pow(step + (1.0 - offset), -exponent)


def adafactor_decay_rate_adam(beta2: float) -> Schedule:
    """Adafactor's second-moment decay rate like Adam's, its bias correction folded in, as a
    schedule: beta2 (1 - beta2^(t - 1)) / (1 - beta2^t), t = step + 1 (0 at the first step).
    Mesh-TensorFlow's function of the same name."""
    beta2 = _fraction("beta2", beta2)

    def schedule(step):
        t = step + 1.0
        return (1.0 - ew.pow(beta2, t - 1.0)) * beta2 / (1.0 - ew.pow(beta2, t))

    return schedule


class AdafactorOptimizer(Optimizer):
    """Adafactor (Shazeer & Stern, 2018), as Mesh-TensorFlow's: second moments factored over a
    variable's two largest dims where both have at least `min_dim_size_to_factor` values; with
    `beta1`, a momentum of the scaled update.

    Without a learning rate it uses min(0.01, 1/sqrt(step + 1)), times the parameter's RMS
    (`multiply_by_parameter_scale`), else times 0.05. The second moments decay at
    1 - (step + 1)^-decay_rate_exponent, unless `decay_rate` is given: Mesh-TensorFlow's
    argument, a schedule (a function of the step, as `adafactor_decay_rate_pow(0.8)`, the
    default, or `adafactor_decay_rate_adam(beta2)`) or a constant in [0, 1). (Mesh-TensorFlow's
    arguments, by keyword: its first positional one is `multiply_by_parameter_scale`, meshax's
    `learning_rate`.)

    As Mesh-TensorFlow's: the variables whose names contain one of the strings in
    `exclude_from_parameter_scale` (substrings, not patterns) are not multiplied by the parameter
    scale; the dims named in `stacked_dim_names` stack independent parameters, so they are never
    factored over, and the parameter scale is taken for each of their slices (the clipping, over
    the whole update, as there)."""

    _own_learning_rate = True

    def __init__(
        self,
        learning_rate=None,
        decay_rate_exponent: float = 0.8,
        beta1: float = 0.0,
        epsilon1: float = 1e-30,
        epsilon2: float = 1e-3,
        clipping_threshold: float | None = 1.0,
        factored: bool = True,
        multiply_by_parameter_scale: bool = True,
        min_dim_size_to_factor: int = 128,
        decay_rate: Schedule | float | None = None,
        stacked_dim_names: Sequence[str] | None = None,
        exclude_from_parameter_scale: Sequence[str] | None = None,
    ):
        super().__init__(learning_rate)
        if decay_rate is None:
            decay_rate = adafactor_decay_rate_pow(decay_rate_exponent)
        elif decay_rate_exponent != 0.8:
            raise ConfigError("give Adafactor decay_rate or decay_rate_exponent, not both")
        elif not callable(decay_rate):
            try:
                decay_rate = float(decay_rate)
            except (TypeError, ValueError):
                raise ConfigError(
                    f"decay_rate {decay_rate!r} is not a number or a schedule (a function of the step)"
                ) from None
            decay_rate = _fraction("decay_rate", decay_rate)
        self.decay_rate = decay_rate if callable(decay_rate) else constant_schedule(decay_rate)
        self.beta1 = beta1
        self.epsilon1, self.epsilon2 = epsilon1, epsilon2
        self.clipping_threshold = clipping_threshold
        self.factored = as_flag(factored, "AdafactorOptimizer: factored")
        self.multiply_by_parameter_scale = as_flag(
            multiply_by_parameter_scale, "AdafactorOptimizer: multiply_by_parameter_scale"
        )
        self.min_dim_size_to_factor = min_dim_size_to_factor
        for name, names in (
            ("stacked_dim_names", stacked_dim_names),
            ("exclude_from_parameter_scale", exclude_from_parameter_scale),
        ):
            if isinstance(names, str):
                raise ConfigError(f"{name} {names!r} must be a list of names, not one string")
        self.stacked_dim_names = tuple(stacked_dim_names or ())
        self.exclude_from_parameter_scale = tuple(exclude_from_parameter_scale or ())

    def learning_rate(self, step):
        """The schedule's rate if one was given, else min(1/sqrt(step + 1), 0.01) (the paper's
        default), times 0.05 without the parameter scale (Mesh-TensorFlow's)."""
        if self._schedule is not None:
            return self._schedule(step)
        rate = ew.minimum(ew.rsqrt(step + 1.0), 0.01)
        return rate if self.multiply_by_parameter_scale else rate * 0.05

    def _factored_dims(self, shape):
        """The two largest dims not stacked (the first of them the largest), or None: not factored."""
        dims = [d for d in shape.dims if d.name not in self.stacked_dim_names]
        if not self.factored or len(dims) < 2:
            return None
        d0, d1 = sorted(dims, key=lambda d: -d.size)[:2]  # (on ties, the first: Mesh-TensorFlow's)
        return (d0, d1) if d1.size >= self.min_dim_size_to_factor else None

    def apply_grad(self, grad, var, lr, step):
        from meshax.core.shape import Shape

        grad = ew.widened(grad)
        decay = self.decay_rate(step)
        gsq = ew.square(grad) + self.epsilon1
        updates = []
        dims = self._factored_dims(var.shape)
        if dims:
            d0, d1 = dims
            vr = self._slot(var, "adafactor_vr", Shape([d for d in var.shape if d != d1]))
            vc = self._slot(var, "adafactor_vc", Shape([d for d in var.shape if d != d0]))
            new_vr = vr * decay + reduce_mean(gsq, reduced_dim=d1) * (1.0 - decay)
            new_vc = vc * decay + reduce_mean(gsq, reduced_dim=d0) * (1.0 - decay)
            updates += [assign(vr, new_vr), assign(vc, new_vc)]
            row_mean = reduce_mean(new_vr, reduced_dim=d0)
            x = grad * ew.rsqrt(new_vr / row_mean) * ew.rsqrt(new_vc)
        else:
            v = self._slot(var, "adafactor_v")
            new_v = v * decay + gsq * (1.0 - decay)
            updates.append(assign(v, new_v))
            x = grad * ew.rsqrt(new_v)
        if self.clipping_threshold is not None:
            rms = ew.sqrt(reduce_mean(ew.square(x)))
            x = x / ew.maximum(rms * (1.0 / self.clipping_threshold), 1.0)
        if self.multiply_by_parameter_scale and not any(s in var.name for s in self.exclude_from_parameter_scale):
            stacked = Shape([d for d in var.shape if d.name in self.stacked_dim_names])  # (a scale per slice)
            ms = reduce_mean(ew.square(ew.cast(var.value, "float32")), output_shape=stacked)
            lr = lr * ew.maximum(ew.sqrt(ms), self.epsilon2)
        subtrahend = x * lr
        if self.beta1:  # the momentum of the scaled update, as Mesh-TensorFlow's (and optax's) keeps
            m = self._slot(var, "adafactor_m")
            subtrahend = m * self.beta1 + subtrahend * (1.0 - self.beta1)
            updates.append(assign(m, subtrahend))
        updates.append(assign(var, var.value - ew.cast(subtrahend, var.dtype)))
        return updates


LOSS_SCALE_SCOPE = "loss_scale"  # LossScaleOptimizer's variables: the scale and the count of finite steps


class LossScaleOptimizer(Optimizer):
    """Dynamic loss scaling around `optimizer`, for a model computing in float16, whose gradients
    underflow to zero below 6e-8 and overflow above 65504: the loss is multiplied by a scale
    before its gradients are taken (`scale_loss`), and the gradients are divided by it, in float32,
    before `optimizer` updates with them. A step whose gradients are not all finite changes
    nothing (weights, optimizer state and its step counter: `updates_only_where`) and halves the
    scale (not below `min_scale`); after `growth_interval` finite steps in a row the scale
    doubles, up to the largest power of two the loss's dtype holds (2**127 for a float32 loss,
    2**15 for a float16 one: the loss's gradient is the scale, in its dtype). The scale (float32,
    logged as "loss_scale" at every step) and the count of finite steps are variables, so
    checkpoints keep them. Scales are powers of two: where nothing overflows, scaling and
    unscaling are exact (with SGD the step is the unscaled one to the bit; XLA may round other
    updates' fused kernels differently). `meshax.train` wraps its optimizer in one where the
    model computes in float16."""

    def __init__(
        self,
        optimizer: Optimizer,
        initial_scale: float = 2.0**15,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
    ):
        if not isinstance(optimizer, Optimizer) or isinstance(optimizer, LossScaleOptimizer):
            raise ConfigError(f"LossScaleOptimizer wraps a meshax optimizer (not a loss-scaled one), got {optimizer!r}")
        for name, value in (("initial_scale", initial_scale), ("min_scale", min_scale)):
            # (above 2**127 the float32 scale is inf: every step skipped, and inf halved stays inf)
            number = isinstance(value, numbers.Real) and not isinstance(value, bool)
            if not (number and 1 <= value <= 2.0**127 and math.frexp(value)[0] == 0.5):
                raise ConfigError(
                    f"{name} {value!r} must be a power of two >= 1 and <= 2**127 (so that scaling is exact, "
                    "and the float32 scale finite)"
                )
        if initial_scale < min_scale:
            raise ConfigError(f"initial_scale {initial_scale!r} is below min_scale {min_scale!r}")
        whole = isinstance(growth_interval, numbers.Integral) and not isinstance(growth_interval, bool)
        if not whole or growth_interval < 1:
            raise ConfigError(f"growth_interval {growth_interval!r} must be a whole number of steps >= 1")
        if growth_interval > 2**31 - 1:  # (an int32 in the step: 2**31 wrapped to -2**31, growing every step)
            raise ConfigError(
                f"growth_interval {growth_interval!r} must be at most 2**31 - 1 (the count of finite steps is an int32)"
            )
        self.optimizer = optimizer
        self.initial_scale, self.min_scale = float(initial_scale), float(min_scale)
        self.growth_interval = int(growth_interval)  # (a NumPy integer too)
        self.scale: Tensor | None = None
        self.finite_steps: Tensor | None = None
        self._largest = 2.0**127  # (the largest scale the loss's dtype holds: `scale_loss`)

    @property
    def step(self) -> Tensor | None:  # type: ignore[override]
        """The wrapped optimizer's step counter (it counts the steps that updated)."""
        return self.optimizer.step

    def learning_rate(self, step: Tensor):
        return self.optimizer.learning_rate(step)

    def scale_loss(self, loss: Tensor) -> Tensor:
        """`loss` times the scale: take the gradients of this, then give them to `apply_grads`."""
        from meshax import initializers
        from meshax.ops.debug import log_scalar

        if is_floating(loss.dtype):  # (the loss's gradient is the scale, in the loss's dtype)
            self._largest = min(2.0**127, 2.0 ** math.floor(math.log2(float(ml_dtypes.finfo(loss.dtype).max))))
            if self.min_scale > self._largest:  # (every step's gradient would overflow, and be skipped)
                raise ConfigError(
                    f"min_scale {self.min_scale!r} is above 2**{math.log2(self._largest):.0f}, the largest scale a "
                    f"{loss.dtype} loss holds (its gradient is the scale, in {loss.dtype}), so every step would be "
                    f"skipped: give a min_scale of at most {self._largest!r}, or compute the loss in float32"
                )
        if self.scale is None or self.scale.graph is not loss.graph:
            if any(v.name.startswith(f"{LOSS_SCALE_SCOPE}/") for v in loss.graph.all_variables):
                raise GraphError(  # (it failed making the variable: "'loss_scale/scale' already exists")
                    "LossScaleOptimizer.scale_loss: another LossScaleOptimizer scales a loss of this graph "
                    "already (one loss scale per graph): use that one, or add the losses and scale their sum"
                )
            scalar = lambda name, init, dtype: get_variable(  # noqa: E731
                loss.mesh, f"{LOSS_SCALE_SCOPE}/{name}", [], initializer=init, dtype=dtype, trainable=False
            )
            self.scale = log_scalar("loss_scale", scalar("scale", initializers.constant(self.initial_scale), "float32"))
            self.finite_steps = scalar("finite_steps", initializers.zeros(), "int32")
        elif self._read_scale([loss])[0]:  # (its gradients would be scale**2 times, unscaled once)
            raise GraphError(
                f"LossScaleOptimizer.scale_loss: {loss.name} is scaled already (it is computed from the loss "
                "scale): scale the loss once, and take the gradients of that"
            )
        scaled = loss * ew.cast(self.scale, loss.dtype)
        loss.graph.loss_scales[scaled] = self.scale
        return scaled

    def _read_scale(self, tensors: Sequence[Tensor]) -> list[bool]:
        """Whether each tensor is computed from the scale (tensors of another graph are not)."""
        assert self.scale is not None
        return _computed_from(self.scale, tensors)

    def apply_grads(self, grads: Sequence[Tensor | None], variables: Sequence) -> list:
        """The wrapped optimizer's updates from the gradients unscaled, where they are all finite;
        then the scale's. `grads` are those of `scale_loss(loss)`, times the scale: clip them by
        global norm at max_norm times `self.scale` (`clip_by_global_norm(grads, max_norm *
        optimizer.scale)`, the unscaled gradients clipped at max_norm), not at max_norm."""
        if self.scale is None or self.finite_steps is None:
            raise GraphError("LossScaleOptimizer: take the gradients of scale_loss(loss), then apply them")
        _check_grads(self, grads)
        given = [(g, v) for g, v in zip(grads, variables) if g is not None]
        unread = [v for (_, v), read in zip(given, self._read_scale([g for g, _ in given])) if not read]
        # gradients of the loss itself, none computed from the scale: unscaled, they would be the
        # scale times too small (one made otherwise beside scaled ones, a frozen weight's zeros, passes)
        if given and len(unread) == len(given):
            raise GraphError(
                f"LossScaleOptimizer.apply_grads: the gradients of {_names(unread)} are not those of scale_loss(loss) "
                "(they are not computed from the loss scale), and unscaled they would be the scale times too "
                "small: take them of the scaled loss, mx.gradients(optimizer.scale_loss(loss), variables)"
            )
        # divided, not multiplied by 1 / scale: 2**-127 is a float32 subnormal, which XLA flushes to 0
        unscaled = [None if g is None else ew.widened(g) / self.scale for g in grads]
        # a sum is finite where every value summed is (an inf or a NaN among them stays one). The
        # sums of gradients of one shape, laid out alike, owe the same partial sums: added first,
        # they are settled together, one scalar allreduce per shape split, not per weight
        by_shape: dict = {}
        for g in unscaled:
            if g is not None:
                by_shape.setdefault(g.shape, []).append(reduce_sum(g))
        if not by_shape:
            raise GraphError("LossScaleOptimizer: no gradients to apply")
        finite = ew.less(ew.abs(ew.add_n([ew.add_n(sums) for sums in by_shape.values()])), math.inf)
        with updates_only_where(finite):
            token = _handing_on.set(True)  # (unscaled, though computed from the scale: not refused)
            try:
                updates = self.optimizer.apply_grads(unscaled, variables)
            finally:
                _handing_on.reset(token)
        scale, count = self.scale, self.finite_steps
        grow = ew.greater_equal(count + 1, self.growth_interval)
        grown = ew.where(grow, ew.minimum(scale * 2.0, self._largest), scale)
        new_scale = ew.where(finite, grown, ew.maximum(scale * 0.5, self.min_scale))
        new_count = ew.where(finite, ew.where(grow, 0, count + 1), 0)
        return [*updates, assign(scale, new_scale), assign(count, new_count)]


def global_norm(grads: Sequence[Tensor | None]) -> Tensor:
    """sqrt of the sum of squares of all gradients, for clipping and logging."""
    total = None
    for g in grads:
        if g is None:
            continue
        s = reduce_sum(ew.square(ew.widened(g)))
        total = s if total is None else total + s
    if total is None:
        raise GraphError("global_norm of no gradients: give at least one gradient")
    return ew.sqrt(total)


def clip_by_global_norm(grads: Sequence[Tensor | None], max_norm: float | Tensor) -> list[Tensor | None]:
    """The gradients scaled down together so that their global norm is at most `max_norm`. The
    gradients of a `LossScaleOptimizer`'s scaled loss are clipped at max_norm times its scale.
    Where the norm overflows float32 (squares past 3e38: gradients times a scale past 2**64), the
    gradients are NaN, not 0: a `LossScaleOptimizer` skips the step and halves its scale."""
    if not isinstance(max_norm, Tensor) and not (
        isinstance(max_norm, numbers.Real) and not isinstance(max_norm, bool) and max_norm > 0
    ):  # (a negative one turned the gradients around: a step up the loss; nan made them nan)
        raise ConfigError(f"clip_by_global_norm: max_norm {max_norm!r} must be a number > 0 (or a scalar tensor)")
    norm = global_norm(grads)
    scale = ew.minimum(max_norm / ew.maximum(norm, 1e-12), 1.0)
    scale = ew.where(ew.less(norm, math.inf), scale, math.nan)  # (0 took an empty step, and the scale grew on)
    return [None if g is None else g * ew.cast(scale, g.dtype) for g in grads]


__all__ = [
    "AdafactorOptimizer",
    "AdamWeightDecayOptimizer",
    "LossScaleOptimizer",
    "MomentumOptimizer",
    "Optimizer",
    "SgdOptimizer",
    "adafactor_decay_rate_adam",
    "adafactor_decay_rate_pow",
    "clip_by_global_norm",
    "constant_schedule",
    "global_norm",
    "linear_decay",
    "linear_warmup",
    "rsqrt_decay",
]


def serialize_training_step(features: dict, model_fn, batch_dim, num_splits: int, scale_loss=None):
    """Gradient accumulation, as Mesh-TensorFlow's: `model_fn(features)` (a dict with a "loss")
    on each of `num_splits` microbatches of `batch_dim` (rows m, m + num_splits, ...), sharing
    its variables; returns (the gradients of the loss for `graph.trainable_variables`, summed
    over the microbatches; model_fn's outputs, those with the batch dim put back together, the
    rest summed). The microbatches run one after another in one program, unrolled.
    `scale_loss`: a function of each microbatch's loss whose gradients are taken instead
    (`LossScaleOptimizer.scale_loss`: float16 training; give the gradients to its `apply_grads`);
    the outputs keep the loss itself."""
    if batch_dim.size % num_splits:
        raise GraphError(f"serialize_training_step: {num_splits} microbatches do not divide {batch_dim}")
    micro = Dimension("microbatch", num_splits)
    smaller = Dimension(batch_dim.name, batch_dim.size // num_splits)
    graph = next(iter(features.values())).graph
    grads_sum, outputs_per = None, []
    for i in range(num_splits):
        mine = {k: entry(replace_dimensions(t, batch_dim, [smaller, micro]), i, micro) for k, t in features.items()}
        if i == 0:
            outputs = model_fn(mine)
        else:
            with reuse_variables():
                outputs = model_fn(mine)
        variables = [v.value for v in graph.trainable_variables]
        loss = outputs["loss"] if scale_loss is None else scale_loss(outputs["loss"])
        grads = gradients([loss], variables)
        grads_sum = (
            grads
            if grads_sum is None
            else [a if b is None else b if a is None else a + b for a, b in zip(grads_sum, grads)]
        )
        outputs_per.append(outputs)
    combined = {}
    for k in outputs_per[0]:
        parts = [o[k] for o in outputs_per]
        if smaller in parts[0].shape:
            combined[k] = replace_dimensions(
                stack(parts, micro.name, parts[0].shape.index(smaller) + 1), [smaller, micro], batch_dim
            )
        else:
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            combined[k] = total
    return grads_sum, combined
