"""The IR: dimensions, shapes, graphs, meshes, tensors, operations. No JAX here."""

from meshax.core.errors import GraphError, LayoutError
from meshax.core.graph import Graph, Mesh, Operation, Tensor, as_dtype, is_floating
from meshax.core.shape import Dimension, Shape, convert_to_shape

__all__ = [
    "Dimension",
    "Graph",
    "GraphError",
    "LayoutError",
    "Mesh",
    "Operation",
    "Shape",
    "Tensor",
    "as_dtype",
    "convert_to_shape",
    "is_floating",
]
