"""An MoE Transformer against a dense one of at least the same FLOPs, on the Markov source.

The MoE model makes every other feed-forward block a mixture of E experts of hidden size d_ff
(top-2, capacity factor 1.25), trained expert-parallel ("batch:all;experts:all" on 8 virtual
CPU devices); the dense model widens d_ff until its training step's FLOPs (meshax's own count,
all devices together) are no fewer than the MoE step's. Both train for the same steps with the
same optimizer and data; the script prints both validation curves and writes them to JSON.

    python examples/moe_vs_dense.py [--steps 600] [--experts 8] [--out runs/moe_vs_dense.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax

jax.config.update("jax_num_cpu_devices", 8)

from meshax.models.transformer import PRESETS  # noqa: E402
from meshax.optimize import AdamWeightDecayOptimizer, linear_decay  # noqa: E402
from meshax.train import LmTask, train  # noqa: E402
from meshax.train.loop import build  # noqa: E402


def _task(config):
    return LmTask(model=config, source="markov", batch_size=32, length=64)


def _flops(config, mesh, layout) -> int:
    lowering, outputs, updates = build(_task(config), mesh, layout, compile=False)
    return lowering.trace_step(outputs, updates).total_flops * lowering.impl.size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--out", default="runs/moe_vs_dense.json")
    args = p.parse_args()
    base = dataclasses.replace(PRESETS["tiny"], num_layers=4)
    moe = dataclasses.replace(base, moe_experts=args.experts)
    runs = {"moe": (moe, "all:8", "batch:all;experts:all")}
    moe_flops = _flops(*runs["moe"])
    d_ff = base.d_ff
    while _flops(dataclasses.replace(base, d_ff=d_ff), "all:8", "batch:all") < moe_flops:
        d_ff += 32
    runs["dense"] = (dataclasses.replace(base, d_ff=d_ff), "all:8", "batch:all")
    result = {}
    for name, (config, mesh, layout) in runs.items():
        flops = _flops(config, mesh, layout)
        out = train(
            _task(config),
            mesh,
            layout,
            steps=args.steps,
            optimizer=AdamWeightDecayOptimizer(linear_decay(3e-3, 100, args.steps)),
            eval_every=max(1, args.steps // 6),
        )
        curve = [(step, m["loss"]) for step, m in out.evals]
        result[name] = {"d_ff": config.d_ff, "step_flops": flops, "eval_loss": curve, "final": out.evals[-1][1]}
        print(
            f"{name:6} d_ff {config.d_ff:4}  step FLOPs {flops / 1e9:.3f} G  validation loss: "
            + "  ".join(f"{step}: {loss:.4f}" for step, loss in curve)
        )
    print(f"entropy rate of the source: {result['moe']['final']['entropy_rate']:.4f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
