"""Section 5: meshax's counters against the collectives in XLA's compiled HLO.

For every configuration of sections 1 and 2 (they run on the 8 devices): the program's
counters (recorded while meshax traced it) against the collectives counted in the HLO that XLA
compiled from it (`fn.compiled_text(feeds)`), per kind; tuple all-reduces count once per
element. Target: equal counts for every kind. Values per device are compared too (for
information: XLA may legitimately change them, e.g. by folding)."""

from __future__ import annotations

from benchmarks import hlo, paper_comm, vs_xla
from benchmarks.records import record
from benchmarks.two_layer import LAYOUTS, model


def _programs(quick: bool):
    s1 = paper_comm.QUICK_SIZES if quick else paper_comm.FULL_SIZES
    s2 = (vs_xla.QUICK if quick else vs_xla.FULL)["sizes"]
    for s in s1:
        for mesh_shape, layout in LAYOUTS:
            yield s, mesh_shape, layout, "loss, dx, updates (section 1)", "comm"
    for s in s2:
        for mesh_shape, layout in LAYOUTS:
            yield s, mesh_shape, layout, "train step (section 2)", "step"


def run(quick: bool) -> list[dict]:
    out = []
    for s, mesh_shape, layout, program, which in _programs(quick):
        m = model(s, mesh_shape, layout)
        mine = hlo.meshax_collectives((m.comm_fn if which == "comm" else m.step_fn).counters)
        xla = hlo.collectives(m.compiled_text(which))
        mismatched = [k for k in hlo.KINDS if mine[k]["count"] != xla[k]["count"]]
        values_differ = [k for k in hlo.KINDS if mine[k]["values"] != xla[k]["values"]]
        cfg = {"mesh": mesh_shape, "layout": layout, "size": str(s), "program": program}
        out.append(record(5, "counter kinds mismatched (meshax vs compiled HLO)", cfg, len(mismatched), "kinds",
                          target="0", met=not mismatched, mismatched=mismatched, values_differ=values_differ,
                          meshax=mine, hlo=xla, summary=f"meshax {hlo.summary(mine)} | HLO {hlo.summary(xla)}"))
    return out
