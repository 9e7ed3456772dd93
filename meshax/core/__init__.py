"""The IR: dimensions, shapes, graphs, meshes, tensors, operations. No JAX here."""

from meshax.core.errors import ConfigError, DebugCallbackWarning, GraphError, LayoutError, LayoutWarning, MeshaxError
from meshax.core.graph import Graph, Mesh, Operation, Tensor, as_dtype, is_floating
from meshax.core.shape import (
    Dimension,
    Shape,
    anonymous_shape,
    combined_dimension,
    convert_to_dimension,
    convert_to_shape,
)

__all__ = [
    "ConfigError",
    "DebugCallbackWarning",
    "Dimension",
    "Graph",
    "GraphError",
    "LayoutError",
    "LayoutWarning",
    "Mesh",
    "MeshaxError",
    "Operation",
    "Shape",
    "Tensor",
    "anonymous_shape",
    "as_dtype",
    "combined_dimension",
    "convert_to_dimension",
    "convert_to_shape",
    "is_floating",
]
