"""The rest of Mesh-TensorFlow's layers: `dense_relu_dense`, `batch_norm`, the sigmoid loss,
`weights_nonzero` and `multiplicative_jitter`."""

from __future__ import annotations

import numpy as np

from meshax import initializers
from meshax.core.errors import GraphError, as_flag
from meshax.core.graph import Tensor
from meshax.core.shape import Dimension, Shape
from meshax.ops import elementwise as ew
from meshax.ops._util import as_dims, dim_of, whole_number
from meshax.ops.random import dropout as _dropout
from meshax.ops.random import random_uniform
from meshax.ops.reduce import reduce_mean
from meshax.ops.variables import assign, get_variable


def dense_relu_dense(
    x: Tensor,
    hidden_channels: Dimension,
    is_training=False,
    dropout=0.0,
    dropout_broadcast_dims=None,
    master_dtype=None,
    slice_dtype=None,
    name=None,
) -> Tensor:
    """dense to `hidden_channels`, relu, dropout (while training), dense back to x's last dim;
    no biases (variables `<name>/wi/kernel`, `<name>/wo/kernel`)."""
    from meshax.layers import _name, dense

    name = _name(x, name, "dense_relu_dense")
    io_channels = x.shape.dims[-1]
    h = dense(x, hidden_channels, use_bias=False, activation=ew.relu, master_dtype=master_dtype, name=f"{name}/wi")
    if is_training and dropout:
        broadcast = {d.name for d in as_dims(dropout_broadcast_dims)}
        h = _dropout(h, rate=dropout, noise_shape=Shape([d for d in h.shape if d.name not in broadcast]))
    return dense(h, io_channels, use_bias=False, master_dtype=master_dtype, name=f"{name}/wo")


def batch_norm(
    x: Tensor,
    is_training: bool,
    momentum: float,
    epsilon: float = 1e-9,
    dims_idx_start: int = 0,
    dims_idx_end: int = -1,
    init_zero: bool = False,
    name=None,
):
    """Batch normalization over x's dims [dims_idx_start, dims_idx_end), as Mesh-TensorFlow's:
    returns (normalized x, the update ops of the moving mean and variance). While training, the
    batch's statistics are used and the moving ones updated (pass the updates to
    `lowering.function(..., updates=...)`); otherwise the moving ones, and no updates."""
    from meshax.layers import _name

    name = _name(x, name, "batch_norm")
    is_training = as_flag(is_training, "batch_norm: is_training", GraphError)
    init_zero = as_flag(init_zero, "batch_norm: init_zero", GraphError)
    normalized = x.shape.dims[dims_idx_start:dims_idx_end]
    kept = Shape([d for d in x.shape if d not in normalized])
    scale = get_variable(
        x.mesh,
        f"{name}/batch_norm_scale",
        kept,
        initializer=initializers.zeros() if init_zero else initializers.ones(),
        activation_dtype=x.dtype,
    )
    bias = get_variable(
        x.mesh, f"{name}/batch_norm_bias", kept, activation_dtype=x.dtype, initializer=initializers.zeros()
    )
    moving_mean = get_variable(
        x.mesh, f"{name}/bn_moving_mean", kept, initializer=initializers.normal(1.0), trainable=False
    )
    moving_variance = get_variable(
        x.mesh, f"{name}/bn_moving_variance", kept, initializer=initializers.ones(), trainable=False
    )
    if not is_training:
        mean, variance = ew.cast(moving_mean, x.dtype), ew.cast(moving_variance, x.dtype)
        return (x - mean) * ew.rsqrt(variance + epsilon) * scale + bias, []
    mean = reduce_mean(x, output_shape=kept)
    variance = reduce_mean(ew.square(x - mean), output_shape=kept)
    updates = [
        assign(moving_mean, moving_mean * momentum + ew.cast(mean, moving_mean.dtype) * (1 - momentum)),
        assign(moving_variance, moving_variance * momentum + ew.cast(variance, moving_variance.dtype) * (1 - momentum)),
    ]
    return (x - mean) * ew.rsqrt(variance + epsilon) * scale + bias, updates


