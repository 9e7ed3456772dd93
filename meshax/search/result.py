"""What a layout search returns: each layout costed (`Candidate`), and the ranked result
(`SearchResult`) with its table, its JSON and how each layout differs from the best."""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

from meshax.core.errors import ConfigError
from meshax.layout import convert_to_layout_rules, convert_to_weight_rules
from meshax.search.cost import StepCost, predict
from meshax.search.devices import Device
from meshax.search.space import Rules

if TYPE_CHECKING:
    from meshax.optimize import Optimizer


@dataclasses.dataclass
class Candidate:
    """One layout: its rules (as `--layout` takes them), its StepCost and predicted time."""

    layout: str
    cost: StepCost
    step_s: float
    compute_s: float
    comm_s: dict[str, float]
    by_link: dict[tuple[str, tuple[str, ...]], float]  # (kind, mesh dims) -> seconds
    mesh: str = ""  # the mesh it is for, as --mesh takes it
    weight_layout: str | None = None  # rules of the weight-shaped tensors, as --weight-layout takes them
    label: str | None = None  # what the report calls it, where not its rules (annotations, say)
    measured_s: float | None = None  # its step's median time where run (`measure_layouts`)

    @property
    def memory_bytes(self) -> int:
        return self.cost.memory_bytes

    @property
    def name(self) -> str:
        """The layout as one line: its label, or its rules and its weight rules where it has its own."""
        if self.label:
            return self.label
        text = self.layout or "(replicated)"
        # (weight rules of none leave the weights to propagation, which splits them where the rules reach them)
        return text if self.weight_layout is None else f"{text} | weights {self.weight_layout or '(propagated)'}"


def make_candidate(layout: str, cost: StepCost, device: Device, mesh_shape, weight_layout=None) -> Candidate:
    p = predict(cost, device, mesh_shape)
    return Candidate(layout, cost, p.step_s, p.compute_s, p.comm_s, p.by_link, mesh_text(mesh_shape), weight_layout)


def _as_dict(c: Candidate) -> dict:
    return {
        "mesh": c.mesh,
        "layout": c.layout,
        "weight_layout": c.weight_layout,
        "label": c.label,
        "step_ms": c.step_s * 1e3,
        "measured_ms": None if c.measured_s is None else c.measured_s * 1e3,
        "compute_ms": c.compute_s * 1e3,
        "communication_ms": {k: v * 1e3 for k, v in c.comm_s.items()},
        "memory_bytes": c.memory_bytes,
        "memory": dict(c.cost.memory),
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def counted(n: int, one: str, many: str = "") -> str:
    """'1 mesh', '4 meshes': n and the noun in its number."""
    return f"{n} {one if n == 1 else many or one + 's'}"


def mesh_text(mesh_shape) -> str:
    """A mesh shape as --mesh takes it: "rows:2;cols:4"."""
    return ";".join(f"{d.name}:{d.size}" for d in mesh_shape)


def parse_bytes(text: str | int | float | None) -> int | None:
    """A memory size: bytes as a number, or "16GB", "1.5 TB" (powers of 1000, as the reports
    print sizes), "512MiB", "16GiB" (powers of 1024)."""
    if text is None or isinstance(text, int | float):
        return None if text is None else int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)(B?)\s*", text, re.IGNORECASE)
    if not m or (m.group(3) and not m.group(2)):
        raise ConfigError(f"memory budget {text!r}: give a size like 16GB, 512MiB or a number of bytes")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " "))


def budget_bytes(text: str | int | float | None, device: Device) -> int:
    """The bytes per device a layout may need: `text` (`parse_bytes`), or the device's memory
    where it is None; a ConfigError for a size that is not positive."""
    budget = parse_bytes(text) if text is not None else device.memory_bytes
    if budget is None or budget <= 0:
        raise ConfigError(f"memory budget {text!r}: give a positive size, like 16GB")
    return budget


