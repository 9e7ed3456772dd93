"""Variable initializers: `init(key, shape, dtype) -> jax.Array`, as in `jax.nn.initializers`.

They are small frozen dataclasses, equal when their parameters are, so meshax compiles one
initializer program per (initializer, shape, dtype, sharding) and reuses it for every layer.
meshax runs them under `jax.jit` with the variable's `NamedSharding` as output sharding; with
JAX's partitionable threefry the numbers do not depend on the layout, and each device makes
only its own slice (a split parameter is never materialised whole). A small variable (at most
2**20 values) is made whole on one device and then split: one program for every layout (a
`Constant` one by numpy, compiling nothing). Any function with the same signature (e.g. from
`jax.nn.initializers`) works too.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from meshax.core.errors import ConfigError


@dataclasses.dataclass(frozen=True, eq=False)
class Constant:
    value: float = 0.0

    def _key(self) -> tuple:
        v = np.asarray(self.value)
        return (v.shape, v.dtype.str, v.tobytes())

    # (by the value's bytes: an array value made the generated hash fail, 'unhashable type', for a
    # variable large enough to be made by a compiled program, which is cached by its initializer)
    def __eq__(self, other) -> bool:
        return isinstance(other, Constant) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __call__(self, key, shape, dtype):
        self.check(shape, dtype)
        return jnp.full(shape, self.value, dtype)

    def check(self, shape, dtype) -> None:
        """Refuse a value that does not fill a variable of `shape` and `dtype`: an array of another
        shape (NumPy's error from inside, when the variable was first used), or a whole number
        past an integer dtype (NumPy's OverflowError for a small variable; wrapped around, 2**40
        as 0, for a large one)."""
        dtype = np.dtype(dtype)
        try:
            np.broadcast_shapes(np.shape(self.value), tuple(shape))
        except ValueError:
            raise ConfigError(
                f"initializers.constant: a value of shape {list(np.shape(self.value))} does not fill a variable of "
                f"shape {list(shape)}"
            ) from None
        if dtype.kind in "iu" and np.asarray(self.value).dtype.kind in "iu":
            low, high = np.iinfo(dtype).min, np.iinfo(dtype).max
            if not (low <= np.min(self.value) and np.max(self.value) <= high):
                raise ConfigError(f"initializers.constant: {self.value!r:.60} is outside {dtype}'s {low}..{high}")


@dataclasses.dataclass(frozen=True)
class Normal:
    stddev: float = 1.0
    mean: float = 0.0
    truncated: bool = False  # cut at two standard deviations, rescaled to keep `stddev`

    def __call__(self, key, shape, dtype):
        if self.truncated:
            x = jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32) / 0.87962566103423978
        else:
            x = jax.random.normal(key, shape, jnp.float32)
        return (x * self.stddev + self.mean).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Uniform:
    minval: float = 0.0
    maxval: float = 1.0

    def __call__(self, key, shape, dtype):
        return jax.random.uniform(key, shape, jnp.float32, self.minval, self.maxval).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Glorot:
    """Glorot (Xavier): variance 2 / (fan_in + fan_out); fans default to (all dims but the last, the last)."""

    fan_in: int | None = None
    fan_out: int | None = None
    distribution: str = "uniform"  # or "normal" (truncated)

    def __call__(self, key, shape, dtype):
        fan_in = self.fan_in if self.fan_in is not None else (math.prod(shape[:-1]) if len(shape) > 1 else 1)
        fan_out = self.fan_out if self.fan_out is not None else (shape[-1] if shape else 1)
        if self.distribution == "uniform":
            limit = math.sqrt(6.0 / (fan_in + fan_out))
            return Uniform(-limit, limit)(key, shape, dtype)
        return Normal(math.sqrt(2.0 / (fan_in + fan_out)), truncated=True)(key, shape, dtype)


@dataclasses.dataclass(frozen=True)
class Stacked:
    """`init` for each of the first `count` rows (the leading dims of a stacked variable, like a
    pipeline's stage dim), each from its own key: every layer gets the initialization, and
    the fans, that it would have on its own."""

    init: object
    count: int

    def __call__(self, key, shape, dtype):
        lead = []
        while math.prod(lead) < self.count:
            lead.append(shape[len(lead)])
        one = lambda k: self.init(k, tuple(shape[len(lead) :]), dtype)  # noqa: E731
        return jax.vmap(one)(jax.random.split(key, self.count)).reshape(shape)


@dataclasses.dataclass(frozen=True)
class TensorFlowDefault:
    """What `tf.get_variable` (and so Mesh-TensorFlow's `get_variable`) gives a variable without
    an initializer: Glorot uniform for floats, with TensorFlow's fans (a kernel [..., in, out] of
    receptive field r = the product of the leading dims: fan_in = in r, fan_out = out r; one dim
    n: n and n; a scalar: 1 and 1), and zeros for integers and bools."""

    def __call__(self, key, shape, dtype):
        if not jnp.issubdtype(dtype, jnp.floating):
            return jnp.zeros(shape, dtype)
        if len(shape) < 2:
            fan_in = fan_out = shape[0] if shape else 1
        else:
            field = math.prod(shape[:-2])
            fan_in, fan_out = shape[-2] * field, shape[-1] * field
        return Glorot(fan_in, fan_out, "uniform")(key, shape, dtype)


def _numbers(fn: str, **values) -> None:
    """Each of `values` is a number (or numbers); else a ConfigError naming the initializer and
    the argument (text failed inside JAX when the variable was made, and None filled it with NaN)."""
    for name, value in values.items():
        try:
            kind = np.asarray(value).dtype.kind
        except (TypeError, ValueError):
            kind = "O"
        if kind not in "biufc":
            raise ConfigError(
                f"initializers.{fn}: {name} is {value!r} ({type(value).__name__}), not a number: e.g. "
                f"initializers.{fn}({_EXAMPLES[fn]})"
            )


_EXAMPLES = {"constant": "0.5", "normal": "stddev=0.02", "truncated_normal": "stddev=0.02", "uniform": "-0.1, 0.1"}


def tensorflow_default():
    """TensorFlow's default initializer (`TensorFlowDefault`): `get_variable`'s default."""
    return TensorFlowDefault()


def zeros():
    """Initialize to zeros."""
    return Constant(0.0)


def ones():
    """Initialize to ones."""
    return Constant(1.0)


def constant(value):
    """Initialize every value to `value`."""
    _numbers("constant", value=value)
    return Constant(value)


def normal(stddev=1.0, mean=0.0):
    """Normal values with `mean` and `stddev`."""
    _numbers("normal", stddev=stddev, mean=mean)
    _spread("normal", stddev)
    return Normal(stddev, mean)


def truncated_normal(stddev=1.0, mean=0.0):
    """Normal values with `mean` and `stddev`, cut at two standard deviations (rescaled to keep `stddev`)."""
    _numbers("truncated_normal", stddev=stddev, mean=mean)
    _spread("truncated_normal", stddev)
    return Normal(stddev, mean, truncated=True)


def _spread(fn: str, stddev) -> None:
    """A negative `stddev` is refused: it drew with stddev |stddev| without a word (a sign slip, as numpy
    and torch refuse it); 0 is every value `mean`."""
    if not np.all(np.asarray(stddev) >= 0):
        what = "NaN" if np.any(np.isnan(stddev)) else "negative"  # (NaN drew NaNs)
        raise ConfigError(
            f"initializers.{fn}: stddev {stddev!r} is {what}: a spread is 0 or more, e.g. {fn}(stddev=0.02)"
        )


def uniform(minval=0.0, maxval=1.0):
    """Uniform values in [minval, maxval)."""
    _numbers("uniform", minval=minval, maxval=maxval)
    if not np.all(np.asarray(minval) < np.asarray(maxval)):  # (every value was minval: uniform(2.0) all 2s)
        raise ConfigError(
            f"initializers.uniform: minval {minval!r} must be less than maxval {maxval!r}: the values are in "
            f"[minval, maxval), minval first (for [0, {minval!r}), as jax.nn.initializers.uniform({minval!r}) "
            f"gives, write uniform(0, {minval!r}))"
        )
    return Uniform(minval, maxval)


def glorot_uniform(fan_in=None, fan_out=None):
    """Glorot (Xavier) uniform: variance 2 / (fan_in + fan_out); fans default to (all dims but the last, the last)."""
    return Glorot(fan_in, fan_out, "uniform")


def glorot_normal(fan_in=None, fan_out=None):
    """Glorot (Xavier) truncated normal: variance 2 / (fan_in + fan_out); fans default as glorot_uniform's."""
    return Glorot(fan_in, fan_out, "normal")
