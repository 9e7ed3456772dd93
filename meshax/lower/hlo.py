"""The collectives XLA actually runs, read from compiled HLO text: to check meshax's counters.

`hlo_collectives(jax.jit(f).lower(*args).compile().as_text())` (or `fn.compiled_text()`)
gives, per kind named like meshax's counters (allreduce, allgather, alltoall, reduce_scatter,
permute), the number of collective calls and the values each device puts in.
``all-reduce(`` / ``all-reduce-start(`` count once per element of a tuple result (XLA's
combiner merges several all-reduces into one tuple all-reduce); every other kind counts once
per instruction (XLA emits an all-to-all as one tuple instruction).

Values per device are the elements each device puts in, read from the result shapes:
all-reduce, all-to-all and collective-permute: the result's elements; all-gather: the result
divided by the group size; reduce-scatter: the result times the group size.

The text holds a loop's body once. With `per_run=True` each collective counts as often as one
run of the program runs it, as meshax's counters count: a while loop's body (a scan's, a
pipeline's) times its trip count where XLA knows it (`known_trip_count`), once where the data
decide it; each branch of a conditional once.
"""

from __future__ import annotations

import math
import re

from meshax.lower.counters import KINDS

_OPCODES = {
    "all-reduce": "allreduce",
    "all-reduce-start": "allreduce",
    "all-gather": "allgather",
    "all-gather-start": "allgather",
    "all-to-all": "alltoall",
    "reduce-scatter": "reduce_scatter",
    "collective-permute": "permute",
    "collective-permute-start": "permute",
}
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.+?)\s+"
    r"(?P<op>all-reduce-start|all-reduce|all-gather-start|all-gather|all-to-all|"
    r"reduce-scatter|collective-permute-start|collective-permute)\((?P<rest>.*)$"
)
_COMMENT = re.compile(r"/\*.*?\*/")
_ARRAY = re.compile(r"\b[a-z]+[0-9]*\[([0-9,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=")


def _top_level(type_text: str) -> list[str]:
    """The top-level elements of an HLO result type (one element if not a tuple)."""
    t = _COMMENT.sub("", type_text).strip()
    if not t.startswith("("):
        return [t]
    parts, depth, cur = [], 0, ""
    for ch in t[1:]:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                break
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return [p.strip() for p in parts]


def _elements(type_text: str) -> int:
    return sum(math.prod(int(d) for d in m.group(1).split(",") if d) for m in _ARRAY.finditer(type_text))


def _group_size(rest: str) -> int:
    m = _GROUPS_LIST.search(rest)
    if m:
        return len([d for d in m.group(1).split(",") if d])
    m = _GROUPS_IOTA.search(rest)
    if m:
        return int(m.group(1).split(",")[-1])
    return 1


_COMPUTATION = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s")
_CALLED = re.compile(r"\b(body|condition|to_apply|calls|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _runs_per_line(lines: list[str]) -> list[int]:
    """How often one run of the module runs each line: its computation's runs (the entry's once;
    a computation another calls, as often as its caller, a while loop's body and condition times
    the trip count XLA knows)."""
    owner: list[str | None] = []
    calls: dict[str, list[tuple[str, int]]] = {}
    entry: str | None = None
    current: str | None = None
    for line in lines:
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(2)
            calls[current] = []
            entry = current if m.group(1) else entry
        owner.append(current)
        if current is None:
            continue
        trips = _TRIPS.search(line)
        times = int(trips.group(1)) if trips and " while(" in line else 1
        called = [(name, times if kind in ("body", "condition") else 1) for kind, name in _CALLED.findall(line)]
        for group in _BRANCHES.findall(line):
            called += [(name.strip().lstrip("%"), 1) for name in group.split(",") if name.strip()]
        calls[current] += called
    runs: dict[str, int] = {}

    def visit(name: str, times: int) -> None:
        runs[name] = runs.get(name, 0) + times
        for callee, n in calls.get(name, ()):
            visit(callee, times * n)

    if entry is not None:
        visit(entry, 1)
    return [runs.get(name, 0) if name is not None else 1 for name in owner]


def hlo_collectives(hlo_text: str, per_run: bool = False) -> dict[str, dict[str, int]]:
    """{kind: {"count": n, "values": elements per device}} for the collectives of a module: as
    its text holds them, or with `per_run` as one run of it runs them (a loop's body times its
    trip count)."""
    out = {k: {"count": 0, "values": 0} for k in KINDS}
    lines = hlo_text.splitlines()
    runs = _runs_per_line(lines) if per_run else [1] * len(lines)
    for line, times in zip(lines, runs):
        m = _INSTR.match(line)
        if not m:
            continue
        op, kind = m.group("op"), _OPCODES[m.group("op")]
        elems = _top_level(m.group("type"))
        if op.endswith("-start") and kind != "allreduce":
            elems = elems[1:2] or elems  # async start: (operand, result, ...): take the result
        n = sum(_elements(e) for e in elems)
        out[kind]["count"] += (len(elems) if kind == "allreduce" else 1) * times
        if kind == "allgather":
            n //= _group_size(m.group("rest"))
        elif kind == "reduce_scatter":
            n *= _group_size(m.group("rest"))
        out[kind]["values"] += n * times
    return out
