"""Mixture of experts: Mesh-TensorFlow's `transformer_moe_layer_v1` with GShard's top-2 gating.

Tokens are cut into groups of `group_size` (the last dim before the model dim is cut into
[chunks, group]); within each group a gate sends every token to its top-1 or top-2 experts, at
most `capacity` tokens per expert and group, capacity = floor(capacity_factor * group_size /
experts): tokens past it are dropped (the layer passes zeros for them, and the
residual around it carries them). Routing is by two tensors [groups..., group, expert_unsplit,
expert_capacity]: `dispatch` (0/1) gathers each expert's inputs with an einsum, `combine`
(the gate weights) scatters the outputs back.

Parallelism is in the names. The groups keep the batch dim's name, so they are split as the
batch is; the experts' own tensors carry `experts` and `<batch>_unsplit` instead, so a layout
that puts `batch` and `experts` on one mesh dim (GSPMD Table 6) turns the change of names into
one all-to-all each way: per layer and direction, each device sends its slice of
[experts E, groups G, capacity C, d_model M], E*G*C*M / n values for n devices on that mesh
dim. Any other mesh dim can split `expert_hidden` and the dense layers (Table 7's hybrid), or
leave experts replicated over an outer batch.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

from meshax import initializers
from meshax.core.errors import GraphError, as_flag
from meshax.core.graph import Tensor
from meshax.core.shape import Dimension
from meshax.ops import elementwise as ew
from meshax.ops.einsum import einsum
from meshax.ops.indexing import one_hot
from meshax.ops.random import random_uniform
from meshax.ops.reduce import argmax, reduce_max, reduce_mean, reduce_sum, softmax
from meshax.ops.shape_ops import rename_dimension, replace_dimensions, reshape
from meshax.ops.slicing import cumsum
from meshax.ops.variables import get_variable

GATINGS = ("top_1", "top_2")
SECOND_POLICIES = ("all", "none", "threshold", "random")


class MoeOutput(NamedTuple):
    """The layer's output (x's shape), its load-balancing loss (a scalar: 1.0 when routing is
    perfectly balanced; add `coef * loss` to the training loss) and the fraction of the routing
    assignments (first choices, and the second choices the policy keeps) dropped at capacity."""

    output: Tensor
    loss: Tensor
    dropped_fraction: Tensor


def expert_capacity(group_size: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens each expert takes from a group: floor(capacity_factor * group_size / experts), at
    most the group (Mesh-TensorFlow's rule; `moe` refuses settings that make it 0)."""
    return min(group_size, int(group_size * capacity_factor / num_experts))


def _top_1(gates: Tensor, dim: Dimension) -> tuple[Tensor, Tensor]:
    return argmax(gates, dim), reduce_max(gates, reduced_dim=dim)


def _gating(gates, group, experts, capacity, gating, second_policy, second_threshold):
    """(combine, dispatch, loss, dropped) from softmaxed gates [..., group, experts]."""
    index_1, gate_1 = _top_1(gates, experts)
    mask_1 = one_hot(index_1, experts, dtype=gates.dtype)
    density = reduce_mean(mask_1, reduced_dim=group)
    proxy = reduce_mean(gates, reduced_dim=group)
    loss = reduce_mean(density * proxy) * float(experts.size**2)
    choices = [(index_1, gate_1, mask_1)]
    if gating == "top_2":
        index_2, gate_2 = _top_1(gates * (1.0 - mask_1), experts)
        mask_2 = one_hot(index_2, experts, dtype=gates.dtype)
        denom = gate_1 + gate_2 + 1e-9
        gate_1, gate_2 = gate_1 / denom, gate_2 / denom
        if second_policy == "none":
            mask_2 = mask_2 * 0.0
        elif second_policy == "threshold":
            mask_2 = mask_2 * ew.cast(ew.greater(gate_2, second_threshold), gates.dtype)
        elif second_policy == "random":
            draw = random_uniform(gates.mesh, gate_2.shape, dtype=gates.dtype)
            mask_2 = mask_2 * ew.cast(ew.less(draw, gate_2 / max(second_threshold, 1e-9)), gates.dtype)
        choices = [(index_1, gate_1, mask_1), (index_2, gate_2, mask_2)]
    combine, wanted, kept, before = None, None, None, None
    for index, gate, mask in choices:
        wanted = reduce_sum(mask) if wanted is None else wanted + reduce_sum(mask)
        position = cumsum(mask, group, exclusive=True)
        if before is not None:
            position = position + before  # second choices queue behind every first choice
        position = position * mask
        mask = mask * ew.cast(ew.less(position, float(capacity.size)), gates.dtype)
        before = reduce_sum(mask, reduced_dim=group)
        flat = reduce_sum(mask, reduced_dim=experts)
        kept = reduce_sum(flat) if kept is None else kept + reduce_sum(flat)
        slot = ew.cast(reduce_sum(position, reduced_dim=experts), "int32")
        part = (gate * flat) * one_hot(index, experts, dtype=gates.dtype) * one_hot(slot, capacity, dtype=gates.dtype)
        combine = part if combine is None else combine + part
    dispatch = ew.cast(ew.greater(combine, 0.0), gates.dtype)
    return combine, dispatch, loss, 1.0 - kept / ew.maximum(wanted, 1.0)


