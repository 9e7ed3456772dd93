"""What the commands build from the flags: the task, the optimizer, the console, and the table
of the parameters' layouts.
"""

from __future__ import annotations

import sys


def task_of(args):
    from meshax.train import CnnTask, LmTask, MlpTask, MnistTask, Seq2SeqTask, UNetTask
    from meshax.train.tasks import model_config

    batch = {"batch_size": args.batch_size} if args.batch_size is not None else {}
    length = {"length": args.length} if args.length is not None else {}
    overrides = {
        field: getattr(args, flag)
        for field, flag in (
            ("pipeline_stages", "pipeline_stages"),
            ("microbatches", "microbatches"),
            ("circular_repeats", "circular_repeats"),
            ("moe_experts", "moe_experts"),
            ("dtype", "dtype"),
            ("attention", "attention"),
            ("remat", "remat"),
        )
        if getattr(args, flag) is not None
    }
    model = model_config(args.model or "tiny", **overrides) if overrides else (args.model or "tiny")
    if args.task == "mlp":
        return MlpTask(hidden=args.hidden or 128, seed=args.seed, **batch)
    if args.task == "mnist":
        return MnistTask(hidden=args.hidden or 1024, data_dir=args.data, seed=args.seed, **batch)
    if args.task == "cnn":
        return CnnTask(channels=args.channels or 16, data_dir=args.data, seed=args.seed, **batch)
    if args.task == "unet":
        return UNetTask(
            channels=args.channels or 8,
            image_size=args.image_size or 16,
            spatial_dims=args.spatial_dims or 2,
            seed=args.seed,
            **batch,
        )
    if args.task == "lm":
        return LmTask(
            model=model,
            source=args.source or "text",
            text_path=args.text,
            seed=args.seed,
            sharding=args.sharding,
            **batch,
            **length,
        )
    return Seq2SeqTask(
        model=model, problem=args.problem or "reverse", seed=args.seed, sharding=args.sharding, **batch, **length
    )


def optimizer_of(args):
    from meshax import optimize

    steps = getattr(args, "steps", 1000)
    lr, warmup = getattr(args, "lr", None), getattr(args, "warmup", 0)
    if getattr(args, "optimizer", "adam") == "adafactor":  # no --lr: Adafactor's own schedule
        return optimize.AdafactorOptimizer(
            None if lr is None else optimize.linear_decay(lr, warmup, steps) if warmup else lr
        )
    lr = 1e-3 if lr is None else lr
    return optimize.AdamWeightDecayOptimizer(optimize.linear_decay(lr, warmup, steps) if warmup else lr)


def layout_table(lowering):
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


def make_console(quiet: bool = False):
    """Rich output on stdout; when stdout is a file or a pipe, as wide as the text (no cut names).
    `quiet`: print nothing (the processes of a multi-process run other than process 0)."""
    from rich.console import Console

    return Console(quiet=quiet) if sys.stdout.isatty() else Console(width=1000, no_color=True, quiet=quiet)
