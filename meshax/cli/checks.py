"""Checks of the flags before anything runs: flags that contradict each other, apply to another
task, or name paths that cannot be read or written. Each names what is wrong and how to fix it.
"""

from __future__ import annotations

import json
import os
import tempfile

# Flags that only some tasks read: giving one to another task is a mistake, not a no-op.
ONLY_FOR = {
    "source": ("lm",),
    "problem": ("seq2seq",),
    "sharding": ("lm", "seq2seq"),
    "model": ("lm", "seq2seq"),
    "pipeline_stages": ("lm", "seq2seq"),
    "microbatches": ("lm", "seq2seq"),
    "circular_repeats": ("lm", "seq2seq"),
    "moe_experts": ("lm", "seq2seq"),
    "dtype": ("lm", "seq2seq"),
    "attention": ("lm", "seq2seq"),
    "remat": ("lm", "seq2seq"),
    "length": ("lm", "seq2seq"),
    "hidden": ("mlp", "mnist"),
    "data": ("mnist", "cnn"),
    "channels": ("cnn", "unet"),
    "image_size": ("unet",),
    "spatial_dims": ("unet",),
    "text": ("lm",),
}


# Flags that name a path, and what each names (for the message when one is given as "").
PATHS = {
    "metrics": "the file to append JSON lines to",
    "checkpoint_dir": "the folder to save checkpoints in",
    "resume": "the checkpoint folder to resume from",
    "tensorboard": "the folder for TensorBoard event files",
    "picture": "the folder to draw the pictures in",
    "data": "the folder with the four MNIST IDX files",
    "text": "a text file or folder",
    "out": "the file to write",
}


def check_no_empty_paths(args) -> None:
    """A path given as "" (`--checkpoint-dir "$DIR"` with DIR unset) is refused: taken for the
    flag left out, a run would save no checkpoint, or start afresh instead of resuming."""
    from meshax.core.errors import ConfigError

    for flag, what in PATHS.items():
        if getattr(args, flag, None) == "":
            raise ConfigError(f"--{flag.replace('_', '-')} '' is empty (an unset shell variable?): give {what}")


def check_rule_texts(args) -> None:
    """--mesh, --layout, --weight-layout and --pin parsed first, so that a bad entry's error names
    the flag (the parsers' own message quotes the text alone, the same for all four)."""
    from meshax.core.errors import ConfigError
    from meshax.layout import convert_to_layout_rules, convert_to_mesh_shape, convert_to_weight_rules

    for flag, parse in (
        ("mesh", convert_to_mesh_shape),
        ("layout", convert_to_layout_rules),
        ("weight_layout", convert_to_weight_rules),
        ("pin", convert_to_layout_rules),
    ):
        text = getattr(args, flag, None)
        if text:
            try:
                parse(text)
            except ConfigError as e:
                raise ConfigError(f"--{flag.replace('_', '-')}: {e}") from None


