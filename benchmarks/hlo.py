"""Collectives in compiled XLA HLO text, for the benchmark tables (the parsing is meshax's own)."""

from __future__ import annotations

import re

from meshax.lower.counters import KINDS
from meshax.lower.hlo import hlo_collectives as collectives

__all__ = ["KINDS", "collectives", "copies", "counts", "meshax_collectives", "summary"]


def counts(hlo_text: str) -> dict[str, int]:
    return {k: v["count"] for k, v in collectives(hlo_text).items()}


def copies(hlo_text: str) -> int:
    """`copy` instructions in compiled HLO text: layout changes and buffers copied in and out."""
    return len(re.findall(r"\} copy\(", hlo_text))


def meshax_collectives(counters) -> dict[str, dict[str, int]]:
    """The same {kind: {"count", "values"}} from a meshax counters mapping."""
    return {k: {"count": int(counters[k].count), "values": int(counters[k].values)} for k in KINDS}


def summary(c: dict[str, dict[str, int]]) -> str:
    """'allreduce 5x/3105' for the kinds present, or 'none'."""
    parts = [f"{k} {v['count']}x/{v['values']}" for k, v in c.items() if v["count"]]
    return ", ".join(parts) or "none"
