"""Section 3: meshax's overhead on one device.

The training step on a one-device mesh ("all:1", layout "") against the same model in plain
`jax.jit` on that device. Both take host arrays, put them on the device and block on the loss.
Target: step-time ratio meshax / jax.jit <= 1.05.
"""

from __future__ import annotations

import numpy as np

from benchmarks.records import record, side
from benchmarks.timing import interleaved
from benchmarks.two_layer import JaxModel, MeshaxModel, Size, feeds, params_agree

QUICK = {"sizes": [Size(64, 32, 128)], "steps": {Size(64, 32, 128): 20}, "warmup": 3}
FULL = {"sizes": [Size(64, 32, 128), Size(512, 256, 1024), Size(1024, 512, 2048)],
        "steps": {Size(64, 32, 128): 400, Size(512, 256, 1024): 100, Size(1024, 512, 2048): 50}, "warmup": 5}


def run(quick: bool) -> list[dict]:
    import jax
    p = QUICK if quick else FULL
    out = []
    for s in p["sizes"]:
        f = feeds(s)
        m = MeshaxModel(s, "all:1", "")
        j = JaxModel(m.params(), device=jax.devices()[0])
        l_mx, l_jax = m.step(f), j.step(f)
        t = interleaved(lambda: m.step(f), lambda: j.step(f), p["steps"][s], p["warmup"])
        cfg = {"mesh": "all:1", "layout": "", "size": str(s), "program": "train step"}
        out.append(record(3, "one-device step time meshax / jax.jit", cfg, t["ratio"], "ratio",
                          target="<= 1.05", met=t["ratio"] <= 1.05,
                          numerator=side("meshax step (median)", t["a_s"], "s"),
                          denominator=side("jax.jit step (median)", t["b_s"], "s"),
                          overhead_s=t["a_s"] - t["b_s"], steps=t["steps"], warmup=t["warmup"],
                          iqr_s={"meshax": t["a_iqr_s"], "jax": t["b_iqr_s"]},
                          first_loss={"meshax": l_mx, "jax": l_jax,
                                      "agree": bool(np.isclose(l_mx, l_jax, rtol=1e-3, atol=1e-3))},
                          params_agree_after=params_agree(m.params(), j.params())))
    return out
