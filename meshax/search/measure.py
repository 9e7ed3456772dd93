"""`measure_layouts`: a search's best layouts compiled and timed on the devices at hand.

The cost model ranks layouts within its own error (and a calibration's noise): layouts it
predicts within a few percent of each other are a tie it cannot settle. Running them can: each
layout's training step is compiled and run, the layouts in rotating order (`in_blocks`), and
they are ranked by their median step time.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

from meshax.core.errors import ConfigError
from meshax.layout import convert_to_mesh_shape
from meshax.search.devices import KNOWN_DEVICES
from meshax.search.result import SearchResult, same_layout

K = TypeVar("K")


def in_blocks(fns: dict[K, Callable[[], object]], rounds: int, block: int) -> dict[K, float]:
    """Median seconds of each of many callables (compiled programs), each run `block` times in a
    row after one warm-up call, `rounds` times in rotating order: a program is timed warm, not
    right after another one evicted its data, as it runs in a training loop."""
    names = list(fns)
    times: dict[K, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            fns[n]()
            for _ in range(block):
                t0 = time.perf_counter()
                fns[n]()
                times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in times.items()}


def measure_layouts(
    result: SearchResult,
    task=None,
    k: int = 3,
    *,
    yours=None,
    rounds: int = 3,
    block: int = 3,
    backend: str = "simd",
) -> SearchResult:
    """`result` with its `k` best layouts (and the user's, where it shows one) compiled and timed
    on this process's devices, each a training step of the training task searched (`task`, if given,
    must be it) running the optimizer the search costed (`result.optimizer`), run
    `block` times in a row after a warm-up step, `rounds` times, the layouts in rotating order.
    The k are ranked by their median step time (`Candidate.measured_s`), ahead of the rest, which
    stay in their predicted order. All k programs hold their weights and optimizer state on the
    devices at once (and one step's gradients and activations at a time), so that much of their
    predicted memory must fit the search's budget; the user's layout is not run where it alone
    is over the budget. A search for an accelerator is not measured on CPUs.
    `yours`: the task the user's layout runs (its GSPMD annotations, say) where it is not `task`."""
    import jax

    from meshax.train.loop import build

    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"measure_layouts(k={k!r}): give how many of the best layouts to time, 1 or more")
    for name, n in (("rounds", rounds), ("block", block)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"measure_layouts({name}={n!r}): give a whole number, 1 or more")
    if task is None and result.task is None:
        raise ConfigError(
            "measure_layouts times training steps, and this search was of a graph: search a training task (a "
            "meshax.train task), or give it: measure_layouts(result, task)"
        )
    task = result.task if task is None else task
    if not hasattr(task, "train_batch"):
        raise ConfigError(
            f"measure_layouts times training steps: give the training task the search was given (a meshax.train "
            f"task), not {type(task).__name__}"
        )
    if result.task is not None and task != result.task:  # (its layouts and costs are another task's)
        raise ConfigError(
            f"measure_layouts: the search was of {result.task!r:.200}, and the task given is {task!r:.200}: the "
            "layouts are ranked for the task searched; leave task out to run it, or search this one"
        )
    chosen = result.ranked[:k]
    mine = result.baseline
    again = next((i for i, c in enumerate(chosen) if mine is not None and same_layout(c, mine)), None)
    over = mine is not None and again is None and mine.memory_bytes > result.memory_budget  # (shown, not run)
    if mine is not None and mine.label and yours is None and not over:  # (annotations: not a layout of `task`)
        raise ConfigError(f"the layout shown beside the search is {mine.label!r}: give yours=, the task that runs it")
    timed = chosen + ([mine] if mine is not None and again is None and not over else [])  # (yours once, where it fits)
    platform = jax.devices()[0].platform
    if platform == "cpu" and result.device in KNOWN_DEVICES.values() and result.device != KNOWN_DEVICES["cpu"]:
        raise ConfigError(
            f"the search predicted for {result.device.name}, and this process's devices are CPUs: measured here, the "
            f"layouts would be ranked by the CPUs' step times, not the {result.device.name}'s; measure on the devices "
            "predicted for, or search for these (device cpu, or a file `meshax calibrate` wrote here)"
        )
    need = max(convert_to_mesh_shape(c.mesh).size for c in timed)
    if need > jax.device_count():
        raise ConfigError(
            f"measuring runs the layouts on this process's devices: the mesh needs {need}, this process has "
            f"{jax.device_count()} (on a CPU, meshax.use_cpu_devices({need}) or JAX_NUM_CPU_DEVICES={need} first)"
        )
    together = sum(map(_kept, timed)) + max(c.memory_bytes - _kept(c) for c in timed)  # (one step runs at a time)
    if together > result.memory_budget:
        from meshax.lower.report import _human

        which = f"the {len(chosen)} best" + (" and yours" if len(timed) > len(chosen) else "")
        raise ConfigError(
            f"the layouts to measure ({which}) are predicted to need {_human(together)}B per device together, over "
            f"the memory budget of {_human(result.memory_budget)}B: each holds its weights and optimizer state on "
            "the devices while the others run; measure fewer, or give a larger budget"
        )
    start = time.perf_counter()
    steps: dict[int, Callable[[], object]] = {}
    for i, c in enumerate(timed):
        runs = yours if c is mine and yours is not None else task
        program = build(runs, c.mesh, c.layout, backend, result.optimizer, weight_layout=c.weight_layout)
        rows = program.train_fn.feed_rows()
        feeds = task.train_batch(0, rows)
        steps[i] = functools.partial(_step, program.train_fn, feeds, rows)
    seconds = in_blocks(steps, rounds, block)
    done = [dataclasses.replace(c, measured_s=seconds[i]) for i, c in enumerate(timed)]
    ranked = [done[i] for i in sorted(range(len(chosen)), key=seconds.__getitem__)] + result.ranked[k:]
    if mine is not None and not over:
        mine = dataclasses.replace(mine, measured_s=seconds[len(chosen) if again is None else again])
    also = " (not yours, over the memory budget)" if over else " and yours" if mine is not None else ""
    how = (
        f"the {len(chosen)} best{also} measured on {need} {platform} devices: median of {rounds} x {block} steps, "
        f"in rotating order, {time.perf_counter() - start:.1f} s"
    )
    return dataclasses.replace(result, ranked=ranked, baseline=mine, measured=how)


def _kept(c) -> int:
    """The bytes a built layout holds between its steps: its weights and optimizer state."""
    return c.cost.memory["parameters"] + c.cost.memory["optimizer_state"]


def _step(fn, feeds, rows):
    """One training step, waited for."""
    import jax

    return jax.block_until_ready(fn(feeds, seed=0, rows=rows))
