"""Checkpoints of a `Lowering`'s variables, written with Orbax.

A checkpoint holds every variable of the graph by name (parameters, optimizer slots and
`global_step`), the step, and small JSON metadata (e.g. the data position). It does not pin a
layout: restoring lays each variable out by *this* lowering's plan, so a run can resume on another
mesh shape or other layout rules. Each step is written to a temporary directory and renamed when
complete, so a half-written checkpoint is never taken for the latest one.
"""

from __future__ import annotations

import json
import logging
import os
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp

from meshax.core.errors import ConfigError
from meshax.optimize import LOSS_SCALE_SCOPE


class _NoReadOnlyNotes(logging.Filter):
    """Drops Orbax's warnings that a manager opened only to read is read only: meshax opens one
    each time it reads a checkpoint, and the notes (several per read) say nothing a user can act
    on, about a folder that may well be writable."""

    NOTES = ("Given directory is read only", "CheckpointManagerOptions.read_only=True")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.NOTES)


logging.getLogger("absl").addFilter(_NoReadOnlyNotes())


def _manager(directory, keep: int | None = None) -> ocp.CheckpointManager:
    """An Orbax manager of `directory`; read-only unless `keep` (how many steps to retain) is given."""
    writing = keep is not None
    options = ocp.CheckpointManagerOptions(
        # Synchronous: the next training step donates the variables' buffers to the program, so
        # they must be written before save_checkpoint returns.
        enable_async_checkpointing=False,
        create=writing,
        read_only=not writing,
        cleanup_tmp_directories=writing,  # leftovers of a save that crashed half-way
        preservation_policy=ocp.checkpoint_managers.LatestN(n=keep) if writing else None,
    )
    handlers = {"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(os.path.abspath(directory), options=options, item_handlers=handlers)


def save_checkpoint(directory, lowering, step: int, extra: dict | None = None, keep: int = 3) -> str:
    """Save every variable of `lowering`, `step` and `extra` under `directory/<step>`; returns that path.

    `extra` is small JSON-able metadata (the data position, the mesh and layout used, ...), given
    back by `restore_checkpoint`. Only the `keep` newest checkpoints are kept. Variables are
    written as the sharded jax.Arrays they are, each device writing its own slices.
    """
    if keep < 1:
        raise ConfigError(f"keep must be at least 1, got {keep}")
    # (a negative step was written to a folder '-1' that latest_step and restore never find; a
    # float was cut to an int, and a string taken for one)
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
        raise ConfigError(f"step must be an int of at least 0, got {step!r}")
    if extra and "step" in extra:
        raise ConfigError("extra must not have a 'step' key: restore_checkpoint returns the step under it")
    meta = {"step": int(step), "extra": dict(extra or {})}
    try:  # before anything is written: a failed write leaves a folder behind that blocks the step
        json.dumps(meta)
    except (TypeError, ValueError) as err:
        raise ConfigError(
            f"save_checkpoint: extra must be JSON (str, int, float, bool, None, lists, dicts): {err}"
        ) from None
    above = os.path.abspath(directory)  # (Orbax logged a traceback and raised NotADirectoryError)
    while not os.path.exists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        what = "is a file" if above == os.path.abspath(directory) else f"is under the file {above!r}"
        raise ConfigError(f"save_checkpoint: {os.fspath(directory)!r} {what}: give a folder to save checkpoints in")
    foreign = foreign_step_folders(directory)
    if foreign:  # (Orbax takes it for an old step and deletes it with the checkpoints past `keep`)
        raise ConfigError(f"save_checkpoint: {foreign_message(foreign)}")
    state = {var.name: lowering.variable_state(var) for var in lowering.graph.all_variables}
    with _manager(directory, keep) as manager:
        saved = manager.save(
            int(step), args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta))
        )
        if not saved:
            raise ConfigError(
                f"checkpoint step {step} not saved: {directory} already has steps "
                f"{list(manager.all_steps())} (steps must increase)"
            )
        return os.fspath(manager.directory / str(int(step)))


def _complete(directory, step: int) -> bool:
    """Whether `directory/<step>` holds a checkpoint's two items (a folder of digits that is
    something else, or lost an item, is not one)."""
    return all(os.path.isdir(os.path.join(directory, str(step), item)) for item in ("state", "meta"))


def damaged_steps(directory, after: int | None = None) -> list[str]:
    """The step folders in `directory` (newer than step `after`) that began as checkpoints (Orbax's
    files or an item are there) but are no whole one: an item deleted, a copy cut short. Each as
    "<folder> (no meta/)". Resuming would pass over such a step for an older one, and a run saving
    into the folder could not write that step."""
    if not os.path.isdir(directory):
        return []
    out = []
    for step in sorted(ocp.step.checkpoint_steps(directory)):
        folder = os.path.join(directory, str(step))
        items = [i for i in ("state", "meta") if os.path.isdir(os.path.join(folder, i))]
        begun = items or os.path.exists(os.path.join(folder, "_CHECKPOINT_METADATA"))
        if (after is None or step > after) and begun and len(items) < 2:
            out.append(f"{folder} (no {' or '.join(f'{i}/' for i in ('state', 'meta') if i not in items)})")
    return out


