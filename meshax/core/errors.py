"""Exception classes users can catch by kind; all of them are `MeshaxError`s (and ValueErrors)."""

from __future__ import annotations

import difflib

import numpy as np


class MeshaxError(ValueError):
    """A bad input to meshax: the message says what is wrong, the value given, and how to fix it."""


class LayoutError(MeshaxError):
    """A layout that cannot be realised: two dims of one tensor on one mesh dim, or a rule naming
    a mesh dim the mesh lacks. The message names the tensor, its dims and the mesh dim."""


class GraphError(MeshaxError):
    """An operation built with inputs that do not fit (wrong dims, mixed meshes, ...)."""


class ConfigError(MeshaxError):
    """A bad setting: a mesh shape, layout rules, an option of a task, optimizer or command."""


class LayoutWarning(UserWarning):
    """Layout rules that split nothing: they name a tensor dim no tensor of the graph has."""


class DebugCallbackWarning(UserWarning):
    """`jax.debug.print` / `jax.debug.callback` in a function given to `mx.partition`: left out."""


def did_you_mean(name: str, choices) -> str:
    """' (did you mean 'x'?)' for the closest of `choices`, or ''."""
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def as_flag(value, what: str, error: type[MeshaxError] = ConfigError) -> bool:
    """`value` as a bool where an option is on or off: a bool, or 0 or 1 (Python's, or a NumPy or
    JAX scalar or 0-d array of them). Anything else is refused, naming `what`: a text like 'no'
    or 'False' is true to Python, so it turned the option on without a word."""
    if isinstance(value, bool | np.bool_) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    if isinstance(value, np.ndarray | np.generic) or type(value).__module__.startswith(("jax", "jaxlib")):
        try:
            a = np.asarray(value)  # (a JAX tracer cannot be read: refused below, as bool() of it failed)
        except Exception:
            a = None
        if a is not None and a.ndim == 0 and a.dtype.kind in "biu" and a.item() in (0, 1):
            return bool(a)
    raise error(f"{what} is {value!r:.60} ({type(value).__name__}): give True or False")
