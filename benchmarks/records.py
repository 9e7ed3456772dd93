"""One record per measurement, the unit of the JSON output and of the table."""

from __future__ import annotations

from typing import Any


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
