"""Reductions over named dims, and the ops built from them (softmax, argmax, logsumexp ...).

A sum over a split dim leaves each device with a partial sum; the output stays *pending* over
those mesh dims (a lazy allreduce) until a consumer needs it, so that sums can be added before
communicating and an allreduce followed by a split becomes a reduce-scatter. max and min are
settled at once with a max/min allreduce.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from meshax.core.errors import GraphError
from meshax.core.graph import Operation, Tensor, is_floating
from meshax.core.shape import Dimension, Shape, convert_to_shape
from meshax.layout import TensorLayout
from meshax.ops import elementwise as ew
from meshax.ops._dtypes import inexact, sum_dtype
from meshax.ops._util import also_accepts, dim_of, shape_of_names

# lax's max and min: of no values they give their identity (-inf, +inf), as the jaxpr's reduce_max
# does; jnp.max raised "zero-size array to reduction operation max which has no identity"
_LOCAL = {"sum": jnp.sum, "max": lax.reduce_max, "min": lax.reduce_min}


def identity(kind: str, dtype):
    """The value that leaves a `kind` reduction unchanged."""
    if kind == "sum":
        return 0
    if jnp.issubdtype(dtype, jnp.inexact):  # (bfloat16 included)
        return -np.inf if kind == "max" else np.inf
    return jnp.iinfo(dtype).min if kind == "max" else jnp.iinfo(dtype).max


class ReduceOperation(Operation):
    def __init__(self, x: Tensor, reduced: list[Dimension], kind: str, name=None):
        super().__init__([x], name=name or f"reduce_{kind}")
        self.kind = kind
        self.reduced = reduced
        if kind != "sum" and x.dtype == np.bool_:
            raise GraphError(
                f"reduce_{kind} of bool tensor {x.name}: use mx.reduce_any / mx.reduce_all, or cast it to int32 first"
            )
        # A sum of bools counts them (int32), and small ints widen, as in jnp.sum.
        dtype = sum_dtype(x.dtype) if kind == "sum" else x.dtype
        self._add_output([d for d in x.shape if d not in reduced], dtype)

    def lower(self, ctx):
        from meshax.lower.context import source

        (x,), (out,) = self.inputs, self.outputs
        run = ctx.layouts(self)
        (in_layout,), (out_layout,) = run.operands, run.results
        pending = run.pending
        if getattr(source(x).operation, "fill", None) is not None:
            # a constant (or a range): each device makes it whole over the reduced dims, as cheaply
            # as its slices, so no device owes another a sum; XLA drops an allreduce of values
            # every device holds alike (reduce_max of ones over a split dim: 2 allreduces counted)
            in_layout = TensorLayout([() if d in self.reduced else a for d, a in zip(x.shape, in_layout.axes)])
            pending = frozenset()
        v = ctx.get(x, in_layout, allow_partial=self.kind == "sum")
        v = ctx.masked(v, x.shape, self.reduced, identity(self.kind, x.dtype))  # (uneven splits' padding)
        axes = [i for i, d in enumerate(x.shape) if d in self.reduced]
        # cast before the local sum, so that the partial sums (and their allreduce) are counts
        local = ctx.slicewise(lambda a: _LOCAL[self.kind](a.astype(out.dtype), tuple(axes)), v)
        ctx.add_flops(ctx.local_size(x, in_layout))
        if self.kind == "sum":
            ctx.set_output(out, local, out_layout, pending | v.pending)
        else:
            ctx.set_output(out, ctx.allreduce(local, sorted(pending), self.kind), out_layout)

    def gradient(self, grad_outputs):
        (g,), (x,), (y,) = grad_outputs, self.inputs, self.outputs
        if g is None:
            return [None]
        from meshax.ops.shape_ops import broadcast

        gb = broadcast(g, x.shape)
        if self.kind == "sum":
            return [gb]
        # Ties share the gradient equally, as jax.grad(jnp.max) does.
        mask = ew.cast(ew.equal(x, broadcast(y, x.shape)), g.dtype)
        ties = broadcast(reduce_sum(mask, reduced_dim=self.reduced), x.shape)
        return [gb * mask / ties]


def _reduced_dims(x: Tensor, reduced_dim, output_shape) -> tuple[list[Dimension], Shape | None]:
    """The dims to reduce, and `output_shape` as a Shape (names without sizes are x's dims)."""
    if reduced_dim is not None and output_shape is not None:
        raise GraphError("give reduced_dim or output_shape, not both")
    if output_shape is not None:
        output_shape = shape_of_names(output_shape, [x])
        extra = [d for d in output_shape if d not in x.shape]
        if extra:
            raise GraphError(f"output_shape {output_shape} has dims {extra} that {x.name} {x.shape} lacks")
        return [d for d in x.shape if d not in output_shape], output_shape
    if reduced_dim is None:
        return list(x.shape), None
    return [dim_of(x, d) for d in shape_of_names(reduced_dim, [x])], None


def _reduction(x: Tensor, reduced: list[Dimension], kind: str, name) -> Tensor:
    """One op per distinct reduction of a tensor: softmax's and argmax's max over the same dim
    are one max-allreduce, not two (XLA would merge them, and the counters must match)."""
    key = (x, kind, frozenset(reduced))
    if key not in x.graph.memo:
        x.graph.memo[key] = ReduceOperation(x, reduced, kind, name).outputs[0]
    return x.graph.memo[key]


def _in_order(y: Tensor, output_shape) -> Tensor:
    """y with its dims in `output_shape`'s order, when one was asked for."""
    if output_shape is None or y.shape == convert_to_shape(output_shape):
        return y
    from meshax.ops.shape_ops import transpose

    return transpose(y, output_shape)


def _reduce(kind):
    def op(x: Tensor, reduced_dim=None, output_shape=None, name=None) -> Tensor:
        reduced, output_shape = _reduced_dims(x, reduced_dim, output_shape)
        return _in_order(_reduction(x, reduced, kind, name) if reduced else x, output_shape)

    op.__name__ = op.__qualname__ = f"reduce_{kind}"
    op.__doc__ = (
        f"reduce_{kind} over `reduced_dim` (a Dimension or list), or down to `output_shape`; neither: all dims."
    )
    return op


reduce_sum = _reduce("sum")
reduce_max = _reduce("max")
reduce_min = _reduce("min")


def _floating(x: Tensor) -> Tensor:
    return ew.cast(x, inexact(x.dtype))


def reduce_mean(x: Tensor, reduced_dim=None, output_shape=None, name=None) -> Tensor:
    """The mean: a float for integer and bool tensors (the fraction of Trues), as jnp.mean."""
    reduced, output_shape = _reduced_dims(x, reduced_dim, output_shape)
    if not reduced:
        return _in_order(_floating(x), output_shape)
    if x.dtype == np.float16:  # summed in float32, as jnp.mean: a float16 sum past 65504 is inf
        return _in_order(ew.cast(reduce_mean(ew.cast(x, "float32"), reduced, name=name), x.dtype), output_shape)
    count = int(np.prod([d.size for d in reduced], dtype=np.int64))
    total = ew.cast(reduce_sum(x, reduced_dim=reduced, name=name), inexact(sum_dtype(x.dtype)))
    return _in_order(total * (1.0 / count), output_shape)


def reduce_logsumexp(x: Tensor, reduced_dim=None, extra_logit=None, name=None, output_shape=None) -> Tensor:
    """log(sum(exp(x))) over the reduced dims, computed stably (the max is subtracted first);
    `extra_logit` (a scalar or a tensor of the output's dims): one more term exp(extra_logit) in
    the sum, as Mesh-TensorFlow's."""
    reduced, output_shape = _reduced_dims(x, reduced_dim, output_shape)
    x = _floating(x)
    if not reduced and extra_logit is None:
        return _in_order(x, output_shape)
    m = _finite(reduce_max(x, reduced_dim=reduced)) if reduced else x
    if extra_logit is None:
        return _in_order(ew.log(reduce_sum(ew.exp(x - m), reduced_dim=reduced)) + m, output_shape)
    m = _finite(ew.maximum(m, extra_logit))
    total = reduce_sum(ew.exp(x - m), reduced_dim=reduced) + ew.exp(extra_logit - m)
    return _in_order(ew.log(total) + m, output_shape)


def _finite(m: Tensor) -> Tensor:
    """logsumexp's shift: the max, or 0 where it is infinite (a row of -inf sums to exp(-inf) = 0,
    whose log is -inf, as jax.nn.logsumexp's; -inf - -inf would be NaN). No gradient."""
    return ew.stop_gradient(ew.where(ew.less(ew.abs(m), float("inf")), m, 0.0))


def _truth(x: Tensor) -> Tensor:
    """1 where x is true (nonzero), else 0, as int32: max and min of it are any and all."""
    return ew.cast(x if x.dtype == np.bool_ else ew.not_equal(x, 0), "int32")


def reduce_any(x: Tensor, reduced_dim=None, output_shape=None, name=None) -> Tensor:
    """Whether any value along the reduced dims is true (nonzero), as jnp.any."""
    return ew.cast(reduce_max(_truth(x), reduced_dim, output_shape), bool)


def reduce_all(x: Tensor, reduced_dim=None, output_shape=None, name=None) -> Tensor:
    """Whether every value along the reduced dims is true (nonzero), as jnp.all."""
    return ew.cast(reduce_min(_truth(x), reduced_dim, output_shape), bool)


@also_accepts(dim="reduced_dim")
def softmax(x: Tensor, reduced_dim, extra_logit=None, name=None) -> Tensor:
    """softmax along `reduced_dim`: exp(x - max) / sum (with one more term exp(extra_logit) in the
    sum, where given); a split dim costs one max and one sum allreduce."""
    if extra_logit is not None:
        return ew.exp(log_softmax(x, reduced_dim, extra_logit))
    d = dim_of(x, reduced_dim)
    x = _floating(x)
    e = ew.exp(x - ew.stop_gradient(reduce_max(x, reduced_dim=d)))
    return e / reduce_sum(e, reduced_dim=d)


@also_accepts(dim="reduced_dim")
def log_softmax(x: Tensor, reduced_dim, extra_logit=None, name=None) -> Tensor:
    """log(softmax(x)) along `reduced_dim`, computed stably."""
    return x - reduce_logsumexp(x, reduced_dim=dim_of(x, reduced_dim), extra_logit=extra_logit)


@also_accepts(dim="reduced_dim")
def argmax(x: Tensor, reduced_dim, name=None) -> Tensor:
    """Index of the largest value along `reduced_dim` (the first one on ties; the first NaN
    where there is one, as `jnp.argmax`), as int32."""
    from meshax.ops.inputs import range as mrange

    d = dim_of(x, reduced_dim)
    if x.dtype == np.bool_:
        x = ew.cast(x, "int32")
    index, n = mrange(x.mesh, d, "int32"), d.size
    is_max = ew.equal(x, reduce_max(x, reduced_dim=d))
    if not is_floating(x.dtype):
        return reduce_min(ew.where(is_max, index, n), reduced_dim=d)
    # a NaN's index before any max's (the max itself may have dropped the NaN: XLA's max over
    # devices does on the CPU, so the answer must come from x alone, the same on every layout)
    first = reduce_min(ew.where(ew.not_equal(x, x), index, ew.where(is_max, index + n, 2 * n)), reduced_dim=d)
    return ew.where(first >= n, first - n, first)


def top_1(x: Tensor, reduced_dim, name=None) -> tuple[Tensor, Tensor]:
    """The largest value along `reduced_dim` and its index (the first one on ties), as
    Mesh-TensorFlow's: (values, int32 indices), without that dim."""
    return reduce_max(x, reduced_dim=dim_of(x, reduced_dim), name=name), argmax(x, reduced_dim)


def _nth_element(x: Tensor, n: int, reduced_dim, largest: bool) -> Tensor:
    d = dim_of(x, reduced_dim)
    if not 0 <= n < d.size:
        raise GraphError(f"n = {n} is outside 0..{d.size - 1}, the indices of {d}")
    from meshax.ops.indexing import top_k
    from meshax.ops.slicing import entry

    k_dim = Dimension(d.name + "_topk", n + 1)
    values, _ = top_k(x if largest else _reversed_order(x), d, k_dim)
    nth = entry(values, n, k_dim)
    return nth if largest else _reversed_order(nth)


def _reversed_order(x: Tensor) -> Tensor:
    """x mapped by an order-reversing bijection that is its own inverse: -x for floats; for
    integers -x - 1 (~x), which wraps: -x overflows at the signed minimum and sends an
    unsigned 0 to 0 (the smallest would read as the largest)."""
    if np.issubdtype(x.dtype, np.integer):
        return ew.negative(x) - 1
    return ew.negative(x)


def nth_largest_element(x: Tensor, n: int, reduced_dim, name=None) -> Tensor:
    """The n-th largest value along `reduced_dim` (n = 0: the largest), without that dim."""
    return _nth_element(x, n, reduced_dim, largest=True)


def nth_smallest_element(x: Tensor, n: int, reduced_dim, name=None) -> Tensor:
    """The n-th smallest value along `reduced_dim` (n = 0: the smallest), without that dim."""
    return _nth_element(x, n, reduced_dim, largest=False)


def reduce_first(tensor: Tensor, reduced_dim) -> Tensor:
    """The entry at index 0 of `reduced_dim`, without that dim."""
    from meshax.ops.slicing import entry

    return entry(tensor, 0, reduced_dim)
