"""Section 2: meshax against XLA's own SPMD partitioner on the same mesh.

The training step of the two-layer network (loss, SGD updates of w, bias, v and a step
counter), once as meshax's shard_map program and once as plain jnp + `jax.grad` under `jax.jit`
with the `NamedSharding`s meshax's plan gives x, g, w, bias, v. Both sides take the same host
arrays each step, put them on the devices, run, and block on the loss. Reported: the step-time
ratio meshax / XLA (medians, interleaved; target <= 1.0) and each compiled program's
collectives, counted from its HLO, with values per device from the HLO shapes.

Then the Transformer language model (benchmarks/transformer.py), presets tiny and small, under
the paper's Transformer layouts: meshax's `LmTask` trained by `meshax.train.loop.build` with
Adam, against the same step in jnp jitted with meshax's shardings. Both return the loss and the
three metric sums to the host. The first step's outputs must agree (rtol 1e-4) before timing.
"""

from __future__ import annotations

import numpy as np

from benchmarks import hlo
from benchmarks import transformer as lm
from benchmarks.records import collectives_records, record, side, step_ratio
from benchmarks.timing import interleaved
from benchmarks.two_layer import LAYOUTS, Size, feeds, jax_twin, model, params_agree

QUICK = {"sizes": [Size(64, 32, 128)], "steps": {Size(64, 32, 128): 10}, "warmup": 3}
# more steps where a step is short (noise is mostly the host's), 50 where it is long
FULL = {
    "sizes": [Size(128, 64, 256), Size(512, 256, 1024)],
    "steps": {Size(128, 64, 256): 200, Size(512, 256, 1024): 50},
    "warmup": 5,
}


# the Transformer: presets x layouts; --quick: tiny, data-parallel only, few steps
LM_QUICK = {"presets": ["tiny"], "layouts": [("all:8", "batch:all")], "steps": {"tiny": 5}, "warmup": 2}
LM_FULL = {
    "presets": ["tiny", "small"],
    "layouts": lm.LAYOUTS,
    "steps": {"tiny": 30, "small": 30},
    "warmup": 3,
    # small unsplit ("") does the whole model on each of 8 virtual devices (~1.3 s a step on
    # 2 cores): no communication to compare, so fewer steps
    "steps_override": {("small", ""): 10},
}


def transformer_configs(quick: bool = False) -> list[dict]:
    """The Transformer's configurations for this section (and section 5): entries
    {"name", "preset", "mesh", "layout", "steps", "warmup", "build_meshax", "build_jax"}, where
    build_meshax() -> MeshaxLm and build_jax(meshax_model) -> JaxLm (the twin starts from the
    meshax model's current variable values, so build it before the first meshax step)."""
    p = LM_QUICK if quick else LM_FULL
    out = []
    for preset in p["presets"]:
        for mesh_shape, layout in p["layouts"]:
            out.append(
                {
                    "name": f"transformer {preset}",
                    "preset": preset,
                    "mesh": mesh_shape,
                    "layout": layout,
                    "steps": p.get("steps_override", {}).get((preset, layout), p["steps"][preset]),
                    "warmup": p["warmup"],
                    "build_meshax": (lambda pr=preset, ms=mesh_shape, la=layout: lm.model(pr, ms, la)),
                    "build_jax": lm.JaxLm,
                }
            )
    return out


def lm_config(tc: dict) -> dict:
    c = lm.task(tc["preset"]).config
    size = (
        f"{tc['preset']}: b={lm.BATCH},l={lm.LENGTH},vocab={c.vocab_size},d_model={c.d_model},"
        f"d_ff={c.d_ff},heads={c.num_heads},layers={c.num_layers}"
    )
    return {
        "mesh": tc["mesh"],
        "layout": tc["layout"],
        "model": f"transformer {tc['preset']}",
        "size": size,
        "program": "LM train step (Adam)",
    }


