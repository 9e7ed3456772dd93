"""GSPMD's sharding completion (paper section 3.5): from a few annotations to every tensor.

The passes, in the order they run (`make_plan`):
  1. rules: every dim named in the layout rules is split as the rules say (fixed);
  2. annotations: `mesh_split` / `shard` fix their tensor's dims (`OPEN` entries stay open);
     an annotation with a priority p > 0 joins later, after everything before it has
     propagated to a fixed point (Shardy's p0, p1: annotate the batch first, then the model);
     ops may keep some dims of their outputs whole (fixed, replicated);
  3. propagation: every other dim is *open*. Iterative backward and forward sweeps over the
     graph (gradient and optimizer ops included) carry each factor's split from tensor to
     tensor through the op sharding rules until nothing changes; a sweep visits, in graph
     order, only the ops that could carry something new (a worklist: those next to a tensor
     that changed since they last ran), with the result of sweeping every op. Priorities:
     elementwise ops first, then the factors other ops pass through (einsum, reductions), and
     last forward through ops that add dims (broadcast), which are preferred backward, and
     along reduced factors (an einsum's contracted dim, from one operand to the other). Where
     two factors of one tensor want one mesh dim, the one whose split comes from the larger
     tensor takes it (Shardy's aggressive propagation: the smaller tensor is resharded). A split
     is only ever refined (an open dim grows a longer split that extends the one it has), never
     overwritten, and fixed dims never change, so the sweeps reach a fixed point; they are
     deterministic.
     A split that does not divide its dim passes only to dims of the same size (no padding
     that no annotation or rule asked for).
     Splits cross a loop's boundary (`ScanOperation.propagation_links`) as through an identity.
  4. open dims that nothing reached are replicated.
Every dim remembers where its split came from, for `Lowering.explain`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from meshax.core.errors import LayoutError
from meshax.core.shape import Shape
from meshax.layout.rules import LayoutRules, TensorLayout, tensor_layout, validate_layout
from meshax.layout.sharding_rule import Factors, ShardingRule, rule_of

LAST = 2  # the last propagation level: forward through ops that add dims, and reduced factors


class _Open:
    """The annotation entry "let propagation decide" (GSPMD's partial specification)."""

    def __repr__(self) -> str:
        return "OPEN"


OPEN = _Open()


def longest_split(want: Sequence[int], size: int, used, mesh_shape: Shape, padded: bool = False) -> tuple[int, ...]:
    """The longest prefix of the split `want` (mesh axes) that a dim of `size` can take beside
    dims using the mesh axes `used`: axes they do not use, and a split that divides the dim
    (`padded`: any split, where the padding is one the user asked for already)."""
    take: list[int] = []
    for m in want:
        if m in used or (not padded and size % (math.prod(mesh_shape[k].size for k in take) * mesh_shape[m].size)):
            break
        take.append(m)
    return tuple(take)


def annotation_layout(t, mesh_shape: Shape) -> tuple[list, list[bool]]:
    """(per-dim mesh axes, per-dim fixed?) from the annotation on t's op, validated."""
    op = t.operation
    what = op.inputs[0].name if op.inputs else t.name  # (the tensor annotated, not the annotation's output)
    axes: list[tuple[int, ...] | None] = []
    fixed: list[bool] = []
    for d, entry in zip(t.shape, op.annotation):
        if entry is OPEN:
            axes.append(None)
            fixed.append(False)
            continue
        for m in entry:
            if m not in mesh_shape:
                raise LayoutError(
                    f"annotation on {what!r} {t.shape} at {op.source}: dim {d.name!r} names mesh dim "
                    f"{m!r}, but the mesh has only {mesh_shape.dimension_names}"
                )
        axes.append(tuple(mesh_shape.index(m) for m in entry))
        fixed.append(True)
    try:
        validate_layout(t.shape, TensorLayout(a or () for a in axes), mesh_shape, t.name)
    except LayoutError as e:
        raise LayoutError(f"annotation at {op.source}: {e}") from None
    return axes, fixed


class _Link:
    """A pseudo-op for propagation only: b stands for a inside a loop body or a branch (or a for
    b outside); dims of one name are one factor, `whole` ones (the loop's own dim) never split."""

    def __init__(self, a, b, whole: str | None, owner):
        what = getattr(owner, "boundary", "loop")  # (what the explanation calls it)
        self.inputs, self.outputs, self.name = [a], [b], f"the {what} boundary of {b.operation.name}"
        self._rule = ShardingRule.by_name([a.shape], [b.shape], whole=(whole,) if whole else ())

    def sharding_rule(self) -> ShardingRule:
        return self._rule


def _fills(t) -> bool:
    """Whether t is made on each device in any layout asked for (a constant, a range): it takes a
    split from a reader but passes none on, so that two readers that want it laid out two ways
    each get it so (XLA splits such constants per user before propagating, for the same end)."""
    return getattr(t.operation, "fill", None) is not None and not getattr(t.operation, "annotation", None)


def _links(op) -> list:
    links = getattr(op, "propagation_links", None)
    return links() if links is not None else []


class _Structure:
    """What propagation needs of a list of ops whatever the rules: the ops (with a loop boundary's
    links), their sharding rules, each tensor's ops, each op's highest level per direction, and
    the tensors each op may carry from (filled as the sweeps ask). The layout search propagates
    one graph under hundreds of rule sets; this is worked out once for all of them."""

    def __init__(self, operations: tuple):
        # A loop's boundary (`propagation_links`): its carries and scanned slices inside and the
        # tensors outside they stand for are tied by name, as an identity op ties them.
        self.ops = list(operations) + [_Link(a, b, whole, op) for op in operations for a, b, whole in _links(op)]
        self.rules = {op: rule_of(op) for op in self.ops}
        self.tensors = {t for op in operations for t in op.outputs}  # (those propagation lays out)
        self.sources: dict[tuple, list] = {}  # (op, target factors, direction, level) -> `_factor_splits`' tensors
        self.users: dict = {}  # tensor -> the indices (in `ops`) of the ops that read or write it
        for j, op in enumerate(self.ops):
            for t in {*op.inputs, *op.outputs}:
                self.users.setdefault(t, []).append(j)
        self.tops = {d: [self._top(op, d) for op in self.ops] for d in (False, True)}

    def _top(self, op, to_results: bool) -> int:
        """The highest `_level` of the op's (source, target) pairs in this direction: at any level
        above it, the op carries what it carries at it."""
        rule = self.rules[op]
        ins, outs = list(zip(op.inputs, rule.operands)), list(zip(op.outputs, rule.results))
        targets = {fs for t, fs in (outs if to_results else ins) if t in self.tensors}
        sources = {fs for t, fs in ins + outs if t in self.tensors}  # (a pair's level is its factors')
        top = max((Propagation._level(rule, s, fs, to_results) for fs in targets for s in sources), default=0)
        return max(top, LAST) if rule.reduced and not to_results else top  # (reduced factors: `_factor_splits`)


def _structure(operations: tuple) -> _Structure:
    """The ops' `_Structure`, kept on their graph (so it lives as long as the graph does) for the
    last 4 lists of its ops propagated."""
    kept = operations[0].graph.derived.setdefault(_Structure, {})
    if operations not in kept:
        while len(kept) >= 4:
            del kept[next(iter(kept))]
        kept[operations] = _Structure(operations)
    return kept[operations]


class Propagation:
    """Per tensor and dim: its mesh axes (None: open, nothing yet), whether it is fixed, and
    where it came from."""

    def __init__(self, operations: Sequence, rules: LayoutRules, mesh_shape: Shape, weights=None):
        """`weights`: (weight rules, the dim-name sets of weight-shaped tensors), which those
        tensors follow instead of `rules` (`plan.make_plan`)."""
        self.mesh_shape = mesh_shape
        self.operations = list(operations)
        self.axes: dict = {}
        self.fixed: dict = {}
        self.origin: dict = {}
        self._initials: dict[tuple, tuple[list, list, list]] = {}
        later: dict[int, list] = {}  # priority -> annotated tensors that join at that round (open till then)
        for op in self.operations:
            for t in op.outputs:
                if getattr(op, "priority", 0) > 0:
                    later.setdefault(op.priority, []).append(t)
                    self.axes[t], self.fixed[t], self.origin[t] = (
                        [None] * t.shape.rank,
                        [False] * t.shape.rank,
                        [""] * t.shape.rank,
                    )
                elif weights is not None and frozenset(t.shape.dimension_names) in weights[1]:
                    self._initial(t, weights[0], "weight rule ")
                else:
                    self._initial(t, rules)
        ops = tuple(self.operations)  # (one op is a tensor laid out after the plan: not worth keeping)
        structure = _structure(ops) if len(ops) > 1 else _Structure(ops)
        self._ops, self._rules, self._users = structure.ops, structure.rules, structure.users
        self._tops, self._sources, self._tensors = structure.tops, structure.sources, structure.tensors
        self._running: tuple | None = None  # the pass under way: (direction, op index, its heap, its queue)
        self._run()
        for priority in sorted(later):  # Shardy's p1, p2 ...: each round propagates to a fixed point
            for t in later[priority]:
                self._annotate(t)
            self._run()

    def _initial(self, t, rules: LayoutRules, what: str = "rule ") -> None:
        op = t.operation
        if getattr(op, "annotation", None) is not None:
            self._annotate(t)
            return
        whole = getattr(op, "replicated_dims", ())
        key = (t.shape, rules, what, frozenset(whole), type(op).__name__ if whole else "")
        if key not in self._initials:  # (tensors of one shape start alike: each shape worked out once)
            if whole:
                rules = LayoutRules([(d, m) for d, m in rules if d not in whole])
            ruled = tensor_layout(t.shape, rules, self.mesh_shape, t.name)
            named = set(rules.tensor_dim_names)
            columns: tuple[list, list, list] = ([], [], [])
            for d, a in zip(t.shape, ruled.axes):
                state: tuple[tuple[int, ...] | None, bool, str]
                if d.name in whole:
                    state = ((), True, f"kept whole by {type(op).__name__}")
                elif d.name in named:
                    state = (a, True, what + ";".join(f"{d.name}:{self.mesh_shape[m].name}" for m in a))
                else:
                    state = (None, False, "")  # open
                for column, value in zip(columns, state):
                    column.append(value)
            self._initials[key] = columns
        self.axes[t], self.fixed[t], self.origin[t] = (list(c) for c in self._initials[key])

    def _annotate(self, t) -> None:
        axes, fixed = annotation_layout(t, self.mesh_shape)
        self.axes[t], self.fixed[t] = axes, fixed
        where = t.operation.source + (f", priority {t.operation.priority}" if t.operation.priority else "")
        self.origin[t] = [f"annotation at {where}" if f else "" for f in fixed]

    # ---- one op, one direction ----------------------------------------------------------------
    @staticmethod
    def _level(rule: ShardingRule, source: Factors, target: Factors, to_results: bool) -> int:
        """The priority of carrying splits from `source` to `target` through an op (0 first):
        between tensors with the same factors (elementwise: no communication when they match),
        then the rest, and last forward through ops that add dims (broadcast)."""
        if set(source) == set(target) and None not in target:
            return 0
        return 2 if to_results and rule.adds_factors else 1

    def _factor_splits(self, op, rule: ShardingRule, target: Factors, to_results: bool, level: int) -> dict:
        """factor -> (mesh axes, the tensor it came from): the finest compatible split among the
        op's tensors that may reach `target` at this level, fixed ones first, then in
        operand/result order. A reduced factor (an einsum's contracted dim, summed out: it goes
        from operand to operand only) carries a split only at the last level, after the factors
        that pass through (Shardy's op priorities: pass-through factors before the rest). Else a
        gradient's contraction over the batch would carry the batch's split back to the
        activations before the forward pass carried a weight's split to them, and where both
        want one mesh dim the batch would win by the order of the sweeps, not by what it costs."""
        key = (op, target, to_results, level)
        if key not in self._sources:  # (which tensors may reach the target is fixed: worked out once per graph)
            self._sources[key] = [
                (t, fs)
                for t, fs in [*zip(op.inputs, rule.operands), *zip(op.outputs, rule.results)]
                if t in self._tensors and self._level(rule, fs, target, to_results) <= level and not _fills(t)
            ]
        tensors = self._sources[key]
        found: dict[str, tuple] = {}
        for want_fixed in (True, False):
            for t, factors in tensors:
                for i, f in enumerate(factors):
                    a = self.axes[t][i]
                    if f is None or f in rule.whole or not a or self.fixed[t][i] != want_fixed:
                        continue
                    if level < LAST and f in rule.reduced:
                        continue
                    have = found.get(f)
                    if have is None or (len(a) > len(have[0]) and a[: len(have[0])] == have[0]):
                        found[f] = (a, t, t.shape[i].size)
        return found

    def _refine(self, t, i: int, want: tuple, size: int) -> tuple:
        """The longest prefix of `want`, the split of a dim of `size`, that t's dim i can take
        (`longest_split`). A split that does not divide passes to a dim of the same size: its
        padding is the same, one the user asked for (an annotation or a rule made it); to a
        dim of another size it would add padding no one asked for."""
        used = {m for j, a in enumerate(self.axes[t]) if j != i and a for m in a}
        return longest_split(want, t.shape[i].size, used, self.mesh_shape, padded=t.shape[i].size == size)

    def _through(self, op, to_results: bool, level: int) -> bool:
        rule = self._rules[op]
        targets = zip(op.outputs, rule.results) if to_results else zip(op.inputs, rule.operands)
        changed = False
        for t, factors in targets:
            if t not in self.axes or all(self.fixed[t]):
                continue
            splits = self._factor_splits(op, rule, factors, to_results, level)
            # Where two factors want one mesh dim, the one from the larger tensor takes it (Shardy's
            # aggressive propagation): resharding the smaller tensor is the cheaper side of the conflict.
            dims = [i for i, f in enumerate(factors) if f in splits and not self.fixed[t][i]]
            if len(dims) > 1:
                dims.sort(key=lambda i: -splits[factors[i]][1].shape.size)
            for i in dims:
                f = factors[i]
                cur = self.axes[t][i] or ()
                new = self._refine(t, i, splits[f][0], splits[f][2])
                if len(new) > len(cur) and new[: len(cur)] == cur:
                    self.axes[t][i] = new
                    source = splits[f][1]
                    self.origin[t][i] = (
                        f"propagated {'forward' if to_results else 'backward'} through {op.name} from {source.name}"
                    )
                    self._changed(t)
                    changed = True
        return changed

    # ---- the sweeps ---------------------------------------------------------------------------
    # What an op carries in one direction depends only on its tensors and on which of its pairs
    # the level admits. So a sweep visits only the ops due in that direction (a worklist): those
    # next to a tensor that changed since they last ran, and, when the level rises, those with
    # pairs at the new level. It visits them in the order a full sweep would, and an op due ahead
    # of the one running joins this sweep, so the result is a full sweep's, visit for visit.
    def _changed(self, t) -> None:
        ahead = self._running
        for j in self._users[t]:
            for direction in (False, True):
                if ahead is not None and direction == ahead[0] and (j > ahead[1] if direction else j < ahead[1]):
                    if j not in ahead[3]:
                        ahead[3].add(j)
                        heapq.heappush(ahead[2], j if direction else -j)
                else:
                    self._due[direction].add(j)

    def _pass(self, to_results: bool, level: int) -> bool:
        """Op by op, in graph order forward (reverse order backward), those due in this direction."""
        queued, self._due[to_results] = self._due[to_results], set()
        heap = [j if to_results else -j for j in queued]
        heapq.heapify(heap)
        changed = False
        while heap:
            j = abs(heapq.heappop(heap))
            queued.discard(j)
            self._running = (to_results, j, heap, queued)
            changed |= self._through(self._ops[j], to_results, level)
        self._running = None
        return changed

    def _sweep(self, level: int) -> bool:
        """One backward and one forward pass through the ops due; whether anything changed.
        (Backward first: a variable then takes its split from the annotated read of it, not from
        its update at the end of the graph, which `explain` reports.)"""
        changed = self._pass(False, level)
        return self._pass(True, level) | changed

    def sweep(self, level: int = LAST) -> bool:
        """One full sweep, every op in both directions; whether anything changed (after
        propagation nothing does: the fuzzer checks it)."""
        self._due = self._every_op()
        return self._sweep(level)

    def _every_op(self) -> dict[bool, set[int]]:
        return {direction: set(range(len(self._ops))) for direction in (False, True)}

    def _run(self) -> None:
        self._due = self._every_op()
        for level in range(LAST + 1):
            if level:  # (an op whose pairs are all at lower levels carries nothing new)
                for direction in (False, True):
                    self._due[direction] |= {j for j, top in enumerate(self._tops[direction]) if top >= level}
            while self._sweep(level):
                pass

    # ---- results ------------------------------------------------------------------------------
    def layout(self, t) -> TensorLayout:
        return TensorLayout(a or () for a in self.axes[t])

    def origins(self, t) -> list[str]:
        return [o or "replicated: nothing splits it" for o in self.origin[t]]
