"""The training loop shared by every task: one jitted SPMD program per step.

Evaluation every N steps, per-step callbacks (progress bars, JSON lines), and checkpoints
(variables, optimizer state, step; the data position is the step, since batches are a pure
function of it), so `resume` continues exactly, on the same or another mesh and layout.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping

import jax
import numpy as np

from meshax.autodiff import gradients
from meshax.backends import PlacementMeshImpl, SimdMeshImpl
from meshax.core.errors import ConfigError, as_flag
from meshax.core.graph import Graph, Mesh
from meshax.lower.function import LoweredFunction
from meshax.lower.lowering import Lowering
from meshax.optimize import AdamWeightDecayOptimizer, LossScaleOptimizer, Optimizer
from meshax.runtime import is_main_process, processes_on_this_host
from meshax.train.metrics import MetricsWriter
from meshax.train.tasks import Task

BACKENDS = {"simd": SimdMeshImpl, "placement": PlacementMeshImpl}


@dataclasses.dataclass
class TrainResult:
    losses: list[float]  # training loss of every step run here
    evals: list[tuple[int, dict[str, float]]]  # (step, metrics) after evaluations
    lowering: Lowering
    step_seconds: list[float]
    first_step: int = 0  # > 0 when resumed from a checkpoint


class Preempted(RuntimeError):
    """A multi-process run stopped on a preemption notice (SIGTERM to any of its processes), at
    the same step in every process, after saving a checkpoint there (if it had a directory)."""

    def __init__(self, step: int, checkpoint_dir: str | None):
        self.step, self.checkpoint_dir = step, checkpoint_dir
        saved = f"; saved a checkpoint: continue with --resume {checkpoint_dir}" if checkpoint_dir else ""
        super().__init__(f"stopped after step {step} on a preemption notice (SIGTERM){saved}")


def _preemption_point() -> Callable[[int], bool]:
    """`reached(step)`: true at the step every process stops at after any of them got SIGTERM.

    In a multi-process run JAX takes SIGTERM as a preemption notice instead of dying, and agrees
    on a step for every process to stop at; in one process SIGTERM stops the process at once."""
    import jax

    if jax.process_count() == 1:
        return lambda step: False
    from jax.experimental import multihost_utils

    return multihost_utils.reached_preemption_sync_point


@dataclasses.dataclass
class Program:
    """A task's graph laid out on a mesh, with its compiled train and eval steps."""

    lowering: Lowering
    train_fn: LoweredFunction
    eval_fn: LoweredFunction
    metric_names: list[str]
    logged_names: list[str] = dataclasses.field(default_factory=list)  # `mx.log_scalar`s, after the loss


def training_graph(task: Task, optimizer: Optimizer | None = None):
    """The task's graph with gradients and optimizer updates (default Adam), on no mesh yet:
    (graph, what the task built, outputs: the loss, updates). A training step computes the loss
    alone: its metrics (an accuracy's argmax over the logits, say) are the evaluation's. Where
    the model computes in float16, the optimizer scales the loss dynamically (wrapped in a
    `LossScaleOptimizer`, unless it is one)."""
    if optimizer is not None and not isinstance(optimizer, Optimizer):  # (was an AttributeError: scale_loss)
        raise ConfigError(
            f"optimizer {optimizer!r} is not a meshax optimizer: give one, e.g. "
            "mx.optimize.AdamWeightDecayOptimizer(1e-3), or None for that default"
        )
    graph = Graph()
    built = task.build(Mesh(graph, "mesh"))
    params = list(graph.trainable_variables)
    optimizer = optimizer or AdamWeightDecayOptimizer(1e-3)
    if not isinstance(optimizer, LossScaleOptimizer) and any(
        t.dtype == np.float16 for op in graph.operations for t in op.outputs
    ):
        optimizer = LossScaleOptimizer(optimizer)
    grads = gradients(optimizer.scale_loss(built.loss), [v.value for v in params])
    updates = optimizer.apply_grads(grads, params)
    return graph, built, [built.loss], updates


def build(
    task: Task,
    mesh_shape: str,
    layout: str,
    backend: str = "simd",
    optimizer: Optimizer | None = None,
    seed: int = 0,
    compile: bool = True,
    weight_layout: str | None = None,
    compiler_options: Mapping[str, object] | None = None,
    cast_copies: bool | None = None,
):
    """The task's graph with gradients and optimizer updates, laid out on the mesh (weight-shaped
    tensors by `weight_layout` where given; its programs compiled with XLA's `compiler_options`:
    `MeshImpl`; the training step keeping its weights' `cast_copies`: `Lowering.function`)."""
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {sorted(BACKENDS)}")
    graph, built, outputs, updates = training_graph(task, optimizer)
    mesh = graph.operations[0].mesh
    impl = BACKENDS[backend](mesh_shape, layout, weight_layout=weight_layout, compiler_options=compiler_options)
    lowering = Lowering(graph, {mesh: impl}, seed=seed)
    names = list(built.metrics)
    if not compile:  # for planning: trace only, allocate nothing
        return lowering, outputs, updates
    logged = list(graph.logged_scalars)
    train_fn = lowering.function(  # (traced, not yet compiled: nothing allocated)
        outputs + [graph.logged_scalars[n] for n in logged], updates=updates, cast_copies=cast_copies
    )
    _check_fits(lowering, outputs, train_fn.copies_bytes())
    eval_fn = lowering.function([built.metrics[n] for n in names])
    return Program(lowering, train_fn, eval_fn, names, logged)


