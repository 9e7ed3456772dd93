"""Learning-rate schedules: functions of the step (the int32 counter as a float32 scalar tensor,
0 at the first step), and Adafactor's decay rates."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import ml_dtypes

from meshax.core.errors import ConfigError
from meshax.core.graph import Tensor
from meshax.ops import elementwise as ew

Schedule = Callable[[Tensor], "Tensor | float"]


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
    as_schedule(learning_rate)  # (a ConfigError for a rate that is no finite number >= 0, as optimizers give)
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


def as_schedule(lr) -> Schedule:
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


def fraction(name: str, value: float) -> float:
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"{name} {value!r} must be in [0, 1)")
    return value


def adafactor_decay_rate_pow(exponent: float = 0.8, offset: int = 0) -> Schedule:
    """Adafactor's second-moment decay rate whose memory grows as step^exponent, as a schedule:
    1 - (step - offset + 1)^-exponent (0 at step `offset`, the first step of a fine-tuning run).
    Mesh-TensorFlow's function of the same name, and Adafactor's default (exponent 0.8)."""
    return lambda step: 1.0 - ew.pow(step + (1.0 - offset), -exponent)


def adafactor_decay_rate_adam(beta2: float) -> Schedule:
    """Adafactor's second-moment decay rate like Adam's, its bias correction folded in, as a
    schedule: beta2 (1 - beta2^(t - 1)) / (1 - beta2^t), t = step + 1 (0 at the first step).
    Mesh-TensorFlow's function of the same name."""
    beta2 = fraction("beta2", beta2)

    def schedule(step):
        t = step + 1.0
        return (1.0 - ew.pow(beta2, t - 1.0)) * beta2 / (1.0 - ew.pow(beta2, t))

    return schedule
