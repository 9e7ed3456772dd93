"""Side-by-side timing: A and B repetitions interleaved (ABBA order), medians compared."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved(a: Callable[[], object], b: Callable[[], object], steps: int, warmup: int) -> dict:
    """Median seconds per call of `a` and of `b`, each call timed alone, the two interleaved
    (A B, B A, A B, ...) so slow drifts of the machine hit both sides alike.

    Each callable must block until its result is on the host."""
    for _ in range(warmup):
        a()
        b()
    ta, tb = [], []
    for i in range(steps):
        order = ((a, ta), (b, tb)) if i % 2 == 0 else ((b, tb), (a, ta))
        for fn, out in order:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    ma, mb = statistics.median(ta), statistics.median(tb)
    return {
        "a_s": ma,
        "b_s": mb,
        "ratio": ma / mb,
        "steps": steps,
        "warmup": warmup,
        "a_iqr_s": _iqr(ta),
        "b_iqr_s": _iqr(tb),
    }


def first_then_median(fn: Callable[[], object], steps: int, warmup: int) -> tuple[object, float, float]:
    """(the first call's result, its seconds: compile and run, the median seconds of `steps` calls
    after `warmup` more). `fn` must block until its result is on the host or ready."""
    t0 = time.perf_counter()
    first = fn()
    first_s = time.perf_counter() - t0
    return first, first_s, round_robin({"fn": fn}, steps, warmup)["fn"]


def queued(dispatch: Callable[[], object], fetch: Callable[[object], object], steps: int, rounds: int = 3) -> float:
    """Seconds per step, the median of `rounds` runs of `steps` steps in which each step's result
    is fetched after the next step is dispatched, as a training loop that logs every loss runs:
    the host dispatches step k + 1 while the device runs step k."""
    per_round = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        pending = dispatch()
        for _ in range(steps - 1):
            queued_next = dispatch()
            fetch(pending)
            pending = queued_next
        fetch(pending)
        per_round.append((time.perf_counter() - t0) / steps)
    return statistics.median(per_round)


def round_robin(fns: dict[str, Callable[[], object]], reps: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds of each of several callables, run in rotating order, `reps` times each."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    times = {n: [] for n in names}
    for i in range(reps):
        k = i % len(names)
        for n in names[k:] + names[:k]:
            t0 = time.perf_counter()
            fns[n]()
            times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in times.items()}


def _iqr(xs: list[float]) -> float:
    if len(xs) < 4:
        return 0.0
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]
