"""The jaxpr front end: plain single-device JAX functions partitioned by meshax (`mx.partition`).

flatten (calls inlined) -> names (a union-find over the axes each equation ties, `roles`) ->
emit (meshax ops) -> the usual plan, propagation and lowering.
"""

from meshax.jaxpr.annotate import mesh_split_array, replicated_region
from meshax.jaxpr.partition import Partitioned, PartitionedProgram, partition

__all__ = ["Partitioned", "PartitionedProgram", "mesh_split_array", "partition", "replicated_region"]
