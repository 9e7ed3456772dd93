"""Which XLA options make meshax's LM training step faster on a GPU: `python -m benchmarks.gpu_options [--size 350M]`.

Each candidate is a set of XLA options (what `jax.jit(compiler_options=...)` takes), given to
meshax's SIMD backend as `build(..., compiler_options=...)`, over meshax's own options for GPUs
(`meshax.lower.mesh_impl.PLATFORM_COMPILER_OPTIONS`), or one of meshax's own choices for the
program (`cast_copies`: `build(..., cast_copies=...)`, `Lowering.function`; `dtype`: the model's,
float16 trained loss-scaled). meshax's step of
section 6 at the size is built, compiled and timed with each candidate in turn, each freed
before the next: meshax's defaults first and again last (the two show the run's noise), then the
candidates that beat the defaults by more than that noise, all together. Timed as section 6
times it (queued steps). Prints a table, writes JSON. A candidate that XLA refuses or that
fails records why, and the rest run. Runs anywhere: the GPU options are accepted and unused on
a CPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os

from benchmarks import gpu

MESHAX_CHOICES = ("cast_copies", "dtype")  # a candidate's keys that are meshax's choices, not XLA's options
CANDIDATES = {
    # the step reads bfloat16 copies of its weights written by the update before (on a GPU, by default)
    "no bf16 weight copies": {"cast_copies": False},
    # float16 computation with dynamic loss scaling (`optimize.LossScaleOptimizer`), for bfloat16's
    "float16, loss-scaled": {"dtype": "float16"},
    "command buffers off": {"xla_gpu_enable_command_buffer": ""},
    "command buffers, concurrent scheduling": {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"},
    "command buffers, concurrent regions": {"xla_gpu_graph_enable_concurrent_region": True},
    "command buffers from one op up": {"xla_gpu_graph_min_graph_size": 1},
    "cuBLASLt (bias and ReLU epilogues)": {"xla_gpu_enable_cublaslt": True},
    "cuDNN layer norm": {"xla_gpu_enable_cudnn_layer_norm": True},
    "Triton gemm fusions (XLA's default)": {"xla_gpu_enable_triton_gemm": True},
    "cuDNN gemm fusions": {"xla_gpu_cudnn_gemm_fusion_level": 2},
    "Triton block-level fusions (norms)": {"xla_gpu_experimental_enable_fusion_block_level_rewriter": True},
    "Triton warp specialization": {"xla_gpu_experimental_enable_triton_warp_specialization": True},
    # XLA merges two matmuls that share an operand (the K and V projections, and their gradients)
    # into one, through a concatenate and slices: meshax turns it off (XLA's default is 32 MB)
    "dot merging (XLA's default)": {"xla_gpu_dot_merger_threshold_mb": 32},
    # the layer norms run as Triton block-level fusions, at 1.8 of the H100's 3 TB/s
    "no Triton block-level fusions": {"xla_gpu_experimental_enable_fusion_block_level_rewriter": False},
    "Triton fusions' tiles autotuned": {"xla_gpu_experimental_enable_fusion_autotuner": True},
}
DEFAULTS = "meshax's defaults"
TOGETHER = "the faster ones together"


def one(size: gpu.Lm, name: str, options: dict, steps: int, warmup: int) -> dict:
    """meshax's step at `size` compiled with `options`, timed: a record (or the error that stopped it)."""
    record = {"name": name, "options": options}
    try:
        choices = {k: v for k, v in options.items() if k in MESHAX_CHOICES}
        xla = {k: v for k, v in options.items() if k not in MESHAX_CHOICES}
        stepper, _, _ = gpu.meshax_step(size, compiler_options=xla or None, **choices)
        t = gpu.timed(stepper, steps, warmup)
    except Exception as err:  # XLA refused the options, or the step failed with them: say why, go on
        return {**record, "queued_s": None, "error": f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"}
    finally:
        gc.collect()  # the program holds reference cycles: free its arrays before the next one's
    return {
        **record,
        "queued_s": t["queued_s"],
        "waited_s": t["waited_s"],
        "tflops": size.flops() / t["queued_s"] / 1e12,
        "first_loss": t["first"],
        "first_s": t["first_s"],
    }


def faster(records: list[dict], default_s: float, noise: float) -> list[dict]:
    """The records faster than `default_s` by more than the fraction `noise` (at least 0.5%)."""
    return [r for r in records if r["queued_s"] is not None and r["queued_s"] < default_s * (1 - max(noise, 0.005))]


def run(size: gpu.Lm, candidates: dict[str, dict], steps: int = 10, warmup: int = 3) -> list[dict]:
    """The defaults, each candidate, the defaults again, then the faster candidates together."""

    def timed(name, options):
        r = one(size, name, options, steps, warmup)
        shown = f"{1e3 * r['queued_s']:.2f} ms/step" if r["queued_s"] is not None else r["error"]
        print(f"{size.name}: {name} {options}: {shown}", flush=True)
        return r

    first = timed(DEFAULTS, {})
    tried = [timed(name, options) for name, options in candidates.items()]
    last = timed(DEFAULTS, {})
    records = [first, *tried, last]
    defaults = [r["queued_s"] for r in (first, last) if r["queued_s"] is not None]
    default_s = min(defaults) if defaults else None
    if default_s is not None:
        winners = faster(tried, default_s, (max(defaults) - default_s) / default_s)
        if len(winners) > 1:  # one alone is measured already
            records.append(timed(TOGETHER, {k: v for r in winners for k, v in r["options"].items()}))
    for r in records:
        r["vs_defaults"] = None if r["queued_s"] is None or default_s is None else default_s / r["queued_s"]
    return records


def table(records: list[dict], peak: float | None) -> str:
    lines = [f"{'candidate':<44} {'ms/step':>9} {'TFLOP/s':>8} {'MFU':>6} {'x defaults':>10}"]
    for r in records:
        if r["queued_s"] is None:
            lines.append(f"{r['name']:<44} {r['error'][:120]}")
            continue
        mfu = f"{r['tflops'] / peak:.1%}" if peak else "-"
        vs = "-" if r["vs_defaults"] is None else f"{r['vs_defaults']:.3f}"
        lines.append(f"{r['name']:<44} {1e3 * r['queued_s']:>9.2f} {r['tflops']:>8.1f} {mfu:>6} {vs:>10}")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_options", description=__doc__.splitlines()[0])
    sizes = {s.name: s for s in gpu.SIZES + gpu.LARGER}
    p.add_argument("--size", default="350M", choices=sizes, help="the model size (default: 350M)")
    p.add_argument(
        "--only", default=None, help="try only the candidates whose names contain one of these, comma-separated"
    )
    p.add_argument("--out", default="benchmarks/out/gpu_options.json", help="the JSON written")
    args = p.parse_args(argv)
    import jax

    size = sizes[args.size]
    chosen = {n: o for n, o in CANDIDATES.items() if args.only is None or any(w in n for w in args.only.split(","))}
    if not chosen:
        p.error(f"--only {args.only!r} is in no candidate's name: {', '.join(CANDIDATES)}")
    kind = jax.devices()[0].device_kind
    print(f"{kind}, jax {jax.__version__}, {size}", flush=True)
    records = run(size, chosen)
    print(table(records, gpu.peak_tflops(kind)), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": kind, "size": size.name, "flops": size.flops(), "records": records}, f, indent=1)
    return records


if __name__ == "__main__":
    main()
