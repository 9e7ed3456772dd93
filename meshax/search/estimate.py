"""The search's fast estimate of a rule set's StepCost, read from the ops' sharding rules.

Tracing a step exactly (`Lowering.trace_step`) takes about a second for a large Transformer,
too slow to try hundreds of rule sets. The estimate asks the same code the lowering does, op by
op, without JAX: `sharding_rule.choose` says how each op runs under the rules' layouts, and
`lower.reshard.reshard`, run on shapes instead of arrays (`_Meter`), says which collectives
bring each operand from its producer's layout (and owed sums) to the one the op runs in. FLOPs
are the op's exact FLOPs on one device (one replicated trace) divided by the splits it runs
with. Tensors are laid out by the rules; a dim no rule names that renames one a rule splits
(`memory_length`, the keys' `length`) is split as that one where the tensor leaves its mesh dims
free, as propagation splits it. What it leaves out: other splits propagation adds, and linear
ops that pass a partial sum on instead of settling it (the exact trace counts those), so the
search re-scores its best candidates exactly.

Ops with the same signature (type, rule, operand and result shapes: a layer repeated) and
tensors with the same producer and consumers are costed once and counted as often as they occur,
so a rule set costs a few milliseconds whatever the depth.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from meshax.core.graph import Graph, Operation, Tensor
from meshax.core.shape import Shape
from meshax.layout.plan import weight_shapes
from meshax.layout.rules import LayoutRules, TensorLayout, block_sizes, slice_shape, split_factor
from meshax.layout.sharding_rule import choose, rule_of
from meshax.lower.laid_out import LaidOutTensor
from meshax.lower.lowering import Lowering, _needed_ops
from meshax.lower.reshard import reshard
from meshax.search.cost import Collective, StepCost, affine_counts, family


class _Meter:
    """What `reshard` needs of a LoweringContext, on local shapes: records the collectives."""

    op = None

    def __init__(self, mesh_shape: Shape, itemsize: int):
        self.mesh_shape, self.itemsize = mesh_shape, itemsize
        self.moves: list[tuple[str, tuple[int, ...], int]] = []  # (kind, mesh axes, bytes in)

    @contextlib.contextmanager
    def blame(self, op):
        yield

    def _live(self, axes) -> list[int]:
        return [m for m in axes if self.mesh_shape[m].size > 1]

    def _pad(self, shape, dim, parts) -> list[int]:
        shape = list(shape)
        shape[dim] += -shape[dim] % parts
        return shape

    def _record(self, kind, axes, shape) -> None:
        self.moves.append((kind, tuple(axes), math.prod(shape) * self.itemsize))

    def allreduce(self, xs, axes, op="sum"):
        axes = sorted(self._live(axes))
        if axes:
            self._record("allreduce", axes, xs)
        return xs

    def reduce_scatter(self, xs, axis, dim):
        if not self._live([axis]):
            return xs
        n = self.mesh_shape[axis].size
        xs = self._pad(xs, dim, n)
        self._record("reduce_scatter", [axis], xs)
        xs[dim] //= n
        return xs

    def allgather(self, xs, axis, dim, keep=None):
        if not self._live([axis]):
            return xs
        self._record("allgather", [axis], xs)
        xs = list(xs)
        xs[dim] = min(xs[dim] * self.mesh_shape[axis].size, keep or math.inf)
        return xs

    def alltoall(self, xs, axis, split_dim, concat_dim, keep=None):
        if not self._live([axis]):
            return xs
        n = self.mesh_shape[axis].size
        xs = self._pad(xs, split_dim, n)
        self._record("alltoall", [axis], xs)
        xs[split_dim] //= n
        xs[concat_dim] = min(xs[concat_dim] * n, keep or math.inf)
        return xs

    def allsplit(self, xs, axis, dim):
        n = self.mesh_shape[axis].size
        if n == 1:
            return xs
        xs = self._pad(xs, dim, n)
        xs[dim] //= n
        return xs


def _shape_key(t: Tensor) -> tuple:
    return (tuple((d.name, d.size) for d in t.shape), np.dtype(t.dtype).str)


class Estimator:
    """Fast StepCosts of rule sets for one program (outputs and updates) of a graph on a mesh."""

    def __init__(self, graph: Graph, mesh_shape: Shape, outputs: Sequence[Tensor], updates: Sequence = ()):
        from meshax.backends import SimdMeshImpl

        self.mesh_shape = mesh_shape
        roots = [*(t.operation for t in outputs), *updates]
        ops = [op for op in _needed_ops(graph, roots) if not getattr(op, "is_input", False)]
        replicated = Lowering(graph, {graph.operations[0].mesh: SimdMeshImpl(mesh_shape)})
        flops = replicated.trace_step(list(outputs), list(updates)).flops
        self._reps: dict[tuple, Operation] = {}
        self._flops: dict[tuple, float] = defaultdict(float)  # signature -> FLOPs of its ops on one device
        sig_of: dict[Operation, tuple] = {}
        for op in ops:
            shapes = (tuple(map(_shape_key, op.inputs)), tuple(map(_shape_key, op.outputs)))
            sig = (type(op).__name__, rule_of(op), *shapes)
            sig_of[op] = sig
            self._reps.setdefault(sig, op)
            self._flops[sig] += flops.get(op.name, 0)
        # tensors: (producer signature and output index, or the input's shape) -> consumers' wants
        consumers: dict[Tensor, list[tuple]] = defaultdict(list)
        for op in ops:
            for i, t in enumerate(op.inputs):
                consumers[t].append((sig_of[op], i))
        for t in outputs:
            consumers[t].append(("output",))
        self._uses: dict[tuple, int] = defaultdict(int)
        for t, cs in consumers.items():
            op = t.operation
            source = (sig_of[op], op.outputs.index(t)) if op in sig_of else ("input", _shape_key(t))
            self._uses[(source, _shape_key(t), tuple(sorted(set(cs), key=repr)))] += 1
        self._shapes = {_shape_key(t): t.shape for t in consumers}
        forward = _needed_ops(graph, [t.operation for t in outputs])
        parts = ("parameters", "gradients", "optimizer_state", "activations")
        self._memory: dict[str, dict[tuple, int]] = {k: defaultdict(int) for k in parts}
        # memory as `search.memory_of` counts it
        kept = [op for op in forward if not getattr(op, "is_input", False)]
        kept += [op for op in graph.operations if getattr(op, "is_placeholder", False)]
        for part, op in [
            *(("parameters" if v.trainable else "optimizer_state", v) for v in graph.all_variables),
            *(("gradients", v) for v in (graph.trainable_variables if updates else ())),
            *(("activations", op) for op in kept),
        ]:
            for t in op.outputs:
                self._memory[part][_shape_key(t)] += 1
                self._shapes[_shape_key(t)] = t.shape
        self._moves: dict[tuple, list] = {}
        self._runs: dict[tuple, tuple] = {}
        self._weight_shapes = weight_shapes(graph.operations)
        self._aliases = _renamed(ops)

    @staticmethod
    def affine(base: Estimator, terms: list[tuple[float, Estimator]]) -> Estimator:
        """An Estimator whose counts are `affine_counts` of others' (the same model at other
        depths, `meshax.search.program.Extrapolated`)."""

        def combine(part) -> dict:
            return {k: round(v) for k, v in affine_counts(part(base), [(w, part(e)) for w, e in terms]).items()}

        out = copy.copy(base)
        everyone = [base, *(e for _, e in terms)]
        out._reps = {k: v for e in reversed(everyone) for k, v in e._reps.items()}
        out._shapes = {k: v for e in everyone for k, v in e._shapes.items()}
        out._flops = affine_counts(base._flops, [(w, e._flops) for w, e in terms])
        out._uses = combine(lambda e: e._uses)
        out._memory = {part: combine(lambda e, part=part: e._memory[part]) for part in base._memory}
        out._moves, out._runs = {}, {}
        out._weight_shapes = frozenset().union(*(e._weight_shapes for e in everyone))
        out._aliases = {k: frozenset().union(*(e._aliases.get(k, ()) for e in everyone)) for k in base._aliases}
        return out

    def __call__(self, rules: LayoutRules, weight_rules: LayoutRules | None = None) -> StepCost:
        """The estimated StepCost of `rules` (and `weight_rules` for weight-shaped tensors)."""
        mesh = self.mesh_shape
        index = {d.name: i for i, d in enumerate(mesh)}

        def axes_of(rules: LayoutRules) -> dict[str, tuple[int, ...]]:
            return {d: tuple(index[m] for m in rules.mesh_dims_for(d)) for d in rules.tensor_dim_names}

        by_dim = axes_of(rules)
        by_weight_dim = by_dim if weight_rules is None else axes_of(weight_rules)
        weight_shaped = self._weight_shapes - getattr(weight_rules, "exempt", frozenset())
        layouts: dict[tuple, TensorLayout] = {}

        def layout(key) -> TensorLayout:
            if key not in layouts:
                names = [n for n, _ in key[0]]
                use = by_weight_dim if frozenset(names) in weight_shaped else by_dim
                axes = [use.get(n, ()) for n in names]
                # a dim no rule names, renamed from or to one a rule splits: split as that one where
                # the tensor leaves its mesh dims free, as propagation splits it (memory_length, the
                # keys' length, from length: the keys' projections run split as the queries' do)
                taken = {m for a in axes for m in a}
                for i, n in enumerate(names):
                    if n in use:
                        continue
                    for other in sorted(self._aliases.get(n, ())):
                        follow = use.get(other, ())
                        if follow and taken.isdisjoint(follow):
                            axes[i] = follow
                            taken.update(follow)
                            break
                layouts[key] = TensorLayout(axes)
            return layouts[key]

        runs = {}
        flops: dict[str, float] = defaultdict(float)
        for sig, f in self._flops.items():
            run, splits = self._choose(sig, tuple(map(layout, sig[2])), tuple(map(layout, sig[3])))
            runs[sig] = run
            flops[family(sig[0])] += f / splits
        moves: dict[tuple, int] = defaultdict(int)
        for (source, key, cs), count in self._uses.items():
            if source[0] == "input":
                have, pending = layout(key), frozenset[int]()
            else:
                run = runs[source[0]]
                have, pending = run.results[source[1]], run.pending
            wants = {layout(key) if c[0] == "output" else runs[c[0]].operands[c[1]] for c in cs}
            for want in wants:
                for kind, axes, nbytes in self._reshard(key, have, pending, want):
                    moves[(kind, axes, nbytes)] += count
        collectives = [
            Collective(kind, tuple(mesh[m].name for m in axes), nbytes, n) for (kind, axes, nbytes), n in moves.items()
        ]
        memory = {
            part: sum(
                n * math.prod(slice_shape(self._shapes[k], layout(k), mesh)) * np.dtype(k[1]).itemsize
                for k, n in groups.items()
            )
            for part, groups in self._memory.items()
        }
        return StepCost(dict(flops), collectives, memory, exact=False)

    def _choose(self, sig: tuple, operands: tuple, results: tuple) -> tuple:
        """How the op of `sig` runs with these operand and result layouts, and how many ways its
        work is split (rule sets share most layouts: each is chosen once)."""
        memo = (sig, operands, results)
        if memo not in self._runs:
            run = choose(self._reps[sig], list(operands), list(results), self.mesh_shape)
            self._runs[memo] = run, math.prod(split_factor(a, self.mesh_shape) for a in run.assign.values())
        return self._runs[memo]

    def _reshard(self, key, have: TensorLayout, pending, want: TensorLayout) -> list:
        memo = (key, have, pending, want)
        if memo not in self._moves:
            shape = self._shapes[key]
            meter = _Meter(self.mesh_shape, np.dtype(key[1]).itemsize)
            local = [block_sizes(d.size, a, self.mesh_shape)[-1] for d, a in zip(shape, have.axes)]
            reshard(meter, LaidOutTensor(local, have, pending), want, shape)
            self._moves[memo] = meter.moves
        return self._moves[memo]


def _renamed(ops) -> dict[str, frozenset[str]]:
    """Dim name -> the names it is renamed to or from somewhere in the ops (a reshape that keeps
    every size in place: `rename_dimension`)."""
    aliases: dict[str, set[str]] = defaultdict(set)
    for op in ops:
        if type(op).__name__ != "ReshapeOperation":
            continue
        old, new = op.inputs[0].shape, op.outputs[0].shape
        if old.to_integer_list != new.to_integer_list:
            continue
        for a, b in zip(old, new):
            if a.name != b.name:
                aliases[a.name].add(b.name)
                aliases[b.name].add(a.name)
    return {k: frozenset(v) for k, v in aliases.items()}
