"""What the search costs: a training step's program on a mesh, asked about one rule set at a time.

`Program` is one graph's step (outputs and updates): under a rule set (and weight rules) its
exact StepCost (`Lowering.trace_step`), its memory per device (from the plan alone) and the fast
estimate (`estimate.Estimator`). `Extrapolated` is a model with stacks of identical layers,
costed at small depths: every count of a step (FLOPs per op, each collective, each tensor's
bytes) is affine in each stack's depth, so the costs at depths 1 and 2 give the costs at any
depth, exactly (tests check it against the full model's), at a small part of the time. `model_of`
builds what to cost from a graph or a training task, once for every mesh.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from meshax.core.errors import ConfigError
from meshax.core.graph import Graph, Tensor
from meshax.core.shape import Shape
from meshax.lower.lowering import Lowering
from meshax.search.cost import StepCost, affine, affine_counts, from_counters
from meshax.search.estimate import Estimator
from meshax.search.space import Rules, rules_string

if TYPE_CHECKING:
    from meshax.optimize import Optimizer

PROBE_DEPTH = 1  # the depth a stack is costed at; and at one more, for its slope


def exact_cost(lowering: Lowering, outputs: Sequence[Tensor], updates: Sequence = ()) -> StepCost:
    """The StepCost of the program a lowering would run (traced abstractly: no devices needed)."""
    counters = lowering.trace_step(list(outputs), list(updates))
    return from_counters(counters, memory_of(lowering, outputs, updates))


def memory_of(lowering: Lowering, outputs: Sequence[Tensor], updates: Sequence = ()) -> dict[str, int]:
    """Bytes per device by part, from the plan alone: parameters, their gradients (when there are
    updates), optimizer state, and activations (every forward tensor, none freed, the weights
    gathered for their readers, the largest recomputed body's internals once, and the batch and
    imported arrays: `meshax.plan.memory_per_device`)."""
    from meshax.plan import memory_per_device

    m = memory_per_device(lowering, outputs)
    return {
        "parameters": m["parameters"],
        "gradients": m["parameters"] if updates else 0,
        "optimizer_state": m["optimizer_state"],
        "activations": m["activations"] + m["inputs"],
    }


@dataclasses.dataclass
class Step:
    """A training step's graph and what it computes: its outputs (the loss) and updates."""

    graph: Graph
    outputs: list[Tensor]
    updates: list


class Program:
    """One step on one mesh, costed by rule set; the last lowering is kept (a memory check, then
    the exact cost of the same rules, plan once), and each rule set's exact cost (a search run
    again on the same Model traces nothing twice)."""

    def __init__(self, step: Step, mesh_shape: Shape):
        self.step, self.mesh_shape = step, mesh_shape
        self._last: tuple = (None, None)
        self._exact: dict[tuple, StepCost] = {}

    @property
    def graph(self) -> Graph:
        return self.step.graph

    def lowering(self, rules: Rules, weights: str | None = None) -> Lowering:
        """The lowering of `rules`, and of `weights` (weight rules, as --weight-layout takes them)."""
        from meshax.backends import SimdMeshImpl

        if self._last[0] != (rules, weights):
            impl = SimdMeshImpl(self.mesh_shape, rules_string(rules), weight_layout=weights)
            self._last = ((rules, weights), Lowering(self.graph, {self.graph.operations[0].mesh: impl}))
        return self._last[1]

    def memory(self, rules: Rules, weights: str | None = None) -> dict[str, int]:
        return memory_of(self.lowering(rules, weights), self.step.outputs, self.step.updates)

    def layouts(self, rules: Rules, weights: str | None = None) -> tuple:
        """Every tensor's planned layout, in graph order: rule sets with equal layouts are one program."""
        plan = self.lowering(rules, weights).plan
        return tuple(plan[t] for op in self.graph.operations for t in op.outputs)

    def exact(self, rules: Rules, weights: str | None = None) -> StepCost:
        if (rules, weights) not in self._exact:
            lowering = self.lowering(rules, weights)
            self._exact[rules, weights] = exact_cost(lowering, self.step.outputs, self.step.updates)
        return self._exact[rules, weights]

    @functools.cached_property
    def estimator(self) -> Estimator:
        return Estimator(self.graph, self.mesh_shape, self.step.outputs, self.step.updates)


