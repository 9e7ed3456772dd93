"""The cost model: a training step's time and memory per device, predicted from its plan.

A `StepCost` is what a layout asks of each device: FLOPs per op family, every collective
(kind, mesh dims, bytes), and memory (parameters, optimizer state, activations kept for the
backward pass). It comes from a lowering's exact counters (`from_counters`) or from the
search's fast estimate (`meshax.search.estimate`). `predict` turns it into seconds on a
`Device`: compute at the family's peak, each collective by the alpha-beta model with its
kind's ring factor over the participating devices.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict

from meshax.core.shape import Shape
from meshax.lower.counters import KINDS, Counters
from meshax.search.devices import Device

MATMUL_FAMILIES = ("Einsum", "Conv", "Convolution")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    mesh_dims: tuple[str, ...]
    bytes: int  # what each participating device puts in
    count: int = 1


@dataclasses.dataclass
class StepCost:
    """Per device and step: FLOPs by op family, collectives, memory in bytes by part."""

    flops: dict[str, float]
    collectives: list[Collective]
    memory: dict[str, int]  # "parameters", "optimizer_state", "activations"
    exact: bool = True  # from the lowering's counters (else the search's estimate)

    @property
    def memory_bytes(self) -> int:
        return sum(self.memory.values())


def ring_factors(kind: str, n: int) -> tuple[float, float]:
    """(messages, bytes sent per byte put in) of one collective over n devices, ring algorithms."""
    if kind == "allreduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if kind == "allgather":
        return n - 1, n - 1
    if kind == "permute":
        return 1, 1
    return n - 1, (n - 1) / n  # reduce_scatter, alltoall


@dataclasses.dataclass(frozen=True)
class Prediction:
    compute_s: float
    comm_s: dict[str, float]  # collective kind -> seconds
    memory: dict[str, int]
    by_link: dict[tuple[str, tuple[str, ...]], float] = dataclasses.field(default_factory=dict)  # (kind, mesh dims)

    @property
    def step_s(self) -> float:
        return self.compute_s + sum(self.comm_s.values())

    @property
    def memory_bytes(self) -> int:
        return sum(self.memory.values())


def collective_seconds(c: Collective, device: Device, mesh_shape: Shape) -> float:
    messages, factor, link = _ring(c.kind, c.mesh_dims, device, mesh_shape)
    return 0.0 if link is None else c.count * (messages * link.latency_s + factor * c.bytes / link.bandwidth)


@functools.lru_cache(maxsize=4096)
def _ring(kind: str, mesh_dims: tuple[str, ...], device: Device, mesh_shape: Shape) -> tuple:
    """(messages, bytes factor, link) of a collective over mesh_dims (link None: one device), for
    `collective_seconds`, which a search asks about every collective of tens of thousands of
    rule sets."""
    n = math.prod(mesh_shape.get_dim_by_name(m).size for m in mesh_dims)
    return (0, 0.0, None) if n <= 1 else (*ring_factors(kind, n), device.link_of(mesh_dims))


def predict(cost: StepCost, device: Device, mesh_shape: Shape) -> Prediction:
    """The step's time on `device`: compute at its peaks, and each collective's ring time; also
    by (kind, mesh dims)."""
    compute = sum(
        f / (device.matmul_flops if family in MATMUL_FAMILIES else device.vector_flops)
        for family, f in cost.flops.items()
    )
    comm = dict.fromkeys(KINDS, 0.0)
    by_link: dict[tuple, float] = defaultdict(float)
    for c in cost.collectives:
        seconds = collective_seconds(c, device, mesh_shape)
        comm[c.kind] += seconds
        by_link[(c.kind, c.mesh_dims)] += seconds
    return Prediction(compute, comm, dict(cost.memory), dict(by_link))


def family(op_type: str) -> str:
    return op_type.removesuffix("Operation") or "?"


def from_counters(counters: Counters, memory: dict[str, int]) -> StepCost:
    """The exact StepCost of a traced program (its counters) with its memory parts."""
    flops: dict[str, float] = defaultdict(float)
    for name, f in counters.flops.items():
        flops[family(counters.op_types.get(name, ""))] += f
    grouped: dict[tuple, int] = defaultdict(int)
    for s in counters.sites():
        grouped[(s.kind, s.mesh_axes, s.bytes)] += 1
    collectives = [Collective(k, m, b, n) for (k, m, b), n in grouped.items()]
    return StepCost(dict(flops), collectives, memory)


def affine_counts(base: dict, terms: list[tuple[float, dict]]) -> dict:
    """base + the sum of weight x (counts - base) over `terms`, key by key."""
    out: dict = defaultdict(float, base)
    for weight, counts in terms:
        for k, v in counts.items():
            out[k] += weight * v
        for k, v in base.items():
            out[k] -= weight * v
    return dict(out)


def affine(base: StepCost, terms: list[tuple[float, StepCost]]) -> StepCost:
    """A StepCost extrapolated from others, `affine_counts` of each of its counts (a model's costs
    at a few depths: `meshax.search.program.Extrapolated`)."""

    def counts(cost: StepCost) -> dict:
        out: dict[tuple, int] = defaultdict(int)
        for c in cost.collectives:
            out[(c.kind, c.mesh_dims, c.bytes)] += c.count
        return out

    numbers = affine_counts(counts(base), [(w, counts(c)) for w, c in terms])
    memory = affine_counts(base.memory, [(w, c.memory) for w, c in terms])
    if any(v < -0.5 for v in [*numbers.values(), *memory.values()]):
        raise ValueError("costs extrapolated to a negative count: the costs given are not affine in the depth")
    return StepCost(
        affine_counts(base.flops, [(w, c.flops) for w, c in terms]),
        [Collective(kind, dims, nbytes, round(n)) for (kind, dims, nbytes), n in numbers.items() if round(n) > 0],
        {k: round(v) for k, v in memory.items()},
        base.exact and all(c.exact for _, c in terms),
    )
