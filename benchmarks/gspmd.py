"""Section 7: GSPMD's annotations, meshax's propagation against XLA's, on the same mesh.

Both sides get the same few annotations and nothing else: meshax through `mx.mesh_split`
(layout rules empty), plain JAX through `jax.lax.with_sharding_constraint` on the same tensors
under `jax.jit`; each completes every other tensor's sharding itself. (Storage is the one thing
a jitted function must be told: XLA's parameters, slots and feeds are placed as meshax's plan
places them, the same tensors on both sides.)

  * the paper's two-layer network y = relu(x w + bias) v, SGD: x annotated [rows, -], w read as
    [rows, cols] and v as [cols, rows] on "rows:2;cols:4": data-parallel over rows, model-
    parallel over cols, and w, v stored split over rows too (weight-update sharding);
  * the Transformer LM preset tiny under the GSPMD paper's 2D finalized sharding on "x:2;y:4",
    Adam (benchmarks/transformer.py, with the constraints at meshax's annotation points).

Reported per model: the step-time ratio meshax / XLA (interleaved medians; target <= 1.0) and
the collective values each device puts in per step, from each compiled HLO (target: meshax <=
XLA). The first step's outputs must agree before anything is timed.
"""

from __future__ import annotations

import numpy as np

from benchmarks import transformer as lm
from benchmarks.records import collectives_ratio, record, step_ratio
from benchmarks.timing import interleaved
from benchmarks.two_layer import JaxModel, MeshaxModel, Size, feeds

MESH = "rows:2;cols:4"
ANNOTATIONS = {"x": ("rows", None), "w": ("rows", "cols"), "v": ("cols", "rows")}
QUICK = {"size": Size(64, 32, 128), "steps": 10, "warmup": 3, "lm_steps": 5}
FULL = {"size": Size(512, 256, 1024), "steps": 50, "warmup": 5, "lm_steps": 30}


def _jax_twin(m: MeshaxModel) -> JaxModel:
    """The same step in jnp under jax.jit: the three annotations as sharding constraints, the
    parameters and feeds stored as meshax's plan stores them."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = m.impl.jax_mesh
    shardings = {n: m.sharding(n) for n in ("x", "g", "w", "bias", "v")}
    shardings["scalar"] = NamedSharding(mesh, PartitionSpec())
    constraints = {n: NamedSharding(mesh, PartitionSpec(*spec)) for n, spec in ANNOTATIONS.items()}
    return JaxModel(m.params(), shardings=shardings, constraints=constraints)


def _compare(
    name: str, cfg: dict, step_mx, step_xla, text_mx: str, text_xla: str, steps: int, warmup: int, first: dict
) -> list[dict]:
    t = interleaved(step_mx, step_xla, steps, warmup)
    out = [
        step_ratio(
            7,
            "step time meshax / XLA, same annotations",
            cfg,
            t,
            "jax.jit + with_sharding_constraint",
            first_outputs=first,
        )
    ]
    out.append(collectives_ratio(7, cfg, text_mx, text_xla, name))
    return out


def run(quick: bool) -> list[dict]:
    p = QUICK if quick else FULL
    s = p["size"]
    f = feeds(s)
    m = MeshaxModel(s, MESH, "", annotations=ANNOTATIONS)
    j = _jax_twin(m)
    cfg = {
        "mesh": MESH,
        "layout": "(annotations) x:[rows,-] w:[rows,cols] v:[cols,rows]",
        "size": str(s),
        "program": "two-layer train step (SGD)",
    }
    l_mx, l_xla = m.step(f), j.step(f)
    first = {"meshax": l_mx, "xla": l_xla, "agree": bool(np.isclose(l_mx, l_xla, rtol=1e-3, atol=1e-3))}
    if not first["agree"]:
        out = [
            record(
                7,
                "step time meshax / XLA, same annotations",
                cfg,
                None,
                "",
                status="not timed: losses differ",
                first_outputs=first,
            )
        ]
    else:
        out = _compare(
            "two-layer",
            cfg,
            lambda: m.step(f),
            lambda: j.step(f),
            m.compiled_text("step"),
            j.compiled_text(f),
            p["steps"],
            p["warmup"],
            first,
        )

    mesh, sharding = "x:2;y:4", "gspmd-2d-finalized"
    lm_m = lm.model("tiny", mesh, "", sharding)
    lm_j = lm.JaxLm(lm_m)
    cfg = {
        "mesh": mesh,
        "layout": f"(annotations) {sharding}",
        "model": "transformer tiny",
        "program": "LM train step (Adam)",
    }
    o_mx, o_xla = lm_m.step(), lm_j.step()
    first = {"names": list(lm.OUTPUTS), "meshax": o_mx, "xla": o_xla, "agree": lm.outputs_agree(o_mx, o_xla, 1e-4)}
    if not first["agree"]:
        status = "not timed: first outputs differ"
        return [
            *out,
            record(7, "step time meshax / XLA, same annotations", cfg, None, "", status=status, first_outputs=first),
        ]
    return out + _compare(
        "transformer tiny",
        cfg,
        lm_m.step,
        lm_j.step,
        lm_m.compiled_text(),
        lm_j.compiled_text(),
        p["lm_steps"],
        p["warmup"],
        first,
    )