def _check_fits(lowering: Lowering, outputs, copies: int = 0) -> None:
    """A ConfigError, before anything is allocated, where the weights, their gradients and the
    optimizer state alone (activations come on top), with the `copies` bytes the step keeps of its
    weights in 16 bits (on a GPU: `Lowering.function`), exceed the memory of this process's
    devices: the host's available memory for CPU devices (they share it, with the job's other
    processes on this host: `processes_on_this_host`), each accelerator's own."""
    from meshax.plan import memory_per_device

    m = memory_per_device(lowering, outputs)
    need = 2 * m["parameters"] + m["optimizer_state"] + copies
    devices = [d for d in lowering.impl.devices if d.process_index == jax.process_index()]
    if not devices:
        return
    if devices[0].platform == "cpu":  # (the host's memory: every process of the job on it needs its share)
        processes = processes_on_this_host()
        hosted = len(devices) * processes
        where = f"on this host's {hosted} CPU devices" + (f" ({processes} processes)" if processes > 1 else "")
        need, have = need * hosted, _host_available_bytes()
    else:
        have, where = (devices[0].memory_stats() or {}).get("bytes_limit"), f"per {devices[0].platform} device"
    if have and need > have:
        kept = f", their 16-bit copies {copies / 2**30:.2f} GiB" if copies else ""
        raise ConfigError(
            f"the weights, gradients and optimizer state alone take {need / 2**30:.1f} GiB {where} "
            f"(parameters {m['parameters'] / 2**30:.2f} GiB and optimizer state {m['optimizer_state'] / 2**30:.2f} "
            f"GiB per device{kept}), and there are {have / 2**30:.1f} GiB: split the weights over more devices "
            "(`meshax plan --search --memory-budget` finds a layout), or train a smaller model"
        )


