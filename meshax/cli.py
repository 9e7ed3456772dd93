"""The `meshax` command: train a model on any mesh and layout, or plan one without running it.

    meshax train mnist --mesh "rows:2;cols:4" --layout "batch:rows;hidden:cols" --steps 300
    meshax plan mlp --mesh "rows:2;cols:4" --layout "batch:rows;hidden:cols"
"""

from __future__ import annotations

import argparse
import json
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshax", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name, helptext in (("train", "train a model"), ("plan", "print layouts and costs; run nothing")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("task", choices=["mlp", "mnist"], help="mlp: the paper's two-layer network; mnist: the README's classifier")
        s.add_argument("--mesh", default="rows:2;cols:4", help='named mesh dims, e.g. "rows:2;cols:4" (default)')
        s.add_argument("--layout", default="batch:rows;hidden:cols",
                       help='layout rules tensor_dim:mesh_dim, e.g. "batch:rows;hidden:cols" (default); "" = replicated')
        s.add_argument("--backend", choices=["simd", "placement"], default="simd")
        s.add_argument("--batch-size", type=int, default=64)
        s.add_argument("--hidden", type=int, default=None, help="hidden units (mlp: 128, mnist: 1024)")
        s.add_argument("--data", default=None, help="mnist: a folder with the four MNIST IDX files (default: scikit-learn digits)")
        s.add_argument("--seed", type=int, default=0)
        if name == "train":
            s.add_argument("--steps", type=int, default=300)
            s.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
            s.add_argument("--eval-every", type=int, default=100)
            s.add_argument("--metrics", default=None, help="append per-step metrics as JSON lines to this file")
            s.add_argument("--no-progress", action="store_true", help="no progress bar (e.g. in logs)")
    return p


def _task(args):
    from meshax.train import MlpTask, MnistTask
    if args.task == "mlp":
        return MlpTask(batch_size=args.batch_size, hidden=args.hidden or 128)
    return MnistTask(batch_size=args.batch_size, hidden=args.hidden or 1024, data_dir=args.data, seed=args.seed)


def _layout_table(lowering):
    from rich.table import Table
    impl = lowering.impl
    table = Table(title="parameters and their layouts", title_justify="left")
    for col in ("variable", "shape", "split", "slice per device"):
        table.add_column(col)
    for var in lowering.graph.trainable_variables:
        t = var.value
        layout = lowering.plan[t]
        split = ", ".join(f"{d.name} over {'x'.join(impl.shape[m].name for m in a)}"
                          for d, a in zip(t.shape, layout.axes) if a) or "replicated"
        table.add_row(var.name, " ".join(f"{d.name}:{d.size}" for d in t.shape), split,
                      str(impl.slice_shape(t.shape, layout)))
    return table


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from meshax.core.shape import convert_to_shape
    from meshax.layout import convert_to_layout_rules
    try:
        mesh_shape = convert_to_shape(args.mesh)
        convert_to_layout_rules(args.layout)
    except ValueError as e:
        print(f"meshax: {e}", file=sys.stderr)
        return 2
    if args.command == "train":
        from meshax.runtime import use_cpu_devices
        use_cpu_devices(mesh_shape.size)

    from rich.console import Console
    from rich.markup import escape

    from meshax.core.errors import LayoutError
    from meshax.train.data import DataError
    from meshax.train.loop import build
    console = Console()
    try:
        task = _task(args)
        from meshax.optimize import AdamWeightDecayOptimizer
        lowering, train_fn, eval_fn, names = build(task, args.mesh, args.layout, args.backend,
                                                  AdamWeightDecayOptimizer(getattr(args, "lr", 1e-3)), args.seed) \
            if args.command == "train" else _plan_only(task, args)
    except (LayoutError, DataError, ValueError) as e:
        console.print(f"[red]meshax:[/red] {escape(str(e))}")
        return 2

    console.print(_layout_table(lowering))
    counters = train_fn.counters
    print(lowering.report(counters), end="", flush=True)
    if args.command == "plan":
        return 0
    return _train(args, task, lowering, train_fn, eval_fn, names, console)


def _plan_only(task, args):
    """Build the training program's graph and count its costs by tracing, allocating nothing."""
    from meshax.autodiff import gradients
    from meshax.backends import PlacementMeshImpl, SimdMeshImpl
    from meshax.core.graph import Graph, Mesh
    from meshax.lower.lowering import Lowering
    from meshax.optimize import AdamWeightDecayOptimizer

    graph = Graph()
    mesh = Mesh(graph, "mesh")
    built = task.build(mesh)
    params = list(graph.trainable_variables)
    updates = AdamWeightDecayOptimizer(1e-3).apply_grads(gradients(built.loss, [v.value for v in params]), params)
    impl = (SimdMeshImpl if args.backend == "simd" else PlacementMeshImpl)(args.mesh, args.layout)
    lowering = Lowering(graph, {mesh: impl}, seed=args.seed)

    class _Plan:  # what main() reads of a function: its counters, from tracing the step
        counters = lowering.trace_step([built.loss] + list(built.metrics.values()), updates)

    return lowering, _Plan, None, list(built.metrics)


def _train(args, task, lowering, train_fn, eval_fn, names, console) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from meshax.train.loop import train
    metrics_file = open(args.metrics, "a") if args.metrics else None
    with Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[status]}"),
                  TimeRemainingColumn(), console=console, disable=args.no_progress) as progress:
        bar = progress.add_task("train", total=args.steps, status="")

        def on_step(step, loss, seconds):
            progress.update(bar, advance=1, status=f"loss {loss:.4f}  {seconds * 1e3:.1f} ms/step")
            if metrics_file:
                metrics_file.write(json.dumps({"step": step, "loss": loss, "step_seconds": seconds}) + "\n")

        result = train(task, steps=args.steps, seed=args.seed, eval_every=args.eval_every, on_step=on_step,
                       built=(lowering, train_fn, eval_fn, names))
    for step, m in result.evals:
        console.print(f"eval after step {step}: " + "  ".join(f"{k} {v:.4f}" for k, v in m.items()))
        if metrics_file:
            metrics_file.write(json.dumps({"step": step, "eval": m}) + "\n")
    if metrics_file:
        metrics_file.close()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
