"""What a lowered program is given, checked: feeds (their shapes and the values their cast
would change), seeds, outputs and updates. Each error names what is wrong and what to give."""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from meshax.core.errors import ConfigError, GraphError, MeshaxError
from meshax.core.graph import Operation, Tensor

if TYPE_CHECKING:
    from meshax.lower.lowering import Lowering
    from meshax.ops.variables import AssignOperation


def fed(t: Tensor, value, who: str = "", verb: str = "fed") -> np.ndarray:
    """A value fed to placeholder t (or, `who` and `verb` saying so, set to a variable whose value t
    is) as an array of t's dtype; refused where the cast would change it: floats given to integers
    or bools, integers outside the dtype's range, finite values past a float dtype's (float32 past
    65504 given as float16: inf), text."""
    who = who or f"placeholder {t.name!r}"
    value = np.asarray(value)
    have, want = value.dtype, t.dtype
    if have == want:
        return value
    problem = ""
    have_kind, want_kind = (("f" if jnp.issubdtype(d, jnp.floating) else d.kind) for d in (have, want))  # (bf16: 'V')
    if have_kind not in "biufc":
        problem = f"an array of {have}"
    elif want_kind in "biuf" and have_kind in "fc" and have_kind != want_kind:
        dropped = "the fractions" if have_kind == "f" else "the imaginary parts"
        problem = f"{have} values (cast them yourself if dropping {dropped} is meant)"
    elif want_kind in "biu" and have_kind in "iu" and value.size:
        low, high = (0, 1) if want.kind == "b" else (np.iinfo(want).min, np.iinfo(want).max)
        if value.min() < low or value.max() > high:
            problem = f"values from {value.min()} to {value.max()}, outside {want}'s {low}..{high}"
    if problem:
        raise MeshaxError(f"{who} is {want} {t.shape}; it was {verb} {problem}")
    with np.errstate(over="ignore"):
        out = value.astype(want, copy=False)
    if want_kind == "f" and have_kind in "iuf" and value.size and np.isinf(out).any():
        overflowed = np.isinf(out) & ~np.isinf(value)  # (finite values past a narrower float's range)
        if overflowed.any():
            raise MeshaxError(
                f"{who} is {want} {t.shape}; it was {verb} {have} values up to "
                f"{np.abs(value[overflowed]).max()}, which are inf in {want} (largest {float(jnp.finfo(want).max)})"
            )
    return out


def extremes(array: jax.Array) -> np.ndarray:
    """The least and the greatest finite value of a jax.Array, on the host: what decides whether
    `fed` refuses its cast (where its dtype's kind alone does not), for an array left on the
    devices. A complex array's kind decides alone: none of its values."""
    if jnp.issubdtype(array.dtype, jnp.complexfloating):
        return np.empty(0, array.dtype)
    finite = jnp.where(jnp.isfinite(array), array, 0) if jnp.issubdtype(array.dtype, jnp.floating) else array
    return np.asarray(jnp.stack([jnp.min(finite), jnp.max(finite)]))


def not_a_tensor(x, what: str) -> TypeError:
    """The error for `x` given where `what` takes a meshax Tensor, saying what to give instead."""
    if isinstance(x, str):
        hint = ": give the tensor itself, not its name"
    elif getattr(x, "is_variable", False):
        hint = f": give the variable's value, {x.name}.value"
    else:
        hint = ""
    return TypeError(f"{what}: {x!r} ({type(x).__name__}) is not a meshax Tensor{hint}")


def tensor_of(lowering: Lowering, t, what: str) -> Tensor:
    """`t`, a Tensor of the lowered graph; else an error saying what it is."""
    if not isinstance(t, Tensor):
        raise not_a_tensor(t, what)
    if t.graph is not lowering.graph:
        raise GraphError(f"{what}: tensor {t.name} belongs to another graph than the one lowered")
    return t


def checked_seed(seed, what: str, low: int = 0) -> int:
    """A seed as an int where it is one JAX tells apart from every other: a whole number in
    low..2**32 - 1 (JAX keeps a seed's low 32 bits: 2**40 is 0)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not low <= int(seed) < 2**32:
        raise ConfigError(
            f"{what} {seed!r} is not a whole number from {low} to 2**32 - 1 (a larger one is the same seed as its "
            "low 32 bits)"
        )
    return int(seed)


def update_list(lowering: Lowering, updates) -> list[AssignOperation]:
    """A program's updates (an assign op or a sequence of them) as a list of the lowered graph's
    assign ops, each variable assigned once."""
    if isinstance(updates, Tensor):
        raise TypeError(
            f"updates take assign operations (mx.assign(variable, value)), got the tensor {updates.name}: "
            "compute it as an output, or assign it to a variable"
        )
    updates = [updates] if isinstance(updates, Operation) else list(updates)
    for u in updates:
        if not hasattr(u, "variable") or u.graph is not lowering.graph:
            raise TypeError(f"updates must be assign operations of this graph (mx.assign ...), got {u!r}")
    targets = [u.variable.name for u in updates]
    twice = sorted({n for n in targets if targets.count(n) > 1})
    if twice:
        raise GraphError(f"variables {twice} are assigned more than once in one function; combine the updates")
    return updates


def output_list(lowering: Lowering, outputs, what: str) -> list[Tensor]:
    """A program's outputs (a Tensor or a sequence of them) as a list of the lowered graph's tensors."""
    if isinstance(outputs, Tensor):
        outputs = [outputs]
    elif isinstance(outputs, str) or not isinstance(outputs, Iterable):
        raise not_a_tensor(outputs, what)
    return [tensor_of(lowering, t, what) for t in outputs]
