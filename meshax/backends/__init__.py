"""Mesh implementations: SIMD (one program under jax.shard_map) and placement (one array per device)."""

from meshax.backends.placement import PlacementMeshImpl
from meshax.backends.simd import SimdMeshImpl

__all__ = ["PlacementMeshImpl", "SimdMeshImpl"]
