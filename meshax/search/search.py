"""`search_layout`: the layout rules that minimise a step's predicted time under a memory budget.

Candidates are the legal rule sets of the graph on the mesh (`space.Space`); each is costed by
the cost model (`cost.predict`) from its StepCost. Where the space is small, every candidate is
traced exactly (`Lowering.trace_step`: the counters of the program that would run); where it is
not, every candidate is costed by the fast estimate (`estimate.Estimator`) and the best ones that
fit are re-scored exactly, so what is reported is always exact. Whether a layout fits is decided
by its plan's memory (exact, and cheap: no trace). A graph with annotations is costed exactly,
candidate by candidate (the estimate lays tensors out by the rules, not by annotations).
Deterministic: candidates come in a fixed order, and ties go to the earlier one.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
from collections.abc import Sequence

from meshax.core.errors import ConfigError, LayoutError, as_flag
from meshax.core.graph import Tensor
from meshax.layout import LayoutRules, convert_to_layout_rules, convert_to_mesh_shape, convert_to_weight_rules
from meshax.lower.lowering import Lowering
from meshax.lower.report import short_source
from meshax.search.cost import StepCost, predict
from meshax.search.devices import Device, load_device
from meshax.search.program import exact_cost, model_of
from meshax.search.result import (
    Candidate,
    SearchResult,
    as_rule_set,
    budget_bytes,
    counted,
    make_candidate,
    mesh_text,
    rule_count,
    split_pairs,
)
from meshax.search.space import Rules, Space, rules_string
from meshax.search.weights import TooMany, exemptions, leave_to_rules, weight_shape_names, with_weight_rules


def search_layout(
    graph,
    mesh_shape,
    outputs: Sequence[Tensor] = (),
    updates: Sequence = (),
    *,
    layout: str = "",
    memory_budget: str | int | None = None,
    device: str | Device | None = None,
    top: int = 5,
    exact_limit: int = 64,
    enumerate_limit: int = 200_000,
    rescore_margin: float = 0.1,
    baseline: Candidate | str | None = None,
    search_weights: bool = False,
    optimizer=None,
) -> SearchResult:
    """The layout rules for `graph` on `mesh_shape` that minimise the predicted step time of the
    program computing `outputs` and applying `updates`, within `memory_budget` per device
    (default: the device's memory). `graph` may be a training task (`meshax.train` tasks): its
    loss and `optimizer`'s updates (default Adam's) are the program, and a deep one is costed at
    small depths and extrapolated, exactly (`program.Extrapolated`). `layout`: rules the user
    pins (kept in every candidate). `device`: a known device name or a `meshax calibrate` file
    (default: the CPU's entry, or $MESHAX_DEVICE). Spaces of at most `exact_limit` rule sets are
    costed exactly; larger ones by the estimate, and the best that fit re-costed exactly: `top`
    of them (at least 5, however few are listed), and on while their estimate is within
    `rescore_margin` of the best one's (at most twice as many). Spaces of more than
    `enumerate_limit` rule sets (a U-Net on a 2 x 2 x 2 mesh has 7.5 million: hours to estimate)
    are searched locally (`_local_search`), which finds a good layout, not always the best.
    `baseline`: the user's own layout (rules, or a Candidate from `evaluate`), shown beside.
    `search_weights`: also give the weight-shaped tensors rules of their own (weights, their
    gradients and optimizer state split one way, activations another: GSPMD's 2D sharding,
    ZeRO), for each of the best rule sets (as many) every legal set of weight rules, by the estimate;
    then weight shapes left to the rules (`WeightRules`: "... except [vocab,d_model]") where that
    makes the best ones faster."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:  # (0 listed nothing, and had no best)
        raise ConfigError(f"search_layout(top={top!r}): give how many layouts to list, 1 or more")
    start, search_weights = time.perf_counter(), as_flag(search_weights, "search_layout: search_weights")
    breadth = max(top, 5)  # (how many the search looks at closely: listing fewer changes nothing)
    mesh_shape = convert_to_mesh_shape(mesh_shape)
    model = model_of(graph, outputs, updates, optimizer)
    if not model.base.outputs and not model.base.updates:
        raise ConfigError("search_layout needs the program to cost: give its outputs (the loss) and updates")
    dev = load_device(device)
    budget = budget_bytes(memory_budget, dev)
    program = model.on(mesh_shape)
    graph = program.graph
    space = Space(graph, mesh_shape, convert_to_layout_rules(layout))
    rule_sets: list[Rules] = list(itertools.islice(space, enumerate_limit + 1))
    every = len(rule_sets) <= enumerate_limit
    if not every:  # (too many to estimate each: a local search from the replicated layout)
        rule_sets = _local_search(space, program.estimator, dev, mesh_shape, budget)

    def exact(rules: Rules, weights: str | None = None) -> Candidate:
        return make_candidate(rules_string(rules), program.exact(rules, weights), dev, mesh_shape, weights)

    annotated = any(hasattr(op, "annotation") for op in graph.operations)
    if (len(rule_sets) <= exact_limit or annotated) and not search_weights:
        compared = [exact(r) for r in rule_sets]
        method = "every one traced exactly"
        exact_ones: list[Candidate] = compared
    else:
        estimator = program.estimator
        compared = [make_candidate(rules_string(r), estimator(space.rules_of(r)), dev, mesh_shape) for r in rule_sets]
        choices: list[tuple[Rules, str | None]] = [(r, None) for r in rule_sets]

        @functools.cache
        def time_of(a: Rules, w: LayoutRules) -> tuple[float, StepCost]:
            cost = estimator(space.rules_of(a), w)
            return predict(cost, dev, mesh_shape).step_s, cost

        def fits_in(a: Rules, w: LayoutRules, slack=1.0) -> bool:  # (by the estimate: see the plan check below)
            return time_of(a, w)[1].memory_bytes <= slack * budget

        skipped = ""
        if search_weights:
            try:
                for a, w in with_weight_rules(
                    graph, space, layout, time_of, fits_in, compared, rule_sets, breadth, enumerate_limit
                ):
                    compared.append(make_candidate(rules_string(a), time_of(a, w)[1], dev, mesh_shape, str(w)))
                    choices.append((a, str(w)))
            except TooMany as e:
                skipped = f"; weight rules not searched: more than {enumerate_limit} legal sets of {e} (pin rules)"
        # Re-score in the estimate's order. The estimate lays tensors out by the rules, splits
        # renamed dims as the dims they rename and carries splits between weights and activations;
        # propagation completes the layouts its own way, so a layout's true memory (its plan's,
        # cheap: no trace) differs, by a few percent, mostly down: check it before tracing (for the
        # layouts estimated to need at most 1.25 x the budget; the rest are taken not to fit).
        # Enough: `breadth` of them, and then on while the estimate is within `rescore_margin` of
        # the estimate of the best found (the estimate is not exact near the top), up to 2 x breadth.
        exact_ones = []
        estimated: list[float] = []  # (the estimate of each traced in this loop)
        programs: dict[tuple, int] = {}  # (a program's layouts: its index in exact_ones)

        def trace(rules: Rules, weights: str | None) -> bool:
            """Trace a layout that fits and is not a program traced already (rules and weight
            rules spelling the same layouts); where it is one, keep the shorter spelling."""
            if sum(program.memory(rules, weights).values()) > budget:
                return False
            layouts = program.layouts(rules, weights)
            if layouts in programs:
                i = programs[layouts]
                if rule_count(rules, weights) < rule_count(
                    as_rule_set(exact_ones[i].layout), exact_ones[i].weight_layout
                ):
                    exact_ones[i] = make_candidate(rules_string(rules), exact_ones[i].cost, dev, mesh_shape, weights)
                return False
            programs[layouts] = len(exact_ones)
            exact_ones.append(exact(rules, weights))
            return True

        for c, (rules, weights) in sorted(zip(compared, choices), key=lambda cr: cr[0].step_s):
            if len(exact_ones) >= breadth and (
                len(exact_ones) >= 2 * breadth
                or c.step_s
                > (1 + rescore_margin) * estimated[min(range(len(estimated)), key=lambda i: exact_ones[i].step_s)]
            ):
                break
            if c.memory_bytes <= 1.25 * budget and trace(rules, weights):
                estimated.append(c.step_s)
        if search_weights:  # the best that fit, improved by leaving some weight shapes to the rules
            starts = [c for c in sorted(exact_ones, key=lambda c: c.step_s)[:breadth] if c.weight_layout is not None]
            for a, w in leave_to_rules(starts, graph, mesh_shape, time_of):
                compared.append(make_candidate(rules_string(a), time_of(a, w)[1], dev, mesh_shape, str(w)))
                trace(a, str(w))
            # and around the best, the moves that drop a rule too, traced exactly (the estimate
            # is least sure where the activations' rules change)
            best = min(
                (c for c in exact_ones if c.weight_layout is not None and c.memory_bytes <= budget),
                key=lambda c: c.step_s,
                default=None,
            )
            if best is not None:
                a, w = tuple(split_pairs(best.layout)), convert_to_weight_rules(best.weight_layout)
                for b, x in exemptions(a, w, weight_shape_names(graph, mesh_shape)):
                    pins_kept = all(dict(b).get(d) == ms for d, ms in space.pinned.items() if ms)
                    if b != a and pins_kept and trace(b, str(x)):
                        compared.append(exact_ones[-1])
        with_weights = f" ({len(compared) - len(rule_sets)} with weight rules of their own)" if search_weights else ""
        how = "all estimated" if every else f"a local search estimated {len(rule_sets)} of them"
        method = f"{how}{with_weights}, the best {len(exact_ones)} that fit traced exactly{skipped}"
    method += model.note
    fits = [c for c in exact_ones if c.memory_bytes <= budget]
    if not fits:
        _no_fit(compared, budget, mesh_shape, program)
    ranked = sorted(fits, key=lambda c: c.step_s)[:top]  # (a stable sort: ties keep the fixed order)
    if isinstance(baseline, str):
        baseline = evaluate(model, mesh=mesh_shape, layout=baseline, device=dev)
    legal = len(rule_sets) if every else enumerate_limit
    seconds = time.perf_counter() - start
    return SearchResult(
        ranked,
        baseline,
        legal,
        method,
        seconds,
        budget,
        dev,
        compared,
        every=every,
        optimizer=model.optimizer,
        task=model.task,
    )


def _local_search(
    space: Space, estimator, dev: Device, mesh_shape, budget: int, beam: int = 8, patience: int = 3
) -> list[Rules]:
    """The rule sets a beam search estimates, for spaces too large to estimate each. From the
    replicated layout (pinned rules kept), each step makes every move from each rule set of the
    beam: one dim's rule changed (to any legal option, none included), two split dims' rules
    swapped, the mesh dims renamed in every rule. The next beam is the `beam` best rule sets not
    yet moved from (those that fit the memory budget first, then by predicted step time), so it
    walks on through worse ones; it stops after `patience` steps without a better one. Returns
    every rule set it estimated."""
    names, mesh_dims = sorted(space.options), list(mesh_shape.dimension_names)
    cost: dict[Rules, tuple[bool, float]] = {}

    def costed(chosen: dict[str, tuple[str, ...]]) -> Rules:
        rules = tuple(sorted((d, ms) for d, ms in chosen.items() if ms))
        if rules not in cost:
            c = estimator(space.rules_of(rules))
            cost[rules] = (c.memory_bytes > budget, predict(c, dev, mesh_shape).step_s)
        return rules

    frontier = [costed({d: space.options[d][0] for d in names})]  # (a pinned dim's one option, else none)
    expanded: set[Rules] = set()
    best, stale = cost[frontier[0]], 0
    while stale < patience:
        found: set[Rules] = set()
        for rules in frontier:
            expanded.add(rules)
            chosen = dict(rules)
            for d in names:
                for opt in space.options[d]:
                    if opt != chosen.get(d, ()) and not space.clashes(chosen, d, opt):
                        found.add(costed({**chosen, d: opt}))
            for d, e in itertools.combinations(sorted(chosen), 2):  # (and two split dims' rules swapped)
                swapped = {**chosen, d: chosen[e], e: chosen[d]}
                if all(space.legal(swapped, x) for x in (d, e)):
                    found.add(costed(swapped))
            for order in itertools.permutations(mesh_dims):  # (and the mesh dims renamed in every rule)
                renamed = {
                    d: tuple(sorted((order[mesh_dims.index(m)] for m in ms), key=mesh_dims.index))
                    for d, ms in chosen.items()
                }
                if renamed != chosen and all(space.legal(renamed, x) for x in renamed):
                    found.add(costed(renamed))
        frontier = sorted(found - expanded, key=lambda r: (*cost[r], r))[:beam]
        if not frontier:
            break
        stale = 0 if cost[frontier[0]] < best else stale + 1
        best = min(best, cost[frontier[0]])
    return list(cost)


MESH_NAMES = {1: ("all",), 2: ("rows", "cols"), 3: ("planes", "rows", "cols")}


def mesh_shapes(devices: int, max_dims: int = 3) -> list[str]:
    """Every factorisation of `devices` into 1 to `max_dims` mesh dims of size > 1, in order
    (2 x 4 and 4 x 2 are different meshes), named by `MESH_NAMES`."""
    out: list[str] = []

    def factor(rest: int, sizes: list[int]) -> None:
        if rest == 1 and sizes:
            out.append(";".join(f"{n}:{s}" for n, s in zip(MESH_NAMES[len(sizes)], sizes)))
        if len(sizes) == max_dims:
            return
        for k in range(2, rest + 1):
            if rest % k == 0:
                factor(rest // k, [*sizes, k])

    factor(devices, [])
    return out


def search_mesh_and_layout(
    graph, devices: int, outputs: Sequence[Tensor] = (), updates: Sequence = (), **kw
) -> SearchResult:
    """`search_layout` over every mesh of `devices` devices (`mesh_shapes`): the best layouts of
    all of them together. Pinned rules (`layout=`) keep to the meshes whose dims they name."""
    start = time.perf_counter()
    model = model_of(graph, outputs, updates, kw.pop("optimizer", None))  # (built once, for every mesh)
    pinned = convert_to_layout_rules(kw.get("layout", ""))
    meshes = mesh_shapes(devices) or [f"all:{devices}"]  # (one device: no dims of size > 1, one mesh)
    names_of = {mesh: convert_to_mesh_shape(mesh).dimension_names for mesh in meshes}
    for d in pinned.tensor_dim_names:
        for m in pinned.mesh_dims_for(d):
            if not any(m in names for names in names_of.values()):
                raise LayoutError(
                    f"pinned rule {d}:{m} names mesh dim {m!r}, which no mesh of {devices} devices searched has "
                    f"({', '.join(meshes)}): pin over one of their dims"
                )
    named = {m for d in pinned.tensor_dim_names for m in pinned.mesh_dims_for(d)}
    eligible = [mesh for mesh in meshes if named <= set(names_of[mesh])]
    if not eligible:
        raise LayoutError(
            f"the pinned rules name mesh dims {', '.join(sorted(named))}, which no one mesh of {devices} devices "
            f"searched has together ({', '.join(meshes)}): pin over the dims of one of them"
        )
    results = []
    for mesh in eligible:
        with contextlib.suppress(LayoutError):  # (no layout fits this mesh; another may)
            results.append(search_layout(model, mesh, **kw))
    if not results:
        raise LayoutError(
            f"no mesh of {devices} devices ({', '.join(meshes)}) has a layout that fits "
            f"(each searched alone says why: mx.search_layout(..., mesh))"
        )
    top = kw.get("top", 5)
    ranked = sorted((c for r in results for c in r.ranked), key=lambda c: c.step_s)[:top]
    first = results[0]
    if len(results) == 1:
        method = f"1 mesh searched, {first.method}"
    elif len({r.method for r in results}) == 1:
        method = f"{len(results)} meshes searched; on each, {first.method}"
    else:  # (say how each was searched: some spaces are searched locally, others in full)
        method = f"{counted(len(results), 'mesh', 'meshes')} searched: " + "; ".join(
            f"{r.ranked[0].mesh}: {r.method}" for r in results
        )
    return SearchResult(
        ranked,
        first.baseline,
        sum(r.legal for r in results),
        method,
        time.perf_counter() - start,
        first.memory_budget,
        first.device,
        [c for r in results for c in r.compared],
        len(results),
        every=all(r.every for r in results),
        optimizer=model.optimizer,
        task=model.task,
    )


def evaluate(
    what,
    outputs: Sequence[Tensor] = (),
    updates: Sequence = (),
    device=None,
    label: str | None = None,
    *,
    mesh=None,
    layout: str = "",
    weight_layout: str | None = None,
    optimizer=None,
) -> Candidate:
    """The exact Candidate of a layout, to compare with; `label` names it in the report (default:
    its rules). `what`: a Lowering, costed under its own layout (rules, weight rules and
    annotations) with `outputs` and `updates`; or, as `search_layout` takes it, a training task
    (with `optimizer`'s updates) or a graph with `outputs` and `updates`, costed on `mesh` under
    `layout` and `weight_layout` as the search costs its candidates: a deep model at two small
    depths, extrapolated exactly (and on the search's own Model, `program.model_of`, a rule set is
    traced once for both)."""
    dev = load_device(device)
    if isinstance(what, Lowering):
        impl = what.impl
        weights = None if impl.weight_rules is None else str(impl.weight_rules)
        candidate = make_candidate(str(impl.layout_rules), exact_cost(what, outputs, updates), dev, impl.shape, weights)
    else:
        if mesh is None:
            raise ConfigError("evaluate(task, ...) needs the mesh to cost it on: evaluate(task, mesh=..., layout=...)")
        mesh_shape = convert_to_mesh_shape(mesh)
        weights = None if weight_layout is None else str(convert_to_weight_rules(weight_layout))
        program = model_of(what, outputs, updates, optimizer).on(mesh_shape)
        cost = program.exact(as_rule_set(layout), weights)
        candidate = make_candidate(str(convert_to_layout_rules(layout)), cost, dev, mesh_shape, weights)
    candidate.label = label
    return candidate


def _no_fit(compared: list[Candidate], budget: int, mesh_shape, program) -> None:
    """Raise the LayoutError that says why nothing fits: the model's state, or its activations."""
    from meshax.lower.report import _human

    def state(memory: dict[str, int]) -> int:
        return sum(memory[k] for k in ("parameters", "gradients", "optimizer_state"))

    def memory(c: Candidate) -> dict[str, int]:  # (its plan's, by which the search found it does not fit)
        return c.cost.memory if c.cost.exact else program.memory(tuple(split_pairs(c.layout)), c.weight_layout)

    mesh = mesh_text(mesh_shape)
    leanest = min(compared, key=lambda c: state(c.cost.memory))
    if state(memory(leanest)) > budget:
        least, held = leanest, state(memory(leanest))
        cause = (
            f"the mesh {mesh} cannot hold the model: split as finely as any legal layout allows "
            f"({least.layout or 'replicated'}), parameters, their gradients and optimizer state alone take "
            f"{_human(held)}B per device, {_human(held - budget)}B over the budget; use more "
            "devices or a larger budget"
        )
    else:
        least = min(compared, key=lambda c: c.memory_bytes)
        need = memory(least)
        total = sum(need.values())
        parts = ", ".join(f"{k.replace('_', ' ')} {_human(v)}B" for k, v in need.items())
        cause = (
            f"the layout needing least memory ({least.layout or 'replicated'}) still needs "
            f"{_human(total)}B per device ({parts}), {_human(total - budget)}B over "
            "the budget; its activations do not fit: use a smaller batch or sequence, more devices, or a larger budget"
        )
    lowering = program.lowering(tuple(split_pairs(least.layout)), least.weight_layout)
    tensors = [t for op in lowering.graph.operations for t in op.outputs]
    sizes = sorted((-lowering.slice_bytes(t), i) for i, t in enumerate(tensors))[:3]  # (ties: the first made)
    largest = ", ".join(f"{_described(tensors[i])} {_human(-n)}B" for n, i in sizes)
    raise LayoutError(
        f"no legal layout fits a memory budget of {_human(budget)}B per device: {cause} (largest per device "
        f"there: {largest})"
    )


def _described(t) -> str:
    """A tensor as a user finds it: its name, dims and the source line that made it ("relu_3
    [batch, length, d_ff] at transformer.py:354": an op's own name is often a generated one)."""
    source = getattr(t.operation, "source", "")
    at = f" at {short_source(source)}" if source else ""
    return f"{t.name} [{', '.join(t.shape.dimension_names)}]{at}"
