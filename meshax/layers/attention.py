"""Mesh-TensorFlow's attention layers: `dot_product_attention`, `multihead_attention` and its
weights, the masks (additive biases of -1e9 where attention is not allowed), and local
attention within blocks (`masked_local_attention_1d`, halos exchanged between devices).

As in Mesh-TensorFlow, the dims say what attends to what: queries run over `length`, keys and
values over `memory_length` (`rename_length_to_memory_length`), and the logits are not scaled:
the query weights' initialization folds in 1/sqrt(d_kv). `meshax.fused_attention` is the fused
kernel (cuDNN on a GPU) for the same computation with a 1/sqrt(d) scale.
"""

from __future__ import annotations

import ml_dtypes

from meshax import initializers
from meshax.core.errors import GraphError
from meshax.core.graph import Tensor, as_dtype, is_floating
from meshax.core.shape import Dimension, Shape
from meshax.ops import elementwise as ew
from meshax.ops._util import as_dims
from meshax.ops.einsum import einsum
from meshax.ops.indexing import one_hot
from meshax.ops.inputs import constant, zeros
from meshax.ops.inputs import range as mtf_range
from meshax.ops.random import dropout as _dropout
from meshax.ops.reduce import softmax
from meshax.ops.shape_ops import rename_dimension, replace_dimensions, reshape
from meshax.ops.slicing import concat, halo_exchange, left_halo_exchange, pad, unstack
from meshax.ops.variables import get_variable, reuse_variables


def rename_length_to_memory_length(x: Tensor, length_name="length", memory_length_name="memory_length") -> Tensor:
    """x with its dim `length_name` called `memory_length_name` (keys and values run over it)."""
    return rename_dimension(x, length_name, memory_length_name)


def _bias(masked: Tensor, dtype) -> Tensor:
    """-1e9 where `masked` holds, else 0, in `dtype`; in float16, whose -1e9 is -inf (and 0 times
    it NaN), its most negative value, -65504."""
    dtype = as_dtype(dtype)
    return ew.cast(masked, dtype) * (max(-1e9, float(ml_dtypes.finfo(dtype).min)) if is_floating(dtype) else -1e9)


def attention_mask_ignore_padding(inputs: Tensor, dtype="float32") -> Tensor:
    """-1e9 where the (memory) token id is 0, padding: [..., memory_length]."""
    return _bias(ew.equal(rename_length_to_memory_length(inputs), 0), dtype)


def attention_mask_autoregressive(query_pos: Tensor, dtype="float32") -> Tensor:
    """-1e9 where a position would attend to a later one: [..., length, memory_length]."""
    return _bias(ew.less(query_pos, rename_length_to_memory_length(query_pos)), dtype)


def attention_mask_same_segment(query_segment: Tensor, memory_segment=None, dtype="float32") -> Tensor:
    """-1e9 between positions of different segments: [..., length, memory_length]."""
    memory = rename_length_to_memory_length(query_segment if memory_segment is None else memory_segment)
    return _bias(ew.not_equal(query_segment, memory), dtype)


def _dropout_of(x: Tensor, is_training: bool, rate: float, broadcast_dims) -> Tensor:
    if not is_training or not rate:
        return x
    broadcast = {d.name for d in as_dims(broadcast_dims)}
    return _dropout(x, rate=rate, noise_shape=Shape([d for d in x.shape if d.name not in broadcast]))


def dot_product_attention(
    q: Tensor, k: Tensor, v: Tensor, mask, is_training=False, dropout=0.0, dropout_broadcast_dims=None, extra_logit=None
) -> Tensor:
    """softmax(q . k + mask) . v: q [..., length_q, d_k], k [..., length_kv, d_k], v [...,
    length_kv, d_v] -> [..., length_q, d_v]; dropout on the weights while training."""
    length_kv = k.shape.dims[-2]
    logits = einsum([q, k], output_shape=Shape([*q.shape.dims[:-1], length_kv]))
    if mask is not None:
        logits = logits + mask
    weights = softmax(logits, length_kv, extra_logit=extra_logit)
    weights = _dropout_of(weights, is_training, dropout, dropout_broadcast_dims)
    return einsum([weights, v], output_shape=Shape([*q.shape.dims[:-1], v.shape.dims[-1]]))


