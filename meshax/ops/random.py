"""Random tensors that do not depend on the layout: each value is keyed by its global position.

A value is drawn from a key folded from (the op's seed, the run's seed, the element's global
row-major index), so every device makes exactly its own stripe, and a tensor has the same
numbers whether it is split over 1 or 512 devices. The op's seed is fixed when the graph is
built (the user's, or the op's place among the graph's random ops), so the same program gives
the same numbers; the run's seed (`fn(feeds, seed=step)`) varies them between steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from meshax.core.errors import GraphError
from meshax.core.graph import Mesh, Operation, Tensor, as_dtype, is_floating
from meshax.core.shape import convert_to_shape
from meshax.layout import slice_shape


def _next_seed(mesh: Mesh) -> int:
    graph = mesh.graph
    graph.random_ops += 1
    return 0x5EED + 7919 * graph.random_ops


class RandomOperation(Operation):
    differentiable = False

    def __init__(self, mesh: Mesh, shape, kind: str, a: float, b: float, dtype, seed, name=None):
        super().__init__([], mesh=mesh, name=name or f"random_{kind}")
        dtype = as_dtype(dtype)
        if not is_floating(dtype):
            raise GraphError(f"random_{kind} makes floats, not {dtype}")
        self.kind, self.a, self.b = kind, float(a), float(b)
        self.seed = _next_seed(mesh) if seed is None else int(seed)
        self._add_output(convert_to_shape(shape), dtype)

    def lower(self, ctx):
        out = self.outputs[0]
        layout = ctx.layout(out)
        local = slice_shape(out.shape, layout, ctx.mesh_shape)
        begins = ctx.slice_begins(out.shape, layout)
        strides = [int(np.prod(out.shape.to_integer_list[i + 1 :], dtype=np.int64)) for i in range(out.shape.rank)]
        kind, a, b, seed = self.kind, self.a, self.b, self.seed

        def draw(run_seed, *offsets):
            index = jnp.zeros(local, jnp.uint32)
            for i, (off, stride) in enumerate(zip(offsets, strides)):
                pos = jax.lax.broadcasted_iota(jnp.uint32, local, i) + jnp.asarray(off, jnp.uint32)
                index = index + pos * jnp.uint32(stride)
            key = jax.random.fold_in(jax.random.key(seed), run_seed)
            keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(index.reshape(-1))
            if kind == "uniform":
                x = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys) * (b - a) + a
            else:
                x = jax.vmap(lambda k: jax.random.normal(k, (), jnp.float32))(keys) * b + a
            x = x.reshape(local).astype(out.dtype)
            if kind == "uniform" and a < b:  # [a, b): in 16 bits the draws past b's last value round to b
                x = jnp.minimum(x, jnp.nextafter(jnp.asarray(b, out.dtype), jnp.asarray(a, out.dtype)))
            return x

        ctx.add_flops(ctx.local_size(out))
        ctx.set_output(out, ctx.slicewise(draw, ctx.rng_seed, *begins), layout)

    def gradient(self, grad_outputs):
        return []


def random_uniform(mesh: Mesh, shape, minval=0.0, maxval=1.0, dtype="float32", seed=None, name=None) -> Tensor:
    """Uniform values in [minval, maxval); the same values whatever the layout (each device draws its own slice)."""
    if not np.all(np.asarray(minval) < np.asarray(maxval)):  # (drew from (maxval, minval], silently)
        raise GraphError(
            f"random_uniform: minval {minval!r} must be less than maxval {maxval!r} (values in [minval, maxval))"
        )
    return RandomOperation(mesh, shape, "uniform", minval, maxval, dtype, seed, name).outputs[0]


def random_normal(mesh: Mesh, shape, mean=0.0, stddev=1.0, dtype="float32", seed=None, name=None) -> Tensor:
    """Normal values (mean, stddev); the same values whatever the layout (each device draws its own slice)."""
    if not np.all(np.asarray(stddev) >= 0):  # (drew with stddev |stddev|, silently; NaN drew NaNs)
        what = "NaN" if np.any(np.isnan(stddev)) else "negative"
        raise GraphError(f"random_normal: stddev {stddev!r} is {what}: a spread is 0 or more")
    return RandomOperation(mesh, shape, "normal", mean, stddev, dtype, seed, name).outputs[0]


def dropout(x: Tensor, is_training=True, keep_prob=None, rate=0.0, noise_shape=None, name=None, seed=None) -> Tensor:
    """Zero each value with probability `rate` (or 1 - `keep_prob`) and scale the rest by
    1 / (1 - rate); x itself when `is_training` is False. Mesh-TensorFlow's arguments; meshax's
    own `dropout(x, 0.1)` (the rate second) works too.

    noise_shape (a subset of x's dims) shares one draw across the dims it leaves out. The draws
    are float32 whatever x's dtype: a 16-bit x keeps what a float32 x keeps."""
    from meshax.ops import elementwise as ew

    if isinstance(is_training, np.bool_) or getattr(is_training, "dtype", None) == np.bool_:
        is_training = bool(is_training)  # (NumPy's or JAX's bool: not a rate of 1.0)
    if not isinstance(is_training, bool):  # dropout(x, rate): the rate where is_training stands
        try:
            rate, is_training = float(is_training), True
        except (TypeError, ValueError):
            raise GraphError(
                f"dropout: is_training {is_training!r} is neither a bool nor a rate: give dropout(x, is_training, "
                "rate=0.1) or dropout(x, 0.1)"
            ) from None
    if keep_prob is not None:
        if rate and abs(rate - (1.0 - keep_prob)) > 1e-9:
            raise GraphError(
                f"dropout: keep_prob {keep_prob} and rate {rate} disagree (rate is 1 - keep_prob): give one of them"
            )
        rate = 1.0 - keep_prob
    if not is_training:
        return x

    if not is_floating(x.dtype):
        raise GraphError(
            f"dropout scales values by 1 / (1 - rate), so it needs a float tensor; {x.name} is "
            f"{x.dtype} (cast it first)"
        )
    if not 0.0 <= rate < 1.0:
        given = f"keep_prob {keep_prob} (rate 1 - keep_prob = {rate})" if keep_prob is not None else f"rate {rate}"
        raise GraphError(f"dropout: {given}; the rate must be in [0, 1), keep_prob in (0, 1]")
    if rate == 0.0:
        return x
    noise_shape = x.shape if noise_shape is None else convert_to_shape(noise_shape)
    extra = [d for d in noise_shape if d not in x.shape]
    if extra:
        raise GraphError(f"dropout noise_shape has dims {extra} that {x.name} {x.shape} lacks")
    # (the draws are float32 whatever x's dtype: in 16 bits those just below the rate round up to it
    # and are kept, 0.5 + 2**-10 of bfloat16 values at rate 0.5, and other ones than float32's)
    keep = ew.greater_equal(random_uniform(x.mesh, noise_shape, dtype="float32", seed=seed), rate)
    return x * ew.cast(keep, x.dtype) * (1.0 / (1.0 - rate))


def sample_with_temperature(logits: Tensor, dim, temperature=1.0, name=None) -> Tensor:
    """A sample along `dim` (int32 indices, without that dim): the argmax of the logits plus
    Gumbel noise times `temperature`, as Mesh-TensorFlow's; temperature 0 is the argmax."""
    from meshax.ops import elementwise as ew
    from meshax.ops.reduce import argmax

    if temperature != 0.0:
        if not is_floating(logits.dtype) or logits.dtype.itemsize < 4:
            # (the noise is a float32 one: bfloat16's uniform draws, 2**-8 apart, cut the Gumbel tails
            # and tie, and the argmax takes the first: the first of 6 was drawn 2x its probability)
            logits = ew.cast(logits, "float32")
        u = random_uniform(logits.mesh, logits.shape, minval=1e-9, maxval=1.0, dtype=logits.dtype)
        logits = logits + ew.negative(ew.log(ew.negative(ew.log(u)))) * temperature
    return argmax(logits, dim, name)
