"""The gradients' global norm, and clipping by it."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

from meshax.core.errors import ConfigError, GraphError
from meshax.core.graph import Tensor
from meshax.ops import elementwise as ew
from meshax.ops.reduce import reduce_sum


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