def multihead_attention_params(
    mesh,
    heads: Dimension,
    io_channels: Dimension,
    kv_channels: Dimension,
    variable_dtype=None,
    combine=False,
    *,
    name: str = "multihead_attention",
) -> list[Tensor]:
    """wq, wk, wv, wo, each [heads, io_channels, kv_channels] (variables `<name>/q` ...), normal
    with Mesh-TensorFlow's scales (q and k: io^-1/2 kv^-1/4, v: io^-1/2, o: (io heads)^-1/2);
    `combine`: one variable `<name>/qkvo` [qkvo, heads, io_channels, kv_channels] unstacked."""
    qk = io_channels.size**-0.5 * kv_channels.size**-0.25
    scales = [qk, qk, io_channels.size**-0.5, (io_channels.size * heads.size) ** -0.5]
    dtype = variable_dtype or "float32"
    shape = [heads, io_channels, kv_channels]
    if combine:
        qkvo = Dimension("qkvo", 4)
        var = _variable(mesh, f"{name}/qkvo", [qkvo, *shape], dtype, initializers.normal(1.0))
        return [w * s for w, s in zip(unstack(var, qkvo), scales)]
    return [_variable(mesh, f"{name}/{n}", shape, dtype, initializers.normal(s)) for n, s in zip("qkvo", scales)]


def _variable(mesh, name: str, shape, dtype, initializer) -> Tensor:
    """The variable `name`: the graph's own if it has one (a decode step shares the weights of
    the layer of the same name, as TensorFlow's variable scopes with reuse do), else a new one."""
    with reuse_variables():
        return get_variable(mesh, name, shape, dtype, initializer=initializer)


def multihead_attention_vars(
    mesh,
    heads,
    io_channels,
    kv_channels,
    master_dtype=None,
    slice_dtype=None,
    activation_dtype=None,
    *,
    name: str = "multihead_attention",
) -> list[Tensor]:
    """wq, wk, wv, wo (`multihead_attention_params`), kept in `master_dtype`, read as `activation_dtype`."""
    ws = multihead_attention_params(mesh, heads, io_channels, kv_channels, master_dtype, name=name)
    return [ew.cast(w, activation_dtype) if activation_dtype is not None else w for w in ws]


def _own_weights(x: Tensor, heads, kv_channels, master_dtype, slice_dtype, name: str) -> list[Tensor]:
    """A layer's wq, wk, wv, wo for input x [..., io_channels], under a name of its own."""
    io_channels = x.shape.dims[-1]
    name = x.graph.unique_name(name)
    return multihead_attention_vars(
        x.mesh, heads, io_channels, kv_channels, master_dtype, slice_dtype, x.dtype, name=name
    )


def multihead_attention(
    query_antecedent: Tensor,
    memory_antecedent,
    mask,
    kv_channels: Dimension,
    heads: Dimension,
    is_training=False,
    dropout=0.0,
    dropout_broadcast_dims=None,
    master_dtype=None,
    slice_dtype=None,
    name="multihead_attention",
) -> Tensor:
    """Multi-head attention with its own weights (variables `<name>/q`, `/k`, `/v`, `/o`):
    query_antecedent [batch..., length, io_channels] attends to memory_antecedent [batch...,
    memory_length, io_channels] (None: to itself) -> [batch..., length, io_channels]."""
    batch_dims = query_antecedent.shape.dims[:-2]
    query_length, io_channels = query_antecedent.shape.dims[-2:]
    name = query_antecedent.graph.unique_name(name)
    wq, wk, wv, wo = multihead_attention_vars(
        query_antecedent.mesh,
        heads,
        io_channels,
        kv_channels,
        master_dtype,
        slice_dtype,
        query_antecedent.dtype,
        name=name,
    )
    if memory_antecedent is None:
        memory_antecedent = rename_length_to_memory_length(query_antecedent, query_length.name)
    memory_length, memory_channels = memory_antecedent.shape.dims[-2:]
    if memory_antecedent.shape.dims[:-2] != batch_dims:
        raise GraphError(f"multihead_attention: memory batch dims {memory_antecedent.shape} differ from the query's")
    if memory_channels != io_channels:
        raise GraphError(
            f"multihead_attention: memory channels {memory_channels} differ from the query's {io_channels}"
        )
    q = einsum([query_antecedent, wq], output_shape=Shape([*batch_dims, heads, query_length, kv_channels]))
    k = einsum([memory_antecedent, wk], output_shape=Shape([*batch_dims, heads, memory_length, kv_channels]))
    v = einsum([memory_antecedent, wv], output_shape=Shape([*batch_dims, heads, memory_length, kv_channels]))
    o = dot_product_attention(q, k, v, mask, is_training, dropout, dropout_broadcast_dims)
    return einsum([o, wo], output_shape=Shape([*batch_dims, query_length, io_channels]))


