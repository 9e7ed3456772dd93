"""Convergence checks of the Transformer, on the CPU in a few minutes each.

1. Markov source: a small LM's validation cross-entropy against the source's entropy rate
   (target: within 5%).
2. Sequence reversal with the encoder-decoder: exact-match accuracy (target: >= 99%).
3. The default text corpus (Python's standard library): the tiny LM's validation bits per byte
   over training (should fall steadily).

    python examples/transformer_convergence.py [markov|reverse|text ...] [--out DIR]

Prints the numbers and writes one JSON file per experiment with the evaluation curve.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

from meshax.optimize import AdamWeightDecayOptimizer, linear_decay  # noqa: E402
from meshax.train import LmTask, Seq2SeqTask, train  # noqa: E402

EXPERIMENTS = {
    # name: (task factory, steps, peak lr, warmup, eval every, mesh, layout)
    "markov": (
        lambda: LmTask(model="tiny", source="markov", batch_size=32, length=64),
        1500,
        3e-3,
        100,
        250,
        "all:8",
        "batch:all",
    ),
    "reverse": (lambda: Seq2SeqTask(model="tiny", batch_size=64, length=8), 600, 3e-3, 100, 150, "all:8", "batch:all"),
    "text": (
        lambda: LmTask(model="tiny", source="text", batch_size=32, length=128),
        1500,
        3e-3,
        100,
        250,
        "rows:2;cols:4",
        "batch:rows;vocab:cols;d_ff:cols;heads:cols",
    ),
}


def run(name: str, out_dir: str) -> dict:
    make, steps, lr, warmup, every, mesh, layout = EXPERIMENTS[name]
    task = make()
    start = time.time()
    result = train(
        task,
        mesh,
        layout,
        steps=steps,
        eval_every=every,
        optimizer=AdamWeightDecayOptimizer(linear_decay(lr, warmup, steps)),
        on_eval=lambda step, m: print(
            f"  {name} step {step}: " + "  ".join(f"{k} {v:.4f}" for k, v in m.items()), flush=True
        ),
    )
    record = {
        "experiment": name,
        "mesh": mesh,
        "layout": layout,
        "steps": steps,
        "seconds": time.time() - start,
        "evals": result.evals,
        "final": result.evals[-1][1],
    }
    if name == "markov":
        final = result.evals[-1][1]
        record["ratio_to_entropy_rate"] = final["loss"] / final["entropy_rate"]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(record, f, indent=1)
    return record


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "experiments", nargs="*", choices=[[], *EXPERIMENTS], help=f"any of {list(EXPERIMENTS)}; default all"
    )
    p.add_argument("--out", default="benchmarks/out/convergence")
    args = p.parse_args()
    for name in args.experiments or list(EXPERIMENTS):
        r = run(name, args.out)
        extra = f"  ratio to entropy rate {r['ratio_to_entropy_rate']:.4f}" if "ratio_to_entropy_rate" in r else ""
        print(f"{name}: {r['final']}  ({r['seconds']:.0f} s){extra}", flush=True)


if __name__ == "__main__":
    main()
