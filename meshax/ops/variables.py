"""Variables (state that lives sharded on the devices between runs) and assignments to them."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import numpy as np

from meshax.core.errors import GraphError
from meshax.core.graph import Mesh, Operation, Tensor
from meshax.core.shape import convert_to_shape


class VariableOperation(Operation):
    """A named, persistent tensor. Its value is kept by the Lowering as a global jax.Array with
    the NamedSharding its layout implies, read at the start of each run."""

    is_input = True
    is_variable = True

    def __init__(self, mesh: Mesh, name: str, shape, dtype, initializer, trainable: bool):
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

    def __init__(self, var: VariableOperation, value: Tensor, kind: str, name=None):
        super().__init__([var.value, value], name=name or f"assign_{var.name}")
        if value.shape != var.shape:
            raise GraphError(f"{kind}: value {value.name} {value.shape} does not match variable {var.name} {var.shape}")
        self.variable = var
        self.kind = kind

    def lower(self, ctx):
        old, value = self.inputs
        layout = ctx.layout(old)
        v = ctx.get(value, layout)
        dtype = old.dtype
        if self.kind == "assign":
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


@contextlib.contextmanager
def stacked_variables(dims: list, select: Callable[[Tensor], Tensor]) -> Iterator[None]:
    """Inside, `get_variable` makes each variable with `dims` in front (each index initialized
    on its own, as a layer of its own) and returns `select(variable)`: how a pipeline gives each
    stage its own weights from layer code written for one (`meshax.pipeline`)."""
    _STACKING.append((list(dims), select))
    try:
        yield
    finally:
        _STACKING.pop()


def get_variable(mesh: Mesh, name: str, shape, initializer=None, dtype="float32", trainable=True) -> Tensor:
    """A variable's value, as a Tensor. `initializer(key, shape, dtype)` as in jax.nn.initializers
    (see meshax.initializers); zeros by default."""
    if _STACKING:
        from meshax import initializers

        dims, select = _STACKING[-1]
        init = initializers.Stacked(initializer or initializers.zeros(), math.prod(d.size for d in dims))
        shape = convert_to_shape(shape)
        return select(VariableOperation(mesh, name, [*dims, *shape], dtype, init, trainable).value)
    return VariableOperation(mesh, name, shape, dtype, initializer, trainable).value


def _assign(kind):
    def op(var, value, name=None) -> AssignOperation:
        v = _variable_of(var)
        if not isinstance(value, Tensor):
            from meshax.ops.inputs import constant

            value = (
                constant(v.mesh, value, v.shape, v.dtype)
                if np.ndim(value) == 0
                else constant(v.mesh, np.asarray(value), v.shape, v.dtype)
            )
        return AssignOperation(v, value, kind, name)

    op.__name__ = op.__qualname__ = kind
    what = {"assign": "set to", "assign_add": "increased by", "assign_sub": "decreased by"}[kind]
    op.__doc__ = (
        f"An update: when the program runs (`lowering.function(..., updates=[...])`), the variable is "
        f"{what} `value` (a tensor of its shape, or a scalar), after every read of it in that run."
    )
    return op


assign = _assign("assign")
assign_add = _assign("assign_add")
assign_sub = _assign("assign_sub")