def moe(
    x: Tensor,
    hidden_dim: Dimension | int,
    num_experts: int,
    group_size: int | None = None,
    gating: str = "top_2",
    train: bool = True,
    capacity_factor: float | None = None,
    second_policy: str = "all",
    second_threshold: float = 0.2,
    model_dim: str | None = None,
    activation=ew.relu,
    name: str = "moe",
) -> MoeOutput:
    """A mixture-of-experts feed-forward layer on x [..., tokens, d_model] (see the module).

    `hidden_dim`: each expert's hidden size (dim `expert_hidden`). `group_size` divides the
    last dim before the model dim (default: all of it). `capacity_factor` defaults to 1.25 in
    training and 2.0 in evaluation. `second_policy` (top-2): use the second expert always
    ("all"), never, when its gate exceeds `second_threshold`, or with probability
    min(1, gate / threshold) ("random"). Variables: `<name>/gate` [d_model, expert_unsplit],
    `<name>/wi` [experts, d_model, expert_hidden], `<name>/wo` [experts, expert_hidden, d_model]."""
    if gating not in GATINGS:
        raise GraphError(f"moe gating {gating!r}: choose one of {GATINGS}")
    if second_policy not in SECOND_POLICIES:
        raise GraphError(f"moe second_policy {second_policy!r}: choose one of {SECOND_POLICIES}")
    for what, n in (("hidden_dim", hidden_dim), ("num_experts", num_experts), ("group_size", group_size)):
        if isinstance(n, Dimension):
            what, n = f"hidden_dim {n}'s size", n.size
        if n is not None and (isinstance(n, bool) or int(n) != n or n < 1):  # (True was taken for 1)
            default = " (or None: the whole token dim)" if what == "group_size" else ""
            raise GraphError(f"moe: {what}={n!r} is not a whole number of at least 1; give an int{default}")
    train = as_flag(train, "moe: train", GraphError)
    factor = capacity_factor if capacity_factor is not None else (1.25 if train else 2.0)
    # (a text was a TypeError from the comparison; nan and inf failed in int() of the capacity)
    value = None
    if not isinstance(factor, str | bytes | bool):
        with contextlib.suppress(TypeError, ValueError):
            value = float(factor)  # (a Python, NumPy or JAX real number)
    if value is None or not math.isfinite(value) or value <= 0:
        raise GraphError(f"moe capacity_factor must be a finite number > 0, got {factor!r}")
    factor = value
    if num_experts < (2 if gating == "top_2" else 1):
        least = 2 if gating == "top_2" else 1
        raise GraphError(
            f"moe with {gating} gating needs at least {least} experts, got {num_experts}: give {least} or more"
            + (" (or gating='top_1')" if gating == "top_2" else "")
        )
    if model_dim and model_dim not in x.shape:  # (a KeyError)
        raise GraphError(f"moe: model_dim {model_dim!r} is not a dim of {x.name} {x.shape}; give one of its dims")
    model = x.shape.get_dim_by_name(model_dim) if model_dim else x.shape[-1]
    tokens = [d for d in x.shape if d != model]
    if not tokens:
        raise GraphError(f"moe: {x.name} {x.shape} has no token dims besides the model dim {model.name!r}")
    last = tokens[-1]
    size = last.size if group_size is None else int(group_size)
    if last.size % size:
        raise GraphError(f"moe group_size {size} does not divide {last} (the token dim before {model.name!r})")
    group = Dimension("group", size)
    experts_unsplit = Dimension("expert_unsplit", num_experts)
    capacity = Dimension("expert_capacity", expert_capacity(size, num_experts, factor))
    if num_experts > factor * size:
        raise GraphError(
            f"moe: {num_experts} experts are more than a group of {size} tokens can fill at capacity factor "
            f"{factor} (capacity would be {factor * size / num_experts:.2f} < 1 token per expert); use fewer "
            "experts, larger groups or a larger capacity factor"
        )
    hidden = hidden_dim if isinstance(hidden_dim, Dimension) else Dimension("expert_hidden", int(hidden_dim))
    experts = Dimension("experts", num_experts)
    chunks = [Dimension(f"{last.name}_chunk", last.size // size)] if size != last.size else []
    # x's dims sit beside the layer's own dims (the token dim alone is renamed), and the model dim
    # beside the experts' dims too (the groups' dims are renamed <dim>_unsplit there)
    own = ["group", "expert_unsplit", "expert_capacity", *(d.name for d in chunks)]
    for d in x.shape:
        taken = (
            own if d != model else [*own, "experts", hidden.name, *(f"{o.name}_unsplit" for o in tokens[:-1] + chunks)]
        )
        if d != last and d.name in taken:
            raise GraphError(
                f"moe: {x.name} {x.shape} has a dim {d.name!r}, a name the layer gives its own dims {taken}; "
                "rename that dim (mx.rename_dimension)"
            )
    grouped = replace_dimensions(x, last, [*chunks, group])  # [..., (chunk), group, d_model]
    outer = [d for d in grouped.shape if d not in (group, model)]
    std = 1.0 / math.sqrt(model.size)
    gate_w = get_variable(x.mesh, f"{name}/gate", [model, experts_unsplit], initializer=initializers.normal(std))
    gates = softmax(einsum(grouped, gate_w, output_shape=[*outer, group, experts_unsplit]), experts_unsplit)
    combine, dispatch, loss, dropped = _gating(
        gates, group, experts_unsplit, capacity, gating, second_policy, second_threshold
    )
    # The gating above is float32 (the gates of a bfloat16 x are x times a float32 weight); the
    # routing tensors and the experts' weights are then used in x's dtype, so that a bfloat16 x's
    # expert matmuls and all-to-alls are bfloat16 (Mesh-TensorFlow's moe casts them alike)
    combine, dispatch = ew.cast(combine, x.dtype), ew.cast(dispatch, x.dtype)
    unsplit = [Dimension(f"{d.name}_unsplit", d.size) for d in outer]
    inputs = einsum(grouped, dispatch, output_shape=[experts_unsplit, *outer, capacity, model])
    inputs = reshape(inputs, [experts, *unsplit, capacity, model])  # the all-to-all
    inputs.operation.info = {"moe": name, "experts": num_experts, "capacity": capacity.size, "group_size": size}
    wi = get_variable(x.mesh, f"{name}/wi", [experts, model, hidden], initializer=initializers.normal(std))
    wo = get_variable(
        x.mesh, f"{name}/wo", [experts, hidden, model], initializer=initializers.normal(1.0 / math.sqrt(hidden.size))
    )
    h = activation(einsum(inputs, ew.cast(wi, x.dtype), output_shape=[experts, *unsplit, capacity, hidden]))
    out = einsum(h, ew.cast(wo, x.dtype), output_shape=[experts, *unsplit, capacity, model])
    out = reshape(out, [experts_unsplit, *outer, capacity, model])  # and back
    out.operation.info = {"moe": name}
    y = einsum(out, combine, output_shape=grouped.shape)
    y = replace_dimensions(y, [*chunks, group], last) if chunks else rename_dimension(y, "group", last.name)
    return MoeOutput(reshape(y, x.shape), loss, dropped)


__all__ = ["MoeOutput", "expert_capacity", "moe"]
