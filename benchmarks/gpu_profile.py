"""Where each side's training step spends its device time: `python -m benchmarks.gpu_profile [--size 1.3B]`.

Section 6 times meshax's step beside its plain-JAX twin; gpu_parts times the twin's parts alone.
This traces a few steps of each side under `jax.profiler` and reads the trace back
(`jax.profiler.ProfileData`): per step, the wall time, each device line's busy time, and the
kernels (or ops) that take the most of it, grouped by kind (matmul, attention, copy, other
fusions). Where the two sides differ, that is where meshax's step loses to the twin's.
Each side runs alone on the device, meshax's arrays freed first, as in section 6. Prints a
table, writes JSON.
"""

from __future__ import annotations

import argparse
import collections
import gc
import glob
import json
import os
import re
import tempfile

from benchmarks import gpu
from benchmarks.timing import queued

KINDS = [  # (kind, pattern over a kernel's or op's name), the first that matches
    ("attention", r"cudnn|fmha|flash|sdpa|attention"),  # before matmul: cuDNN's kernels name wgmma
    ("matmul", r"gemm|xmma|cutlass|nvjet|cublas|dot|matmul"),
    ("copy", r"copy|transpose|memcpy|memset"),
    ("reduction", r"reduce|scatter|gather"),
]


def kind_of(name: str) -> str:
    return next((k for k, pattern in KINDS if re.search(pattern, name, re.IGNORECASE)), "other")


def summarize(xspace_path: str, steps: int, top: int = 25) -> dict:
    """Per step: each device line's busy ms and event count, its busy ms by kind, and its `top`
    events by total time (a host plane stands in where there is no device plane)."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(xspace_path)
    planes = [p for p in data.planes if p.name.startswith("/device:")] or [
        p for p in data.planes if p.name.startswith("/host:CPU")
    ]
    lines = []
    for plane in planes:
        for line in plane.lines:
            total, count, by_kind = collections.Counter(), collections.Counter(), collections.Counter()
            for e in line.events:
                total[e.name] += e.duration_ns
                count[e.name] += 1
                by_kind[kind_of(e.name)] += e.duration_ns
            if not total:
                continue
            lines.append(
                {
                    "plane": plane.name,
                    "line": line.name,
                    "busy_ms": sum(total.values()) / 1e6 / steps,
                    "events": sum(count.values()) / steps,
                    "by_kind_ms": {k: v / 1e6 / steps for k, v in by_kind.most_common()},
                    "top": [
                        {"name": n[:160], "ms": t / 1e6 / steps, "calls": count[n] / steps}
                        for n, t in total.most_common(top)
                    ],
                }
            )
    return {"lines": lines}


def profile(stepper: gpu.Stepper, steps: int = 3, warmup: int = 2) -> dict:
    """`warmup` steps, then `steps` steps queued (as the training loop queues them) under the
    profiler: the wall ms per step and the trace's summary."""
    import jax

    for _ in range(warmup):
        stepper()
    where = tempfile.mkdtemp(prefix="meshax-profile-")
    with jax.profiler.trace(where):
        wall = queued(stepper.dispatch, stepper.fetch, steps, rounds=1)
    (xspace,) = glob.glob(os.path.join(where, "**", "*.xplane.pb"), recursive=True)
    return {"wall_ms": 1e3 * wall, **summarize(xspace, steps)}


def both(size: gpu.Lm, steps: int = 3, optimizer: str = "adam") -> dict:
    """meshax's step and the twin's at `size`, each profiled alone."""
    import jax

    m_step, weights, task = gpu.meshax_step(size, optimizer=optimizer)
    weights = {k: gpu.np.asarray(v) for k, v in weights.items()}
    out = {"meshax": profile(m_step, steps)}
    del m_step
    gc.collect()
    implementation = gpu.TWIN_ATTENTION if jax.default_backend() == "gpu" else None
    twin = gpu.twin_step(size, weights, task.train_batch(0), implementation=implementation, optimizer=optimizer)
    out["twin"] = profile(twin, steps)
    return out


def show(result: dict, lines: int = 4, top: int = 12) -> None:
    """The busiest lines of each side, their time by kind and their top events."""
    for side, r in result.items():
        print(f"== {side}: wall {r['wall_ms']:.2f} ms/step")
        for line in sorted(r["lines"], key=lambda x: -x["busy_ms"])[:lines]:
            kinds = ", ".join(f"{k} {v:.2f}" for k, v in line["by_kind_ms"].items())
            where = f"{line['plane']} | {line['line']}"
            print(f"  {where}: busy {line['busy_ms']:.2f} ms, {line['events']:.0f} events ({kinds})")
            for e in line["top"][:top]:
                print(f"    {e['ms']:8.3f} ms {e['calls']:6.1f}x  {e['name'][:110]}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_profile", description=__doc__.splitlines()[0])
    sizes = {s.name: s for s in gpu.SIZES + gpu.LARGER}
    p.add_argument("--size", default="1.3B", choices=sizes, help="the model size (default: 1.3B)")
    p.add_argument("--steps", type=int, default=3, help="steps traced per side (default: 3)")
    p.add_argument("--optimizer", default="adam", choices=gpu.OPTIMIZERS, help="both sides' (default: adam)")
    p.add_argument("--out", default="benchmarks/out/gpu_profile.json", help="the JSON written")
    args = p.parse_args(argv)
    return run(sizes[args.size], args.steps, args.out, args.optimizer)


def run(size: gpu.Lm, steps: int, out: str, optimizer: str = "adam") -> dict:
    import jax

    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {size}, {optimizer}", flush=True)
    result = both(size, steps, optimizer)
    show(result)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(
            {"device": jax.devices()[0].device_kind, "size": size.name, "optimizer": optimizer, **result}, f, indent=1
        )
    return result


if __name__ == "__main__":
    main()
