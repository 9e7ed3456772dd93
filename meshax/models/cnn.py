"""Convolutional models over named spatial dims: a digits classifier and a U-Net.

Both keep the spatial dims' names through every layer (pooling and upsampling change their
sizes, not their names), so one layout rule, "h:rows;w:cols", splits every activation in
space; the convolutions exchange halos (see `meshax.ops.conv`).
"""

from __future__ import annotations

from meshax.core.graph import Tensor
from meshax.core.shape import Dimension
from meshax.layers import conv2d, conv2d_transpose, conv3d, conv3d_transpose, dense
from meshax.ops import elementwise as ew
from meshax.ops.pool import max_pool2d, max_pool3d
from meshax.ops.slicing import concat


def cnn_classifier(images: Tensor, classes_dim: Dimension, channels: tuple[int, int] = (16, 32)) -> Tensor:
    """images [batch, h, w, channels] -> logits [batch, classes]: two 3x3 convolutions with relu,
    each followed by a 2x2 max pool, then a dense layer over what is left of h, w and channels."""
    x = images
    for i, c in enumerate(channels):
        x = ew.relu(conv2d(x, Dimension(f"conv{i}_channels", c), (3, 3), name=f"conv{i}"))
        x = max_pool2d(x, (2, 2))
    return dense(x, classes_dim, reduced_dims=list(x.shape.dims[1:]), name="logits")


def unet(images: Tensor, classes_dim: Dimension, base_channels: int = 8, depth: int = 2) -> Tensor:
    """A U-Net (Ronneberger et al.; GSPMD section 5.6's 3D U-Net with `images` [batch, d, h, w,
    channels]): at each of `depth` levels two 3x3 convolutions, then a 2x2 max pool; at the
    bottom two more; back up, a strided transposed convolution, the skip connection joined along
    channels, two convolutions; finally a 1x1 convolution to per-voxel logits [batch, spatial...,
    classes]. 2-D when `images` has two spatial dims, 3-D when three."""
    k = images.shape.rank - 2
    conv, up, pool = (conv3d, conv3d_transpose, max_pool3d) if k == 3 else (conv2d, conv2d_transpose, max_pool2d)

    def block(x, c, name):  # (each convolution's output channels get a dim name of their own)
        for j in range(2):
            x = ew.relu(conv(x, Dimension(f"{name}_c{j}", c), (3,) * k, (1,) * k, name=f"{name}/conv{j}"))
        return x

    x, skips = images, []
    for level in range(depth):
        x = block(x, base_channels << level, f"down{level}")
        skips.append(x)
        x = pool(x, (2,) * k)
    x = block(x, base_channels << depth, "bottom")
    for level in reversed(range(depth)):
        skip = skips[level]
        upsampled = up(x, skip.shape[-1], (2,) * k, (2,) * k, name=f"up{level}/upsample")
        x = block(concat([skip, upsampled], skip.shape[-1].name), base_channels << level, f"up{level}")
    return conv(x, classes_dim, (1,) * k, (1,) * k, name="logits")
