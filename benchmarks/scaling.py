"""Section 4: SPMD scaling of the lowering.

The two-layer network with layout "batch:rows;hidden:cols" on abstract meshes of 8, 64 and 512
devices (`lowering.trace_program` traces under `jax.sharding.AbstractMesh`: no devices). For
each mesh: the time to build the Lowering (the plan) and trace the training step, and the
size of the traced program (jaxpr equations, sub-jaxprs counted recursively). Target: flat,
512 / 8 <= 1.2 for both.
"""

from __future__ import annotations

from benchmarks.records import record, side
from benchmarks.timing import round_robin
from benchmarks.two_layer import Size, build_graph

MESHES = ["rows:2;cols:4", "rows:8;cols:8", "rows:16;cols:32"]
LAYOUT = "batch:rows;hidden:cols"
QUICK = {"size": Size(512, 512, 512), "reps": 5}
FULL = {"size": Size(2048, 1024, 4096), "reps": 101}


def count_eqns(jaxpr) -> int:
    """Equations of a (closed) jaxpr, with those of every sub-jaxpr in its params."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    n += count_eqns(sub)
    return n


def run(quick: bool) -> list[dict]:
    import meshax as mx

    p = QUICK if quick else FULL
    s = p["size"]
    graph, mesh, t, updates = build_graph(s)
    results = {}

    def lower_and_trace(mesh_shape):
        lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl(mesh_shape, LAYOUT)})
        results[mesh_shape] = lowering.trace_program([t["loss"]], updates)

    times = round_robin({ms: (lambda ms=ms: lower_and_trace(ms)) for ms in MESHES}, p["reps"])
    out = []
    sizes, counts = {}, {}
    for ms in MESHES:
        counters, jaxpr = results[ms]
        sizes[ms] = count_eqns(jaxpr)
        counts[ms] = {k: counters[k].count for k in counters}
        devices = 1
        for part in ms.split(";"):
            devices *= int(part.split(":")[1])
        cfg = {"mesh": ms, "devices": devices, "layout": LAYOUT, "size": str(s), "program": "train step"}
        out.append(record(4, "lower + trace time", cfg, times[ms], "s", reps=p["reps"]))
        out.append(
            record(
                4,
                "program size (jaxpr equations)",
                cfg,
                sizes[ms],
                "equations",
                collectives=counts[ms],
                allreduce_values=counters["allreduce"].values,
            )
        )
    small, large = MESHES[0], MESHES[-1]
    cfg = {"meshes": f"{large} / {small}", "layout": LAYOUT, "size": str(s)}
    r = times[large] / times[small]
    out.append(
        record(
            4,
            "lower + trace time 512 / 8 devices",
            cfg,
            r,
            "ratio",
            target="<= 1.2",
            met=r <= 1.2,
            numerator=side(large, times[large], "s"),
            denominator=side(small, times[small], "s"),
        )
    )
    r = sizes[large] / sizes[small]
    out.append(
        record(
            4,
            "program size 512 / 8 devices",
            cfg,
            r,
            "ratio",
            target="<= 1.2",
            met=r <= 1.2,
            numerator=side(large, sizes[large], "equations"),
            denominator=side(small, sizes[small], "equations"),
            same_collective_counts=counts[large] == counts[small],
        )
    )
    return out
