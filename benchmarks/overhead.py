"""Section 3: meshax's overhead on one device.

The training step on a one-device mesh ("all:1", layout "") against the same model in plain
`jax.jit` on that device. Both take host arrays, put them on the device and block on the loss.
Target: step-time ratio meshax / jax.jit <= 1.05.

Then the tiny Transformer language model (benchmarks/transformer.py: meshax's LmTask and
training loop with Adam, against the same step in jnp under jax.jit on that device); both return
the loss and the three metric sums to the host.
"""

from __future__ import annotations

import numpy as np

from benchmarks import transformer as lm
from benchmarks.records import record, step_ratio
from benchmarks.timing import interleaved
from benchmarks.two_layer import JaxModel, MeshaxModel, Size, feeds, params_agree

QUICK = {"sizes": [Size(64, 32, 128)], "steps": {Size(64, 32, 128): 20}, "warmup": 3}
FULL = {
    "sizes": [Size(64, 32, 128), Size(512, 256, 1024), Size(1024, 512, 2048)],
    "steps": {Size(64, 32, 128): 400, Size(512, 256, 1024): 100, Size(1024, 512, 2048): 50},
    "warmup": 5,
}
LM_QUICK = {"presets": ["tiny"], "steps": 5, "warmup": 2}
LM_FULL = {"presets": ["tiny"], "steps": 30, "warmup": 3}


def run_transformer(preset: str, steps: int, warmup: int) -> dict:
    m = lm.MeshaxLm(preset, "all:1", "")
    j = lm.JaxLm(m)  # from meshax's initial values; on the mesh's one device
    o_mx, o_jax = m.step(), j.step()
    first = {
        "names": list(lm.OUTPUTS),
        "meshax": o_mx,
        "jax": o_jax,
        "loss_rel_diff": abs(o_mx[0] - o_jax[0]) / abs(o_jax[0]),
        "agree": lm.outputs_agree(o_mx, o_jax, 1e-4),
    }
    c = m.task.config
    cfg = {
        "mesh": "all:1",
        "layout": "",
        "model": f"transformer {preset}",
        "program": "LM train step (Adam)",
        "size": f"{preset}: b={lm.BATCH},l={lm.LENGTH},vocab={c.vocab_size},d_model={c.d_model},"
        f"d_ff={c.d_ff},heads={c.num_heads},layers={c.num_layers}",
    }
    if not first["agree"]:  # two programs that compute different steps: their times compare nothing
        name, status = "one-device step time meshax / jax.jit", "not timed: first outputs differ"
        return record(3, name, cfg, None, "", status=status, first_outputs=first)
    t = interleaved(m.step, j.step, steps, warmup)
    diff, where = lm.max_param_diff(m, j)
    return step_ratio(
        3,
        "one-device step time meshax / jax.jit",
        cfg,
        t,
        "jax.jit",
        target=1.05,
        baseline_key="jax",
        overhead_s=t["a_s"] - t["b_s"],
        first_loss={"meshax": o_mx[0], "jax": o_jax[0], "agree": first["agree"]},
        first_outputs=first,
        # Adam: ~0 gradients amplify rounding to full steps, so agreement is looser than SGD's
        params_agree_after=diff <= 1e-2,
        params_max_abs_diff_after={"value": diff, "variable": where, "steps": m.steps_run},
    )


def run(quick: bool) -> list[dict]:
    import jax

    p = QUICK if quick else FULL
    out = []
    for s in p["sizes"]:
        f = feeds(s)
        m = MeshaxModel(s, "all:1", "")
        j = JaxModel(m.params(), device=jax.devices()[0])
        l_mx, l_jax = m.step(f), j.step(f)
        first_loss = {"meshax": l_mx, "jax": l_jax, "agree": bool(np.isclose(l_mx, l_jax, rtol=1e-3, atol=1e-3))}
        cfg = {"mesh": "all:1", "layout": "", "size": str(s), "program": "train step"}
        name = "one-device step time meshax / jax.jit"
        if not first_loss["agree"]:  # two programs that compute different steps: their times compare nothing
            out.append(record(3, name, cfg, None, "", status="not timed: first losses differ", first_loss=first_loss))
            continue
        t = interleaved(lambda m=m, f=f: m.step(f), lambda j=j, f=f: j.step(f), p["steps"][s], p["warmup"])
        out.append(
            step_ratio(
                3,
                name,
                cfg,
                t,
                "jax.jit",
                target=1.05,
                baseline_key="jax",
                overhead_s=t["a_s"] - t["b_s"],
                first_loss=first_loss,
                params_agree_after=params_agree(m.params(), j.params()),
            )
        )
    lp = LM_QUICK if quick else LM_FULL
    for preset in lp["presets"]:
        out.append(run_transformer(preset, lp["steps"], lp["warmup"]))
    return out