def local_1d_halo_exchange(k: Tensor, v: Tensor, num_w_blocks, w_dim: Dimension, mask_right: bool):
    """Keys and values of each block of `w_dim` extended by a block of their neighbours' (the
    left one; and the right one unless `mask_right`): a halo exchange over `num_w_blocks` where
    blocks are given, else zero padding of the one block."""
    if num_w_blocks is not None:
        exchange = left_halo_exchange if mask_right else halo_exchange
        return tuple(exchange(t, num_w_blocks, w_dim, w_dim.size) for t in (k, v))
    paddings = [w_dim.size, 0] if mask_right else [w_dim.size, w_dim.size]
    return tuple(pad(t, paddings, w_dim.name) for t in (k, v))


def attention_bias_local_block(mesh, block_length: Dimension, memory_length: Dimension, dtype="int32") -> Tensor:
    """The bias of local attention within blocks, [block_length, memory_length of 2 blocks]: the
    previous block all visible, this block up to the query's own position (-1e9 beyond)."""
    memory = Dimension(memory_length.name, block_length.size)
    earlier = zeros(mesh, [block_length, memory], dtype=dtype)
    later = ew.cast(ew.less(mtf_range(mesh, block_length, dtype), mtf_range(mesh, memory, dtype)), dtype)
    return ew.cast(concat([earlier, later], memory.name), "float32") * -1e9