def check_flags(args) -> None:
    """Flags that contradict each other or point at nothing: a ConfigError naming them."""
    from meshax.core.errors import ConfigError

    if args.model == "":  # (`--model "$MODEL"` with MODEL unset: it trained the default preset, tiny)
        from meshax.models.transformer import PRESETS

        raise ConfigError(f"--model '' is empty (an unset shell variable?): give a preset ({', '.join(PRESETS)})")
    for flag, tasks in ONLY_FOR.items():
        if getattr(args, flag) not in (None, "") and args.task not in tasks:
            raise ConfigError(f"--{flag.replace('_', '-')} applies to {' and '.join(tasks)}, not to {args.task}")
    if args.text and args.source == "markov":
        raise ConfigError("--text gives the text for --source text, but --source is markov")
    for flag in ("microbatches", "circular_repeats"):
        if getattr(args, flag) is not None and args.pipeline_stages is None:
            raise ConfigError(f"--{flag.replace('_', '-')} needs --pipeline-stages S")
    if args.data and not os.path.isdir(args.data):
        raise ConfigError(f"--data {args.data!r} is not a folder: give the folder with the four MNIST IDX files")
    if args.command in ("plan", "train") and not args.search:
        predicted = args.command == "plan"  # (a plan predicts its step on --device, against --memory-budget)
        given = [
            flag
            for flag, value in (
                ("--memory-budget", args.memory_budget and not predicted),
                ("--device", args.device and not predicted),
                ("--search-mesh", args.search_mesh),
                ("--search-weights", args.search_weights),
                ("--pin", args.pin),
                ("--top", args.top != 5),
                ("--measure", args.measure),
            )
            if value
        ]
        if given:
            raise ConfigError(f"{', '.join(given)} applies to a layout search: add --search")
    if args.command in ("plan", "train") and (args.device or args.memory_budget is not None):
        from meshax.search import load_device
        from meshax.search.result import budget_bytes

        budget_bytes(args.memory_budget, load_device(args.device))  # (now, not after the model is traced)
    if args.command == "plan" and args.search and args.explain:  # (it printed the table alone)
        raise ConfigError(
            "--explain explains the tensors of one layout, and --search lists many: give one of them (--explain "
            "with --layout set to the layout the search chose explains that one)"
        )
    if args.command == "generate":
        check_generate(args)
    if args.command != "train":
        return
    check_paths(args)
    if args.search and args.sharding:
        raise ConfigError(
            f"--search chooses the layout rules to train with, and --sharding {args.sharding} annotates the layout "
            "yourself: give one of them (meshax plan --search --sharding compares the two)"
        )
    if args.warmup > args.steps:
        raise ConfigError(f"--warmup {args.warmup} is longer than --steps {args.steps}")
    if args.warmup and args.optimizer == "adafactor" and args.lr is None:
        raise ConfigError(
            f"--warmup {args.warmup} shapes --lr's schedule; Adafactor without --lr has its own "
            "(min(0.01, 1/sqrt(step + 1)), scaled by each weight's size): give --lr, or drop --warmup"
        )
    if args.checkpoint_every and not (args.checkpoint_dir or args.resume):
        raise ConfigError(f"--checkpoint-every {args.checkpoint_every} needs --checkpoint-dir DIR (or --resume DIR)")
    if args.resume and args.checkpoint_dir and os.path.abspath(args.resume) != os.path.abspath(args.checkpoint_dir):
        raise ConfigError(
            f"--resume {args.resume!r} and --checkpoint-dir {args.checkpoint_dir!r} differ: a resumed run "
            "keeps saving where it resumed from; give one of them"
        )
    from meshax.train.checkpoint import checkpoint_info, foreign_message, foreign_step_folders, latest_step

    for flag, folder in (("--resume", args.resume), ("--checkpoint-dir", args.checkpoint_dir)):
        foreign = foreign_step_folders(folder) if folder else []
        if foreign:
            raise ConfigError(f"{flag} {folder!r}: {foreign_message(foreign)}")
    if args.resume:
        last = latest_step(args.resume)
        check_whole_steps("--resume", args.resume, last)
        if last is None:
            raise ConfigError(f"--resume {args.resume!r}: no checkpoint there (start with --checkpoint-dir)")
        if args.steps <= last:
            raise ConfigError(f"--resume {args.resume!r} is at step {last}: give --steps beyond it")
        check_checkpoint_task(args, checkpoint_info(args.resume))  # (before --search spends its time)
    elif args.checkpoint_dir:
        last = latest_step(args.checkpoint_dir)
        check_whole_steps("--checkpoint-dir", args.checkpoint_dir, None)
        if last is not None:
            raise ConfigError(
                f"--checkpoint-dir {args.checkpoint_dir!r} already holds the checkpoint of step {last}: "
                "continue it with --resume, or give an empty folder"
            )


