"""einsum over named dims: the paper's workhorse (matmul, broadcast, contraction, transpose).

Lowering (paper section 5): every device runs einsum on its own slices; mesh dims that split a
summed-out dim leave partial sums, owed as a lazy allreduce over exactly those mesh dims.
When inputs disagree on how a dim is split, or two dims would share a mesh dim, an input is
resharded first so that each mesh dim splits at most one dim of the iteration space.
"""

from __future__ import annotations

import string

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshax.core.errors import GraphError, did_you_mean
from meshax.core.graph import Operation, Tensor, as_dtype, is_floating
from meshax.core.shape import Shape
from meshax.layout.rules import block_sizes
from meshax.ops._dtypes import gradient_dtype, result_type
from meshax.ops._util import shape_of_names
from meshax.ops.elementwise import cast, union_shape


def _subscripts(shapes: list[Shape], out: Shape) -> str:
    letters: dict[str, str] = {}
    for s in [*shapes, out]:
        for d in s:
            if d.name not in letters:
                if len(letters) == 52:
                    raise GraphError("einsum over more than 52 distinct dims is not supported")
                letters[d.name] = string.ascii_letters[len(letters)]
    spec = ",".join("".join(letters[d.name] for d in s) for s in shapes)
    return spec + "->" + "".join(letters[d.name] for d in out)


def contract(spec: str, xs, dtype):
    """`jnp.einsum(spec, *xs, preferred_element_type=dtype)` built as jnp.einsum builds it for one
    or two operands (the same dot_general, sums and transpose: the same program), without its
    per-call contraction-path search: tracing a model calls this for every einsum, and a layout
    search traces a model hundreds of times. (For meshax's slices: each letter appears once per
    operand, as dim names are unique in a shape, and no slice is weakly typed.)"""
    if len(xs) > 2:
        return jnp.einsum(spec, *xs, preferred_element_type=dtype)
    with jax.named_scope(spec):  # (the name jnp.einsum gives its ops in the HLO's metadata)
        return _contract(spec, xs, dtype)


def _contract(spec: str, xs, dtype):
    ins, out = spec.split("->")
    names, xs = ins.split(",")[::-1], list(xs)[::-1]  # (the pair in the order opt_einsum hands jnp)
    for i, n in enumerate(names):  # sum out what appears in no other operand and not in the output
        keep = set(out).union(*(m for j, m in enumerate(names) if j != i))
        axes = tuple(k for k, c in enumerate(n) if c not in keep)
        if axes:
            if jnp.result_type(xs[i].dtype, dtype) != xs[i].dtype:
                xs[i] = xs[i].astype(dtype)
            xs[i] = lax.reduce_sum(xs[i], axes)
            names[i] = "".join(c for c in n if c in keep)
    if len(xs) == 1:
        (y,), (got,) = xs, names
    else:
        (lhs, rhs), (ln, rn) = xs, names
        summed = sorted(set(ln) & set(rn) - set(out))
        batch = [c for c in out if c in ln and c in rn]
        lc, rc = tuple(ln.index(c) for c in summed), tuple(rn.index(c) for c in summed)
        lb, rb = tuple(ln.index(c) for c in batch), tuple(rn.index(c) for c in batch)
        rest_l, rest_r = ("".join(c for c in n if c not in batch and c not in summed) for n in (ln, rn))
        got = "".join(batch) + rest_r + rest_l
        if got == out:  # (rhs first where that needs no transpose, as jnp.einsum tries)
            y = lax.dot_general(rhs, lhs, ((rc, lc), (rb, lb)), preferred_element_type=dtype)
        else:
            got = "".join(batch) + rest_l + rest_r
            y = lax.dot_general(lhs, rhs, ((lc, rc), (lb, rb)), preferred_element_type=dtype)
    if got != out:
        y = lax.transpose(y, tuple(got.index(c) for c in out))
    return y if y.dtype == dtype else lax.convert_element_type(y, dtype)


