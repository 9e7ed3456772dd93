"""Layout annotations: GSPMD's `mesh_split` and the by-name `shard`.

An annotation is an identity op whose output's layout the user fixes, dim by dim (an `OPEN`
entry leaves that dim to propagation). Its gradient carries the same annotation (GSPMD section
3.4), so the backward pass is annotated too. One tensor takes one annotation: a second,
different one is refused (to lay one tensor out two ways, annotate a copy: `mx.identity(x)`).
"""

from __future__ import annotations

from collections.abc import Sequence

from meshax.core.errors import LayoutError
from meshax.core.graph import Operation, Tensor
from meshax.layout import OPEN, convert_to_layout_rules

Annotation = tuple  # per tensor dim: a tuple of mesh dim names (major to minor; () replicated) or OPEN


class ShardOperation(Operation):
    """Identity whose output has the annotated layout, whatever the rules say."""

    passes_sums = True  # a partial sum flows through: settling it is blamed on the op that summed

    def __init__(self, x: Tensor, annotation: Annotation, priority: int = 0, name=None):
        super().__init__([x], name=name or "shard")
        self.annotation = annotation
        self.priority = priority
        self._add_output(x.shape, x.dtype)

    def lower(self, ctx):
        (x,), (out,) = self.inputs, self.outputs
        run = ctx.layouts(self)  # x resharded to the annotated layout (a tie with resharding later)
        v = ctx.get(x, run.operands[0], allow_partial=True)
        ctx.set_output(out, v.slices, run.results[0], v.pending)

    def remade(self, ctx, layout) -> list | None:
        """Its slices in `layout` made where its input's are made with nothing moved (a constant,
        a broadcast of one: the gradient of a sum into the loss, annotated as the summed tensor
        was), as XLA simplifies a gather of a constant. None where the input would have to move,
        here or into the annotated layout (then that move, counted, is what a reader reads)."""
        (x,) = self.inputs
        v = ctx.values.get(x)
        if v is None or v.pending:
            return None
        fill, remade = getattr(x.operation, "fill", None), getattr(x.operation, "remade", None)
        if fill is not None:
            return fill(ctx, layout)
        if remade is None or remade(ctx, ctx.values[self.outputs[0]].layout) is None:
            return None
        return remade(ctx, layout)

    def gradient(self, grad_outputs):
        (g,) = grad_outputs
        if g is None:
            return [None]
        seen = g.graph.memo.get(("annotation", g))
        if seen is not None and (seen.annotation, seen.priority) != (self.annotation, self.priority):
            # one gradient reaching two tensors annotated two ways (x laid out as it is and as a
            # copy, then added back): each annotation's gradient annotates a copy of it, as the
            # user annotated a copy, not the one tensor twice
            from meshax.ops.elementwise import identity

            g = identity(g)
        return [_annotate(g, self.annotation, self.priority, None, self.source)]


def _entry(x: Tensor, i: int, entry, where: str):
    if entry is OPEN:
        return OPEN
    if entry is None:
        return ()
    names = (entry,) if isinstance(entry, str) else tuple(entry) if isinstance(entry, Sequence) else None
    if names is None or not all(isinstance(m, str) for m in names):
        raise LayoutError(
            f"mesh_split of {x.name!r} {x.shape} at {where}: entry {i} ({x.shape[i].name!r}) is "
            f"{entry!r}; give a mesh dim name, a tuple of names, None (replicated) or mx.OPEN"
        )
    return names


def _annotate(x: Tensor, annotation: Annotation, priority: int, name, where: str) -> Tensor:
    used = [m for e in annotation if e is not OPEN for m in e]
    twice = sorted({m for m in used if used.count(m) > 1})
    if twice:
        raise LayoutError(
            f"annotation of {x.name!r} {x.shape} at {where}: mesh dim(s) {twice} used more than "
            "once; a mesh dim can split at most one dim of a tensor"
        )
    key = ("annotation", x)
    seen = x.graph.memo.get(key)
    if seen is not None:
        if (seen.annotation, seen.priority) == (annotation, priority):
            return seen.outputs[0]
        raise LayoutError(
            f"conflicting annotations on {x.name!r} {x.shape}: {_show(seen.annotation)} at "
            f"{seen.source} and {_show(annotation)} at {where}; annotate it once (to lay it "
            "out two ways, annotate a copy: mx.identity(x))"
        )
    if not (isinstance(priority, int) and priority >= 0):
        raise LayoutError(f"annotation of {x.name!r} at {where}: priority must be an int >= 0, got {priority!r}")
    op = ShardOperation(x, annotation, priority, name)
    x.graph.memo[key] = op
    return op.outputs[0]


def _show(annotation: Annotation) -> str:
    return (
        "["
        + ", ".join(
            "OPEN" if e is OPEN else (repr(e[0]) if len(e) == 1 else repr(e)) if e else "None" for e in annotation
        )
        + "]"
    )


def mesh_split(x: Tensor, dims_mapping, priority: int = 0, name=None) -> Tensor:
    """x annotated GSPMD-style: one entry per dim of x, in order: a mesh dim name, a tuple of
    names (major to minor), None (replicated) or `mx.OPEN` (propagation decides). Annotations
    of priority p > 0 take part only after those of lower priority have propagated (Shardy's
    p0, p1), so e.g. the batch split can be settled before the model's. On a jax array (inside
    a function given to `mx.partition`) it records the annotation in the traced program."""
    if not isinstance(x, Tensor):  # a jax array inside a function for mx.partition
        from meshax.jaxpr.annotate import mesh_split_array

        return mesh_split_array(x, dims_mapping, priority)
    where = x.graph.where()
    if isinstance(dims_mapping, str) or not isinstance(dims_mapping, Sequence):
        raise LayoutError(
            f"mesh_split of {x.name!r} at {where}: dims_mapping must be a list with one "
            f"entry per dim of {x.shape}, got {dims_mapping!r}"
        )
    if len(dims_mapping) != x.shape.rank:
        raise LayoutError(
            f"mesh_split of {x.name!r} {x.shape} at {where}: dims_mapping has "
            f"{len(dims_mapping)} entries for {x.shape.rank} dims; give one per dim, in order "
            f"({x.shape.dimension_names})"
        )
    return _annotate(x, tuple(_entry(x, i, e, where) for i, e in enumerate(dims_mapping)), priority, name, where)


def shard(x: Tensor, layout, priority: int = 0, name=None) -> Tensor:
    """x laid out as `layout`, by dim name (e.g. "batch:cols"; "" = replicated), overriding the
    rules; dims it does not name are replicated."""
    where = x.graph.where()
    rules = convert_to_layout_rules(layout)
    unknown = [d for d in rules.tensor_dim_names if d not in x.shape]
    if unknown:
        raise LayoutError(
            f"layout {str(rules)!r} for tensor {x.name!r} at {where} names dim(s) {unknown} "
            f"that it does not have (its dims: {x.shape.dimension_names})"
        )
    return _annotate(x, tuple(tuple(rules.mesh_dims_for(d.name)) for d in x.shape), priority, name, where)
