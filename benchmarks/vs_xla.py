"""Section 2: meshax against XLA's own SPMD partitioner on the same mesh.

The training step of the two-layer network (loss, SGD updates of w, bias, v and a step
counter), once as meshax's shard_map program and once as plain jnp + `jax.grad` under `jax.jit`
with the `NamedSharding`s meshax's plan gives x, g, w, bias, v. Both sides take the same host
arrays each step, put them on the devices, run, and block on the loss. Reported: the step-time
ratio meshax / XLA (medians, interleaved; target <= 1.0) and each compiled program's
collectives, counted from its HLO, with values per device from the HLO shapes.
"""

from __future__ import annotations

import numpy as np

from benchmarks import hlo
from benchmarks.records import record, side
from benchmarks.timing import interleaved
from benchmarks.two_layer import LAYOUTS, Size, feeds, jax_twin, model, params_agree

QUICK = {"sizes": [Size(64, 32, 128)], "steps": {Size(64, 32, 128): 10}, "warmup": 3}
# more steps where a step is short (noise is mostly the host's), 50 where it is long
FULL = {"sizes": [Size(128, 64, 256), Size(512, 256, 1024)],
        "steps": {Size(128, 64, 256): 200, Size(512, 256, 1024): 50}, "warmup": 5}


def transformer_configs() -> list:
    """Extra configurations for this section. The transformer (another issue, in progress as
    meshax.models.transformer) plugs in here: return entries like
    {"name", "mesh", "layout", "build_meshax", "build_jax"}; none yet."""
    return []


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
            agree = bool(np.isclose(l_mx, l_jax, rtol=1e-3, atol=1e-3))
            t = interleaved(lambda: m.step(f), lambda: j.step(f), p["steps"][s], p["warmup"])
            out.append(record(2, "step time meshax / XLA", cfg, t["ratio"], "ratio",
                              target="<= 1.0", met=t["ratio"] <= 1.0,
                              numerator=side("meshax step (median)", t["a_s"], "s"),
                              denominator=side("jax.jit + NamedSharding step (median)", t["b_s"], "s"),
                              steps=t["steps"], warmup=t["warmup"],
                              iqr_s={"meshax": t["a_iqr_s"], "xla": t["b_iqr_s"]},
                              first_loss={"meshax": l_mx, "xla": l_jax, "agree": agree},
                              params_agree_after=params_agree(m.params(), j.params())))
            c_mx = hlo.collectives(m.compiled_text("step"))
            c_xla = hlo.collectives(j.compiled_text(f))
            for who, c in (("meshax (compiled HLO)", c_mx), ("XLA partitioner (compiled HLO)", c_xla)):
                out.append(record(2, f"collectives: {who}", cfg, sum(v["count"] for v in c.values()), "collectives",
                                  values_per_device=sum(v["values"] for v in c.values()),
                                  by_kind=c, summary=hlo.summary(c)))
    for tc in transformer_configs():  # pragma: no cover - nothing registered yet
        raise NotImplementedError(f"transformer configuration {tc!r}: hook not wired yet")
    return out