@dataclasses.dataclass
class SearchResult:
    """The best `top` layouts that fit (exactly costed, best first), the user's own layout if
    given, how many rule sets were legal, how they were costed, and how long it took."""

    ranked: list[Candidate]
    baseline: Candidate | None
    legal: int
    method: str
    seconds: float
    memory_budget: int
    device: Device
    compared: list[Candidate]  # every candidate costed (estimates where not exact), in order
    meshes: int = 1  # how many meshes were searched (`search_mesh_and_layout`)
    every: bool = True  # whether every legal rule set was costed (else `legal` is a lower bound)
    measured: str = ""  # how the best were run and timed, where they were (`measure_layouts`)
    optimizer: Optimizer | None = None  # the one the steps costed run (None: Adam's, or a graph's own updates)
    task: object = None  # the training task searched (None: a graph), whose steps `measure_layouts` runs

    @property
    def best(self) -> Candidate:
        return self.ranked[0]

    @property
    def layout(self) -> str:
        return self.best.layout

    def format(self) -> str:
        from meshax.lower.report import _human

        kinds = [
            k
            for k in ("allreduce", "allgather", "reduce_scatter", "alltoall", "permute")
            if any(c.comm_s[k] for c in [*self.ranked, *([self.baseline] if self.baseline else [])])
        ]
        rows = [(str(i + 1), c) for i, c in enumerate(self.ranked)]
        if self.baseline is not None:
            rows.append(("yours", self.baseline))
        meshes = self.meshes > 1 or len({c.mesh for _, c in rows}) > 1  # (say which mesh each row is for)

        mesh_width = max(len(str(c.mesh)) for _, c in rows) if meshes else 0

        def name(c: Candidate) -> str:  # (the mesh in a column of its own, the layout after it)
            return (f"{c.mesh!s:<{mesh_width}}  " if meshes else "") + c.name

        width = max(len(name(c)) for _, c in rows)
        timed = [("measured ms", 13, [_ms(c.measured_s) for _, c in rows])] if self.measured else []
        columns = [  # (header, width at least, each row's cell)
            ("step ms", 10, [f"{c.step_s * 1e3:.3f}" for _, c in rows]),
            *timed,
            ("compute", 10, [f"{c.compute_s * 1e3:.3f}" for _, c in rows]),
            *((k, 15, [f"{c.comm_s[k] * 1e3:.3f}" for _, c in rows]) for k in kinds),
            ("memory", 10, [_human(c.memory_bytes) + "B" for _, c in rows]),
        ]
        widths = [max(least, 2 + max(map(len, cells))) for _, least, cells in columns]
        title = f"{'mesh':<{mesh_width}}  layout" if meshes else "layout"
        head = f"{'#':<6}{title:<{width + 2}}" + "".join(f"{h:>{w}}" for (h, _, _), w in zip(columns, widths))
        lines = [
            f"layout search: {'' if self.every else 'more than '}{counted(self.legal, 'legal rule set')}, "
            f"{self.method}, "
            f"{self.seconds:.1f} s; "
            f"device {self.device.name}; memory budget {_human(self.memory_budget)}B per device",
            *([f"{self.measured}; ranked by it"] if self.measured else []),
            head,
        ]
        for i, (tag, c) in enumerate(rows):
            cells = "".join(f"{cells[i]:>{w}}" for (_, _, cells), w in zip(columns, widths))
            lines.append(f"{tag:<6}{name(c):<{width + 2}}{cells}")
        lines.append("")
        for tag, c in rows[1:]:
            lines.append(f"{tag}: {self.why(c)}")
        return "\n".join(lines) + "\n"

    def as_dict(self) -> dict:
        """The result as JSON data (`meshax plan --search --json`): how the layouts were searched
        (and measured), and each one listed, best first, and the user's, with its predicted step
        and its parts in ms, its measured step (None where not run) and its memory per device."""
        return {
            "legal": self.legal,
            "every": self.every,
            "method": self.method,
            "seconds": self.seconds,
            "meshes": self.meshes,
            "device": self.device.name,
            "memory_budget_bytes": self.memory_budget,
            "measured": self.measured or None,
            "ranked": [_as_dict(c) for c in self.ranked],
            "baseline": None if self.baseline is None else _as_dict(self.baseline),
        }

    def why(self, other: Candidate) -> str:
        """How `other` differs from the best: its rules and the biggest time differences."""
        mine = dict(split_pairs(self.best.layout))
        theirs = dict(split_pairs(other.layout))
        rule_diff = [
            f"{d}: {','.join(theirs.get(d, ())) or '-'} -> {','.join(mine.get(d, ())) or '-'}"
            for d in sorted(set(mine) | set(theirs))
            if mine.get(d) != theirs.get(d)
        ]
        deltas = []
        if other.compute_s != self.best.compute_s:
            deltas.append(("compute", other.compute_s - self.best.compute_s))
        for key in set(other.by_link) | set(self.best.by_link):
            d = other.by_link.get(key, 0.0) - self.best.by_link.get(key, 0.0)
            if d:
                deltas.append((f"{key[0]} over {','.join(key[1])}", d))
        deltas.sort(key=lambda kv: -abs(kv[1]))
        said = ", ".join(f"{name} {d * 1e3:+.3f} ms" for name, d in deltas[:3])
        if other.mesh != self.best.mesh:
            rule_diff.insert(0, f"mesh {other.mesh} -> {self.best.mesh}")
        if _weight_rules(other) != _weight_rules(self.best):
            rule_diff.append(f"weights: {_weights(other)} -> {_weights(self.best)}")
        if other.label:  # (annotations, or rules beside them: the rules alone are not the layout)
            rule_diff = [f"{other.label} -> {self.best.name}"]
        changes = "; ".join(rule_diff) or "nothing"
        times = f"{other.step_s / self.best.step_s:.2f}x the best's time"
        if other.measured_s is not None and self.best.measured_s is not None:
            ratio = other.measured_s / self.best.measured_s
            times = f"measured {ratio:.2f}x the best's time (predicted {other.step_s / self.best.step_s:.2f}x)"
        return f"{times}; best changes {changes}; {said or 'same costs'}"


