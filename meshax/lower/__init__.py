"""Lowering a graph to SPMD programs: the context ops see, resharding, counters, MeshImpl."""

from meshax.lower.counters import CollectiveRecord, Counters, Site, pretty_print_counters
from meshax.lower.function import LoweredFunction
from meshax.lower.hlo import hlo_collectives
from meshax.lower.laid_out import LaidOutTensor
from meshax.lower.lowering import Lowering
from meshax.lower.mesh_impl import MeshImpl
from meshax.lower.report import log_variable_sizes

__all__ = [
    "CollectiveRecord",
    "Counters",
    "LaidOutTensor",
    "LoweredFunction",
    "Lowering",
    "MeshImpl",
    "Site",
    "hlo_collectives",
    "log_variable_sizes",
    "pretty_print_counters",
]
