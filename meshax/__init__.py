"""meshax: Mesh-TensorFlow and GSPMD on JAX.

Write the mathematics once with named dimensions, describe the devices as a named mesh, say
which tensor dims are split over which mesh dims, and meshax lowers the graph to one SPMD
program with explicit collectives, and tells you what each layout costs.

    import meshax as mx
    graph = mx.Graph(); mesh = mx.Mesh(graph, "mesh")
    x = mx.placeholder(mesh, "x", "batch:8;io:4")
    ...
    lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "batch:rows")})
"""

from meshax import initializers, layers, optimize, search
from meshax.autodiff import gradients
from meshax.backends import PlacementMeshImpl, SimdMeshImpl
from meshax.backends import placement as placement_mesh_impl  # (Mesh-TensorFlow's module names)
from meshax.backends import simd as simd_mesh_impl
from meshax.core import (
    ConfigError,
    DebugCallbackWarning,
    Dimension,
    Graph,
    GraphError,
    LayoutError,
    LayoutWarning,
    Mesh,
    MeshaxError,
    Operation,
    Shape,
    Tensor,
    anonymous_shape,
    combined_dimension,
    convert_to_dimension,
    convert_to_shape,
)
from meshax.jaxpr import Partitioned, PartitionedProgram, partition, replicated_region
from meshax.layout import OPEN, LayoutRules, ShardingRule, TensorLayout, WeightRules, convert_to_layout_rules
from meshax.lower import (
    Counters,
    LaidOutTensor,
    LoweredFunction,
    Lowering,
    MeshImpl,
    hlo_collectives,
    log_variable_sizes,
    pretty_print_counters,
)
from meshax.ops import *  # noqa: F403 (the flat op namespace users of Mesh-TensorFlow expect)
from meshax.ops import __all__ as _ops
from meshax.ops.variables import updates_only_where
from meshax.optimize import serialize_training_step
from meshax.pipeline import pipeline
from meshax.runtime import initialize_distributed, is_main_process, use_cpu_devices
from meshax.search import search_layout

__version__ = "0.1.0"
__all__ = [
    "ConfigError",
    "Counters",
    "Dimension",
    "DebugCallbackWarning",
    "Graph",
    "GraphError",
    "LaidOutTensor",
    "LayoutError",
    "LayoutRules",
    "WeightRules",
    "LayoutWarning",
    "LoweredFunction",
    "Lowering",
    "Mesh",
    "MeshImpl",
    "MeshaxError",
    "OPEN",
    "Operation",
    "Partitioned",
    "PartitionedProgram",
    "PlacementMeshImpl",
    "Shape",
    "ShardingRule",
    "SimdMeshImpl",
    "Tensor",
    "TensorLayout",
    "anonymous_shape",
    "combined_dimension",
    "convert_to_dimension",
    "convert_to_layout_rules",
    "convert_to_shape",
    "gradients",
    "hlo_collectives",
    "initialize_distributed",
    "initializers",
    "is_main_process",
    "layers",
    "log_variable_sizes",
    "optimize",
    "partition",
    "pipeline",
    "placement_mesh_impl",
    "pretty_print_counters",
    "replicated_region",
    "search",
    "search_layout",
    "serialize_training_step",
    "simd_mesh_impl",
    "updates_only_where",
    "use_cpu_devices",
    *_ops,
]
