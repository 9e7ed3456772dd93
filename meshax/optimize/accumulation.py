"""Gradient accumulation over microbatches (Mesh-TensorFlow's `serialize_training_step`)."""

from __future__ import annotations

from meshax.autodiff import gradients
from meshax.core.errors import GraphError
from meshax.core.shape import Dimension
from meshax.ops.shape_ops import replace_dimensions
from meshax.ops.slicing import entry, stack
from meshax.ops.variables import reuse_variables


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