class EinsumOperation(Operation):
    def __init__(self, inputs: list[Tensor], output_shape: Shape, name=None, dtype=None):
        super().__init__(inputs, name=name or "einsum")
        every = union_shape(*[t.shape for t in inputs])
        sizes = {d.name: d.size for d in every}
        for d in output_shape:  # (a name the inputs have at another size: said so, not "in no input")
            if d.name in sizes and d.size != sizes[d.name]:
                raise GraphError(
                    f"einsum output_shape has {d.name}:{d.size}, but the inputs have {d.name}:{sizes[d.name]} "
                    f"({[str(t.shape) for t in inputs]})"
                )
        missing = [d for d in output_shape if d not in every]
        if missing:
            raise GraphError(
                f"einsum output dims {missing} appear in no input ({[str(t.shape) for t in inputs]})"
                f"{did_you_mean(missing[0].name, sizes)}"
            )
        bools = [t.name for t in inputs if t.dtype == np.bool_]
        if bools:
            raise GraphError(f"einsum sums products, and {bools} are bool: cast them to int32 or a float first")
        natural = result_type(*[t.dtype for t in inputs])
        out = natural if dtype is None else as_dtype(dtype)
        if dtype is not None and (not is_floating(out) or not is_floating(natural)):
            raise GraphError(f"einsum dtype={out}: a float output needs float inputs (they are {natural})")
        self._add_output(output_shape, out)
        self._subscripts = _subscripts([t.shape for t in inputs], output_shape)

    def lower(self, ctx):
        out = self.outputs[0]
        run = ctx.layouts(self)
        used = {m for a in run.assign.values() for m in a}
        local = {d.name: d.size for t in self.inputs for d in t.shape}
        for name, axes in run.assign.items():
            local[name] = block_sizes(local[name], axes, ctx.mesh_shape)[-1]
        vals = [ctx.get(t, lay, allow_partial=True) for t, lay in zip(self.inputs, run.operands)]
        # The einsum is linear in one partial input, if the others are whole and its owed axes
        # split nothing here; otherwise settle the sums first. So too where its result is larger
        # than that input (a one-hot adding a dim): settling the smaller tensor moves fewer values.
        partial = [i for i, v in enumerate(vals) if v.pending]
        size = lambda shape: int(np.prod([local[d.name] for d in shape], dtype=np.int64))  # noqa: E731
        if len(partial) > 1 or (
            partial and (vals[partial[0]].pending & used or size(out.shape) > size(self.inputs[partial[0]].shape))
        ):
            vals = [ctx.get(t, lay) for t, lay in zip(self.inputs, run.operands)]
        summed = [d for d in union_shape(*[t.shape for t in self.inputs]) if d not in out.shape]
        vals = [ctx.masked(v, t.shape, summed, 0) for t, v in zip(self.inputs, vals)]  # (uneven splits' padding)
        pending = set().union(run.pending, *[v.pending for v in vals])
        ctx.add_flops((2 if len(self.inputs) > 1 else 1) * int(np.prod(list(local.values()), dtype=np.int64)))
        spec = self._subscripts
        result = ctx.slicewise(lambda *xs: contract(spec, xs, out.dtype), *vals)
        ctx.set_output(out, result, run.results[0], pending)

    def gradient(self, grad_outputs):
        (g,) = grad_outputs
        if g is None:
            return [None] * len(self.inputs)
        from meshax.ops.shape_ops import broadcast

        natural = result_type(*[t.dtype for t in self.inputs])
        if is_floating(natural) and is_floating(g.dtype) and natural.itemsize < g.dtype.itemsize:
            # A wide einsum (bfloat16 inputs summed into float32: the logits) passes its gradient
            # back at the inputs' width, so its gradient's matmuls are bfloat16 ones as the rest
            # of the step's are (JAX lowers a float32 gradient beside a bfloat16 operand to a
            # float32 matmul, the bfloat16 operand converted up)
            g = cast(g, natural)
        grads = []
        for i, x in enumerate(self.inputs):
            others = [g] + [t for j, t in enumerate(self.inputs) if j != i]
            available = union_shape(*[t.shape for t in others])
            reachable = Shape([d for d in x.shape if d in available])
            # x's own dtype (a bfloat16 activation's gradient stays bfloat16 beside float32 logits),
            # or a bfloat16 weight's master dtype (its gradient sums in float32)
            dtype = gradient_dtype(x) if is_floating(x.dtype) else None
            gx = einsum(others, output_shape=reachable, dtype=None if dtype == result_type(*others) else dtype)
            grads.append(gx if reachable == x.shape else broadcast(gx, x.shape))
        return grads


def einsum(xs, *more, output_shape=None, reduced_dims=None, name=None, dtype=None) -> Tensor:
    """Einstein summation by dimension name: `einsum([x, w], output_shape)` (Mesh-TensorFlow's
    form, output_shape second or by keyword), or `einsum(x, w, output_shape=...)`.

    Without output_shape, the output has the dims that appear in exactly one input (in order of
    first appearance), or, when reduced_dims is given, every dim except those. `dtype`: the
    output's float dtype, products summed in it (bfloat16 inputs, float32 sums and result: the
    logits of a mixed-precision model); default JAX's promotion of the inputs'."""
    if isinstance(xs, list | tuple):  # einsum([x, w], output_shape, reduced_dims, name)
        if len(more) > 3:
            raise GraphError(f"einsum([...], output_shape, reduced_dims, name) got {len(more)} more arguments")
        output_shape, reduced_dims, name = (*more, *(output_shape, reduced_dims, name)[len(more) :])
        xs = tuple(xs)
    else:
        xs = (xs, *more)
    if not xs:
        raise GraphError("einsum needs at least one tensor")
    for t in xs:
        if not isinstance(t, Tensor):
            raise GraphError(f"einsum inputs must be meshax Tensors, got {t!r}")
    every = union_shape(*[t.shape for t in xs])
    if reduced_dims is not None:  # (a dim no input has, or of another size, is a typo: it reduced nothing)
        reduced = shape_of_names(reduced_dims, xs)
        for d in reduced:
            if d not in every:
                shapes = ", ".join(f"{t.name} {t.shape}" for t in xs)
                have = next((e for e in every if e.name == d.name), None)
                close = did_you_mean(d.name, every.dimension_names)
                which = f"the inputs have {have}" if have else f"no input has it{close}"
                raise GraphError(f"einsum reduced_dims has {d}, but {which} (inputs: {shapes})")
    if output_shape is not None:
        output_shape = shape_of_names(output_shape, xs)
        if reduced_dims is not None and any(d in output_shape for d in reduced):
            kept = [d for d in reduced if d in output_shape]
            raise GraphError(
                f"einsum reduced_dims {kept} are in the output_shape {output_shape} too: give one or the other"
            )
    elif reduced_dims is not None:
        output_shape = Shape([d for d in every if d not in reduced])
    else:
        counts = {d.name: sum(d in t.shape for t in xs) for d in every}
        output_shape = Shape([d for d in every if counts[d.name] == 1])
    return EinsumOperation(list(xs), output_shape, name, dtype).outputs[0]


def matmul(a: Tensor, b: Tensor, output_shape=None, reduced_dims=None, name=None) -> Tensor:
    """`einsum([a, b], ...)`: the product of two tensors, summing the dims not in the output."""
    return einsum([a, b], output_shape=output_shape, reduced_dims=reduced_dims, name=name)
