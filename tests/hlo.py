"""Count collective instructions in compiled XLA HLO text.

The kinds are named like meshax's counters: allreduce, allgather, alltoall,
reduce_scatter, permute.

* ``all-reduce(`` / ``all-reduce-start(``: one per element of the result when
  the result is a tuple (XLA's combiner merges several all-reduces into one
  tuple all-reduce), else one.
* ``all-gather(`` / ``all-gather-start(``: one per instruction.
* ``all-to-all(``: one per instruction, even when the result is a tuple.
* ``reduce-scatter(``: one per instruction.
* ``collective-permute(`` / ``collective-permute-start(``: one per instruction.
"""
import re

KINDS = ("allreduce", "allgather", "alltoall", "reduce_scatter", "permute")

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

# "%name = TYPE opcode(" (optionally preceded by ROOT).  The opcode group lists
# longer names first so "all-reduce-start" is not read as "all-reduce".
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.+?)\s+"
    r"(?P<op>all-reduce-start|all-reduce|all-gather-start|all-gather|all-to-all|"
    r"reduce-scatter|collective-permute-start|collective-permute)\("
)
_COMMENT = re.compile(r"/\*.*?\*/")


def tuple_arity(type_text):
    """Number of top-level elements of an HLO result type (1 if not a tuple)."""
    t = _COMMENT.sub("", type_text).strip()
    if not t.startswith("("):
        return 1
    depth = 0
    n = 1
    inner = t[1:]
    # walk until the matching ")" of the outer tuple
    for ch in inner:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                break
            depth -= 1
        elif ch == "," and depth == 0:
            n += 1
    if inner.strip().startswith(")"):  # empty tuple "()"
        return 0
    return n


def count_collectives(hlo_text):
    """Return {kind: count} for the collectives in an HLO module text."""
    counts = {k: 0 for k in KINDS}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        op = m.group("op")
        kind = _OPCODES[op]
        if kind == "allreduce":
            counts[kind] += tuple_arity(m.group("type"))
        else:
            counts[kind] += 1
    return counts


def counter_counts(counters):
    """{kind: count} from a meshax counters mapping."""
    return {k: int(counters[k].count) for k in KINDS}
