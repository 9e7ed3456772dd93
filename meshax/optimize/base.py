"""The optimizer base class (a step counter, slot variables beside each parameter, the checks
every `apply_grads` makes) and the plain optimizers: SGD, momentum, Adam."""

from __future__ import annotations

import contextvars
import re
from collections.abc import Sequence

from meshax.core.errors import ConfigError, GraphError, as_flag
from meshax.core.graph import Tensor
from meshax.ops import elementwise as ew
from meshax.ops.variables import VariableOperation, _variable_of, assign, assign_add, get_variable
from meshax.optimize.schedules import as_schedule, fraction


def names_of(variables: Sequence) -> str:
    """The names of the variables, the first three and how many more."""
    more = f" and {len(variables) - 3} more" if len(variables) > 3 else ""
    return ", ".join(_variable_of(v).name for v in variables[:3]) + more


def computed_from(scale: Tensor, tensors: Sequence) -> list[bool]:
    """Whether each tensor is computed from `scale` (tensors of another graph are not)."""
    reading = {scale.operation}
    for op in scale.graph.operations:
        if op not in reading and any(t.operation in reading for t in op.inputs):
            reading.add(op)
    return [t.operation in reading for t in tensors]


# Whether the gradients given to apply_grads are a LossScaleOptimizer's, unscaled (set while it
# hands them on to the optimizer it wraps, whose apply_grads a subclass may override)
handing_on: contextvars.ContextVar[bool] = contextvars.ContextVar("meshax_unscaled_gradients", default=False)


def refuse_scaled(optimizer, grads: Sequence, variables: Sequence) -> None:
    """Gradients of a loss scaled by a `LossScaleOptimizer` (`scale_loss`) given to an optimizer
    directly, the one it wraps say: they carry the scale, so the step would be the scale times too
    far. They are told by being computed from a scale of their graph (`graph.loss_scales`), as no
    gradient of an unscaled loss is; the LossScaleOptimizer hands its unscaled ones on
    (`handing_on`). (So are gradients unscaled by hand: that skips its overflow check and its scale's
    changes, so they are refused as well.)"""
    given = [(g, v) for g, v in zip(grads, variables) if isinstance(g, Tensor)]
    scales = {s for g, _ in given for s in g.graph.loss_scales.values()}
    scaled = [v for s in scales for (_, v), read in zip(given, computed_from(s, [g for g, _ in given])) if read]
    if scaled:
        raise GraphError(
            f"{type(optimizer).__name__}.apply_grads: the gradients of {names_of(scaled)} are those of a loss scaled "
            "by a LossScaleOptimizer (scale_loss(loss)): they carry its scale, and a step with them would be the "
            "scale times too far: apply them with the LossScaleOptimizer (its apply_grads unscales them, skips "
            "the steps that overflow and adjusts the scale)"
        )


def check_grads(optimizer, grads: Sequence) -> None:
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
        self._schedule = as_schedule(learning_rate) if learning_rate is not None else None
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
        the step counter's. Gradients of a loss-scaled loss are refused (`refuse_scaled`), but
        those a `LossScaleOptimizer` hands on, unscaled."""
        check_grads(self, grads)
        if not handing_on.get():
            refuse_scaled(self, grads, variables)
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
        self.momentum = fraction("momentum", momentum)

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
        self.beta_1, self.beta_2, self.epsilon = fraction("beta_1", beta_1), fraction("beta_2", beta_2), epsilon
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