def _host_available_bytes() -> int | None:
    """The memory the host has available (Linux's MemAvailable; else all its memory)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None


def evaluate(task: Task, program: Program) -> dict[str, float]:
    sums = dict.fromkeys(program.metric_names, 0.0)
    rows = program.eval_fn.feed_rows()  # this process's rows (all of them in a single process)
    for feeds in task.eval_batches(rows):
        for n, v in zip(program.metric_names, program.eval_fn(feeds, rows=rows)):
            sums[n] += float(v)
    return task.summarize(sums)


def _check_settings(steps, eval_every, checkpoint_dir, checkpoint_every, on_step, on_eval) -> None:
    """train's settings, refused before the first step where they would fail later or do nothing:
    steps=-1 evaluated at step -1, checkpoint_every without a checkpoint_dir saved nothing."""
    for name, value in (("steps", steps), ("eval_every", eval_every), ("checkpoint_every", checkpoint_every)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
            raise ConfigError(f"train: {name}={value!r} must be a whole number >= 0")
    if checkpoint_every and not checkpoint_dir:
        raise ConfigError(
            f"train: checkpoint_every={checkpoint_every} without a checkpoint_dir would save nothing: give the folder"
        )
    for name, fn in (("on_step", on_step), ("on_eval", on_eval)):
        if fn is not None and not callable(fn):
            raise ConfigError(f"train: {name}={fn!r} is not a function")


def train(
    task: Task,
    mesh_shape: str = "all:1",
    layout: str = "",
    steps: int = 100,
    backend: str = "simd",
    optimizer: Optimizer | None = None,
    seed: int = 0,
    eval_every: int = 0,
    on_step: Callable[[int, float, float], None] | None = None,
    on_eval: Callable[[int, dict], None] | None = None,
    program: Program | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    metrics_path: str | None = None,
    tensorboard_dir: str | None = None,
) -> TrainResult:
    """Train `task` up to step `steps`; evaluate every `eval_every` steps and at the end.

    With `checkpoint_dir`, save every `checkpoint_every` steps and at the end; with `resume`,
    start from the latest checkpoint there (restored onto this run's mesh and layout). Metrics
    go to `metrics_path` (JSON lines) and `tensorboard_dir` (TensorBoard event files), from
    process 0 only in a multi-process run (every process gets the same losses and metrics).
    On a backend that queues programs (SIMD), each step is dispatched before the last one's loss
    is fetched, so the host feeds step k + 1 while the devices run step k; `on_step(k, ...)` then
    runs with step k + 1 already under way. A step's `step_seconds` runs from its dispatch, or
    from the last step's fetch where it was queued behind it: summed, they are the run's time.
    Where the host, not the devices, sets the pace, a step fetched right before an evaluation, a
    checkpoint or the end shows less than its share (no next step was prepared meanwhile)."""
    _check_settings(steps, eval_every, checkpoint_dir, checkpoint_every, on_step, on_eval)
    resume = as_flag(resume, "train: resume")
    program = program or build(task, mesh_shape, layout, backend, optimizer, seed)
    first = 0
    if resume:
        if not checkpoint_dir:
            raise ConfigError("resume needs a checkpoint directory")
        from meshax.train.checkpoint import damaged_steps, latest_step, restore_checkpoint

        if latest_step(checkpoint_dir) is not None or damaged_steps(checkpoint_dir):  # (restore names the damage)
            first = int(restore_checkpoint(checkpoint_dir, program.lowering)["step"])

    if not is_main_process():
        metrics_path = tensorboard_dir = None
    writer = MetricsWriter(metrics_path, tensorboard_dir)
    record = writer.record
    impl = program.lowering.impl
    settings = {  # (what ran: the metrics' first record of the run, and each checkpoint's)
        "mesh": str(";".join(f"{d.name}:{d.size}" for d in impl.shape)),
        "layout": str(impl.layout_rules),
        "weight_layout": None if impl.weight_rules is None else str(impl.weight_rules),
        "task": task.name,
        "data": task.data_settings(),
    }
    record({"step": first, "run": settings})

    def save(step):
        from meshax.train.checkpoint import save_checkpoint

        save_checkpoint(checkpoint_dir, program.lowering, step, settings)

    losses, evals, times = [], [], []
    last_done = [0.0]  # when the last step's loss was fetched

    def finish(step: int, outputs: list, started: float) -> None:
        """Fetch a dispatched step's loss (waiting for it), record it, stop on divergence."""
        loss, *logged = program.train_fn.fetch(outputs)
        now = time.perf_counter()
        # from its dispatch, or from the last step's fetch if it was queued behind that step
        seconds = now - max(started, last_done[0])
        last_done[0] = now
        times.append(seconds)
        losses.append(float(loss))
        entry = {"step": step + 1, "loss": losses[-1], "step_seconds": seconds}
        if not math.isfinite(losses[-1]):
            record(entry)
            writer.close()
            before = f" (it was {losses[-2]:.4g} at step {step})" if len(losses) > 1 else ""
            raise ConfigError(
                f"training diverged: the loss is {losses[-1]} at step {step + 1}{before}; lower the learning "
                "rate (--lr), or add warmup (--warmup). Nothing is saved after the last checkpoint"
            )
        entry.update({n: float(v) for n, v in zip(program.logged_names, logged)})
        if task.tokens_per_batch:
            entry["tokens_per_second"] = task.tokens_per_batch / seconds
        record(entry)
        if on_step:
            on_step(step, losses[-1], seconds)

    rows = program.train_fn.feed_rows()  # this process's rows of each batch
    preempted = _preemption_point()
    queue = program.lowering.impl.dispatch_is_asynchronous
    pending = None  # the step in flight: its loss is fetched after the next step is dispatched
    for step in range(first, steps):
        try:
            feeds = task.train_batch(step, rows)
            started = time.perf_counter()
            outputs = program.train_fn.dispatch(feeds, seed=step, rows=rows)
        except BaseException:
            if pending:  # the step before still gets its record
                finish(*pending)
            raise
        if pending:
            finish(*pending)
        pending = (step, outputs, started)
        done = step + 1
        evaluating = bool(eval_every) and done % eval_every == 0 and done < steps
        stopping = preempted(done) and done < steps
        saving = bool(checkpoint_dir and checkpoint_every) and done % checkpoint_every == 0 and done < steps
        if not queue or evaluating or stopping or saving or done == steps:  # these see this step's variables
            finish(*pending)
            pending = None
        if evaluating:
            evals.append((done, evaluate(task, program)))
            record({"step": done, "eval": evals[-1][1]})
            if on_eval:
                on_eval(*evals[-1])
        if stopping:
            if checkpoint_dir:
                save(done)
            writer.close()
            raise Preempted(done, checkpoint_dir)
        if saving:
            save(done)
    evals.append((steps, evaluate(task, program)))
    record({"step": steps, "eval": evals[-1][1]})
    if on_eval:
        on_eval(*evals[-1])
    if checkpoint_dir:
        save(steps)
    writer.close()
    return TrainResult(losses, evals, program.lowering, times, first)
