"""The `meshax` command: train a model on any mesh and layout, or plan one without running it.

    meshax train mnist --mesh "rows:2;cols:4" --layout "batch:rows;hidden:cols" --steps 300
    meshax train lm --model tiny --mesh "all:8" --layout "batch:all" --steps 500
    meshax plan seq2seq --model paper-ff65536 --mesh "rows:16;cols:32" \\
        --layout "batch:rows;vocab:cols;d_ff:cols;heads:cols" --batch-size 256 --length 256
"""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_LAYOUTS = {
    "mlp": "batch:rows;hidden:cols",
    "mnist": "batch:rows;hidden:cols",
    "lm": "batch:rows;vocab:cols;d_ff:cols;heads:cols",
    "seq2seq": "batch:rows;vocab:cols;d_ff:cols;heads:cols",
}


def _parser() -> argparse.ArgumentParser:
    from meshax.models.transformer import GSPMD_SHARDINGS

    p = argparse.ArgumentParser(
        prog="meshax", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    for name, helptext in (("train", "train a model"), ("plan", "print layouts and costs; run nothing")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument(
            "task",
            choices=list(DEFAULT_LAYOUTS),
            help="mlp: the paper's two-layer net; mnist: the README's classifier; "
            "lm: a Transformer language model; seq2seq: a Transformer encoder-decoder",
        )
        s.add_argument("--mesh", default="rows:2;cols:4", help='named mesh dims (default "rows:2;cols:4")')
        s.add_argument(
            "--layout",
            default=None,
            help=f'layout rules tensor_dim:mesh_dim; "" = replicated (default per task: {DEFAULT_LAYOUTS})',
        )
        s.add_argument("--backend", choices=["simd", "placement"], default="simd")
        s.add_argument(
            "--sharding",
            default="",
            choices=["", *GSPMD_SHARDINGS],
            help="lm/seq2seq: annotate the tensors of the GSPMD paper's Table 1 (mesh dims x and y) and "
            "let propagation lay out the rest; the layout rules still apply",
        )
        s.add_argument(
            "--model", default="tiny", help="lm/seq2seq: a preset (tiny, small, paper-ff2048 .. paper-ff65536)"
        )
        s.add_argument("--batch-size", type=int, default=None)
        s.add_argument("--length", type=int, default=None, help="lm/seq2seq: sequence length")
        s.add_argument("--hidden", type=int, default=None, help="mlp/mnist: hidden units")
        s.add_argument("--data", default=None, help="mnist: a folder with the four MNIST IDX files (default: digits)")
        s.add_argument(
            "--source", choices=["text", "markov"], default="text", help="lm: bytes of text or a Markov chain"
        )
        s.add_argument("--text", default=None, help="lm: a text file or folder (default: Python's standard library)")
        s.add_argument("--problem", choices=["reverse", "sort"], default="reverse", help="seq2seq task")
        s.add_argument("--seed", type=int, default=0)
        if name == "train":
            s.add_argument("--steps", type=int, default=300)
            s.add_argument("--optimizer", choices=["adam", "adafactor"], default="adam")
            s.add_argument("--lr", type=float, default=None, help="peak learning rate (adam: 1e-3; adafactor: its own)")
            s.add_argument("--warmup", type=int, default=0, help="linear warmup steps, then linear decay to 0")
            s.add_argument("--eval-every", type=int, default=100)
            s.add_argument("--metrics", default=None, help="append metrics as JSON lines to this file")
            s.add_argument("--checkpoint-dir", default=None, help="save orbax checkpoints here")
            s.add_argument("--checkpoint-every", type=int, default=0)
            s.add_argument("--resume", default=None, metavar="DIR", help="continue from the latest checkpoint in DIR")
            s.add_argument("--no-progress", action="store_true", help="no progress bar (e.g. in logs)")
        else:
            s.add_argument("--json", action="store_true", help="print the plan as JSON")
            s.add_argument(
                "--explain",
                action="store_true",
                help="also list every tensor's layout and where it came from, with warnings",
            )
    return p


def _task(args):
    from meshax.train import LmTask, MlpTask, MnistTask, Seq2SeqTask

    batch = {"batch_size": args.batch_size} if args.batch_size else {}
    length = {"length": args.length} if args.length else {}
    if args.task == "mlp":
        return MlpTask(hidden=args.hidden or 128, seed=args.seed, **batch)
    if args.task == "mnist":
        return MnistTask(hidden=args.hidden or 1024, data_dir=args.data, seed=args.seed, **batch)
    if args.task == "lm":
        return LmTask(
            model=args.model,
            source=args.source,
            text_path=args.text,
            seed=args.seed,
            sharding=args.sharding,
            **batch,
            **length,
        )
    return Seq2SeqTask(
        model=args.model, problem=args.problem, seed=args.seed, sharding=args.sharding, **batch, **length
    )


def _optimizer(args):
    from meshax import optimize

    steps = getattr(args, "steps", 1000)
    if getattr(args, "optimizer", "adam") == "adafactor":
        lr = args.lr and (optimize.linear_decay(args.lr, args.warmup, steps) if args.warmup else args.lr)
        return optimize.AdafactorOptimizer(lr)
    lr = getattr(args, "lr", None) or 1e-3
    warmup = getattr(args, "warmup", 0)
    return optimize.AdamWeightDecayOptimizer(optimize.linear_decay(lr, warmup, steps) if warmup else lr)


def _layout_table(lowering):
    from rich.table import Table

    impl = lowering.impl
    table = Table(title="parameters and their layouts", title_justify="left")
    for col in ("variable", "shape", "split", "slice per device"):
        table.add_column(col)
    for var in lowering.graph.trainable_variables:
        t = var.value
        layout = lowering.plan[t]
        split = (
            ", ".join(
                f"{d.name} over {'x'.join(impl.shape[m].name for m in a)}" for d, a in zip(t.shape, layout.axes) if a
            )
            or "replicated"
        )
        table.add_row(
            var.name, " ".join(f"{d.name}:{d.size}" for d in t.shape), split, str(impl.slice_shape(t.shape, layout))
        )
    return table


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.layout is None:
        args.layout = DEFAULT_LAYOUTS[args.task]
    from meshax.core.shape import convert_to_shape
    from meshax.layout import convert_to_layout_rules

    try:
        mesh_shape = convert_to_shape(args.mesh)
        convert_to_layout_rules(args.layout)
        if args.command == "train":
            from meshax.runtime import use_cpu_devices

            use_cpu_devices(mesh_shape.size)
    except (ValueError, RuntimeError) as e:
        print(f"meshax: {e}", file=sys.stderr)
        return 2

    from rich.console import Console
    from rich.markup import escape

    from meshax.core.errors import GraphError, LayoutError
    from meshax.train.data import DataError
    from meshax.train.loop import build

    console = Console()
    try:
        task = _task(args)
        if args.command == "plan":
            return _plan(args, task, console)
        program = build(task, args.mesh, args.layout, args.backend, _optimizer(args), args.seed)
    except (LayoutError, GraphError, DataError, ValueError) as e:
        console.print(f"[red]meshax:[/red] {escape(str(e))}")
        return 2
    console.print(_layout_table(program.lowering))
    print(program.lowering.report(program.train_fn.counters), end="", flush=True)
    return _train(args, task, program, console)


def _plan(args, task, console) -> int:
    from meshax.plan import format_summary, summarize
    from meshax.train.loop import build

    lowering, outputs, updates = build(
        task, args.mesh, args.layout, args.backend, _optimizer(args), args.seed, compile=False
    )
    counters = lowering.trace_step(outputs, updates)
    summary = summarize(lowering, counters, outputs)
    if args.json:
        print(json.dumps(summary.as_dict(), indent=1))
        return 0
    console.print(_layout_table(lowering))
    print(lowering.report(counters), end="")
    print(format_summary(summary), end="", flush=True)
    if args.explain:
        print("\n" + lowering.explain(), end="", flush=True)
    return 0


def _train(args, task, program, console) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from meshax.train.loop import train

    checkpoint_dir = args.resume or args.checkpoint_dir
    with Progress(
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(),
        console=console,
        disable=args.no_progress,
    ) as progress:
        bar = progress.add_task("train", total=args.steps, status="")

        def on_step(step, loss, seconds):
            speed = f"  {task.tokens_per_batch / seconds:,.0f} tokens/s" if task.tokens_per_batch else ""
            progress.update(bar, completed=step + 1, status=f"loss {loss:.4f}  {seconds * 1e3:.1f} ms/step{speed}")

        def on_eval(step, metrics):
            progress.console.print(f"eval after step {step}: " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

        result = train(
            task,
            steps=args.steps,
            seed=args.seed,
            eval_every=args.eval_every,
            on_step=on_step,
            on_eval=on_eval,
            program=program,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=args.checkpoint_every,
            resume=bool(args.resume),
            metrics_path=args.metrics,
        )
    if result.first_step:
        console.print(f"resumed from step {result.first_step}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