def sigmoid_cross_entropy_with_logits(logits: Tensor, targets: Tensor) -> Tensor:
    """The sigmoid loss per value, stably: relu(x) - x z + log(1 + exp(-|x|))."""
    if logits.shape != targets.shape:
        raise GraphError(f"sigmoid_cross_entropy_with_logits: logits {logits.shape} and targets {targets.shape} differ")
    return ew.relu(logits) - logits * targets + ew.log(ew.exp(-ew.abs(logits)) + 1.0)


def weights_nonzero(targets: Tensor, dtype="float32") -> Tensor:
    """1 where targets is nonzero, else 0 (the loss weights of padded targets)."""
    return ew.cast(ew.not_equal(targets, 0), dtype)


def multiplicative_jitter(x: Tensor, epsilon: float = 1e-2) -> Tensor:
    """x times uniform noise in [1 - epsilon, 1 + epsilon] (robustness to bfloat16 rounding)."""
    if epsilon == 0:
        return x
    return x * random_uniform(x.mesh, x.shape, minval=1.0 - epsilon, maxval=1.0 + epsilon, dtype=x.dtype)


def compress_mean(x: Tensor, dim: Dimension, compression_factor: int) -> Tensor:
    """x with `dim` shrunk by `compression_factor`: each group of that many consecutive entries
    replaced by its mean (the dim keeps its name)."""
    from meshax.ops.shape_ops import replace_dimensions

    dim, compression_factor = dim_of(x, dim), whole_number(compression_factor, "compress_mean: compression_factor")
    if compression_factor < 1 or dim.size % compression_factor:
        raise GraphError(f"compress_mean: compression_factor {compression_factor} does not divide {dim}")
    factor = Dimension("compression_factor", compression_factor)
    grouped = replace_dimensions(x, dim, [Dimension(dim.name, dim.size // compression_factor), factor])
    return reduce_mean(grouped, reduced_dim=factor)


def clip_activation_gradient(x: Tensor, clip_rms_norm=None) -> Tensor:
    """x, whose gradient is scaled down to an RMS of at most `clip_rms_norm` (None: unchanged).
    The RMS is taken in float32 (a float16 gradient's squares overflow), and of the unscaled
    gradient where the loss is scaled (`LossScaleOptimizer`)."""
    from meshax.autodiff import loss_scale
    from meshax.ops.recompute import custom_gradient

    def grad_fn(explicit_inputs, all_inputs, forward_operations, outputs, output_grads):
        if not clip_rms_norm:
            return output_grads
        scale = loss_scale()
        clipped = []
        for g in output_grads:
            wide = ew.widened(g)
            # (unscaled before it is squared: a float32 square overflows past 1.8e19, 2**64 times 1)
            rms = ew.sqrt(reduce_mean(ew.square(wide if scale is None else wide / scale)))
            clipped.append(ew.cast(wide / ew.maximum(rms / clip_rms_norm, 1.0), g.dtype))
        return clipped

    return custom_gradient(ew.identity, grad_fn, [x])


def dense_product(x: Tensor, reduced_dims, new_dims, activation_functions=None, name="dense_product", **kwargs):
    """The product of dense layers of x, one per activation function (a function, its name in
    meshax, or "linear"/None): e.g. a gated unit, ["gelu", "linear"]. `kwargs` go to `dense`."""
    from meshax.layers import _activation, dense

    activations = activation_functions if isinstance(activation_functions, list) else [activation_functions]
    activations = [_activation(a) for a in activations]  # (all checked before any layer is made)
    product = None
    for i, activation in enumerate(activations):
        factor = dense(
            x,
            new_dims,
            reduced_dims=reduced_dims,
            activation=activation,
            name=f"{name}_{i}" if len(activations) > 1 else name,
            **kwargs,
        )
        product = factor if product is None else product * factor
    return product


def corr(x: Tensor, dim: Dimension, epsilon: float = 1e-20, name="pearson_correlation") -> Tensor:
    """The Pearson correlations between the entries of `dim` (x's last dim) over x's other dims:
    [dim_1, dim_2], as Mesh-TensorFlow's. Float16 is taken in float32 and returned in float16."""
    from meshax.ops.einsum import matmul
    from meshax.ops.reduce import reduce_sum
    from meshax.ops.shape_ops import rename_dimension

    if x.dtype == np.float16:  # (as reduce_mean sums it: epsilon is 0 in float16, sums of squares past 65504 inf)
        return ew.cast(corr(ew.cast(x, "float32"), dim, epsilon, name), x.dtype)
    centered = x - reduce_mean(x, output_shape=[dim])
    x1 = rename_dimension(centered, dim.name, f"{dim.name}_1")
    x2 = rename_dimension(centered, dim.name, f"{dim.name}_2")

    def norm(z: Tensor) -> Tensor:
        return ew.sqrt(reduce_sum(ew.square(z), output_shape=z.shape.dims[-1:])) + epsilon

    return matmul(x1, x2) / matmul(norm(x1), norm(x2))


def annealed_dropout(x: Tensor, is_training: bool, start_step, end_step, init_rate=None, noise_shape=None, name=None):
    """Dropout whose rate falls linearly from `init_rate` at `start_step` to 0 at `end_step`,
    counted by the optimizer's step (`global_step`), as Mesh-TensorFlow's; x itself when not
    training."""
    from meshax.ops.variables import global_step

    if init_rate is None:
        raise GraphError("annealed_dropout needs init_rate: the dropout rate at start_step")
    if not is_training:
        return x
    step = ew.cast(global_step(x.mesh), "float32")  # (the counter is an int32)
    fraction = (step - float(start_step)) * (1.0 / (float(end_step) - float(start_step)))
    keep = ew.minimum(fraction * init_rate + (1.0 - init_rate), 1.0)
    shape = x.shape if noise_shape is None else Shape(as_dims(noise_shape))
    noise = ew.cast(ew.less(random_uniform(x.mesh, shape, dtype=x.dtype), ew.cast(keep, x.dtype)), x.dtype)
    return x * (noise / ew.cast(keep, x.dtype))


def unit_scaling_convention(value: bool = False) -> bool:
    """Whether layers follow the unit-scaling convention (Mesh-TensorFlow's gin switch): here,
    as there, the value given (default False)."""
    return value


def us_einsum(xs, *args, **kwargs) -> Tensor:
    """`einsum`, scaled by 1/sqrt(the size of the reduced dims) under the unit-scaling convention."""
    from meshax.ops.einsum import einsum

    y = einsum(xs, *args, **kwargs)
    if unit_scaling_convention():
        reduced = {d for x in xs for d in x.shape if d not in y.shape}
        y = y * Shape(sorted(reduced, key=lambda d: d.name)).size ** -0.5
    return y


def reversible_half_residual_and_swap(x1, x1_backwards, x2, x2_backwards, f, recompute_grads=True):
    """Half a reversible residual layer, as Mesh-TensorFlow's: (x2, x2_backwards, x1 + f(x2),
    x1_backwards). With `recompute_grads`, f's activations are recomputed in the backward pass
    (`recompute_grad`); Mesh-TensorFlow's version also rebuilds x1 from the outputs and passes it
    back through the `_backwards` tensors, which here are passed through unchanged (the values
    and gradients are the same; x1 is kept)."""
    from meshax.ops.inputs import zeros_like
    from meshax.ops.recompute import recompute_grad

    x1_backwards = zeros_like(x1) if x1_backwards is None else x1_backwards
    x2_backwards = zeros_like(x2) if x2_backwards is None else x2_backwards
    fx2 = recompute_grad(f, [x2]) if recompute_grads else f(x2)
    return x2, x2_backwards, x1 + fx2, x1_backwards