def run_transformer(tc: dict) -> list[dict]:
    cfg = lm_config(tc)
    problem = lm.layout_problem(tc["preset"], tc["mesh"], tc["layout"])
    if problem:  # e.g. tiny's 4 heads cannot split 8 ways
        return [
            record(
                2, "step time meshax / XLA", cfg, None, "", status="skipped: layout invalid for preset", note=problem
            )
        ]
    m = tc["build_meshax"]()
    j = tc["build_jax"](m)  # from meshax's initial values, before meshax's first step
    # same parameters in, same outputs out: the two programs compute the same step
    o_mx, o_jax = m.step(), j.step()
    first = {
        "names": list(lm.OUTPUTS),
        "meshax": o_mx,
        "xla": o_jax,
        "loss_rel_diff": abs(o_mx[0] - o_jax[0]) / abs(o_jax[0]),
        "agree": lm.outputs_agree(o_mx, o_jax, 1e-4),
    }
    if not first["agree"]:
        return [
            record(
                2,
                "step time meshax / XLA",
                cfg,
                None,
                "",
                status="not timed: first outputs differ",
                first_outputs=first,
            )
        ]
    t = interleaved(m.step, j.step, tc["steps"], tc["warmup"])
    o_mx, o_jax = m.step(), j.step()  # after the same number of steps on each side
    last = {
        "meshax": o_mx,
        "xla": o_jax,
        "loss_rel_diff": abs(o_mx[0] - o_jax[0]) / abs(o_jax[0]),
        "agree": lm.outputs_agree(o_mx, o_jax, 1e-3),
    }
    diff, where = lm.max_param_diff(m, j)
    out = [
        step_ratio(
            2,
            "step time meshax / XLA",
            cfg,
            t,
            "jax.jit + NamedSharding",
            first_outputs=first,
            last_outputs=last,
            params_max_abs_diff_after={"value": diff, "variable": where, "steps": m.steps_run},
        )
    ]
    if tc["layout"] == "batch:all":  # the data-parallel rows: the layout copies XLA also avoids
        mine, xla = hlo.copies(m.compiled_text()), hlo.copies(j.compiled_text())
        out.append(
            record(
                2,
                "copy instructions meshax / XLA (compiled HLO)",
                cfg,
                mine / xla if xla else None,
                "x",
                target="<= 1.0",
                met=mine <= xla,
                numerator=side("meshax", mine, "copies"),
                denominator=side("XLA partitioner", xla, "copies"),
            )
        )
    return out + collectives_records(
        2,
        cfg,
        {
            "meshax (compiled HLO)": hlo.collectives(m.compiled_text()),
            "XLA partitioner (compiled HLO)": hlo.collectives(j.compiled_text()),
        },
    )


def run(quick: bool) -> list[dict]:
    p = QUICK if quick else FULL
    out = []
    for s in p["sizes"]:
        f = feeds(s)
        for mesh_shape, layout in LAYOUTS:
            m = model(s, mesh_shape, layout)
            j = jax_twin(m)
            cfg = {"mesh": mesh_shape, "layout": layout, "size": str(s), "program": "train step"}
            # same parameters in, same loss out: the two programs compute the same step
            l_mx, l_jax = m.step(f), j.step(f)
            first_loss = {"meshax": l_mx, "xla": l_jax, "agree": bool(np.isclose(l_mx, l_jax, rtol=1e-3, atol=1e-3))}
            if first_loss["agree"]:
                t = interleaved(lambda m=m, f=f: m.step(f), lambda j=j, f=f: j.step(f), p["steps"][s], p["warmup"])
                timed = step_ratio(
                    2,
                    "step time meshax / XLA",
                    cfg,
                    t,
                    "jax.jit + NamedSharding",
                    first_loss=first_loss,
                    params_agree_after=params_agree(m.params(), j.params()),
                )
            else:  # two programs that compute different steps: their times compare nothing
                status = "not timed: first losses differ"
                timed = record(2, "step time meshax / XLA", cfg, None, "", status=status, first_loss=first_loss)
            out.append(timed)
            compiled = {
                "meshax (compiled HLO)": hlo.collectives(m.compiled_text("step")),
                "XLA partitioner (compiled HLO)": hlo.collectives(j.compiled_text(f)),
            }
            out += collectives_records(2, cfg, compiled)
    for tc in transformer_configs(quick):
        out.extend(run_transformer(tc))
    return out
