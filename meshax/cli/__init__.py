"""The `meshax` command: train a model on any mesh and layout, or plan one without running it.

    meshax train mnist --mesh "rows:2;cols:4" --layout "batch:rows;hidden:cols" --steps 300
    meshax train cnn --mesh "rows:2;cols:4" --layout "h:rows;w:cols" --steps 300
    meshax train lm --model tiny --mesh "all:8" --layout "batch:all" --steps 500
    meshax launch -n 2 --devices-per-process 4 -- meshax train mnist --mesh "rows:2;cols:4"
    meshax plan seq2seq --model paper-ff65536 --mesh "rows:16;cols:32" \\
        --layout "batch:rows;vocab:cols;d_ff:cols;heads:cols" --batch-size 256 --length 256
"""

from __future__ import annotations

import gc
import os
import sys

from meshax.cli.checks import check_flags, check_no_empty_paths, check_rule_texts
from meshax.cli.common import layout_table, make_console, optimizer_of, task_of
from meshax.cli.generate import run_generate
from meshax.cli.parser import DEFAULT_LAYOUTS, build_parser, join_dash_values
from meshax.cli.plan import run_calibrate, run_plan, run_plot, train_searched
from meshax.cli.train import another_launched_process, check_resume, kept, quiet_dependencies, run_train, start_devices


def _tune_gc() -> None:
    """Python's garbage collector, for a process that traces JAX programs: what is imported by now
    is set aside for good (gc.freeze), and collections come less often. Tracing makes many
    short-lived objects, and each full collection walks every live one: the README's paper-scale
    search spent 2.3 s of its 12.6 s collecting before, 0.4 s of 9.1-9.8 s after."""
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def main(argv=None) -> int:
    """Run the command line; returns the exit status (2: bad input, said in one line on stderr).
    Run as the command (no `argv`: `sys.argv`), the process's garbage collector is tuned first
    (`_tune_gc`); called with `argv` from Python, the caller's process is left as it is."""
    from meshax.core.errors import LayoutWarning

    if argv is None:
        _tune_gc()
    parser = build_parser()
    args = parser.parse_args(join_dash_values(parser, sys.argv[1:] if argv is None else list(argv)))
    try:
        return _run(args)
    except BrokenPipeError:  # the reader of the output went away (`meshax plan lm | head`): quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (Python's recipe: no error at exit)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: one line saying what is kept, not a traceback into JAX
        if args.debug:
            raise
        print(f"meshax: interrupted{kept(args)}", file=sys.stderr)
        return _exit_code_of_a_job(130)
    except MemoryError as e:  # this machine's memory, not the devices' (a host array of the sizes given)
        if args.debug:
            raise
        print(f"meshax: error: {_HOST_OUT_OF_MEMORY} ({e}) (--debug shows where)", file=sys.stderr)
        return _exit_code_of_a_job(2)
    except (ValueError, RuntimeError, OSError, LayoutWarning) as e:  # MeshaxError is a ValueError
        if args.debug:
            raise
        message = " ".join(str(e).split())
        if "RESOURCE_EXHAUSTED" in message:  # (XLA's out of memory: say what the user can change)
            message = message.rstrip(".") + _OUT_OF_MEMORY
        print(f"meshax: error: {message} (--debug shows where)", file=sys.stderr)
        return _exit_code_of_a_job(2)


def _exit_code_of_a_job(code: int) -> int:
    """`code`; in a multi-process job the process ends with it at once instead: not in JAX's
    shutdown barrier, waiting for processes that may wait for this one."""
    if "jax" in sys.modules:
        from meshax.runtime import exit_at_once, in_a_job

        if in_a_job():
            exit_at_once(code)
    return code


_HOST_OUT_OF_MEMORY = (
    "this machine's memory cannot hold what the sizes given ask for: give smaller ones (--batch-size, --length, "
    "--hidden, --image-size, --channels)"
)


_OUT_OF_MEMORY = (
    ": the step does not fit in the devices' memory. `meshax plan` with the same flags shows its memory "
    "per device; lower --batch-size or --length, split more of the model over the mesh (--layout), or "
    "recompute activations in the backward pass (--remat, lm and seq2seq)"
)


def _run(args) -> int:
    import warnings

    check_no_empty_paths(args)
    check_rule_texts(args)
    if args.command not in ("train", "launch") and another_launched_process():
        return 0  # one process of `meshax launch` does the one-process commands; the rest exit
    if args.command == "plot":
        return run_plot(args)
    if args.command == "calibrate":
        return run_calibrate(args)
    if args.command == "launch":
        from meshax.launch import launch

        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        return launch(cmd, args.num_processes, args.devices_per_process, args.port)
    from meshax.core.errors import ConfigError, LayoutError, LayoutWarning
    from meshax.layout import convert_to_layout_rules, convert_to_mesh_shape, convert_to_weight_rules
    from meshax.lower.mesh_impl import check_mesh_dims
    from meshax.train.loop import build

    mesh_shape = convert_to_mesh_shape(args.mesh)
    if args.layout is None:  # the task's default rules; with a GSPMD sharding, the annotations alone
        args.layout = "" if args.sharding else DEFAULT_LAYOUTS[args.task]
        try:
            check_mesh_dims(convert_to_layout_rules(args.layout), mesh_shape)
        except LayoutError as e:
            if getattr(args, "search", False):  # nothing to compare the search's choice with
                args.layout = ""
                args.no_baseline = True
            else:
                raise ConfigError(
                    f"no --layout given, so {args.task}'s default layout {args.layout!r} applies: {e}; "
                    'give --layout ("" for none)'
                ) from None
    convert_to_layout_rules(args.layout)
    if args.weight_layout is not None:
        check_mesh_dims(convert_to_weight_rules(args.weight_layout), mesh_shape)
    missing = [m for m in ("x", "y") if args.sharding and m not in mesh_shape.dimension_names]
    if missing:
        raise ConfigError(
            f"--sharding {args.sharding} annotates over the GSPMD paper's mesh dims x and y, and the mesh "
            f'{args.mesh!r} has no {" or ".join(missing)}: give e.g. --mesh "x:2;y:4"'
        )
    quiet_dependencies()
    if args.command == "train":  # before anything starts JAX (checking --resume reads with Orbax)
        start_devices(args, mesh_shape.size)
    if args.command == "generate" or (args.command == "plan" and args.measure):  # (plan --measure runs steps)
        from meshax.runtime import use_cpu_devices

        use_cpu_devices(mesh_shape.size)
    check_flags(args)
    if args.command == "train":
        from meshax.runtime import is_main_process

        console = make_console(quiet=not is_main_process())  # one process speaks for all
        if not is_main_process():  # (and its warnings: each process warned the same; LayoutWarning: an error below)
            warnings.simplefilter("ignore")
    else:
        console = make_console()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayoutWarning)  # a rule that splits nothing is a typo here
        task = task_of(args)
        if args.command == "plan":
            return run_plan(args, task, console)
        if args.command == "generate":
            return run_generate(args, task, console)
        if args.search:
            train_searched(args, task, console)
        program = build(
            task, args.mesh, args.layout, args.backend, optimizer_of(args), args.seed, weight_layout=args.weight_layout
        )
    resumed = check_resume(args, task, program) if args.resume else None
    console.print(layout_table(program.lowering))
    if not console.quiet:
        print(program.lowering.report(program.train_fn.counters, width=console.width), end="", flush=True)
    return run_train(args, task, program, console, resumed)