def check_generate(args) -> None:
    from meshax.core.errors import ConfigError
    from meshax.train.checkpoint import checkpoint_info, latest_step

    if args.task not in ("lm", "seq2seq"):
        raise ConfigError(f"generate decodes the Transformers (lm, seq2seq), not {args.task}")
    check_outside_step_folders("--resume", args.resume)
    check_whole_steps("--resume", args.resume, latest_step(args.resume))
    if latest_step(args.resume) is None:
        raise ConfigError(f"--resume {args.resume!r}: no checkpoint there (train one with --checkpoint-dir)")
    check_checkpoint_task(args, checkpoint_info(args.resume))
    if args.task == "lm" and not args.prompt:
        raise ConfigError("generate lm needs --prompt: the text to continue")
    if args.batch_size is not None:
        raise ConfigError(
            f"--batch-size {args.batch_size} is training's; generate decodes --samples sequences (times --beam-size)"
        )
    if args.task == "seq2seq" and args.new is not None:
        raise ConfigError("--new applies to lm; a seq2seq output has --length tokens")
    if args.alpha is not None and not args.beam_size:
        raise ConfigError("--alpha is beam search's length penalty: give --beam-size too")
    if args.beam_size and args.temperature:
        raise ConfigError("--beam-size searches for the most likely output; it takes no --temperature")
    if args.beam_size and args.top_k:
        raise ConfigError("--beam-size searches for the most likely output; it takes no --top-k")
    if args.beam_size and args.samples > 1:
        raise ConfigError(
            f"--beam-size gives the most likely output; --samples {args.samples} would repeat it: drop --samples "
            "(or sample with --temperature instead of --beam-size)"
        )
    if args.top_k and not args.temperature:
        raise ConfigError(
            f"--top-k {args.top_k} samples among the {args.top_k} most likely tokens, but --temperature 0 "
            "(the default) takes the most likely one: add --temperature, e.g. 0.8"
        )
    if args.samples > 1 and not args.temperature:
        raise ConfigError(
            f"--samples {args.samples} at --temperature 0 (the default: the most likely token each step) "
            f"gives {args.samples} identical outputs: add --temperature, e.g. 0.8"
        )


def check_paths(args) -> None:
    """Every path train writes to can be written, before anything runs."""
    from meshax.core.errors import ConfigError

    for flag, path in (
        ("--checkpoint-dir", args.checkpoint_dir),
        ("--resume", args.resume),
        ("--tensorboard", args.tensorboard),
    ):
        check_outside_step_folders(flag, path)  # (first: the probes below would write inside one)
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(f"{flag} {path!r} is a file, not a folder")
        if path and flag != "--resume":
            check_can_create(flag, path)
            check_can_make_folder(flag, path)
        elif path and os.path.isdir(path) and not os.access(path, os.W_OK):  # (found at the first save, the steps lost)
            raise ConfigError(
                f"--resume {path!r} is not writable, and a resumed run saves its checkpoints there: copy it to a "
                "folder you can write to, and resume from the copy"
            )
    if args.tensorboard:
        check_installed("tensorboardX", "--tensorboard needs tensorboardX: pip install 'meshax[tensorboard]'")
    if args.metrics:
        for flag, folder in (("--checkpoint-dir", args.checkpoint_dir), ("--tensorboard", args.tensorboard)):
            if folder and os.path.abspath(folder) == os.path.abspath(args.metrics):  # (neither made yet)
                raise ConfigError(
                    f"--metrics {args.metrics!r} is the folder {flag} names: give the metrics file a path of its own"
                )
        check_outside_step_folders("--metrics", args.metrics)
        check_file_to_write("--metrics", args.metrics, "a file to append JSON lines to")
        check_metrics_file(args.metrics)


def check_metrics_file(path: str) -> None:
    """A --metrics file that exists is one of meshax's (its first line a record with a step), or
    empty: lines are appended to it, and another file (notes, a source file) would take them in."""
    from meshax.core.errors import ConfigError

    if not os.path.isfile(path) or not os.path.getsize(path):
        return
    record = None
    try:
        with open(path, encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "")  # (blank lines are passed over, as plot does)
        record = json.loads(first) if first.strip() else {"step": 0}  # (blank lines alone: nothing to mix with)
    except (UnicodeDecodeError, ValueError):
        pass
    if not isinstance(record, dict) or type(record.get("step")) is not int:
        raise ConfigError(
            f"--metrics {path!r} holds something other than meshax metrics (its first line is no JSON record with "
            "a step), and the run would append its lines to it: give a new file, or one meshax train wrote"
        )


def check_installed(module: str, message: str) -> None:
    """`module` can be imported, else a ConfigError saying how to install it (before the run, not
    at the first use of it, after the compile and the cost report)."""
    import importlib.util

    from meshax.core.errors import ConfigError

    try:
        found = importlib.util.find_spec(module) is not None
    except ValueError:  # (a module set to None in sys.modules: taken as missing)
        found = False
    if not found:
        raise ConfigError(f"{message} (or {module})")


