"""Section 5: meshax's counters against the collectives in XLA's compiled HLO.

For every configuration of sections 1 and 2 (they run on the 8 devices): the program's
counters (recorded while meshax traced it) against the collectives counted in the HLO that XLA
compiled from it (`fn.compiled_text()`), per kind; tuple all-reduces count once per
element. Target: equal counts for every kind. Values per device are compared too (for
information: XLA may legitimately change them, e.g. by folding).

Then the Transformer language model's training step (Adam) for the configurations section 2
times (benchmarks/transformer.py; shared with section 2 when both run, so compiled once)."""

from __future__ import annotations

from benchmarks import hlo, paper_comm, vs_xla
from benchmarks import transformer as lm
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


def _compare(cfg: dict, counters, hlo_text: str) -> dict:
    mine = hlo.meshax_collectives(counters)
    xla = hlo.collectives(hlo_text)
    mismatched = [k for k in hlo.KINDS if mine[k]["count"] != xla[k]["count"]]
    values_differ = [k for k in hlo.KINDS if mine[k]["values"] != xla[k]["values"]]
    return record(
        5,
        "counter kinds mismatched (meshax vs compiled HLO)",
        cfg,
        len(mismatched),
        "kinds",
        target="0",
        met=not mismatched,
        mismatched=mismatched,
        values_differ=values_differ,
        meshax=mine,
        hlo=xla,
        summary=f"meshax {hlo.summary(mine)} | HLO {hlo.summary(xla)}",
    )


def run(quick: bool) -> list[dict]:
    out = []
    for s, mesh_shape, layout, program, which in _programs(quick):
        m = model(s, mesh_shape, layout)
        cfg = {"mesh": mesh_shape, "layout": layout, "size": str(s), "program": program}
        out.append(_compare(cfg, (m.comm_fn if which == "comm" else m.step_fn).counters, m.compiled_text(which)))
    for tc in vs_xla.transformer_configs(quick):
        if lm.layout_problem(tc["preset"], tc["mesh"], tc["layout"]):
            continue  # section 2 says why
        m = tc["build_meshax"]()
        m.zeros_unless_initialized()  # only the HLO is read: skip the initializers when section 2 did not run
        cfg = dict(vs_xla.lm_config(tc), program="LM train step, Adam (section 2)")
        out.append(_compare(cfg, m.counters, m.compiled_text()))
    return out
