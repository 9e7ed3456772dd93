"""meshax benchmark suite: `python -m benchmarks` (see benchmarks/__main__.py).

Sections: 1 communication against the paper's Table 1, 2 step time and collectives against
XLA's own partitioner (jax.jit + NamedSharding), 3 one-device overhead against plain jax.jit,
4 SPMD scaling of the lowering (abstract meshes up to 512 devices), 5 meshax's counters against
the collectives in XLA's compiled HLO, 6 GPU (skipped without one).

Modules import JAX lazily where it matters: `__main__` sets the number of virtual CPU devices
before anything touches a backend.
"""
