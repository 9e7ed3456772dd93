"""Uneven splits: between a tensor's logical array and the padded array its slices tile.

A dim of size n split k ways is held as k slices of ceil(n / k), the padding at the end of the
dim (of each block, for a dim split over several mesh dims: `layout.block_sizes`). Users only
ever see the logical array: `pad` and `unpad` convert at the edges (inputs, outputs, variables,
checkpoints), with NumPy on the host or jax.numpy on the devices. Even layouts pass unchanged.
"""

from __future__ import annotations

import numpy as np

from meshax.core.shape import Shape
from meshax.layout import TensorLayout
from meshax.layout.rules import block_sizes, is_padded


def padded_dims(shape: Shape, layout: TensorLayout, mesh_shape: Shape) -> list[int]:
    """Positions of the dims that carry padding in this layout."""
    return [i for i, (d, a) in enumerate(zip(shape, layout.axes)) if is_padded(d.size, a, mesh_shape)]


def _xp(array):
    if isinstance(array, np.ndarray):
        return np
    import jax.numpy as jnp

    return jnp


def _pad_last(x, to: int, xp):
    extra = to - x.shape[-1]
    return xp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)]) if extra else x


def pad(array, shape: Shape, layout: TensorLayout, mesh_shape: Shape):
    """The padded global array of a logical one (the padding is zeros)."""
    xp = _xp(array)
    for i in padded_dims(shape, layout, mesh_shape):
        x = xp.moveaxis(array, i, -1)
        lead, groups = x.shape[:-1], 1
        axes = layout.axes[i]
        for m, block in zip(axes, block_sizes(shape[i].size, axes, mesh_shape)[1:]):
            parts = mesh_shape[m].size
            x = _pad_last(x, parts * block, xp).reshape(*lead, groups * parts, block)
            groups *= parts
        array = xp.moveaxis(x.reshape(*lead, groups * x.shape[-1]), -1, i)
    return array


def unpad(array, shape: Shape, layout: TensorLayout, mesh_shape: Shape):
    """The logical array of a padded global one (`pad`'s inverse)."""
    xp = _xp(array)
    for i in padded_dims(shape, layout, mesh_shape):
        x = xp.moveaxis(array, i, -1)
        lead = x.shape[:-1]
        axes = layout.axes[i]
        blocks = block_sizes(shape[i].size, axes, mesh_shape)
        groups = int(np.prod([mesh_shape[m].size for m in axes]))
        for m, parent in zip(reversed(axes), reversed(blocks[:-1])):
            groups //= mesh_shape[m].size
            width = int(np.prod(x.shape[len(lead) :])) // groups  # (not -1: an empty array cannot infer it)
            x = x.reshape(*lead, groups, width)[..., :parent]
        array = xp.moveaxis(x.reshape(*lead, shape[i].size), -1, i)
    return array


def logical_rows(shape: Shape, layout: TensorLayout, mesh_shape: Shape) -> np.ndarray:
    """For each index of dim 0 of the padded array, the logical row it holds (-1: padding)."""
    first = Shape(shape.dims[:1])
    return pad(np.arange(1, shape[0].size + 1), first, TensorLayout(layout.axes[:1]), mesh_shape) - 1
