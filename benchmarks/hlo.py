"""Collectives in compiled XLA HLO text, for the benchmark tables (the parsing is meshax's own)."""

from __future__ import annotations

from meshax.lower.counters import KINDS
from meshax.lower.hlo import hlo_collectives as collectives

__all__ = ["KINDS", "collectives", "counts", "meshax_collectives", "summary"]


def counts(hlo_text: str) -> dict[str, int]:
    return {k: v["count"] for k, v in collectives(hlo_text).items()}


def meshax_collectives(counters) -> dict[str, dict[str, int]]:
    """The same {kind: {"count", "values"}} from a meshax counters mapping."""
    return {k: {"count": int(counters[k].count), "values": int(counters[k].values)} for k in KINDS}


def summary(c: dict[str, dict[str, int]]) -> str:
    """'allreduce 5x/3105' for the kinds present, or 'none'."""
    parts = [f"{k} {v['count']}x/{v['values']}" for k, v in c.items() if v["count"]]
    return ", ".join(parts) or "none"