def check_whole_steps(flag: str, folder: str, last: int | None) -> None:
    """No step folder in `folder` newer than `last` (its latest whole checkpoint; None: any) is a
    checkpoint cut short: resuming passed over it for an older step, and a run that came to save
    its step failed there, its steps lost."""
    from meshax.core.errors import ConfigError
    from meshax.train.checkpoint import damaged_steps

    damaged = damaged_steps(folder, after=last)
    if not damaged:
        return
    if flag == "--checkpoint-dir":
        fix = "move it away, or give an empty folder"
    else:
        fix = (
            f"move it away to go on from step {last}"
            if last is not None
            else "there is no older whole checkpoint there"
        )
    raise ConfigError(f"{flag} {folder!r}: the step folder {damaged[-1]} is no whole checkpoint: {fix}")


def check_outside_step_folders(flag: str, path: str | None) -> None:
    """`path` is no checkpoint's step folder, nor inside one (which goes when newer steps replace it)."""
    from meshax.core.errors import ConfigError
    from meshax.train.checkpoint import step_folder_around

    found = step_folder_around(path) if path else None
    if path is None or found is None:
        return
    folder, step = found
    where = "the" if os.path.abspath(path) == os.path.join(folder, str(step)) else "inside the"
    folder = folder if os.path.isabs(path) else os.path.relpath(folder)  # (as the user wrote it)
    said = f"{flag} {path!r} is {where} folder of step {step} of the checkpoints in {folder!r}"
    if flag == "--resume":
        raise ConfigError(f"{said}: give --resume {folder!r} (a run resumes from its latest step)")
    raise ConfigError(f"{said}, which goes when newer steps replace it: give a path outside it")


def check_file_to_write(flag: str, path: str, what: str) -> None:
    """`path` names a file (`what` says which) in a folder that exists, and can be written (a new
    one: a file of a name of its own is made there and removed, as `check_can_make_folder` does)."""
    from meshax.core.errors import ConfigError

    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path!r} is a folder: give {what}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path!r}: its folder does not exist")
    check_can_create(flag, path)
    if not os.path.exists(path):
        try:
            handle, probe = tempfile.mkstemp(prefix=".meshax-check-", dir=folder)
            os.close(handle)
            os.remove(probe)
        except OSError as err:
            raise ConfigError(
                f"{flag} {path!r} cannot be created: {err.strerror}; give a file in a folder you can write to"
            ) from None


def check_can_make_folder(flag: str, path: str) -> None:
    """A folder that does not exist yet can be made in its nearest existing folder: a folder of a
    name of its own is made there and removed (some folders refuse what their permissions allow,
    /proc's, found otherwise only when the run saves; the processes of one job check at once)."""
    from meshax.core.errors import ConfigError

    where = os.path.abspath(path)
    if os.path.exists(where):
        return
    while not os.path.exists(where):
        where = os.path.dirname(where)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".meshax-check-", dir=where))
    except OSError as err:
        raise ConfigError(
            f"{flag} {path!r} cannot be created: {err.strerror}; give a folder you can write to"
        ) from None


def check_can_create(flag: str, path: str) -> None:
    """`path` exists or can be made (as a folder or file) in its nearest existing folder."""
    from meshax.core.errors import ConfigError

    target = os.path.abspath(path)
    if not os.path.exists(target):
        target = os.path.dirname(target)
        while not os.path.exists(target):
            target = os.path.dirname(target)
        if not os.path.isdir(target):
            raise ConfigError(f"{flag} {path!r} cannot be created: {target!r} is a file; give a path under a folder")
    if not os.access(target, os.W_OK):
        raise ConfigError(f"{flag} {path!r}: {target!r} is not writable; give a folder you can write to")


def check_checkpoint_task(args, info: dict) -> None:
    """The checkpoint in --resume (its `checkpoint_info`) is of this task and, for lm, of this
    --source, which sets the vocabulary: else a ConfigError saying which to give (not the
    variables that differ, which is all that restoring it could say)."""
    from meshax.core.errors import ConfigError

    saved = info.get("task", args.task)
    if saved != args.task:
        if args.command == "train":
            how = f"resume it with `meshax train {saved} ...`"
        elif saved in ("lm", "seq2seq"):
            how = f"decode it with `meshax generate {saved} ...`"
        else:
            how = "generate decodes the Transformers (lm, seq2seq)"
        raise ConfigError(f"--resume {args.resume!r} holds a checkpoint of the task {saved}, not {args.task}: {how}")
    source = info.get("data", {}).get("source")
    if args.task == "lm" and source and source != (args.source or "text"):
        raise ConfigError(
            f"--resume {args.resume!r} holds a model of --source {source}, whose vocabulary differs from "
            f"--source {args.source or 'text'}'s: give --source {source}"
        )
