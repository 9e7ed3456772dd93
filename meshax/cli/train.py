"""`meshax train`: the devices (and a multi-process job) started, a checkpoint to resume checked,
and the training loop with its progress bar.
"""

from __future__ import annotations

import collections
import functools
import sys


def kept(args) -> str:
    """What an interrupted `meshax train` keeps: its latest checkpoint, and how to go on from it."""
    folder = getattr(args, "resume", None) or getattr(args, "checkpoint_dir", None)
    if args.command != "train" or not folder:
        return ""
    from meshax.train.checkpoint import latest_step

    last = latest_step(folder)
    if last is None:
        return f"; no checkpoint was saved in {folder!r} yet"
    return f"; the latest checkpoint in {folder!r} is of step {last}: continue with --resume {folder}"


def check_resume(args, task, program) -> str:
    """Before the run: the checkpoint in --resume holds this model (else a ConfigError). Returns
    the line saying where the run resumes, with a note if the batches differ from the first
    run's (its --batch-size, --seed, --length, data ...)."""
    from meshax.train.checkpoint import check_restorable, checkpoint_info

    info = checkpoint_info(args.resume)  # (its task checked before: `check_flags`)
    check_restorable(args.resume, program.lowering, info["step"])
    line = f"resuming from step {info['step']} of {args.resume}"
    saved, now = info.get("data", {}), task.data_settings()
    changed = [k for k in saved if k in now and saved[k] != now[k]]
    if not changed:
        return line
    flags = {"text_path": "text", "data_dir": "data", "eval_batches_count": "eval batches"}

    def settings(values: dict) -> str:
        return ", ".join(f"{flags.get(k, k).replace('_', '-')} {values[k]}" for k in changed)

    return (
        f"{line}\nnote: it was trained with {settings(saved)}; this run has {settings(now)}: from step "
        f"{info['step']} on it trains on other batches than the first run would have"
    )


def another_launched_process() -> bool:
    """Whether this process is one of a job's processes (`meshax launch` sets their environment)
    other than process 0."""
    from meshax.runtime import ENV_PROCESS_ID, env_int

    return bool(env_int(ENV_PROCESS_ID))


def start_devices(args, mesh_size: int) -> None:
    """Virtual CPU devices for the mesh; in a multi-process job, join it first (this process's
    share of the devices) and check that the mesh spans every process's devices."""
    import jax

    from meshax.core.errors import ConfigError
    from meshax.runtime import (
        ENV_NUM_PROCESSES,
        ENV_PROCESS_ID,
        distributed_requested,
        env_int,
        exit_at_once_on_interrupt,
        initialize_distributed,
        use_cpu_devices,
    )

    if not (args.distributed or distributed_requested(args.coordinator, args.num_processes, args.process_id)):
        use_cpu_devices(mesh_size)
        return
    given = {"--coordinator": args.coordinator, "--num-processes": args.num_processes, "--process-id": args.process_id}
    if any(v is not None for v in given.values()) and None in given.values():
        missing = [flag for flag, v in given.items() if v is None]
        raise ConfigError(
            f"{' and '.join(missing)} missing: give --coordinator, --num-processes and --process-id together "
            "(or none of them, with --distributed, to take the job from the cluster's environment)"
        )
    n = args.num_processes or env_int(ENV_NUM_PROCESSES)
    if n and mesh_size % n:
        raise ConfigError(f"--mesh {args.mesh!r} has {mesh_size} devices, which {n} processes cannot share evenly")
    per_process = env_int("JAX_NUM_CPU_DEVICES") or (mesh_size // n if n else 1)
    if not args.debug:  # (--debug: the KeyboardInterrupt's traceback) the id known so far: process 0's says it
        process_id = args.process_id if args.process_id is not None else env_int(ENV_PROCESS_ID)
        exit_at_once_on_interrupt(lambda: f"meshax: interrupted{kept(args)}", first=process_id in (0, None))
    initialize_distributed(args.coordinator, args.num_processes, args.process_id, per_process)
    if jax.device_count() != mesh_size:
        raise ConfigError(
            f"--mesh {args.mesh!r} has {mesh_size} devices, but the {jax.process_count()} processes of this job "
            f"have {jax.device_count()} ({jax.local_device_count()} each): the mesh must span them all"
        )
    if not args.debug:  # (and now that it is known, only process 0 says it)
        exit_at_once_on_interrupt(lambda: f"meshax: interrupted{kept(args)}")


def quiet_dependencies() -> None:
    """Keep out what dependencies log that means nothing to a user (absl's notes from Orbax)."""
    try:
        from absl import logging as absl_logging
    except ImportError:  # pragma: no cover
        return
    absl_logging.set_verbosity(absl_logging.ERROR)


def run_train(args, task, program, console, resumed: str | None = None) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from meshax.train.loop import Preempted, train

    checkpoint_dir = args.resume or args.checkpoint_dir
    if resumed:
        console.print(resumed, markup=False, highlight=False)
    with Progress(  # on stderr, and only on a terminal: logs get the eval lines, not a bar
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=args.no_progress or console.quiet or not sys.stderr.isatty(),
    ) as progress:
        bar = progress.add_task("train", total=args.steps, status="")

        recent: collections.deque[float] = collections.deque(maxlen=10)

        def on_step(step, loss, seconds):
            recent.append(seconds)  # the last 10 steps' mean: queued steps' times vary one by one
            seconds = sum(recent) / len(recent)
            speed = f"  {task.tokens_per_batch / seconds:,.0f} tokens/s" if task.tokens_per_batch else ""
            progress.update(bar, completed=step + 1, status=f"loss {loss:.4f}  {seconds * 1e3:.1f} ms/step{speed}")

        def on_eval(step, metrics):
            console.print(f"eval after step {step}: " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

        run = functools.partial(
            train,
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
            tensorboard_dir=args.tensorboard,
        )
        try:
            run()
        except Preempted as e:  # every process stops at the same step, the checkpoint saved
            console.print(f"meshax: {e}")
            from meshax.launch import PREEMPTED

            return PREEMPTED
    return 0
