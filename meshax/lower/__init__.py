"""Lowering a graph to SPMD programs: the context ops see, resharding, counters, MeshImpl."""

from meshax.lower.counters import CollectiveRecord, Counters, Site
from meshax.lower.hlo import hlo_collectives
from meshax.lower.laid_out import LaidOutTensor
from meshax.lower.lowering import LoweredFunction, Lowering
from meshax.lower.mesh_impl import MeshImpl

__all__ = [
    "CollectiveRecord",
    "Counters",
    "LaidOutTensor",
    "LoweredFunction",
    "Lowering",
    "MeshImpl",
    "Site",
    "hlo_collectives",
]
