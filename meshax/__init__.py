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

from meshax.backends import PlacementMeshImpl, SimdMeshImpl
from meshax.core import (
    Dimension, Graph, GraphError, LayoutError, Mesh, Operation, Shape, Tensor, convert_to_shape,
)
from meshax.layout import LayoutRules, TensorLayout, convert_to_layout_rules
from meshax.lower import Counters, LaidOutTensor, Lowering, LoweredFunction, MeshImpl, hlo_collectives
from meshax.ops import *  # noqa: F403 (the flat op namespace users of Mesh-TensorFlow expect)
from meshax.runtime import use_cpu_devices
from meshax.autodiff import gradients
from meshax import initializers, layers, optimize

__version__ = "0.1.0"
