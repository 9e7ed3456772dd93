"""The paper's two-fully-connected-layer network and the README's MNIST classifier."""

from __future__ import annotations

import math

from meshax import initializers
from meshax.core.graph import Tensor
from meshax.core.shape import Dimension
from meshax.layers import dense
from meshax.ops import elementwise as ew
from meshax.ops.einsum import einsum
from meshax.ops.variables import get_variable


def two_layer(x: Tensor, hidden_dim: Dimension, io_dim: Dimension | None = None, name: str = "") -> Tensor:
    """y = relu(x w + bias) v (paper section 8): x [batch, io] -> y [batch, io].

    Variables `w` [io, hidden], `bias` [hidden] and `v` [hidden, io] (prefixed by `name/`)."""
    io = io_dim or x.shape[-1]
    prefix = f"{name}/" if name else ""
    w = get_variable(x.mesh, prefix + "w", [io, hidden_dim], initializer=initializers.normal(1 / math.sqrt(io.size)))
    bias = get_variable(x.mesh, prefix + "bias", [hidden_dim], initializer=initializers.zeros())
    v = get_variable(
        x.mesh, prefix + "v", [hidden_dim, io], initializer=initializers.normal(1 / math.sqrt(hidden_dim.size))
    )
    h = ew.relu(einsum(x, w, output_shape=[d for d in x.shape if d != io] + [hidden_dim]) + bias)
    return einsum(h, v, output_shape=x.shape)


def mnist_classifier(
    images: Tensor, pixel_dims: list[Dimension], hidden_dim: Dimension, classes_dim: Dimension
) -> Tensor:
    """The README's MNIST model: one hidden relu layer, then logits over `classes_dim`."""
    h = dense(images, hidden_dim, reduced_dims=pixel_dims, activation=ew.relu, name="hidden")
    return dense(h, classes_dim, name="logits")
