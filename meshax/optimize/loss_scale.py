"""Dynamic loss scaling (`LossScaleOptimizer`), for models computing in float16."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import ml_dtypes

from meshax.core.errors import ConfigError, GraphError
from meshax.core.graph import Tensor, is_floating
from meshax.ops import elementwise as ew
from meshax.ops.reduce import reduce_sum
from meshax.ops.variables import assign, get_variable, updates_only_where
from meshax.optimize.base import Optimizer, check_grads, computed_from, handing_on, names_of

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
        return computed_from(self.scale, tensors)

    def apply_grads(self, grads: Sequence[Tensor | None], variables: Sequence) -> list:
        """The wrapped optimizer's updates from the gradients unscaled, where they are all finite;
        then the scale's. `grads` are those of `scale_loss(loss)`, times the scale: clip them by
        global norm at max_norm times `self.scale` (`clip_by_global_norm(grads, max_norm *
        optimizer.scale)`, the unscaled gradients clipped at max_norm), not at max_norm."""
        if self.scale is None or self.finite_steps is None:
            raise GraphError("LossScaleOptimizer: take the gradients of scale_loss(loss), then apply them")
        check_grads(self, grads)
        given = [(g, v) for g, v in zip(grads, variables) if g is not None]
        unread = [v for (_, v), read in zip(given, self._read_scale([g for g, _ in given])) if not read]
        # gradients of the loss itself, none computed from the scale: unscaled, they would be the
        # scale times too small (one made otherwise beside scaled ones, a frozen weight's zeros, passes)
        if given and len(unread) == len(given):
            raise GraphError(
                f"LossScaleOptimizer.apply_grads: the gradients of {names_of(unread)} are not those of "
                "scale_loss(loss) (they are not computed from the loss scale), and unscaled they would be the "
                "scale times too small: take them of the scaled loss, "
                "mx.gradients(optimizer.scale_loss(loss), variables)"
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
            token = handing_on.set(True)  # (unscaled, though computed from the scale: not refused)
            try:
                updates = self.optimizer.apply_grads(unscaled, variables)
            finally:
                handing_on.reset(token)
        scale, count = self.scale, self.finite_steps
        grow = ew.greater_equal(count + 1, self.growth_interval)
        grown = ew.where(grow, ew.minimum(scale * 2.0, self._largest), scale)
        new_scale = ew.where(finite, grown, ew.maximum(scale * 0.5, self.min_scale))
        new_count = ew.where(finite, ew.where(grow, 0, count + 1), 0)
        return [*updates, assign(scale, new_scale), assign(count, new_count)]