class Extrapolated:
    """A model costed at small depths: base (every stack at PROBE_DEPTH) + the sum over stacks of
    (depth - PROBE_DEPTH) x (the cost with that stack one layer deeper - base)."""

    def __init__(self, base: Program, terms: list[tuple[float, Program]]):
        self.base, self.terms = base, terms
        self.mesh_shape = base.mesh_shape

    @property
    def graph(self) -> Graph:
        return self.base.graph

    def lowering(self, rules: Rules, weights: str | None = None) -> Lowering:
        """The base's (a shallower model: the same tensors per layer, fewer layers)."""
        return self.base.lowering(rules, weights)

    def memory(self, rules: Rules, weights: str | None = None) -> dict[str, int]:
        base = self.base.memory(rules, weights)
        got = affine_counts(base, [(w, p.memory(rules, weights)) for w, p in self.terms])
        return {k: round(v) for k, v in got.items()}

    def layouts(self, rules: Rules, weights: str | None = None) -> tuple:
        return tuple(p.layouts(rules, weights) for p in [self.base, *(p for _, p in self.terms)])

    def exact(self, rules: Rules, weights: str | None = None) -> StepCost:
        return affine(self.base.exact(rules, weights), [(w, p.exact(rules, weights)) for w, p in self.terms])

    @functools.cached_property
    def estimator(self) -> Estimator:
        return Estimator.affine(self.base.estimator, [(w, p.estimator) for w, p in self.terms])


@dataclasses.dataclass
class Model:
    """What a search costs, built once for every mesh: one step, or a task's steps at small
    depths (`terms`: weight and step) to extrapolate from; `depths` says to what."""

    base: Step
    terms: list[tuple[float, Step]] = dataclasses.field(default_factory=list)
    depths: dict[str, int] = dataclasses.field(default_factory=dict)
    optimizer: Optimizer | None = None  # the one a task's steps run (None: Adam's, or a graph's own updates)
    task: object = None  # the training task it is of (None: a graph's)
    _programs: dict[Shape, Program | Extrapolated] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def on(self, mesh_shape: Shape) -> Program | Extrapolated:
        if mesh_shape not in self._programs:
            base = Program(self.base, mesh_shape)
            terms = [(w, Program(s, mesh_shape)) for w, s in self.terms]
            self._programs[mesh_shape] = Extrapolated(base, terms) if self.terms else base
        return self._programs[mesh_shape]

    @property
    def note(self) -> str:
        if not self.terms:
            return ""
        depths = ", ".join(f"{k} {v}" for k, v in self.depths.items())
        return f"; costed at depths {PROBE_DEPTH} and {PROBE_DEPTH + 1}, extrapolated to {depths}"


def model_of(graph, outputs: Sequence[Tensor] = (), updates: Sequence = (), optimizer=None) -> Model:
    """The Model of a graph (with its outputs and updates), or of a training task (`meshax.train`
    tasks: the loss and `optimizer`'s updates, default Adam's), extrapolated where its stacks are
    deeper than the probes."""
    if optimizer is not None and isinstance(graph, Model | Graph):
        raise ConfigError(
            "optimizer= applies to a training task: a graph's updates (or a Model's) are its own optimizer's"
        )
    if isinstance(graph, Model):
        return graph
    if isinstance(graph, Graph):
        return Model(Step(graph, list(outputs), list(updates)))
    task = graph
    if not hasattr(task, "build"):
        raise TypeError(f"search_layout takes a Graph (with outputs and updates) or a training task, got {task!r}")
    depths = task.depths()
    if not depths or max(depths.values()) <= PROBE_DEPTH + 1:
        return Model(_build(task, optimizer), optimizer=optimizer, task=task)
    shallow = {k: min(v, PROBE_DEPTH) for k, v in depths.items()}
    terms = []
    for depth in sorted({v for v in depths.values() if v > PROBE_DEPTH}):
        deeper = {k: PROBE_DEPTH + 1 if v == depth else shallow[k] for k, v in depths.items()}
        terms.append((float(depth - PROBE_DEPTH), _build(task.at_depths(deeper), optimizer)))
    return Model(_build(task.at_depths(shallow), optimizer), terms, depths, optimizer, task)


def _build(task, optimizer=None) -> Step:
    from meshax.train.loop import training_graph

    graph, _, outputs, updates = training_graph(task, optimizer)
    return Step(graph, outputs, updates)
