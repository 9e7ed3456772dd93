"""Variable initializers: `init(key, shape, dtype) -> jax.Array`, as in `jax.nn.initializers`.

meshax runs them under `jax.jit` with the variable's `NamedSharding` as output sharding; with
JAX's partitionable threefry, the numbers do not depend on the layout, and each device makes
only its own slice (a split parameter is never materialised whole).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def zeros():
    return lambda key, shape, dtype: jnp.zeros(shape, dtype)


def ones():
    return lambda key, shape, dtype: jnp.ones(shape, dtype)


def constant(value):
    return lambda key, shape, dtype: jnp.full(shape, value, dtype)


def normal(stddev=1.0, mean=0.0):
    return lambda key, shape, dtype: (jax.random.normal(key, shape, jnp.float32) * stddev + mean).astype(dtype)


def truncated_normal(stddev=1.0, mean=0.0):
    """Normal values cut at two standard deviations (and rescaled to keep `stddev`)."""
    scale = stddev / 0.87962566103423978  # std of a standard normal truncated to [-2, 2]

    def init(key, shape, dtype):
        return (jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32) * scale + mean).astype(dtype)
    return init


def uniform(minval=0.0, maxval=1.0):
    return lambda key, shape, dtype: jax.random.uniform(key, shape, jnp.float32, minval, maxval).astype(dtype)


def _fans(shape, fan_in, fan_out):
    if fan_in is None:
        fan_in = math.prod(shape[:-1]) if len(shape) > 1 else shape[0] if shape else 1
    if fan_out is None:
        fan_out = shape[-1] if shape else 1
    return fan_in, fan_out


def glorot_uniform(fan_in=None, fan_out=None):
    """Uniform in +-sqrt(6 / (fan_in + fan_out)); fans default to (all dims but the last, the last)."""
    def init(key, shape, dtype):
        fi, fo = _fans(shape, fan_in, fan_out)
        limit = math.sqrt(6.0 / (fi + fo))
        return jax.random.uniform(key, shape, jnp.float32, -limit, limit).astype(dtype)
    return init


def glorot_normal(fan_in=None, fan_out=None):
    def init(key, shape, dtype):
        fi, fo = _fans(shape, fan_in, fan_out)
        return truncated_normal(math.sqrt(2.0 / (fi + fo)))(key, shape, dtype)
    return init
