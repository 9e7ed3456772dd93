"""The cost report: collectives per op with the user's source line, values, bytes and FLOPs."""

from __future__ import annotations

import io

from rich.console import Console
from rich.markup import escape
from rich.table import Table

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
    table = Table(
        title=escape(f"meshax cost report: mesh {mesh!r}, layout {str(impl.layout_rules)!r}, per device and run"),
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
            _short(site.source),
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
    Console(file=out, width=width, no_color=True, highlight=False).print(table)
    return out.getvalue()


def _short(source: str) -> str:
    path, _, line = source.rpartition(":")
    return f"{path.rsplit('/', 1)[-1]}:{line}" if path else source
