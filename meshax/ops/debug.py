"""`Print`, `depend` and `log_scalar`: Mesh-TensorFlow's debugging and ordering ops, for JAX.

`Print(x, data, message)` is x, and prints `message` and the whole values of `data` when the
program runs (`jax.debug.print`, once per device: each device prints what it holds after the
data is gathered). `depend(x, dependencies)` is x: Mesh-TensorFlow needed it to order
TensorFlow's side effects; a meshax program runs in dataflow order and its assignments come
after every read, so there is nothing to order. `log_scalar(name, x)` is Mesh-TensorFlow's
`scalar_summary` without TensorFlow: the training loop writes the value at every step with its
metrics (JSON lines, TensorBoard).
"""

from __future__ import annotations

import jax

from meshax.core.errors import GraphError
from meshax.core.graph import Tensor
from meshax.layout import ShardingRule
from meshax.ops.slicewise import SlicewiseOperation


class PrintOperation(SlicewiseOperation):
    """x passed through (its split kept); the data tensors gathered whole and printed."""

    def __init__(self, x: Tensor, data: list[Tensor], message: str):
        shapes = [x.shape, *(t.shape for t in data)]
        rule = ShardingRule.by_name(shapes, [x.shape], whole={d.name for t in data for d in t.shape})
        fmt = message + " " + " ".join("{}" for _ in data)

        def show(_local, a, *values):
            jax.debug.print(fmt, *values)
            return a

        super().__init__([x, *data], show, [x.shape], [x.dtype], rule=rule, linear=True, name="Print")
        self.differentiable = True

    def gradient(self, grad_outputs):
        return [grad_outputs[0]] + [None] * (len(self.inputs) - 1)


def Print(x: Tensor, data, message: str) -> Tensor:
    """x, printing `message` and the values of the tensors `data` whenever the program runs."""
    data = [data] if isinstance(data, Tensor) else list(data)
    if not all(isinstance(t, Tensor) for t in [x, *data]):
        raise GraphError("Print takes a meshax Tensor x and a list of meshax Tensors to print")
    return PrintOperation(x, data, str(message)).outputs[0]


def log_scalar(name: str, x: Tensor) -> Tensor:
    """Log the scalar `x` as `name` at every training step (Mesh-TensorFlow's `scalar_summary`):
    `meshax train` and `meshax.train.train` write it with the step's loss (`--metrics` JSON lines,
    TensorBoard). The graph keeps them in `graph.logged_scalars` (name -> tensor), for a loop of
    your own to fetch. Returns x."""
    if not isinstance(x, Tensor) or x.shape.rank != 0:
        raise GraphError(
            f"log_scalar {name!r}: give a scalar meshax Tensor (reduce it first, e.g. mx.reduce_mean), got {x!r}"
        )
    logged = x.graph.logged_scalars
    if name in logged and logged[name] is not x:
        raise GraphError(f"log_scalar: {name!r} is logged already; give each scalar its own name")
    logged[name] = x
    return x


def depend(x: Tensor, dependencies) -> Tensor:
    """x (Mesh-TensorFlow ordered side effects with it; a meshax program needs no ordering)."""
    return x