def masked_local_attention_1d(
    x: Tensor,
    kv_channels: Dimension,
    heads: Dimension,
    is_training=False,
    window_size: int = 128,
    master_dtype=None,
    slice_dtype=None,
    length_per_split=None,
    return_kv=None,
    params=None,
    name=None,
) -> Tensor:
    """Attention from each position to itself and the positions before it within a block, x
    [batch..., length, io_channels] -> the same shape, as Mesh-TensorFlow's: the length is cut
    into blocks (the largest divisor of `length_per_split` up to max(window_size, 128)), whose
    dim keeps the length's name and so its split, and each block's keys and values are extended
    by the `window_size` before it from the block to its left (a halo exchange between devices
    where the length is split). `params`: (wq, wk, wv, wo), else new weights; `return_kv`: a
    list that receives k and v."""
    batch_dims = x.shape.dims[:-2]
    length, io_channels = x.shape.dims[-2:]
    if params is None:
        params = _own_weights(x, heads, kv_channels, master_dtype, slice_dtype, name or "masked_local_attention_1d")
    wq, wk, wv, wo = params
    qkv_shape = Shape([*batch_dims, heads, length, kv_channels])
    q, k, v = (einsum([x, w], output_shape=qkv_shape) for w in (wq, wk, wv))
    if return_kv is not None:
        return_kv.extend([k, v])
    per_split = length_per_split or length.size
    block = max(window_size, 128)
    while per_split % block:
        block -= 1
    query_block = Dimension("query_block_length", block)
    memory_block = Dimension("memory_block_length", block)
    blocks = Dimension(length.name, length.size // block)  # (the length's name: split as it is)
    q = reshape(q, [*batch_dims, heads, blocks, query_block, kv_channels])
    k, v = (reshape(t, [*batch_dims, heads, blocks, memory_block, kv_channels]) for t in (k, v))
    k, v = (left_halo_exchange(t, blocks, memory_block, window_size) for t in (k, v))
    padded = Dimension("memory_block_length", window_size + block)
    mpos = mtf_range(x.mesh, padded, "float32")
    qpos = mtf_range(x.mesh, query_block, "float32") + float(window_size)
    mask = _bias(ew.greater(mpos, qpos), x.dtype)  # not forward
    mask = mask + _bias(ew.less_equal(mpos, qpos - float(block)), x.dtype)  # not a block back or more
    o = dot_product_attention(q, k, v, mask=mask, is_training=is_training)
    o = reshape(o, [*batch_dims, heads, length, kv_channels])
    return einsum([o, wo], output_shape=Shape([*batch_dims, length, io_channels]))


def multihead_self_attention_memory_compressed(
    x: Tensor,
    mask_right: bool,
    compression_factor: int,
    kv_channels: Dimension,
    heads: Dimension,
    is_training=False,
    dropout=0.0,
    dropout_broadcast_dims=None,
    master_dtype=None,
    slice_dtype=None,
    name="multihead_attention",
) -> Tensor:
    """Self-attention to a memory of x shortened by `compression_factor` (group means,
    `compress_mean`), as Mesh-TensorFlow's; `mask_right`: a query sees only the groups that end
    at or before it. x [batch..., length, io_channels] -> the same shape."""
    from meshax.layers.common import compress_mean

    batch_dims = x.shape.dims[:-2]
    length, io_channels = x.shape.dims[-2:]
    wq, wk, wv, wo = _own_weights(x, heads, kv_channels, master_dtype, slice_dtype, name)
    memory = rename_length_to_memory_length(compress_mean(x, length, compression_factor), length.name)
    memory_length = memory.shape.dims[-2]
    q = einsum([x, wq], output_shape=Shape([*batch_dims, heads, length, kv_channels]))
    k, v = (einsum([memory, w], output_shape=Shape([*batch_dims, heads, memory_length, kv_channels])) for w in (wk, wv))
    mask = None
    if mask_right:
        query_pos = mtf_range(x.mesh, length, "int32")
        memory_pos = mtf_range(x.mesh, memory_length, "int32") * compression_factor + (compression_factor - 1)
        mask = _bias(ew.greater(memory_pos, query_pos), x.dtype)
    o = dot_product_attention(q, k, v, mask, is_training, dropout, dropout_broadcast_dims, extra_logit=0.0)
    return einsum([o, wo], output_shape=Shape([*batch_dims, length, io_channels]))


def multihead_self_attention_incremental(
    query_antecedent: Tensor,
    prev_k: Tensor,
    prev_v: Tensor,
    step_num,
    master_dtype=None,
    slice_dtype=None,
    name="multihead_attention",
):
    """One decoding step of self-attention, as Mesh-TensorFlow's: the query at position
    `step_num` (an int32 scalar tensor, or an int) [batch..., io_channels] writes its key and
    value into the caches prev_k, prev_v [batch..., heads, memory_length, kv_channels] (laid out
    like any tensor of theirs) and attends to positions up to its own. The weights are those of
    the layer `name` (`multihead_attention(..., name=name)`'s, shared). Returns (y, new_k, new_v)."""
    batch_dims = query_antecedent.shape.dims[:-1]
    io_channels = query_antecedent.shape.dims[-1]
    heads, memory_length, kv_channels = prev_k.shape.dims[-3:]
    mesh = query_antecedent.mesh
    wq, wk, wv, wo = multihead_attention_vars(
        mesh, heads, io_channels, kv_channels, master_dtype, slice_dtype, query_antecedent.dtype, name=name
    )
    step = step_num if isinstance(step_num, Tensor) else constant(mesh, int(step_num), [], "int32")
    q, k, v = (
        einsum([query_antecedent, w], output_shape=Shape([*batch_dims, heads, kv_channels])) for w in (wq, wk, wv)
    )
    here = one_hot(step, memory_length, dtype=prev_k.dtype)
    k = prev_k + ew.multiply(k, here, output_shape=prev_k.shape)
    v = prev_v + ew.multiply(v, here, output_shape=prev_v.shape)
    mask = _bias(ew.greater(mtf_range(mesh, memory_length, "int32"), step), q.dtype)
    o = dot_product_attention(q, k, v, mask, is_training=False)
    return einsum([o, wo], output_shape=query_antecedent.shape), k, v


def multihead_encdec_attention_incremental(
    query_antecedent: Tensor, wq: Tensor, wo: Tensor, k: Tensor, v: Tensor, mask, name="multihead_attention"
) -> Tensor:
    """One decoding step of attention to the encoder's keys and values k, v [memory dims...,
    heads, memory_length, kv_channels] (computed once), with the layer's wq and wo."""
    heads, _, kv_channels = k.shape.dims[-3:]
    q = einsum([query_antecedent, wq], output_shape=Shape([*query_antecedent.shape.dims[:-1], heads, kv_channels]))
    o = dot_product_attention(q, k, v, mask, is_training=False)
    return einsum([o, wo], output_shape=query_antecedent.shape)


def masked_local_attention_1d_incremental(
    x: Tensor, prev_k: Tensor, prev_v: Tensor, step_num, master_dtype=None, slice_dtype=None, params=None, name=None
):
    """One decoding step of local attention over a window of caches prev_k, prev_v [batch...,
    heads, window_length, kv_channels]: the step's key and value replace the window's entry
    step_num mod window_length, and the query attends to the window. Returns (y, new_k, new_v)."""
    batch_dims, io_channels = x.shape.dims[:-1], x.shape.dims[-1]
    heads, window, kv_channels = prev_k.shape.dims[-3:]
    if params is None:
        params = multihead_attention_vars(
            x.mesh,
            heads,
            io_channels,
            kv_channels,
            master_dtype,
            slice_dtype,
            x.dtype,
            name=name or "masked_local_attention_1d",
        )
    wq, wk, wv, wo = params
    q, k, v = (einsum([x, w], output_shape=Shape([*batch_dims, heads, kv_channels])) for w in (wq, wk, wv))
    step = step_num if isinstance(step_num, Tensor) else constant(x.mesh, int(step_num), [], "int32")
    here = ew.equal(mtf_range(x.mesh, window, "int32"), ew.mod(step, window.size))
    k = ew.where(here, k, prev_k, output_shape=prev_k.shape)
    v = ew.where(here, v, prev_v, output_shape=prev_v.shape)
    o = dot_product_attention(q, k, v, mask=None, is_training=False)
    return einsum([o, wo], output_shape=x.shape), k, v


def local_self_attention_spatial_blocks(
    query_antecedent: Tensor,
    kv_channels: Dimension,
    heads: Dimension,
    is_training=False,
    memory_w_dim=None,
    mask_right=False,
    master_dtype=None,
    slice_dtype=None,
    name=None,
) -> Tensor:
    """Attention within blocks of a sequence laid out as [batch, num_w_blocks, ..., w_dim,
    io_channels], each block also seeing the block before it (and after, unless `mask_right`)
    through a halo exchange over num_w_blocks (so between devices where it is split)."""
    x = query_antecedent
    w_dim, io_channels = x.shape.dims[-2:]
    batch, blocks = x.shape.dims[:2]
    wq, wk, wv, wo = _own_weights(x, heads, kv_channels, master_dtype, slice_dtype, name or "multihead_attention")
    memory = rename_dimension(x, w_dim.name, "memory_" + w_dim.name)
    memory_w = memory.shape.dims[-2]
    q = einsum([x, wq], output_shape=Shape([batch, heads, blocks, w_dim, kv_channels]))
    k, v = (einsum([memory, w], output_shape=Shape([batch, heads, blocks, memory_w, kv_channels])) for w in (wk, wv))
    k, v = local_1d_halo_exchange(k, v, blocks, memory_w, mask_right)
    mask = attention_bias_local_block(x.mesh, w_dim, memory_w) if mask_right else None
    o = dot_product_attention(q, k, v, mask=mask, is_training=is_training)
    return einsum([o, wo], output_shape=Shape([batch, blocks, w_dim, io_channels]))


def local_2d_halo_exchange(k: Tensor, v: Tensor, num_h_blocks, h_dim: Dimension, num_w_blocks, w_dim, mask_right):
    """`local_1d_halo_exchange` along both block dims of an image: height, then width."""
    for blocks, size in ((num_h_blocks, h_dim), (num_w_blocks, w_dim)):
        k, v = local_1d_halo_exchange(k, v, blocks, size, mask_right)
    return k, v


def attention_bias_local_2d_block(mesh, h_dim, w_dim, memory_h_dim, memory_w_dim, dtype="int32") -> Tensor:
    """The bias of causal 2-D local attention, [h_dim, w_dim, memory_h, memory_w] over the
    memory of 2 x 2 blocks (the blocks above-left, above and left, then the query's own): -1e9
    on the positions of the query's own block after it in raster order. (Mesh-TensorFlow's
    version concatenates masks of different shapes and cannot run; this is the mask it means.)"""
    mh = Dimension(memory_h_dim.name, 2 * h_dim.size) if memory_h_dim.size == h_dim.size else memory_h_dim
    mw = Dimension(memory_w_dim.name, 2 * w_dim.size) if memory_w_dim.size == w_dim.size else memory_w_dim
    row = mtf_range(mesh, mh, "int32") - h_dim.size  # (negative: the blocks above)
    col = mtf_range(mesh, mw, "int32") - w_dim.size
    qh, qw = mtf_range(mesh, h_dim, "int32"), mtf_range(mesh, w_dim, "int32")
    own = ew.logical_and(ew.greater_equal(row, 0), ew.greater_equal(col, 0))
    after = ew.logical_or(ew.greater(row, qh), ew.logical_and(ew.equal(row, qh), ew.greater(col, qw)))
    masked = ew.logical_and(own, after, output_shape=[h_dim, w_dim, mh, mw])
    return ew.cast(ew.cast(masked, dtype), "float32") * -1e9


def local_2d_self_attention_spatial_blocks(
    query_antecedent: Tensor,
    kv_channels: Dimension,
    heads: Dimension,
    is_training=False,
    memory_h_dim=None,
    memory_w_dim=None,
    mask_right=False,
    master_dtype=None,
    slice_dtype=None,
    name=None,
) -> Tensor:
    """Attention within 2-D blocks of an image [batch, num_h_blocks, num_w_blocks, h_dim, w_dim,
    io_channels], each block also seeing its neighbours' (above and left; and below and right
    unless `mask_right`) through halo exchanges over the block dims. Each position attends to
    every position of its window (Mesh-TensorFlow's version sums its logits over the memory
    rows: its `dot_product_attention` takes one memory dim; here the window's rows and columns
    are one dim)."""
    x = query_antecedent
    h_dim, w_dim, io_channels = x.shape.dims[-3:]
    batch, h_blocks, w_blocks = x.shape.dims[:3]
    wq, wk, wv, wo = _own_weights(x, heads, kv_channels, master_dtype, slice_dtype, name or "multihead_attention")
    memory = rename_dimension(
        rename_dimension(x, h_dim.name, "memory_" + h_dim.name), w_dim.name, "memory_" + w_dim.name
    )
    memory_h, memory_w = memory.shape.dims[-3:-1]
    q = einsum([x, wq], output_shape=Shape([batch, heads, h_blocks, w_blocks, h_dim, w_dim, kv_channels]))
    kv_shape = Shape([batch, heads, h_blocks, w_blocks, memory_h, memory_w, kv_channels])
    k, v = (einsum([memory, w], output_shape=kv_shape) for w in (wk, wv))
    k, v = local_2d_halo_exchange(k, v, h_blocks, memory_h, w_blocks, memory_w, mask_right)
    # one memory dim of the window's positions (rows x columns), which the attention runs over
    memory_h, memory_w = k.shape.dims[-3:-1]
    window = Dimension("memory_" + h_dim.name + "_" + w_dim.name, memory_h.size * memory_w.size)
    k, v = (replace_dimensions(t, [memory_h, memory_w], window) for t in (k, v))
    mask = None
    if mask_right:
        bias = attention_bias_local_2d_block(x.mesh, h_dim, w_dim, memory_h, memory_w)
        mask = replace_dimensions(bias, bias.shape.dims[-2:], window)
    o = dot_product_attention(q, k, v, mask=mask, is_training=is_training)
    return einsum([o, wo], output_shape=Shape([batch, h_blocks, w_blocks, h_dim, w_dim, io_channels]))
