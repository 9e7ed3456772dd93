"""Variables (state that lives sharded on the devices between runs) and assignments to them."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import numpy as np

from meshax.core.errors import ConfigError, GraphError
from meshax.core.graph import Mesh, Operation, Tensor, as_dtype, check_mesh
from meshax.core.shape import convert_to_shape
from meshax.ops._util import also_accepts


class VariableOperation(Operation):
    """A named, persistent tensor. Its value is kept by the Lowering as a global jax.Array with
    the NamedSharding its layout implies, read at the start of each run."""

    is_input = True
    is_variable = True

    def __init__(self, mesh: Mesh, name: str, shape, dtype, initializer, trainable: bool):
        check_mesh(mesh, f"get_variable {name!r}")
        if any(v.name == name for v in mesh.graph.all_variables):
            raise GraphError(f"a variable named {name!r} already exists in this graph; variable names must be unique")
        super().__init__([], mesh=mesh, name=name)
        from meshax import initializers

        self.initializer = initializer if initializer is not None else initializers.zeros()
        self.trainable = trainable
        self._add_output(convert_to_shape(shape), dtype, name=name)
        self.graph.all_variables.append(self)
        if trainable:
            self.graph.trainable_variables.append(self)

    @property
    def value(self) -> Tensor:
        return self.outputs[0]

    @property
    def shape(self):
        return self.outputs[0].shape

    @property
    def dtype(self):
        return self.outputs[0].dtype

    def gradient(self, grad_outputs):
        return []


class AssignOperation(Operation):
    """Sets a variable to a new value (or adds/subtracts one) when the program runs.

    Every read of the variable in the same program sees the value from before the run."""

    differentiable = False

    def __init__(self, var: VariableOperation, value: Tensor, kind: str, name=None, assign_fn=None):
        super().__init__([var.value, value], name=name or f"assign_{var.name}")
        if value.shape != var.shape:
            raise GraphError(f"{kind}: value {value.name} {value.shape} does not match variable {var.name} {var.shape}")
        self.variable = var
        self.kind = kind
        self.assign_fn = assign_fn

    def lower(self, ctx):
        old, value = self.inputs
        layout = ctx.layout(old)
        v = ctx.get(value, layout)
        dtype = old.dtype
        if self.assign_fn is not None:  # (each device's slice: assign_fn(variable, old slice, new value's slice))
            fn, var = self.assign_fn, self.variable
            new = ctx.slicewise(lambda a, b: fn(var, a, b).astype(dtype), ctx.get(old), v)
        elif self.kind == "assign":
            new = ctx.slicewise(lambda b: b.astype(dtype), v)
        else:
            sign = 1 if self.kind == "assign_add" else -1
            new = ctx.slicewise(lambda a, b: (a + sign * b).astype(dtype), ctx.get(old), v)
        ctx.updates[self.variable] = new


def _variable_of(var) -> VariableOperation:
    if isinstance(var, VariableOperation):
        return var
    if isinstance(var, Tensor) and isinstance(var.operation, VariableOperation):
        return var.operation
    raise GraphError(f"expected a variable (from mx.get_variable), got {var!r}")


_STACKING: list[tuple[list, Callable[[Tensor], Tensor]]] = []
_REUSING: list[bool] = []
_GUARDS: list[Tensor] = []


@contextlib.contextmanager
def updates_only_where(condition: Tensor) -> Iterator[None]:
    """Inside, every `assign`, `assign_add` and `assign_sub` made takes effect only where the
    scalar bool `condition` holds when the program runs; elsewhere the variable keeps its value
    (a loss-scaled step whose gradients overflowed: `LossScaleOptimizer`). An `assign_fn`, which
    computes each slice itself, cannot be held back so: made inside, it is a GraphError."""
    if not isinstance(condition, Tensor) or condition.dtype != np.bool_ or condition.shape.rank != 0:
        raise GraphError(f"updates_only_where: give a scalar bool meshax Tensor, got {condition!r}")
    if _GUARDS:  # (inside another: both must hold)
        from meshax.ops.elementwise import logical_and

        condition = logical_and(_GUARDS[-1], condition)
    _GUARDS.append(condition)
    try:
        yield
    finally:
        _GUARDS.pop()


@contextlib.contextmanager
def reuse_variables() -> Iterator[None]:
    """Inside, `get_variable` of a name the graph has gives that variable (TensorFlow's
    variable scope with reuse): a model function called again shares its weights."""
    _REUSING.append(True)
    try:
        yield
    finally:
        _REUSING.pop()


@contextlib.contextmanager
def stacked_variables(dims: list, select: Callable[[Tensor], Tensor]) -> Iterator[None]:
    """Inside, `get_variable` makes each variable with `dims` in front (each index initialized
    on its own, as a layer of its own), or reuses it (`reuse_variables`), and returns
    `select(variable)`: how a pipeline gives each stage its own weights from layer code written
    for one (`meshax.pipeline`), and how decoding reads one stage's. A variable made outside
    (without `dims`: the global step, a weight every stage shares) is reused whole."""
    _STACKING.append((list(dims), select))
    try:
        yield
    finally:
        _STACKING.pop()


def get_variable(
    mesh: Mesh,
    name: str,
    shape,
    dtype="float32",
    master_dtype=None,
    slice_dtype=None,
    activation_dtype=None,
    initializer=None,
    trainable=True,
) -> Tensor:
    """A variable's value, as a Tensor. `initializer(key, shape, dtype)` as in jax.nn.initializers
    (see meshax.initializers); by default TensorFlow's, as in Mesh-TensorFlow: Glorot uniform for
    floats, zeros for integers and bools (`initializers.tensorflow_default`). Mesh-TensorFlow's
    arguments: the variable is kept in `master_dtype` (default `dtype`), each device's slice too
    (`slice_dtype`, if given, must be the same), and read as `activation_dtype` (a cast; its
    gradient is summed in the master dtype). meshax's own order, the initializer fourth
    (`get_variable(mesh, name, shape, init)`), works too."""
    if not (isinstance(name, str) and name):  # ('' became 'variable'; 3 a variable no checkpoint can name)
        raise GraphError(f"get_variable: the name must be a non-empty string (checkpoints keep it), got {name!r}")
    if callable(dtype) and not isinstance(dtype, type | np.dtype):  # (mesh, name, shape, initializer)
        dtype, initializer = "float32", dtype
    dtype = master_dtype or dtype
    if slice_dtype is not None and as_dtype(slice_dtype) != as_dtype(dtype):
        raise ConfigError(
            f"get_variable {name!r}: slice_dtype {slice_dtype} differs from the master dtype {dtype}; meshax keeps "
            "each device's slice in the master dtype: leave slice_dtype out, or read it as another dtype with "
            "activation_dtype"
        )
    if initializer is None:
        from meshax import initializers

        initializer = initializers.tensorflow_default()
    if not callable(initializer):
        raise ConfigError(
            f"get_variable {name!r}: the initializer must be a function (key, shape, dtype) -> array, as in "
            f"meshax.initializers or jax.nn.initializers (e.g. mx.initializers.constant(0.5)); got {initializer!r}"
        )
    existing = next((v for v in mesh.graph.all_variables if v.name == name), None) if _REUSING else None
    if existing is not None:
        # (inside stacked_variables: a stacked variable gives its index's weights; one made
        # outside, shared by every index (the global step, a tied weight), is read whole)
        lead, select = _STACKING[-1] if _STACKING else ([], None)
        want = convert_to_shape([*lead, *convert_to_shape(shape)])
        if existing.shape not in (want, convert_to_shape(shape)):
            raise GraphError(f"variable {name!r} exists with shape {existing.shape}, not {want}")
        value = select(existing.value) if select is not None and existing.shape == want else existing.value
    else:
        value = _new_variable(mesh, name, shape, initializer, dtype, trainable)
    if activation_dtype is not None:
        from meshax.ops.elementwise import cast

        value = cast(value, activation_dtype)
    return value


def _new_variable(mesh: Mesh, name: str, shape, initializer, dtype, trainable) -> Tensor:
    if len(_STACKING) > 1:  # (it took the inner dims alone: the outer stages shared it, without a word)
        raise GraphError(
            f"get_variable {name!r}: made inside two stacked_variables at once (a pipeline's stage inside "
            "another's), it would get the inner stage dims alone and every outer stage would share it; make it "
            "in the outer stage_fn, before the inner pipeline (each outer stage its own, read whole by the inner)"
        )
    if _STACKING:
        from meshax import initializers

        dims, select = _STACKING[-1]
        init = initializers.Stacked(initializer or initializers.zeros(), math.prod(d.size for d in dims))
        shape = convert_to_shape(shape)
        return select(VariableOperation(mesh, name, [*dims, *shape], dtype, init, trainable).value)
    return VariableOperation(mesh, name, shape, dtype, initializer, trainable).value


def global_step(mesh: Mesh) -> Tensor:
    """The step counter `global_step` (int32, from 0: exact up to 2^31 - 1 steps, where a float32
    one stopped at 2^24): the one the optimizer increments at each update, created here if nothing
    made it yet (TensorFlow's `get_or_create_global_step`)."""
    from meshax import initializers

    with reuse_variables():
        return get_variable(mesh, "global_step", [], dtype="int32", initializer=initializers.zeros(), trainable=False)


def read_variable(var) -> Tensor:
    """A variable's value (a variable, or its value: returned as is)."""
    return _variable_of(var).outputs[0]


def _assign(kind):
    def op(var, new_val, assign_fn=None, name=None) -> AssignOperation:
        if assign_fn is not None and kind != "assign":
            raise GraphError(f"{kind} takes no assign_fn: give it to assign (assign_fn=mx.assign_add_slice adds)")
        v, value = _variable_of(var), new_val
        if not isinstance(value, Tensor):
            from meshax.ops.inputs import constant

            value = (
                constant(v.mesh, value, v.shape, v.dtype)
                if np.ndim(value) == 0
                else constant(v.mesh, np.asarray(value), v.shape, v.dtype)
            )
        if _GUARDS:
            if assign_fn is not None:
                raise GraphError(
                    f"assign of {v.name} with an assign_fn inside updates_only_where (a loss-scaled "
                    "step): the assign_fn computes each slice itself and cannot be held back; "
                    "compute the new value as a tensor and assign it"
                )
            from meshax.ops.elementwise import where

            value = where(_GUARDS[-1], value, v.outputs[0] if kind == "assign" else 0, output_shape=value.shape)
        return AssignOperation(v, value, kind, name, assign_fn)

    op.__name__ = op.__qualname__ = kind
    what = {"assign": "set to", "assign_add": "increased by", "assign_sub": "decreased by"}[kind]
    op.__doc__ = (
        f"An update: when the program runs (`lowering.function(..., updates=[...])`), the variable is "
        f"{what} `new_val` (a tensor of its shape, or a scalar), after every read of it in that run."
        + (
            " `assign_fn(variable, slice, new_slice)`, Mesh-TensorFlow's, computes each device's new slice "
            "instead (`assign_slice`, `assign_add_slice`, `assign_sub_slice`, or a JAX function of yours)."
            if kind == "assign"
            else ""
        )
    )
    return also_accepts(value="new_val")(op)


def assign_slice(variable, slice_var, val):
    """The slice's new value is `val` (Mesh-TensorFlow's default `assign_fn` of `assign`):
    `assign_fn(variable, slice_var, val)` maps each device's slice of the variable and of the
    value (JAX arrays) to its new slice."""
    return val


def assign_add_slice(variable, slice_var, val):
    """An `assign_fn` that adds: the slice plus `val`."""
    return slice_var + val


def assign_sub_slice(variable, slice_var, val):
    """An `assign_fn` that subtracts: the slice minus `val`."""
    return slice_var - val


assign = _assign("assign")
assign_add = _assign("assign_add")
assign_sub = _assign("assign_sub")