def foreign_step_folders(directory) -> list[str]:
    """The folders in `directory` named as a step's ("1", "2019") that hold something and never
    began as checkpoints (neither an item nor Orbax's metadata file in them): Orbax counts them as
    steps, and deletes them with the old checkpoints once newer ones replace them."""
    if not os.path.isdir(directory):
        return []
    out = []
    for step in sorted(ocp.step.checkpoint_steps(directory)):
        folder = os.path.join(directory, str(step))
        begun = any(os.path.exists(os.path.join(folder, n)) for n in ("state", "meta", "_CHECKPOINT_METADATA"))
        if os.path.isdir(folder) and not begun and os.listdir(folder):
            out.append(folder)
    return out


def foreign_message(folders: list[str]) -> str:
    """What to say of `foreign_step_folders`."""
    more = f" (and {len(folders) - 1} more)" if len(folders) > 1 else ""
    return (
        f"{folders[0]}{more} is named as a checkpoint's step but holds something else, which would be deleted "
        "with the old checkpoints as new ones are saved: move it away, or save checkpoints in a folder of their own"
    )


def step_folder_around(path) -> tuple[str, int] | None:
    """(the checkpoint folder, the step) where `path` is a checkpoint's step folder or inside one;
    None elsewhere."""
    here = os.path.abspath(path)
    while True:
        parent, name = os.path.split(here)
        if name.isdigit() and _complete(parent, int(name)):
            return parent, int(name)
        if parent == here:
            return None
        here = parent


def _complete_steps(directory) -> list[int]:
    """The steps of the complete checkpoints in `directory`, oldest first. Read from the folder
    alone, not with a manager: Orbax's manager syncs every process of a job when it opens (a
    collective), which hangs where the processes are not all there (a Ctrl-C's one line reads
    this, in each process as it stops)."""
    if not os.path.isdir(directory):
        return []
    return sorted(s for s in ocp.step.checkpoint_steps(directory) if _complete(directory, s))


def latest_step(directory) -> int | None:
    """The newest complete checkpoint's step in `directory`, or None if it has none."""
    steps = _complete_steps(directory)
    return steps[-1] if steps else None


def _float32_step_counter(name: str, var, saved) -> bool:
    """Whether `name` is the step counter as checkpoints before meshax's int32 one hold it, a
    float32, where this graph's is an int32: restored as its int32 (every value a float32
    counter reached, counting by ones from 0, is a whole number)."""
    return (
        name == "global_step"
        and np.dtype(var.dtype) == np.int32
        and name in saved
        and np.dtype(saved[name].dtype) == np.float32
    )


def _optional(name: str) -> bool:
    """Whether a variable may be missing from a checkpoint, keeping the value it has: a loss
    scale's state (`LossScaleOptimizer`), which a float16 run makes and the checkpoint of a
    bfloat16 or float32 run of the same model lacks."""
    return name.startswith(f"{LOSS_SCALE_SCOPE}/")


