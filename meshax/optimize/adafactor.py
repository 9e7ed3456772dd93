"""Adafactor (Shazeer & Stern, 2018), as Mesh-TensorFlow's."""

from __future__ import annotations

from collections.abc import Sequence

from meshax.core.errors import ConfigError, as_flag
from meshax.ops import elementwise as ew
from meshax.ops.reduce import reduce_mean
from meshax.ops.variables import assign
from meshax.optimize.base import Optimizer
from meshax.optimize.schedules import Schedule, adafactor_decay_rate_pow, constant_schedule, fraction


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
            decay_rate = fraction("decay_rate", decay_rate)
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
