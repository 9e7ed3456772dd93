"""One record per measurement, the unit of the JSON output and of the table."""

from __future__ import annotations

from typing import Any

from benchmarks import hlo


def record(
    section: int,
    name: str,
    config: dict,
    value,
    unit: str,
    *,
    target: str | None = None,
    met: bool | None = None,
    numerator: dict | None = None,
    denominator: dict | None = None,
    note: str = "",
    **extra: Any,
) -> dict:
    """A measurement. Ratios carry both sides as `numerator` / `denominator`
    ({"name", "value", "unit"}); `met` says whether `target` is met (None: no target)."""
    r = {"section": section, "name": name, "config": dict(config), "value": value, "unit": unit}
    if target is not None:
        r["target"] = target
        r["met"] = met
    if numerator is not None:
        r["numerator"] = numerator
    if denominator is not None:
        r["denominator"] = denominator
    if note:
        r["note"] = note
    r.update(extra)
    return r


def side(name: str, value, unit: str) -> dict:
    return {"name": name, "value": value, "unit": unit}


def step_ratio(
    section: int,
    name: str,
    config: dict,
    t: dict,
    baseline: str,
    target: float | None = 1.0,
    baseline_key: str = "xla",
    **extra: Any,
) -> dict:
    """The record of an interleaved timing `t` (benchmarks.timing.interleaved): meshax's median
    step over the baseline's, met when <= `target` (None: reported, no target); `baseline_key`
    names the baseline's IQR."""
    return record(
        section,
        name,
        config,
        t["ratio"],
        "ratio",
        target=None if target is None else f"<= {target}",
        met=None if target is None else t["ratio"] <= target,
        numerator=side("meshax step (median)", t["a_s"], "s"),
        denominator=side(f"{baseline} step (median)", t["b_s"], "s"),
        steps=t["steps"],
        warmup=t["warmup"],
        iqr_s={"meshax": t["a_iqr_s"], baseline_key: t["b_iqr_s"]},
        **extra,
    )


def collectives_ratio(section: int, config: dict, text_mx: str, text_xla: str, note: str, itemsize: int = 0) -> dict:
    """meshax's collective values (or bytes, given the values' `itemsize`) per device and step
    over XLA's, both read from compiled HLO; met when meshax moves no more."""
    c_mx, c_xla = hlo.collectives(text_mx), hlo.collectives(text_xla)
    what, unit, scale = ("bytes", "bytes", itemsize) if itemsize else ("values", "values", 1)
    v_mx, v_xla = (scale * sum(v["values"] for v in c.values()) for c in (c_mx, c_xla))
    return record(
        section,
        f"collective {what} meshax / XLA (compiled HLO)",
        config,
        v_mx / max(v_xla, 1),
        "ratio",
        target="<= 1.0",
        met=v_mx <= v_xla,
        numerator=side(f"meshax {what} per device per step", v_mx, unit),
        denominator=side(f"XLA {what} per device per step", v_xla, unit),
        meshax=hlo.summary(c_mx),
        xla=hlo.summary(c_xla),
        note=note,
    )


def collectives_records(section: int, config: dict, compiled: dict[str, dict]) -> list[dict]:
    """One record per program: its collectives ({kind: {"count", "values"}}, from its HLO)."""
    return [
        record(
            section,
            f"collectives: {who}",
            config,
            sum(v["count"] for v in c.values()),
            "collectives",
            values_per_device=sum(v["values"] for v in c.values()),
            by_kind=c,
            summary=hlo.summary(c),
        )
        for who, c in compiled.items()
    ]
