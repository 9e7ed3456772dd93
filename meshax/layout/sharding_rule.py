"""Op sharding rules: how an op's dims relate, as data, apart from its kernel.

With named dims, a dim name already is a *factor* (OpenXLA Shardy's term): every operand and
result dim carrying one factor is split the same way when the op runs. Each factor is one of

  passed    in a result (and maybe in operands): split it and no communication is needed;
  reduced   only in operands: a split leaves each device a partial result (a pending sum);
  whole     must not be split: the op gathers it first (slice, concat, cumsum, top_k ...);
  windowed  in a result, each output value reads neighbours up to a width away (shift,
            convolutions): it stays split over one mesh dim, with a halo exchange at the edges
            (several hops where the halo is wider than a slice); a *cyclic* one (a shift that
            wraps around) only where the split divides it.

A dim with factor `None` belongs to no factor: nothing ties it to another dim, and the op runs
with it whole (reshape's dims that are not aligned). The lowering (`choose`: how an op runs,
which every op's `lower` asks through `ctx.layouts`), sharding propagation, the cost estimate
`choose` compares ways to run by (`moved`), and later layout search read the same rule; no op
decides its layout in its kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from meshax.core.shape import Shape
from meshax.layout.rules import TensorLayout, block_sizes, slice_shape, split_factor

Factors = tuple[str | None, ...]  # per dim of one operand or result: its factor


@dataclasses.dataclass(frozen=True)
class ShardingRule:
    operands: tuple[Factors, ...]
    results: tuple[Factors, ...]
    whole: frozenset[str] = frozenset()
    windows: tuple[tuple[str, int], ...] = ()  # windowed factor -> its halo width
    cyclic: frozenset[str] = frozenset()  # windowed factors whose window wraps around
    divides: tuple[tuple[str, int], ...] = ()  # compound factor -> a size its split must divide

    @staticmethod
    def by_name(inputs: Sequence[Shape], outputs: Sequence[Shape], whole=(), windows=(), cyclic=()) -> ShardingRule:
        """The rule of an op whose dims relate by name (most ops)."""
        return ShardingRule(
            tuple(tuple(s.dimension_names) for s in inputs),
            tuple(tuple(s.dimension_names) for s in outputs),
            frozenset(whole),
            tuple(windows),
            frozenset(cyclic),
        )

    @property
    def factors(self) -> list[str]:
        """Every factor the rule names, each once, operands first."""
        seen: dict[str, None] = {}
        for fs in (*self.operands, *self.results):
            seen.update((f, None) for f in fs if f is not None)
        return list(seen)

    def kind(self, factor: str) -> str:
        """ "passed", "reduced", "whole" or "windowed": what splitting `factor` means for the op (see the module)."""
        if factor in self.whole:
            return "whole"
        if factor in dict(self.windows):
            return "windowed"
        return "passed" if any(factor in fs for fs in self.results) else "reduced"

    @functools.cached_property
    def reduced(self) -> frozenset[str]:
        """The factors `kind` calls "reduced" (in operands only: splitting one leaves a partial sum)."""
        return frozenset(f for f in self.factors if self.kind(f) == "reduced")

    @functools.cached_property
    def adds_factors(self) -> bool:
        """Results have factors no operand has (broadcast): propagation prefers backward."""
        ins = {f for fs in self.operands for f in fs}
        return any(f not in ins for fs in self.results for f in fs if f is not None)


ORDERS = (("results", "operands"), ("reduced", "results", "operands"), ("operands", "results"))

# A collective's fixed cost, in values moved: small tensors are latency-bound, so of two ways
# to run an op that move about as much, the one with fewer collectives wins.
LATENCY = 4096


def iteration(
    rule: ShardingRule,
    layouts: Sequence[TensorLayout],
    planned: Sequence[TensorLayout],
    order: Sequence[str],
    sizes: Mapping[str, int],
    mesh_shape: Shape,
) -> dict[str, tuple[int, ...]]:
    """factor -> mesh axes an op runs with: each mesh axis splits at most one factor.

    `planned` are the results' planned layouts, `layouts` the operands'. Factors take their
    split where its mesh axes are still free, from the groups in `order`: "results" (their
    planned split), "reduced" (operands' splits of reduced factors only) and "operands" (all
    operands' splits). Whole factors are never split; a windowed factor only over one mesh
    dim and narrower than the whole dim, a cyclic one only where the split divides it
    (`sizes`: factor -> its size); a compound factor (a reshape's merged dim and its major
    part) only where the split divides the size the rule gives it."""
    assign: dict[str, tuple[int, ...]] = {}
    used: set[int] = set()
    windows, divides = dict(rule.windows), dict(rule.divides)
    results, operands = list(zip(rule.results, planned)), list(zip(rule.operands, layouts))
    pairs = [(group, fs, layout) for group in order for fs, layout in (results if group == "results" else operands)]
    for group, factors, layout in pairs:
        for f, axes in zip(factors, layout.axes):
            if f is None or f in assign or (group == "reduced" and rule.kind(f) != "reduced"):
                continue
            if f in rule.whole or used & set(axes):
                axes = ()
            if f in divides and axes and divides[f] % split_factor(axes, mesh_shape):
                axes = ()
            if (
                f in windows
                and axes
                and (
                    len(axes) > 1
                    or (windows[f] and windows[f] >= sizes[f])
                    or (windows[f] and f in rule.cyclic and sizes[f] % split_factor(axes, mesh_shape))
                )
            ):
                axes = ()
            assign[f] = tuple(axes)
            used |= set(axes)
    return assign


def layouts(factor_lists: Sequence[Factors], assign: Mapping[str, tuple[int, ...]]) -> list[TensorLayout]:
    """Per tensor (operands or results), its layout while the op runs with `assign`: each dim
    split as its factor; a dim of no factor whole."""
    return [TensorLayout(assign.get(f, ()) if f is not None else () for f in fs) for fs in factor_lists]


def owed(rule: ShardingRule, assign: Mapping[str, tuple[int, ...]]) -> frozenset[int]:
    """Mesh axes the results are partial sums over: those that split a reduced factor."""
    return frozenset(m for f in rule.factors if rule.kind(f) == "reduced" for m in assign.get(f, ()))


def moved(
    rule: ShardingRule,
    operands: Sequence[tuple[Shape, TensorLayout]],
    results: Sequence[tuple[Shape, TensorLayout]],
    assign: Mapping[str, tuple[int, ...]],
    mesh_shape: Shape,
) -> int:
    """Values one device sends to run the op with `assign`, from its operands' (shape, layout)
    to its results' (shape, planned layout), plus `LATENCY` per mesh dim communicated over:
    reshards, the allreduce of owed sums, halo exchanges. An estimate to compare choices by
    (the lowering's counters record what really runs)."""

    def local(shape, layout) -> int:
        return math.prod(slice_shape(shape, layout, mesh_shape))

    def reshard(shape, have: TensorLayout, want: TensorLayout) -> int:
        if all(w[: len(h)] == h for h, w in zip(have.axes, want.axes)):
            return 0  # a free allsplit
        moved_axes = {m for h, w in zip(have.axes, want.axes) for m in set(h) ^ set(w)}
        return local(shape, want) + LATENCY * len(moved_axes)

    total = sum(reshard(shape, have, want) for (shape, have), want in zip(operands, layouts(rule.operands, assign)))
    pending = owed(rule, assign)
    windows = dict(rule.windows)
    for (shape, planned), factors, got in zip(results, rule.results, layouts(rule.results, assign)):
        if pending:
            total += local(shape, got) + LATENCY * len(pending)
        for d, f, axes in zip(shape, factors, got.axes):
            if f is not None and windows.get(f) and axes:  # the halo: `width` rows of the slice, in hops of a slice
                block = block_sizes(d.size, axes, mesh_shape)[-1]
                total += local(shape, got) // block * windows[f] + LATENCY * -(-windows[f] // block)
        total += reshard(shape, got, planned)
    return total


def choose(op, layouts_in: Sequence[TensorLayout], planned: Sequence[TensorLayout], mesh_shape: Shape) -> Run:
    """How `op` runs, read from its sharding rule: of the splits taken from the operands'
    reduced factors first, from the operands first, or from the results' plan first, the one
    that moves the fewest values by `moved` (on a tie, the earliest of these three; for an op
    without reduced factors the first is the results' plan; without a conflict all three are
    one). (The lowering passes the operands' planned layouts.) Taking a reduced
    factor's split first is GSPMD's weight-update sharding: a weight's gradient summed over a
    batch split over the mesh dim that also splits the weight is reduce-scattered, not the
    activations gathered. Chosen once per op and layouts (a layout search lowers one graph under
    hundreds of rule sets that share most layouts); the Run is shared, not to be changed."""
    key = (tuple(layouts_in), tuple(planned), mesh_shape)
    runs = _RUNS.setdefault(op, {})
    if key not in runs:
        runs[key] = _choose(op, layouts_in, planned, mesh_shape)
    return runs[key]


_RUNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # op -> {(layouts, planned, mesh): Run}


def _choose(op, layouts_in: Sequence[TensorLayout], planned: Sequence[TensorLayout], mesh_shape: Shape) -> Run:
    rule = rule_of(op)
    tensors = [*zip(op.inputs, rule.operands), *zip(op.outputs, rule.results)]
    sizes = {f: t.shape[i].size for t, fs in tensors for i, f in enumerate(fs) if f is not None} if rule.windows else {}
    first, *others = [iteration(rule, layouts_in, planned, order, sizes, mesh_shape) for order in ORDERS]
    if any(o != first for o in others):
        operands = [(t.shape, layout) for t, layout in zip(op.inputs, layouts_in)]
        results = [(t.shape, layout) for t, layout in zip(op.outputs, planned)]
        first = min(
            [*others, first], key=lambda a: moved(rule, operands, results, a, mesh_shape)
        )  # keeps the earliest of ties
    return Run(first, layouts(rule.operands, first), layouts(rule.results, first), owed(rule, first))


class Run(NamedTuple):
    """How an op runs: factor -> mesh axes, the layouts its operands are fetched in and its
    results come out in, and the mesh axes its results are partial sums over."""

    assign: dict[str, tuple[int, ...]]
    operands: list[TensorLayout]
    results: list[TensorLayout]
    pending: frozenset[int]


def rule_of(op) -> ShardingRule:
    """The op's own rule (`op.sharding_rule()`), or the rule by dim name, with the dims it
    names in `whole_dims` kept whole, those in `windows` ((name, halo width) pairs) windowed,
    and those in `cyclic` wrapping around."""
    rule = _RULES.get(op)
    if rule is None:  # (an op's rule is fixed when it is made: worked out once, a search asks hundreds of times)
        rule = _RULES[op] = _own_rule(op)
    return rule


_RULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # op -> its ShardingRule


def _own_rule(op) -> ShardingRule:
    own = getattr(op, "sharding_rule", None)
    if own is not None:
        return own()
    return ShardingRule.by_name(
        [t.shape for t in op.inputs],
        [t.shape for t in op.outputs],
        getattr(op, "whole_dims", ()),
        getattr(op, "windows", ()),
        getattr(op, "cyclic", ()),
    )