def _check_same_model(directory, step: int, variables: dict, saved) -> None:
    """Every variable of the graph is in the checkpoint with its shape and dtype; else a
    ConfigError naming a few of those missing, reshaped or retyped (a checkpoint of another
    model: all of them)."""

    def some(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    missing = [repr(n) for n in variables if n not in saved and not _optional(n)]
    reshaped = [
        f"{n!r} ({var.shape.to_integer_list} here, {list(saved[n].shape)} there)"
        for n, var in variables.items()
        if n in saved and list(saved[n].shape) != var.shape.to_integer_list
    ]
    # (Orbax casts to the dtype asked for: float32 values read into an int32 variable were cut)
    retyped = [
        f"{n!r} ({np.dtype(var.dtype).name} here, {np.dtype(saved[n].dtype).name} there)"
        for n, var in variables.items()
        if n in saved and np.dtype(saved[n].dtype) != np.dtype(var.dtype) and not _float32_step_counter(n, var, saved)
    ]
    problems = [f"{len(missing)} of its {len(variables)} variables are not there ({some(missing)})"] if missing else []
    problems += [f"{len(reshaped)} have other shapes ({some(reshaped)})"] if reshaped else []
    problems += [f"{len(retyped)} have other dtypes ({some(retyped)})"] if retyped else []
    if problems:
        raise ConfigError(
            f"cannot restore step {step} from {directory}: it holds another model: {'; '.join(problems)}. "
            "Restore with the model (task, --model and its options) and optimizer it was saved with"
        )


def _whole_step(directory, step: int | None) -> int:
    """`step` (default: the latest), if `directory` holds its whole checkpoint; else FileNotFoundError."""
    if step is None:
        step = latest_step(directory)
        damaged = damaged_steps(directory, after=step)
        if damaged:
            older = "there is no older whole one" if step is None else f"move it away to restore step {step}"
            raise FileNotFoundError(f"the newest checkpoint in {directory} is not whole: {damaged[-1]}; {older}")
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {directory}")
    steps = _complete_steps(directory)
    if step not in steps:
        partial = os.path.isdir(os.path.join(directory, str(step)))
        raise FileNotFoundError(
            f"no checkpoint of step {step} in {directory} (it has steps {steps}"
            + (f"; {os.path.join(directory, str(step))} is not a whole checkpoint)" if partial else ")")
        )
    return step


def checkpoint_info(directory, step: int | None = None) -> dict:
    """`{"step": step, **extra}` of the checkpoint of `step` (default: the latest), restoring
    no variable."""
    step = _whole_step(directory, step)
    with _manager(directory) as manager:
        try:
            meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except json.JSONDecodeError as e:
            raise _damaged(directory, step, "meta", f"not JSON: {e}") from None
    return _step_and_extra(directory, step, meta)


def _damaged(directory, step: int, item: str, why: str) -> ConfigError:
    """The error of a step folder whose `item` (state, meta) cannot be read."""
    folder = os.path.join(directory, str(step))
    return ConfigError(
        f"the checkpoint of step {step} in {directory} is damaged: its {item}/ is {why}; move {folder} away "
        "(a run resumes from the newest whole step)"
    )


def _step_and_extra(directory, step: int, meta) -> dict:
    """`{"step": step, **extra}` of a checkpoint's meta item (a ConfigError if it is not one save_checkpoint wrote)."""
    if not isinstance(meta, dict) or not isinstance(meta.get("extra"), dict) or "step" not in meta:
        raise _damaged(directory, step, "meta", "no step and extra metadata")
    return {"step": meta["step"], **meta["extra"]}


def _saved_variables(manager, directory, step: int):
    """The metadata of the variables in the checkpoint of `step` (a ConfigError if it has none:
    its state/ emptied, which Orbax reads as None)."""
    saved = manager.item_metadata(step)["state"]
    if not saved:
        raise _damaged(directory, step, "state", "holding no variables")
    return saved


def saved_variable_names(directory, step: int | None = None) -> list[str]:
    """The names of the variables in the checkpoint of `step` (default: the latest), reading
    only its metadata."""
    step = _whole_step(directory, step)
    with _manager(directory) as manager:
        return sorted(_saved_variables(manager, directory, step))


def check_restorable(directory, lowering, step: int | None = None) -> None:
    """The check `restore_checkpoint` makes first, restoring nothing: every variable of
    `lowering`'s graph is in the checkpoint with its shape (else a ConfigError naming them)."""
    step = _whole_step(directory, step)
    with _manager(directory) as manager:
        saved = _saved_variables(manager, directory, step)
    _check_same_model(directory, step, {var.name: var for var in lowering.graph.all_variables}, saved)


def restore_checkpoint(directory, lowering, step: int | None = None) -> dict:
    """Restore every variable of `lowering` from the checkpoint of `step` (default: the latest).

    Returns `{"step": step, **extra}`. Each variable is laid out by this lowering's plan, whatever
    the layout it was saved under: for SIMD each device reads only its own slice from disk. Every
    graph variable must be in the checkpoint with the same shape and dtype (but a loss scale's
    state: a bfloat16 run's checkpoint restores into a float16 one, whose scale keeps its value);
    checkpoint variables the graph lacks are skipped with a warning.
    """
    step = _whole_step(directory, step)
    variables = {var.name: var for var in lowering.graph.all_variables}
    with _manager(directory) as manager:
        saved = _saved_variables(manager, directory, step)
        _check_same_model(directory, step, variables, saved)  # (as check_restorable, on what is read here)
        variables = {name: var for name, var in variables.items() if name in saved}  # (else `_optional`)
        unused = sorted(set(saved) - set(variables))
        if unused:
            warnings.warn(
                f"checkpoint {directory} step {step} has variables the graph lacks, not restored: {unused}",
                stacklevel=2,
            )
        old_counter = [name for name, var in variables.items() if _float32_step_counter(name, var, saved)]
        target = {
            name: jax.ShapeDtypeStruct(
                tuple(var.shape.to_integer_list),
                np.dtype(np.float32 if name in old_counter else var.dtype),
                sharding=lowering.impl.global_sharding(var.shape, lowering.plan[var.value]),
            )
            for name, var in variables.items()
        }
        try:
            restored = manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
                    ),
                    meta=ocp.args.JsonRestore(),
                ),
            )
        except json.JSONDecodeError as e:
            raise _damaged(directory, step, "meta", f"not JSON: {e}") from None
    info = _step_and_extra(directory, step, restored["meta"])  # (before any variable is set)
    for name in old_counter:
        restored["state"][name] = restored["state"][name].astype(np.int32)
    for name, var in variables.items():
        lowering.set_variable_value(var, restored["state"][name])  # already laid out as the plan says
    return info
