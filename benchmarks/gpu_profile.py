"""Where each side's training step spends its device time: `python -m benchmarks.gpu_profile [--size 1.3B]`.

Section 6 times meshax's step beside its plain-JAX twin; gpu_parts times the twin's parts alone.
This traces a few steps of each side under `jax.profiler` and reads the trace back
(`jax.profiler.ProfileData`): per step, the wall time, each device line's busy time, and the
kernels (or ops) that take the most of it, grouped by kind (matmul, attention, copy, other
fusions), and the HLO instructions those kernels run for, each described from the compiled
module (`instructions`: shapes, fusion kind, custom-call target), so a kernel can be tied to a
matmul or fusion of the model. Where the two sides differ, that is where meshax's step loses
to the twin's.
Each side runs alone on the device, meshax's arrays freed first, as in section 6. Prints a
table, writes JSON, and each side's compiled module beside it (gzipped text).
"""

from __future__ import annotations

import argparse
import collections
import gc
import glob
import gzip
import json
import math
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


def _balanced(text: str, start: int) -> int:
    """The index just past the bracket that closes the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, "{": 1, ")": -1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


def _shape(text: str) -> str:
    return re.sub(r"\{[^{}]*\}", "", text)  # without its layout: bf16[8,1024]{1,0} -> bf16[8,1024]


def instructions(hlo_text: str) -> dict[str, str]:
    """Each instruction of a compiled HLO module, by name: its result's shape, what it is (the
    opcode, a fusion's kind, a custom call's target) and its operands' shapes. The profiler
    names the instruction each kernel runs for (its `hlo_op`), so this says which matmul or
    fusion of the model a kernel is."""
    defined = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = ")
    shapes, parts = {}, {}
    for line in hlo_text.splitlines():
        m = defined.match(line)
        if not m:
            continue
        at = m.end()
        end = _balanced(line, at) if line[at : at + 1] == "(" else line.find(" ", at)
        opcode = re.match(r"\s*([\w\-]+)\(", line[end:]) if end > at else None
        if opcode is None:  # not an instruction as this reads them: left undescribed, not fatal
            continue
        args_at = end + opcode.end() - 1
        operands = re.findall(r"%([\w.\-]+)", line[args_at : _balanced(line, args_at)])
        how = re.search(r'kind=(k\w+)|custom_call_target="([^"]+)"', line)
        shapes[m.group(1)] = _shape(line[at:end])
        parts[m.group(1)] = (opcode.group(1), how and (how.group(1) or how.group(2)), operands)
    return {
        name: f"{shapes[name]} = {op}{f' {how}' if how else ''}({', '.join(shapes.get(o, o) for o in operands)})"
        for name, (op, how, operands) in parts.items()
    }


def bytes_of(description: str) -> int:
    """The bytes of every array an instruction's description names (`instructions`): its result
    and its operands, what a memory-bound kernel must move at least once."""
    width = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4}
    width |= {"f64": 8, "s64": 8, "u64": 8}
    return sum(
        width.get(dtype, 0) * math.prod(int(n) for n in dims.split(",") if n)
        for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", description)
    )


def kernel_names(described: dict[str, str]) -> dict[str, str]:
    """The name XLA gives the kernel of each instruction it names one after (a fusion's:
    `loop_add_fusion.49` runs as `loop_add_fusion_49`), to the instruction's name."""
    return {re.sub(r"[.\-]", "_", name): name for name in described}


def tie(kernel: str, hlo_op: str | None, named: dict[str, str]) -> str | None:
    """The HLO instruction a kernel runs for: the one it is named after (`kernel_names`), or else
    the trace's `hlo_op` stat (inside a command buffer, a GPU kernel's is the buffer's)."""
    return named.get(kernel) or hlo_op


