"""The training loop shared by every task: one jitted SPMD program per step."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from meshax.autodiff import gradients
from meshax.backends import PlacementMeshImpl, SimdMeshImpl
from meshax.core.graph import Graph, Mesh
from meshax.lower.lowering import Lowering
from meshax.optimize import AdamWeightDecayOptimizer, Optimizer
from meshax.train.tasks import Task

BACKENDS = {"simd": SimdMeshImpl, "placement": PlacementMeshImpl}


@dataclasses.dataclass
class TrainResult:
    losses: list[float]  # training loss of every step
    evals: list[tuple[int, dict[str, float]]]  # (step, metrics) after evaluations
    lowering: Lowering
    step_seconds: list[float]


def build(task: Task, mesh_shape: str, layout: str, backend: str = "simd", optimizer: Optimizer | None = None,
          seed: int = 0):
    """The task's graph with gradients and updates, laid out: (lowering, train_fn, eval_fn)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {sorted(BACKENDS)}")
    graph = Graph()
    mesh = Mesh(graph, "mesh")
    built = task.build(mesh)
    params = list(graph.trainable_variables)
    grads = gradients(built.loss, [v.value for v in params])
    optimizer = optimizer or AdamWeightDecayOptimizer(1e-3)
    updates = optimizer.apply_grads(grads, params)
    lowering = Lowering(graph, {mesh: BACKENDS[backend](mesh_shape, layout)}, seed=seed)
    names = list(built.metrics)
    train_fn = lowering.function([built.loss] + [built.metrics[n] for n in names], updates=updates)
    eval_fn = lowering.function([built.metrics[n] for n in names])
    return lowering, train_fn, eval_fn, names


def evaluate(task: Task, eval_fn, names) -> dict[str, float]:
    sums = dict.fromkeys(names, 0.0)
    for feeds in task.eval_batches():
        for n, v in zip(names, eval_fn(feeds)):
            sums[n] += float(v)
    return task.summarize(sums)


def train(task: Task, mesh_shape: str = "all:1", layout: str = "", steps: int = 100, backend: str = "simd",
          optimizer: Optimizer | None = None, seed: int = 0, eval_every: int = 0,
          on_step: Callable[[int, float, float], None] | None = None, built=None) -> TrainResult:
    """Train `task` for `steps` steps; evaluate every `eval_every` steps (0: only at the end)."""
    lowering, train_fn, eval_fn, names = built or build(task, mesh_shape, layout, backend, optimizer, seed)
    data = task.train_batches(seed)
    losses, evals, times = [], [], []
    for step in range(steps):
        feeds = next(data)
        start = time.perf_counter()
        loss, *_ = train_fn(feeds, seed=step)
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
        if on_step:
            on_step(step, losses[-1], times[-1])
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            evals.append((step + 1, evaluate(task, eval_fn, names)))
    evals.append((steps, evaluate(task, eval_fn, names)))
    return TrainResult(losses, evals, lowering, times)
