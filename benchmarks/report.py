"""Output: the JSON file, the rich table on the terminal and the markdown summary."""

from __future__ import annotations

import datetime
import json
import os
import platform

SECTION_TITLES = {
    1: "Communication against the paper (Table 1)",
    2: "Against XLA's partitioner",
    3: "One-device overhead",
    4: "SPMD scaling of the lowering",
    5: "Counter truth (meshax counters vs compiled HLO)",
    6: "GPU",
    7: "GSPMD annotations: meshax propagation vs XLA's, same annotations",
    8: "Spatial partitioning: halo exchange vs XLA's, same shardings",
    9: "Plain JAX functions: mx.partition vs jax.jit, same function and annotations",
    10: "Layout search: the cost model's choice and ranking against measurement",
}


def machine(args) -> dict:
    import jax

    d = jax.devices()
    return {
        "platform": d[0].platform,
        "devices": len(d),
        "device_kind": d[0].device_kind,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "quick": bool(args.quick),
        "sections": list(args.sections),
    }


def write_json(path: str, info: dict, records: list[dict], wall_s: float) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"machine": info, "wall_s": wall_s, "records": records}, f, indent=1, default=_plain)
        f.write("\n")


def _plain(o):
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
    except ImportError:  # pragma: no cover
        pass
    return str(o)


# ---- formatting ------------------------------------------------------------------------------
def _num(v, unit: str = "") -> str:
    if v is None:
        return "-"
    if unit == "s":
        return f"{v * 1e3:.3f} ms" if v < 1 else f"{v:.3f} s"
    if isinstance(v, float):
        if unit == "ratio":
            return f"{v:.4f}"
        return str(int(v)) if v.is_integer() else f"{v:.6g}"
    return str(v)


def config_text(r: dict) -> str:
    c = r["config"]
    parts = []
    keys = ("mesh", "meshes", "layout", "size", "platform") + (("program",) if r["section"] in (5, 9) else ())
    keys += ("reduce_scatter_as",)
    for k in keys:
        if k in c:
            v = c[k]
            parts.append(f'{k}="{v}"' if k == "layout" else f"{k}={v}")
    return " ".join(parts)


def value_text(r: dict) -> str:
    u = r["unit"]
    if r["value"] is None:
        return r.get("status", "-")
    return _num(r["value"], u) + ("" if u in ("ratio", "s", "") else f" {u}")


def detail_text(r: dict) -> str:
    if "numerator" in r:
        n, d = r["numerator"], r["denominator"]
        s = f"{_num(n['value'], n['unit'])} / {_num(d['value'], d['unit'])}"
        if "lower_order" in r:
            s += f" (lower-order {r['lower_order']:g})"
        if r.get("params_agree_after") is False:
            s += "; PARAMETERS DIFFER after the run"
        return s
    if "summary" in r:
        return r["summary"]
    if "lower_order" in r:
        return f"measured {r['measured']}, lower-order {r['lower_order']:g}"
    if "collectives" in r:
        return ", ".join(f"{k} {v}x" for k, v in r["collectives"].items() if v) or "no collectives"
    return r.get("note", "")


def status_text(r: dict) -> str:
    if "met" not in r:
        return ""
    return "met" if r["met"] else "MISSED"


def rows(records: list[dict]) -> list[tuple[str, ...]]:
    return [
        (
            str(r["section"]),
            r["name"],
            config_text(r),
            value_text(r),
            r.get("target", ""),
            status_text(r),
            detail_text(r),
        )
        for r in records
    ]


HEADER = ("§", "measurement", "configuration", "value", "target", "status", "detail")


def print_table(info: dict, records: list[dict], wall_s: float) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=max(160, Console().width))
    table = Table(title=f"meshax benchmarks ({_machine_line(info)}; {wall_s:.1f} s)", show_lines=False)
    for h in HEADER:
        table.add_column(h, overflow="fold")
    last = None
    for r, row in zip(records, rows(records)):
        if last is not None and r["section"] != last:
            table.add_section()
        last = r["section"]
        style = "red" if row[5] == "MISSED" else None
        table.add_row(*map(escape, row), style=style)
    console.print(table)
    console.print(targets_line(records))


def _machine_line(info: dict) -> str:
    return (
        f"{info['platform']} x{info['devices']} ({info['device_kind']}), {info['cpu_count']} CPU cores, "
        f"jax {info['jax']}, {info['date']}" + (", --quick" if info.get("quick") else "")
    )


def targets_line(records: list[dict]) -> str:
    with_target = [r for r in records if "met" in r]
    missed = [r for r in with_target if not r["met"]]
    return f"targets: {len(with_target) - len(missed)} met, {len(missed)} missed"


def write_markdown(path: str, info: dict, records: list[dict], wall_s: float, command: str) -> None:
    lines = [
        "# meshax benchmark results",
        "",
        "Regenerated by `python -m benchmarks` (this file is overwritten on every run; "
        "the JSON with every record is written next to it under `benchmarks/out/`).",
        "",
        f"* command: `{command}`",
        f"* machine: {info['platform']} ({info['device_kind']}), {info['devices']} JAX devices, "
        f"{info['cpu_count']} CPU cores, {info['machine']}, Python {info['python']}",
        f"* jax {info['jax']}; date {info['date']}; wall time {wall_s:.1f} s",
        f"* {targets_line(records)}",
        "",
    ]
    for section in sorted({r["section"] for r in records}):
        lines += [
            f"## {section}. {SECTION_TITLES.get(section, '')}",
            "",
            "| " + " | ".join(HEADER[1:]) + " |",
            "|" + "---|" * (len(HEADER) - 1),
        ]
        for r, row in zip(records, rows(records)):
            if r["section"] == section:
                lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row[1:]) + " |")
        lines.append("")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines))