def _weights(c: Candidate) -> str:
    return "as the rules" if c.weight_layout is None else c.weight_layout or "(propagated)"


def _weight_rules(c: Candidate):
    """A candidate's weight rules as what they split (per dim, its mesh dims in order; the exempt
    shapes), so that the same rules written in another order are the same; None: as the rules."""
    if c.weight_layout is None:
        return None
    rules = convert_to_weight_rules(c.weight_layout)
    return dict(_by_dim(rules)), rules.exempt


def same_layout(a: Candidate, b: Candidate) -> bool:
    """Whether two candidates are one layout (the same rules and weight rules, in any order, on one mesh)."""
    if a.label or b.label or a.mesh != b.mesh:
        return a is b
    return as_rule_set(a.layout) == as_rule_set(b.layout) and _weight_rules(a) == _weight_rules(b)


def _by_dim(rules) -> list[tuple[str, tuple[str, ...]]]:
    """Each tensor dim the rules split and its mesh dims, in order."""
    return [(d, tuple(rules.mesh_dims_for(d))) for d in rules.tensor_dim_names]


def rule_count(rules: Rules, weights: str | None) -> int:
    """How many rules a layout is written with (its rules and its weight rules)."""
    return len(rules) + (0 if weights is None else len(convert_to_weight_rules(weights).pairs))


def split_pairs(layout: str) -> list[tuple[str, tuple[str, ...]]]:
    return _by_dim(convert_to_layout_rules(layout))


def as_rule_set(layout: str) -> Rules:
    """A layout as the search's rule sets are, in dim-name order (so a rule set it traced is found)."""
    return tuple(sorted(split_pairs(layout)))