def summarize(xspace_path: str, steps: int, top: int = 25, described: dict[str, str] | None = None) -> dict:
    """Per step: each device line's busy ms and event count, its busy ms by kind, and its `top`
    events by total time (a host plane stands in where there is no device plane); and its
    `3 * top` HLO instructions by the time of their kernels, each `described` (`instructions`)
    where the trace names it, with the bytes its arrays hold and the rate its kernels moved them
    at; each kernel tied to its instruction by `tie`."""
    from jax.profiler import ProfileData

    described = described or {}
    named = kernel_names(described)

    data = ProfileData.from_file(xspace_path)
    planes = [p for p in data.planes if p.name.startswith("/device:")] or [
        p for p in data.planes if p.name.startswith("/host:CPU")
    ]
    lines = []
    for plane in planes:
        for line in plane.lines:
            total, count, by_kind = collections.Counter(), collections.Counter(), collections.Counter()
            by_op, op_calls, op_kernels = collections.Counter(), collections.Counter(), {}
            for e in line.events:
                total[e.name] += e.duration_ns
                count[e.name] += 1
                by_kind[kind_of(e.name)] += e.duration_ns
                op = tie(e.name, dict(e.stats).get("hlo_op"), named)
                if op is not None:
                    by_op[op] += e.duration_ns
                    op_calls[op] += 1
                    op_kernels.setdefault(op, collections.Counter())[e.name] += e.duration_ns
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
                    "top_ops": [
                        _op(op, t, op_calls[op], op_kernels[op], described.get(op), steps)
                        for op, t in by_op.most_common(3 * top)
                    ],
                }
            )
    return {"lines": lines}


def _op(op: str, ns: int, calls: int, kernels: collections.Counter, instruction: str | None, steps: int) -> dict:
    moved = bytes_of(instruction) if instruction else None
    return {
        "hlo_op": op,
        "ms": ns / 1e6 / steps,
        "calls": calls / steps,
        "kernel": kernels.most_common(1)[0][0][:160],
        "instruction": instruction,
        "bytes": moved,
        "gb_per_s": moved * calls / ns if moved else None,  # (bytes per ns is GB/s)
    }


def profile(stepper: gpu.Stepper, steps: int = 3, warmup: int = 2) -> dict:
    """`warmup` steps, then `steps` steps queued (as the training loop queues them) under the
    profiler: the wall ms per step and the trace's summary."""
    import jax

    for _ in range(warmup):
        stepper()
    text = stepper.compiled_text()
    with tempfile.TemporaryDirectory(prefix="meshax-profile-") as where:  # (the trace, read and removed)
        with jax.profiler.trace(where):
            wall = queued(stepper.dispatch, stepper.fetch, steps, rounds=1)
        (xspace,) = glob.glob(os.path.join(where, "**", "*.xplane.pb"), recursive=True)
        summary = summarize(xspace, steps, described=instructions(text))
    return {"wall_ms": 1e3 * wall, **summary, "hlo": text}


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
    """The busiest lines of each side, their time by kind and their top events; the busiest
    line's top HLO instructions."""
    for side, r in result.items():
        print(f"== {side}: wall {r['wall_ms']:.2f} ms/step")
        for i, line in enumerate(sorted(r["lines"], key=lambda x: -x["busy_ms"])[:lines]):
            kinds = ", ".join(f"{k} {v:.2f}" for k, v in line["by_kind_ms"].items())
            where = f"{line['plane']} | {line['line']}"
            print(f"  {where}: busy {line['busy_ms']:.2f} ms, {line['events']:.0f} events ({kinds})")
            for e in line["top"][:top]:
                print(f"    {e['ms']:8.3f} ms {e['calls']:6.1f}x  {e['name'][:110]}")
            for op in line["top_ops"][: 3 * top] if i == 0 else []:
                rate = f"{op['gb_per_s']:6.0f} GB/s" if op["gb_per_s"] else " " * 11
                what = (op["instruction"] or "?")[:150]
                print(f"    {op['ms']:8.3f} ms {op['calls']:6.1f}x {rate}  {op['hlo_op']}: {what}")


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
    for side, r in result.items():  # each side's compiled module beside the JSON, to read its kernels against
        with gzip.open(f"{os.path.splitext(out)[0]}.{side}.hlo.txt.gz", "wt") as f:
            f.write(r.pop("hlo"))
    with open(out, "w") as f:
        json.dump(
            {"device": jax.devices()[0].device_kind, "size": size.name, "optimizer": optimizer, **result}, f, indent=1
        )
    return result


if __name__ == "__main__":
    main()
