"""Setting up the embedded default: JAX on the local CPU with as many virtual devices as needed."""

from __future__ import annotations

import contextlib
import os


def use_cpu_devices(n: int) -> None:
    """Ask JAX for `n` virtual CPU devices. Call before anything touches a JAX backend.

    If the backend is already up with fewer devices, say so plainly rather than fail later."""
    import jax

    with contextlib.suppress(RuntimeError):  # the backend is already up: checked below
        jax.config.update("jax_num_cpu_devices", int(n))
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(n))
    have = len(jax.devices())
    if jax.devices()[0].platform == "cpu" and have < n:
        raise RuntimeError(
            f"JAX already started with {have} CPU device(s), but {n} are needed. Call "
            f"meshax.use_cpu_devices({n}) (or set JAX_NUM_CPU_DEVICES={n}) before any JAX computation"
        )
