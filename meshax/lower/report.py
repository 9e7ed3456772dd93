"""The cost report: collectives per op with the user's source line, values, bytes and FLOPs."""

from __future__ import annotations

import io
import math

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from meshax.layout.rules import is_padded, slice_shape, split_factor
from meshax.lower.counters import KINDS, Counters


def _human(n: float) -> str:
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}E"


def _who(site) -> str:
    kind = site.op_type.removesuffix("Operation")
    return f"grad of {site.grad_of} ({kind})" if site.grad_of else f"{site.op_name} ({kind})"


def format_report(lowering, counters: Counters, width: int = 132) -> str:
    impl = lowering.impl
    mesh = ";".join(f"{d.name}:{d.size}" for d in impl.shape)
    weights = "" if impl.weight_rules is None else f", weight layout {str(impl.weight_rules)!r}"
    table = Table(
        title=escape(
            f"meshax cost report: mesh {mesh!r}, layout {str(impl.layout_rules)!r}{weights}, per device and run"
        ),
        title_justify="left",
    )
    for col in ("op", "where", "collective", "mesh dims", "values", "bytes", "FLOPs"):
        table.add_column(col, justify="right" if col in ("values", "bytes", "FLOPs") else "left")
    shown = set()
    for site in counters.sites():
        flops = counters.flops.get(site.op_name, 0) if site.op_name not in shown else 0
        shown.add(site.op_name)
        table.add_row(
            escape(_who(site)),
            short_source(site.source),
            site.kind,
            ",".join(site.mesh_axes),
            _human(site.values),
            _human(site.bytes),
            _human(flops) if flops else "",
        )
    table.add_section()
    for kind in KINDS:
        r = counters[kind]
        if r.count:
            table.add_row("total", "", f"{kind} x{r.count}", "", _human(r.values), _human(r.bytes), "")
    table.add_row("total", "", "compute", "", "", "", _human(counters.total_flops))
    out = io.StringIO()
    console = Console(file=out, width=width, no_color=True, highlight=False)
    console.print(table)
    padded = _padded_table(lowering)
    if padded is not None:
        console.print(padded)
    return out.getvalue()


def _padded_table(lowering) -> Table | None:
    """Tensors whose layout pads a dim (uneven splits): values per device, with and without
    padding, and the overhead; None when every split divides."""
    impl, rows = lowering.impl, []
    for op in lowering.graph.operations:
        for t in op.outputs:
            layout = lowering.plan[t]
            padded = [
                f"{d.name}={d.size}/{split_factor(a, impl.shape)}"
                for d, a in zip(t.shape, layout.axes)
                if is_padded(d.size, a, impl.shape)
            ]
            if padded:
                held = math.prod(slice_shape(t.shape, layout, impl.shape))
                values = t.shape.size / split_factor(tuple(layout.mesh_axes_used), impl.shape)
                rows.append((held - values, t.name, ", ".join(padded), values, held))
    if not rows:
        return None
    rows.sort(key=lambda r: -r[0])
    table = Table(title="padded tensors (uneven splits): values per device, most padding first", title_justify="left")
    for col in ("tensor", "padded dims (size/parts)", "values", "held", "overhead"):
        table.add_column(col, justify="left" if col in ("tensor", "padded dims (size/parts)") else "right")
    for _, name, dims, values, held in rows[:_PADDED_ROWS]:
        table.add_row(escape(name), escape(dims), _human(values), _human(held), f"{held / values - 1:+.0%}")
    if len(rows) > _PADDED_ROWS:
        table.add_row(f"... {len(rows) - _PADDED_ROWS} more", "", "", "", "")
    values, held = sum(r[3] for r in rows), sum(r[4] for r in rows)
    table.add_section()
    table.add_row(f"all {len(rows)}", "", _human(values), _human(held), f"{held / values - 1:+.0%}")
    return table


_PADDED_ROWS = 12


def short_source(source: str) -> str:
    """A source line as "file.py:line" (its folder left out), as the cost report shows it."""
    path, _, line = source.rpartition(":")
    return f"{path.rsplit('/', 1)[-1]}:{line}" if path else source


def log_variable_sizes(var_list, tag: str | None = None, verbose: bool = True, mesh_to_impl=None, log_file=None) -> str:
    """Each variable's name, shape and number of values, and the total (Mesh-TensorFlow's name);
    with `mesh_to_impl` ({mesh: MeshImpl}), the values each device holds under its layout rules.
    Logged to the "meshax" logger (and appended to `log_file`, a path, where given); returned."""
    import logging

    variables = [getattr(v, "operation", v) for v in var_list]
    lines = [f"{tag or 'Variables'}: {len(variables)}"]
    total = per_device = 0
    for v in sorted(variables, key=lambda v: v.name):
        size = v.shape.size
        total += size
        held = ""
        if mesh_to_impl is not None and v.mesh in mesh_to_impl:
            impl = mesh_to_impl[v.mesh]
            local = math.prod(impl.slice_shape(v.shape))
            per_device += local
            held = f"  per device {local:>12,}  {impl.tensor_layout(v.shape)}"
        if verbose:
            lines.append(f"  {v.name:<40} {v.shape!s:<40} {size:>14,}{held}")
    lines.append(f"  total {total:,} values" + (f", {per_device:,} per device" if mesh_to_impl is not None else ""))
    text = "\n".join(lines)
    logging.getLogger("meshax").info(text)
    if log_file is not None:
        with open(log_file, "a") as f:
            f.write(text + "\n")
    return text
