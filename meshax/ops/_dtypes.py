"""The dtype policy, in one place: every op's result dtype is the one `jax.numpy` gives.

Ops ask this module for their output dtype when the graph is built, so the declared dtype is the
dtype the lowering produces on every backend (`LoweringContext.set_output` checks it), and a
dtype an op cannot take is a `GraphError` at build time, not a JAX error inside the lowering.

The rules are JAX's: its type-promotion lattice (int32 with float32 is float32, not NumPy's
float64), weak types for Python scalars (`x * 0.5` keeps a bfloat16 `x` bfloat16, `i + 1` keeps
an int32 `i` int32), true division and transcendental functions promote integers and bools to
the default float, and sums of bools count (`sum` is an int32 count, `mean` a float).
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from meshax.core.errors import GraphError
from meshax.core.graph import is_floating


def result_type(*operands) -> np.dtype:
    """JAX's promotion of dtypes and Python scalars (weakly typed, as in `jnp`)."""
    return np.dtype(jnp.result_type(*[_operand(o) for o in operands]))


def _operand(o):
    if isinstance(o, np.generic):  # NumPy scalars are strongly typed
        return o.dtype
    if isinstance(o, numbers.Number):  # Python scalars are weak
        return o
    return np.dtype(o)


def scalar_dtype(value, like) -> np.dtype:
    """The dtype a Python scalar takes beside a tensor of dtype `like`: JAX's weak typing."""
    return result_type(like, value)


def inexact(dtype) -> np.dtype:
    """`dtype` if it is a float, else the default float (what jnp's transcendental ops compute in)."""
    return np.dtype(dtype) if is_floating(dtype) else np.dtype(jnp.result_type(float))


@functools.lru_cache(maxsize=4096)
def _kernel_dtype(fn, dtypes: tuple) -> np.dtype:
    structs = [jax.ShapeDtypeStruct((), d) for d in dtypes]
    return np.dtype(jax.eval_shape(fn, *structs).dtype)


def kernel_dtype(op: str, fn, *dtypes) -> np.dtype:
    """The dtype `fn` (an op's per-slice kernel) returns for inputs of `dtypes`: asked of JAX
    once per (kernel, dtypes), abstractly. A dtype the kernel refuses is a GraphError."""
    try:
        return _kernel_dtype(fn, tuple(np.dtype(d) for d in dtypes))
    except TypeError as err:
        names = ", ".join(str(np.dtype(d)) for d in dtypes)
        raise GraphError(f"{op} does not take {names}: {err}") from None


def sum_dtype(dtype) -> np.dtype:
    """What a sum of `dtype` values is: bools count as int32, small ints widen (as jnp.sum)."""
    return kernel_dtype("a sum", jnp.sum, dtype)


def gradient_dtype(t) -> np.dtype:
    """The dtype to sum `t`'s gradient in: the master dtype where `t` is a weight cast to a
    narrower float (a float32 variable, perhaps annotated or a loop's slice of one, cast to
    bfloat16 for the computation: mixed precision), so that weight gradients are summed and
    allreduced in float32; else t's own (activation gradients stay bfloat16)."""
    from meshax.ops.elementwise import CastOperation
    from meshax.ops.layout_ops import ShardOperation
    from meshax.ops.loops import LoopVariableOperation

    op = t.operation
    if not isinstance(op, CastOperation):
        return np.dtype(t.dtype)
    source = op.inputs[0]
    while isinstance(source.operation, ShardOperation):
        source = source.operation.inputs[0]
    weight = getattr(source.operation, "is_variable", False) or isinstance(source.operation, LoopVariableOperation)
    wide = np.dtype(source.dtype)
    if weight and is_floating(wide) and is_floating(t.dtype) and wide.itemsize > np.dtype(t.dtype).itemsize:
        return wide
    return np.dtype(t.dtype)
