"""Mesh-TensorFlow's attention layers: `dot_product_attention`, `multihead_attention` and its
weights, and the masks (additive biases of -1e9 where attention is not allowed).

As in Mesh-TensorFlow, the dims say what attends to what: queries run over `length`, keys and
values over `memory_length` (`rename_length_to_memory_length`), and the logits are not scaled:
the query weights' initialization folds in 1/sqrt(d_kv). `meshax.fused_attention` is the fused
kernel (cuDNN on a GPU) for the same computation with a 1/sqrt(d) scale.
"""

from __future__ import annotations

from meshax import initializers
from meshax.core.errors import GraphError
from meshax.core.graph import Tensor
from meshax.core.shape import Dimension, Shape
from meshax.ops import elementwise as ew
from meshax.ops._util import as_dims
from meshax.ops.einsum import einsum
from meshax.ops.random import dropout as _dropout
from meshax.ops.reduce import softmax
from meshax.ops.shape_ops import rename_dimension
from meshax.ops.slicing import unstack
from meshax.ops.variables import get_variable


def rename_length_to_memory_length(x: Tensor, length_name="length", memory_length_name="memory_length") -> Tensor:
    """x with its dim `length_name` called `memory_length_name` (keys and values run over it)."""
    return rename_dimension(x, length_name, memory_length_name)


def attention_mask_ignore_padding(inputs: Tensor, dtype="float32") -> Tensor:
    """-1e9 where the (memory) token id is 0, padding: [..., memory_length]."""
    return ew.cast(ew.equal(rename_length_to_memory_length(inputs), 0), dtype) * -1e9


def attention_mask_autoregressive(query_pos: Tensor, dtype="float32") -> Tensor:
    """-1e9 where a position would attend to a later one: [..., length, memory_length]."""
    return ew.cast(ew.less(query_pos, rename_length_to_memory_length(query_pos)), dtype) * -1e9


def attention_mask_same_segment(query_segment: Tensor, memory_segment=None, dtype="float32") -> Tensor:
    """-1e9 between positions of different segments: [..., length, memory_length]."""
    memory = rename_length_to_memory_length(query_segment if memory_segment is None else memory_segment)
    return ew.cast(ew.not_equal(query_segment, memory), dtype) * -1e9


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
        var = get_variable(mesh, f"{name}/qkvo", [qkvo, *shape], dtype, initializer=initializers.normal(1.0))
        return [w * s for w, s in zip(unstack(var, qkvo), scales)]
    return [
        get_variable(mesh, f"{name}/{n}", shape, dtype, initializer=initializers.normal(s))
        for n, s in zip("qkvo", scales)
    ]


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
