"""The search's weight rules (`search_layout(search_weights=True)`): weights, their gradients and
optimizer state split one way and the activations another (GSPMD's 2D sharding, ZeRO), each
searched given the other; and weight shapes left to the rules where that is faster."""

from __future__ import annotations

import itertools

from meshax.layout import LayoutRules, WeightRules, convert_to_layout_rules, convert_to_weight_rules
from meshax.search.result import Candidate, split_pairs
from meshax.search.space import Rules, Space


class TooMany(Exception):
    """A space the weight-rules search would have to estimate in full is larger than the limit."""


def _at_most(rule_sets, limit: int, what: str) -> list[Rules]:
    out = list(itertools.islice(rule_sets, limit + 1))
    if len(out) > limit:
        raise TooMany(what)
    return out


def with_weight_rules(graph, space: Space, layout: str, time_of, fits_in, compared, rule_sets, top: int, limit: int):
    """(rules, weight rules) to compare beside the rule sets: bases (rules legal for the activations
    alone), each with every legal set of weight rules. Which activations' rules are best depends
    on the weights' (GSPMD's 2D sharding splits the activations on d_model as the weights are;
    pure data parallelism wins only beside weights split ZeRO's way, so where memory is short),
    so each is searched given the other. The first bases are the `top` best rule sets and
    2 x `top` sets of rules for the activations alone: the 10 x `top` best with the weights as
    propagation lays them out, ranked again each with its best of the weight rules that suit the
    3 best rule sets. Then, in turn, for the weight rules of the `top` best pairs so far that fit
    (`fits_in`: by the estimate, within the budget, and within 1.25 x it), the activations' rules
    that are best with them and fit are bases too, until none is new.
    `TooMany` where the weight rules or the activations' rules number more than `limit`."""
    weight_space = Space(graph, space.mesh_shape, part="weights")
    weight_sets = {w: WeightRules(space.rules_of(w).pairs) for w in _at_most(weight_space, limit, "weight rules")}
    activations = Space(graph, space.mesh_shape, convert_to_layout_rules(layout), part="activations")
    activation_sets = _at_most(activations, limit, "rules for the activations alone")
    best = sorted(range(len(rule_sets)), key=lambda i: compared[i].step_s)[:top]
    suiting: list[LayoutRules] = [LayoutRules()]
    for i in best[:3]:
        w = min(weight_sets.values(), key=lambda w: time_of(rule_sets[i], w)[0])
        if w not in suiting:
            suiting.append(w)
    ranked = sorted(activation_sets, key=lambda a: time_of(a, LayoutRules())[0])[: 10 * top]
    ranked.sort(key=lambda a: min(time_of(a, w)[0] for w in suiting))
    pairs: dict[tuple[Rules, WeightRules], float] = {}
    bases: list[Rules] = []
    new = list(dict.fromkeys([*(rule_sets[i] for i in best), *ranked[: 2 * top]]))
    while new:
        bases += new
        for a in new:
            same = tuple((d, ms) for d, ms in a if d in weight_space.sizes)  # (a's own, already costed)
            pairs.update(
                {(a, w): time_of(a, w)[0] for key, w in weight_sets.items() if key != same or a not in rule_sets}
            )
        new = []
        for slack in (1.0, 1.25):
            leaders = sorted((p for p in pairs if fits_in(*p, slack)), key=pairs.__getitem__)[:top]
            for w in dict.fromkeys(w for _, w in leaders):
                fitting = [a for a in activation_sets if fits_in(a, w, slack)]
                a = min(fitting, key=lambda a: time_of(a, w)[0], default=None)
                if a is not None and a not in bases and a not in new:
                    new.append(a)
    return list(pairs)


def leave_to_rules(starts: list[Candidate], graph, mesh_shape, time_of) -> list[tuple[Rules, WeightRules]]:
    """From each of `starts` (with weight rules), weight shapes left to the rules one at a time
    (`WeightRules.exempt`) while the estimate improves; each start's last step. GSPMD annotates
    the layers' weights and leaves the embedding and the norms' scales to propagation."""
    shapes = weight_shape_names(graph, mesh_shape)
    ends = []
    for c in starts:
        a, w = tuple(split_pairs(c.layout)), convert_to_weight_rules(c.weight_layout)
        t, moved = time_of(a, w)[0], False
        while True:
            trials = [(time_of(a, x)[0], x) for b, x in exemptions(a, w, shapes) if b == a]
            if not trials or min(trials, key=lambda tr: tr[0])[0] >= t:
                break
            t, w = min(trials, key=lambda tr: tr[0])
            moved = True
        if moved and (a, w) not in ends:
            ends.append((a, w))
    return ends


def weight_shape_names(graph, mesh_shape) -> list[frozenset]:
    return sorted({frozenset(n) for n in Space(graph, mesh_shape, part="weights").shapes if n}, key=sorted)


def exemptions(a: Rules, w: WeightRules, shapes: list[frozenset]):
    """(rules, weight rules) with one more weight shape left to the rules; where the rules split
    two of its dims over one mesh dim, with the rule of each of those dims dropped in turn. The
    weight rules keep only the rules of dims some weight shape they still lay out has (one that
    splits nothing would list the same layout twice)."""
    for s in shapes:
        if s in w.exempt:
            continue
        live = {d for shape in shapes if shape != s and shape not in w.exempt for d in shape}
        exempt = WeightRules([(d, m) for d, m in w.pairs if d in live], w.exempt | {s})
        by_mesh: dict[str, list[str]] = {}
        for d, ms in a:
            for m in ms:
                if d in s:
                    by_mesh.setdefault(m, []).append(d)
        clashing = sorted({d for ds in by_mesh.values() if len(ds) > 1 for d in ds})
        if not clashing:
            yield a, exempt
        for d in clashing:
            if all(len(ds) < 2 or d in ds for ds in by_mesh.values()):
                yield tuple((e, ms) for e, ms in a if e != d), exempt
