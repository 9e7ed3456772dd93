"""Op sharding rules: how an op's dims relate, as data, apart from its kernel.

With named dims, a dim name already is a *factor* (OpenXLA Shardy's term): every operand and
result dim carrying one factor is split the same way when the op runs. Each factor is one of

  passed    in a result (and maybe in operands): split it and no communication is needed;
  reduced   only in operands: a split leaves each device a partial result (a pending sum);
  whole     must not be split: the op gathers it first (slice, concat, cumsum, top_k ...).

A dim with factor `None` belongs to no factor (nothing ties it to another dim). The lowering
(`iteration`), sharding propagation, the cost report and layout search read the same rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from meshax.core.shape import Shape

Factors = tuple[str | None, ...]  # per dim of one operand or result: its factor


@dataclasses.dataclass(frozen=True)
class ShardingRule:
    operands: tuple[Factors, ...]
    results: tuple[Factors, ...]
    whole: frozenset[str] = frozenset()

    @staticmethod
    def by_name(inputs: Sequence[Shape], outputs: Sequence[Shape], whole=()) -> ShardingRule:
        """The rule of an op whose dims relate by name (most ops)."""
        return ShardingRule(tuple(tuple(s.dimension_names) for s in inputs),
                            tuple(tuple(s.dimension_names) for s in outputs), frozenset(whole))

    @property
    def factors(self) -> list[str]:
        seen: dict[str, None] = {}
        for fs in (*self.operands, *self.results):
            seen.update((f, None) for f in fs if f is not None)
        return list(seen)

    def kind(self, factor: str) -> str:
        if factor in self.whole:
            return "whole"
        return "passed" if any(factor in fs for fs in self.results) else "reduced"

    @property
    def adds_factors(self) -> bool:
        """Results have factors no operand has (broadcast): propagation prefers backward."""
        ins = {f for fs in self.operands for f in fs}
        return any(f not in ins for fs in self.results for f in fs if f is not None)


ORDERS = (("results", "operands"), ("reduced", "results", "operands"), ("operands", "results"))


def iteration(rule: ShardingRule, layouts: Sequence, planned: Sequence,
              order: Sequence[str] = ORDERS[0]) -> dict[str, tuple[int, ...]]:
    """factor -> mesh axes an op runs with: each mesh axis splits at most one factor.

    `planned` are the results' planned layouts, `layouts` the operands'. Factors take their
    split where its mesh axes are still free, from the groups in `order`: "results" (their
    planned split), "reduced" (operands' splits of reduced factors only) and "operands" (all
    operands' splits). Whole factors are never split."""
    assign: dict[str, tuple[int, ...]] = {}
    used: set[int] = set()
    results, operands = list(zip(rule.results, planned)), list(zip(rule.operands, layouts))
    pairs = [(group, fs, layout) for group in order for fs, layout in (results if group == "results" else operands)]
    for group, factors, layout in pairs:
        for f, axes in zip(factors, layout.axes):
            if f is None or f in assign or (group == "reduced" and rule.kind(f) != "reduced"):
                continue
            if f in rule.whole or used & set(axes):
                axes = ()
            assign[f] = tuple(axes)
            used |= set(axes)
    return assign


def rule_of(op) -> ShardingRule:
    """The op's own rule (`op.sharding_rule()`), or the rule by dim name, with the dims it
    names in `whole_dims` kept whole."""
    own = getattr(op, "sharding_rule", None)
    if own is not None:
        return own()
    return ShardingRule.by_name([t.shape for t in op.inputs], [t.shape for t in op.outputs],
                                getattr(op, "whole_dims", ()))
