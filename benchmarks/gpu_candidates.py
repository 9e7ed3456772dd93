"""How much faster the twin's step gets with changes to its program: `python -m benchmarks.gpu_candidates`.

Section 6's twin (`gpu.twin_step`) is the step written the fast way in plain JAX. Each candidate
changes its program without changing its mathematics, so that a change is measured before meshax
takes it up:
- "bf16 copies": the update writes a bfloat16 copy of each layer weight it updates, and the next
  step reads the copy, where the twin casts each float32 weight at every step (a read of 4 bytes a
  weight saved, if XLA writes the copy from the optimizer's own fusion);
- "one-pass logsumexp": the loss's logsumexp in one pass over the float32 logits
  (`gpu_parts.one_pass_logsumexp`), where `jax.nn.logsumexp` reads them twice;
- both together;
- "norm keeps its statistics": each layer norm's gradient reads the rows' mean and reciprocal
  deviation its forward computed (`gpu.kept_statistics_norm`), where JAX's gradient makes XLA
  recompute both row reductions in each backward fusion and write the scale's gradient product in
  float32 before its column sum; and the same with the statistics behind an optimization barrier
  (so XLA keeps them, not recomputes them).
The twin as it is runs first and again last (the two show the run's noise); each is timed alone
(`gpu.timed`, queued steps), freed before the next, from meshax's initial weights. Prints a table,
writes JSON. Runs anywhere (on the CPU: XLA's attention, slowly).
"""

from __future__ import annotations

import argparse
import gc
import json
import os

from benchmarks import gpu, gpu_parts

AS_IT_IS = "the twin as it is"


def _one_pass(x, axis):
    assert axis == -1
    return gpu_parts.one_pass_logsumexp()(x)


CANDIDATES = {
    "bf16 copies": {"copies": True},
    "one-pass logsumexp": {"logsumexp": _one_pass},
    "bf16 copies and one-pass logsumexp": {"copies": True, "logsumexp": _one_pass},
    "norm keeps its statistics": {"norm": gpu.kept_statistics_norm()},
    "norm keeps its statistics, barrier": {"norm": gpu.kept_statistics_norm(barrier=True)},
}


def run(size: gpu.Lm, steps: int = 10, warmup: int = 3, optimizer: str = "adam", candidates=None) -> list[dict]:
    """The twin as it is, each candidate (default: all of `CANDIDATES`), the twin as it is again."""
    import jax
    import numpy as np

    m_step, weights, task = gpu.meshax_step(size, optimizer=optimizer)
    weights = {k: np.asarray(v) for k, v in weights.items()}
    del m_step
    gc.collect()
    implementation = gpu.TWIN_ATTENTION if jax.default_backend() == "gpu" else None
    records = []
    chosen = CANDIDATES if candidates is None else candidates
    for name, kw in [(AS_IT_IS, {}), *chosen.items(), (AS_IT_IS, {})]:
        stepper = gpu.twin_step(
            size, weights, task.train_batch(0), implementation=implementation, optimizer=optimizer, **kw
        )
        t = gpu.timed(stepper, steps, warmup)
        del stepper
        gc.collect()
        records.append({"name": name, "tflops": size.flops() / t["queued_s"] / 1e12, **t})
        print(f"{size.name}: {name}: {1e3 * t['queued_s']:.2f} ms/step, first loss {t['first']:.4f}", flush=True)
    base = (records[0]["queued_s"] + records[-1]["queued_s"]) / 2
    for r in records:
        r["x_as_it_is"] = base / r["queued_s"]
    return records


def main(argv=None) -> list[dict]:
    import jax

    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_candidates", description=__doc__.splitlines()[0])
    sizes = {s.name: s for s in gpu.SIZES + gpu.LARGER}
    p.add_argument("--size", default="1.3B", choices=sizes, help="the model size (default: 1.3B)")
    p.add_argument("--optimizer", default="adam", choices=gpu.OPTIMIZERS, help="the twin's (default: adam)")
    p.add_argument("--only", default=None, help="only the candidates whose names contain one of these, comma-separated")
    p.add_argument("--out", default="benchmarks/out/gpu_candidates.json", help="the JSON written")
    args = p.parse_args(argv)
    chosen = {n: kw for n, kw in CANDIDATES.items() if args.only is None or any(w in n for w in args.only.split(","))}
    if not chosen:
        p.error(f"--only {args.only!r} is in no candidate's name: {', '.join(CANDIDATES)}")
    kind = jax.devices()[0].device_kind
    peak = gpu.peak_tflops(kind)
    print(f"{kind}, jax {jax.__version__}, {sizes[args.size]}, {args.optimizer}", flush=True)
    records = run(sizes[args.size], optimizer=args.optimizer, candidates=chosen)
    for r in records:
        mfu = f"{100 * r['tflops'] / peak:5.1f}% MFU" if peak else ""
        print(
            f"  {r['name']:40s} {1e3 * r['queued_s']:8.2f} ms  {r['tflops']:6.1f} TFLOP/s {mfu}  x{r['x_as_it_is']:.3f}"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": kind, "size": args.size, "optimizer": args.optimizer, "records": records}, f, indent=1)
    return records


if __name__ == "__main__":
    main()
