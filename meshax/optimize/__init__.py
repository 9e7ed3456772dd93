"""Optimizers and learning-rate schedules, built as graph operations.

`optimizer.apply_grads(grads, variables)` returns assign operations to pass to
`lowering.function(..., updates=...)`. Optimizer state (slots) are variables with the same dims
as their parameter, so they are laid out like it: a split parameter has split slots.
"""

from meshax.optimize.accumulation import serialize_training_step as serialize_training_step
from meshax.optimize.adafactor import AdafactorOptimizer
from meshax.optimize.base import AdamWeightDecayOptimizer, MomentumOptimizer, Optimizer, SgdOptimizer
from meshax.optimize.loss_scale import LOSS_SCALE_SCOPE as LOSS_SCALE_SCOPE
from meshax.optimize.loss_scale import LossScaleOptimizer
from meshax.optimize.norms import clip_by_global_norm, global_norm
from meshax.optimize.schedules import (
    Schedule as Schedule,
)
from meshax.optimize.schedules import (
    adafactor_decay_rate_adam,
    adafactor_decay_rate_pow,
    constant_schedule,
    linear_decay,
    linear_warmup,
    rsqrt_decay,
)

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
