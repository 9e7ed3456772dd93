"""Say why: every tensor's layout and where it came from, and what to worry about.

`Lowering.explain()` lists each tensor's final layout with its origin per split dim (a rule,
an annotation at file:line, or propagated from which neighbour through which op and in which
direction), then warns about large tensors left replicated over a mesh dim, and about every
reshard an annotation forces.
"""

from __future__ import annotations

from meshax.core.graph import Tensor
from meshax.core.shape import Shape
from meshax.layout import TensorLayout


def layout_string(shape: Shape, layout: TensorLayout, mesh_shape: Shape) -> str:
    """ "batch:rows;d_ff:cols" (a dim split over two mesh dims appears twice); "" when replicated."""
    return ";".join(f"{d.name}:{mesh_shape[m].name}" for d, axes in zip(shape, layout.axes) for m in axes)


def _dims(shape: Shape) -> str:
    return "[" + ", ".join(f"{d.name}={d.size}" for d in shape) + "]"


def _origin(lowering, t: Tensor) -> str:
    prop = lowering.plan.propagation
    if t not in prop.axes:
        return "built after the lowering: rules only"
    layout = lowering.plan[t]
    parts = [f"{d.name}: {o}" for d, a, o in zip(t.shape, layout.axes, prop.origins(t)) if a]
    if parts:
        return "; ".join(parts)
    fixed = [o for o, f in zip(prop.origins(t), prop.fixed[t]) if f]
    return fixed[0] if fixed else "replicated: nothing splits it"


def warnings(lowering, threshold: int) -> list[str]:
    mesh_shape = lowering.impl.shape
    out = []
    for op in lowering.graph.operations:
        for t in op.outputs:
            layout = lowering.plan[t]
            idle = [m.name for i, m in enumerate(mesh_shape) if m.size > 1 and i not in layout.mesh_axes_used]
            if t.size >= threshold and idle:
                out.append(
                    f"{t.name} {_dims(t.shape)} ({t.size:,} values, built at {op.source}) is replicated over "
                    f"mesh dim(s) {', '.join(idle)}"
                )
        if getattr(op, "annotation", None) is not None:
            (x,), (y,) = op.inputs, op.outputs
            before, after = lowering.plan[x], lowering.plan[y]
            if before != after:
                out.append(
                    f"the annotation at {op.source} reshards {x.name} from "
                    f"{layout_string(x.shape, before, mesh_shape)!r} to {layout_string(y.shape, after, mesh_shape)!r}"
                )
    return out


def explain(lowering, threshold: int = 1 << 20) -> str:
    mesh_shape = lowering.impl.shape
    rows = [
        (
            t.name,
            _dims(t.shape),
            layout_string(t.shape, lowering.plan[t], mesh_shape) or "(replicated)",
            _origin(lowering, t),
        )
        for op in lowering.graph.operations
        for t in op.outputs
    ]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(("tensor", "shape", "layout"))]
    lines = [f"{'tensor':<{widths[0]}}  {'shape':<{widths[1]}}  {'layout':<{widths[2]}}  from"]
    lines += [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:<{widths[2]}}  {d}" for a, b, c, d in rows]
    found = warnings(lowering, threshold)
    if found:
        lines += ["", f"warnings ({len(found)}):"] + [f"  {w}" for w in found]
    return "\n".join(lines) + "\n"
