"""Mesh shapes, layout rules and per-tensor layouts."""

from meshax.layout.mesh_shape import (
    convert_to_mesh_shape,
    pnum_to_processor_coordinates,
    processor_coordinates_to_pnum,
)
from meshax.layout.propagate import OPEN
from meshax.layout.rules import (
    LayoutRules,
    TensorLayout,
    WeightRules,
    convert_to_layout_rules,
    convert_to_weight_rules,
    slice_begin,
    slice_index,
    slice_shape,
    split_factor,
    tensor_layout,
    validate_layout,
)
from meshax.layout.sharding_rule import ShardingRule, iteration, rule_of

__all__ = [
    "OPEN",
    "LayoutRules",
    "ShardingRule",
    "TensorLayout",
    "WeightRules",
    "convert_to_layout_rules",
    "convert_to_mesh_shape",
    "convert_to_weight_rules",
    "iteration",
    "pnum_to_processor_coordinates",
    "processor_coordinates_to_pnum",
    "rule_of",
    "slice_begin",
    "slice_index",
    "slice_shape",
    "split_factor",
    "tensor_layout",
    "validate_layout",
]
