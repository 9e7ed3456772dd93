"""The record of every collective a lowered program runs: the cost report.

Each collective call is recorded once, at the moment the lowering emits it, with the op that
caused it and the user's source line. Figures are per device and per run of the program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

KINDS = ("allreduce", "allgather", "alltoall", "reduce_scatter", "permute")


@dataclasses.dataclass(frozen=True)
class Site:
    """One collective call: what, over which mesh dims, how many values, and who caused it."""

    kind: str
    mesh_axes: tuple[str, ...]
    values: int  # elements each participating device puts in
    bytes: int
    op_name: str
    op_type: str
    source: str  # the user's "file:line" where the op was built
    grad_of: str = ""  # for an op of a backward pass: the forward op it differentiates


@dataclasses.dataclass
class CollectiveRecord:
    """All calls of one kind: `.count` calls per run, `.values` elements per device, summed."""

    kind: str
    sites: list[Site] = dataclasses.field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.sites)

    @property
    def values(self) -> int:
        return sum(s.values for s in self.sites)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.sites)

    def __repr__(self) -> str:
        return f"CollectiveRecord({self.kind!r}, count={self.count}, values={self.values})"


class Counters(Mapping):
    """kind -> CollectiveRecord for the five collective kinds, plus FLOPs per op."""

    def __init__(self):
        self._records = {k: CollectiveRecord(k) for k in KINDS}
        self.flops: dict[str, int] = {}  # op name -> FLOPs per device
        self.op_types: dict[str, str] = {}  # op name -> op class name

    def add(self, site: Site) -> None:
        """Record one collective (the lowering calls this as it emits each one)."""
        self._records[site.kind].sites.append(site)

    def add_flops(self, op_name: str, flops: int, op_type: str = "") -> None:
        """Add `flops` floating-point operations (per device) to the op called `op_name`."""
        self.flops[op_name] = self.flops.get(op_name, 0) + int(flops)
        self.op_types[op_name] = op_type

    @property
    def total_flops(self) -> int:
        """Floating-point operations per device and run, all ops together."""
        return sum(self.flops.values())

    @property
    def total_values(self) -> int:
        """Values each device puts into collectives per run, all kinds together."""
        return sum(r.values for r in self._records.values())

    def __getitem__(self, kind: str) -> CollectiveRecord:
        if kind not in self._records:
            raise KeyError(f"unknown collective kind {kind!r}; the kinds are {list(KINDS)}")
        return self._records[kind]

    def __iter__(self) -> Iterator[str]:
        return iter(KINDS)

    def __len__(self) -> int:
        return len(KINDS)

    def sites(self) -> list[Site]:
        """Every recorded collective, grouped by kind (allreduce, allgather, ...), in emission order."""
        return [s for k in KINDS for s in self._records[k].sites]

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={r.count}x/{r.values}" for k, r in self._records.items())
        return f"Counters({body}, flops={self.total_flops})"


def pretty_print_counters(counters: Counters) -> str:
    """The counters as lines of text (Mesh-TensorFlow's name): each collective kind's count,
    values and bytes per device, then the FLOPs, by op type."""
    lines = [
        f"{kind}: {r.count} collectives, {r.values} values, {r.bytes} bytes" for kind, r in counters.items() if r.count
    ]
    by_type: dict[str, int] = {}
    for op, flops in counters.flops.items():
        kind = counters.op_types.get(op, "")
        by_type[kind] = by_type.get(kind, 0) + flops
    lines.append(f"flops: {counters.total_flops}")
    lines += [f"flops/{kind or 'other'}: {n}" for kind, n in sorted(by_type.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines)
