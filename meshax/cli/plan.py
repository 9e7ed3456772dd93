"""`meshax plan` (and its layout search), `meshax calibrate`, `meshax plot`; and `meshax train
--search`'s choice of a layout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable

from meshax.cli.checks import check_can_create, check_can_make_folder, check_file_to_write, check_installed
from meshax.cli.common import layout_table, optimizer_of


def run_plot(args) -> int:
    from meshax.core.errors import ConfigError
    from meshax.train.metrics import plot_metrics

    if not args.out.endswith(".png"):
        raise ConfigError(f"--out {args.out!r}: give a .png file")
    check_file_to_write("--out", args.out, "the .png file to write")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("meshax plot needs matplotlib: pip install 'meshax[plot]' (or matplotlib)") from None
    print(plot_metrics(args.metrics, args.out))
    return 0


def run_calibrate(args) -> int:
    from meshax.layout import convert_to_mesh_shape
    from meshax.runtime import use_cpu_devices
    from meshax.search import calibrate

    check_file_to_write("--out", args.out, "a file to write the device's JSON to")
    if os.path.isfile(args.out) and os.path.getsize(args.out):  # (replaced: only a device file of its own)
        from meshax.core.errors import ConfigError
        from meshax.search import load_device

        try:
            load_device(args.out)
        except ConfigError:
            raise ConfigError(
                f"--out {args.out!r} is a file that is no device file `meshax calibrate` wrote, and calibrate "
                "would write over it: give a new path (or move the file away)"
            ) from None
    use_cpu_devices(convert_to_mesh_shape(args.mesh).size)
    device = calibrate(args.mesh)
    with open(args.out, "w") as f:
        json.dump(device.to_json(), f, indent=1)
    links = ", ".join(f"{m}: {x.latency_s * 1e6:.1f} us + B / {x.bandwidth / 1e9:.2f} GB/s" for m, x in device.links)
    print(
        f"{device.name}: matmul {device.matmul_flops / 1e9:.1f} GFLOP/s, elementwise "
        f"{device.vector_flops / 1e9:.2f} GFLOP/s per device; links {links}; wrote {args.out} "
        "(use it with meshax plan --search --device FILE)"
    )
    return 0


def plan_search(args, task) -> int:
    """`meshax plan --search`: the table, and with --picture the comparison and the chosen layouts drawn."""
    from meshax.search.draw import draw_comparison

    result, searched = run_search(args, task)
    print(json.dumps(result.as_dict(), indent=1) if args.json else result.format(), end="\n" if args.json else "")
    if args.picture:
        os.makedirs(args.picture, exist_ok=True)
        from meshax.train.loop import build

        said = sys.stderr if args.json else sys.stdout  # (stdout is the JSON's alone)
        print(f"wrote {draw_comparison(result, os.path.join(args.picture, 'search.png'))}", file=said)
        best = result.best
        chosen = build(
            searched,
            best.mesh,
            best.layout,
            args.backend,
            optimizer_of(args),
            compile=False,
            weight_layout=best.weight_layout,
        )
        draw_parameters(chosen[0], args.picture, said)
    return 0


def train_searched(args, task, console) -> None:
    """`meshax train --search`: the search's table printed, and its best mesh, rules and weight
    rules put in `args` to train with; or yours (--layout, --weight-layout) where the table has it
    faster, within the budget and keeping --pin (weight rules of your own, say, which the search
    did not try). Every process searches (the same, by the cost model); timed (--measure), each
    process's times differ, and process 0's choice is taken."""
    import jax

    from meshax.layout import convert_to_layout_rules

    result, _ = run_search(args, task, say=not console.quiet)
    if not console.quiet:
        print(result.format(), end="", flush=True)
    best, mine = result.best, result.baseline
    pinned, yours = convert_to_layout_rules(args.pin), convert_to_layout_rules(mine.layout if mine else "")
    keeps = all(yours.mesh_dims_for(d) == pinned.mesh_dims_for(d) for d in pinned.tensor_dim_names)
    if mine is not None and keeps and mine.memory_bytes <= result.memory_budget:  # (over it, shown, not run)
        said, key = ("measured", lambda c: c.measured_s) if result.measured else ("predicted", lambda c: c.step_s)
        if key(mine) < key(best):
            best = mine
            console.print(f"training yours, {said} faster than the search's best", markup=False, highlight=False)
    if args.measure and jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        same_order = sorted([*result.ranked, *([mine] if mine else [])], key=lambda c: (c.mesh, c.name))
        i = int(multihost_utils.broadcast_one_to_all(np.int32(same_order.index(best))))
        best = same_order[i]
    args.mesh, args.layout, args.weight_layout = best.mesh, best.layout, best.weight_layout


def run_search(args, task, say: bool = True):
    """The layout search the flags ask for (timed with --measure), and the task it searched."""
    from meshax.layout import convert_to_mesh_shape
    from meshax.search import SearchResult, evaluate, search_layout
    from meshax.search.program import model_of
    from meshax.search.search import search_mesh_and_layout

    # Costed once, at small depths where the model is deep: the search's candidates and the
    # layout given beside them (or the task's default, where it fits the mesh), annotations and all
    searched = dataclasses.replace(task, sharding="") if getattr(task, "sharding", "") else task
    optimizer = optimizer_of(args)  # (the search costs its steps; the result keeps it, and --measure runs them)
    model = model_of(searched, optimizer=optimizer)
    baseline = None
    if not getattr(args, "no_baseline", False):
        label = None
        if args.sharding:  # the annotations are the user's layout: name them
            label = f"{args.layout} + annotations {args.sharding}" if args.layout else f"annotations {args.sharding}"
        yours = model if searched is task else model_of(task, optimizer=optimizer)
        baseline = evaluate(
            yours, mesh=args.mesh, layout=args.layout, weight_layout=args.weight_layout, device=args.device, label=label
        )
    search: Callable[..., SearchResult] = search_mesh_and_layout if args.search_mesh else search_layout
    where = convert_to_mesh_shape(args.mesh).size if args.search_mesh else args.mesh  # (every mesh of that many)
    result = search(
        model,
        where,
        layout=args.pin,
        memory_budget=args.memory_budget,
        device=args.device,
        top=max(args.top, args.measure),  # (--measure 8 lists the 8 it measures)
        baseline=baseline,
        search_weights=args.search_weights,
    )
    if args.measure:
        from meshax.search import measure_layouts

        if say:
            k = min(args.measure, len(result.ranked))
            print(f"measuring the {k} best layout{'s' if k > 1 else ''} ...", file=sys.stderr, flush=True)
        annotated = None if searched is task else task  # (what runs the layout given beside: its annotations)
        result = measure_layouts(result, k=args.measure, yours=annotated, backend=args.backend)
    return result, searched


def draw_parameters(lowering, folder: str, said=None) -> None:
    """One picture per parameter shape (the first variable of each), in `folder`; each file
    written is said on `said` (default stdout)."""
    seen = set()
    for var in lowering.graph.trainable_variables:
        t = var.value
        if tuple(t.shape.dimension_names) in seen:
            continue
        seen.add(tuple(t.shape.dimension_names))
        print(f"wrote {lowering.draw(t, os.path.join(folder, var.name.replace('/', '.') + '.png'))}", file=said)


def run_plan(args, task, console) -> int:
    from meshax.core.errors import ConfigError
    from meshax.plan import format_summary, summarize
    from meshax.train.loop import build

    if args.picture:
        check_installed("matplotlib", "--picture needs matplotlib: pip install 'meshax[plot]'")
    if args.picture and not os.path.isdir(args.picture):
        if os.path.exists(args.picture):
            raise ConfigError(f"--picture {args.picture!r} is a file: give a folder to write the pictures to")
        check_can_create("--picture", args.picture)
        check_can_make_folder("--picture", args.picture)  # (made when the pictures are drawn: none if it fails first)
    if args.search:
        return plan_search(args, task)
    lowering, outputs, updates = build(
        task,
        args.mesh,
        args.layout,
        args.backend,
        optimizer_of(args),
        args.seed,
        compile=False,
        weight_layout=args.weight_layout,
    )
    counters = lowering.trace_step(outputs, updates)
    summary = summarize(lowering, counters, outputs)
    prediction = plan_prediction(args, lowering, outputs, updates) if args.device or args.memory_budget else None
    if args.picture:
        os.makedirs(args.picture, exist_ok=True)
        draw_parameters(lowering, args.picture, sys.stderr if args.json else None)  # (stdout: the JSON's alone)
    if args.json:
        explained = {"explain": lowering.explain()} if args.explain else {}
        predicted = {"prediction": prediction} if prediction else {}
        print(json.dumps({**summary.as_dict(), **predicted, **explained}, indent=1))
        return 0
    console.print(layout_table(lowering))
    print(lowering.report(counters, width=console.width), end="")
    print(format_summary(summary), end="", flush=True)
    if prediction:
        print("\n" + format_prediction(prediction, args), end="", flush=True)
    if args.explain:
        print("\n" + lowering.explain(), end="", flush=True)
    return 0


def plan_prediction(args, lowering, outputs, updates) -> dict:
    """The plan's step as the layout search costs it (`search.evaluate`): its predicted time on
    --device, in ms by part, and its memory per device against --memory-budget (default: the
    device's memory)."""
    from meshax.search import evaluate, load_device
    from meshax.search.result import budget_bytes

    device = load_device(args.device)
    budget = budget_bytes(args.memory_budget, device)
    c = evaluate(lowering, outputs, updates, device=device)
    return {
        "device": device.name,
        "step_ms": c.step_s * 1e3,
        "compute_ms": c.compute_s * 1e3,
        "communication_ms": {k: v * 1e3 for k, v in c.comm_s.items() if v},
        "memory_bytes": c.memory_bytes,
        "memory_budget_bytes": budget,
        "fits": c.memory_bytes <= budget,
    }


def _time(ms: float) -> str:
    """A duration in the unit that reads best: '9.83 s', '1.425 ms', '7.74 us'."""
    for unit, scale in (("s", 1e3), ("ms", 1.0), ("us", 1e-3)):
        if ms >= scale:
            return f"{ms / scale:.4g} {unit}"
    return f"{ms * 1e6:.4g} ns"


def format_prediction(p: dict, args) -> str:
    from meshax.lower.report import _human

    parts = ", ".join(
        [f"compute {_time(p['compute_ms'])}", *(f"{k} {_time(v)}" for k, v in p["communication_ms"].items())]
    )
    memory = f"memory / device {_human(p['memory_bytes'])}B of {_human(p['memory_budget_bytes'])}B"
    if p["fits"]:
        verdict = "fits"
    else:
        over = _human(p["memory_bytes"] - p["memory_budget_bytes"])
        remat = " --remat (each layer recomputed in the backward pass)," if args.task in ("lm", "seq2seq") else ""
        remat = "" if getattr(args, "remat", False) else remat
        verdict = f"does not fit, {over}B over: try{remat} a layout that splits more, or --search"
    return f"predicted on {p['device']}: step {_time(p['step_ms'])} ({parts})\n{memory}: {verdict}\n"
