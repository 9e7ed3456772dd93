"""The legal layout rule sets of a graph on a mesh: what the search chooses among.

A rule set maps each tensor dim name to the mesh dims that split it (Mesh-TensorFlow's form,
several mesh dims major to minor in mesh order). It is legal when every split divides its dim
(no padding) and no tensor of the graph has two dims split over the same mesh dim. Layers that
repeat share their dim names, so they share one decision. Rules the user pinned are kept.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping

from meshax.core.errors import LayoutError
from meshax.core.graph import Graph
from meshax.core.shape import Shape
from meshax.layout.plan import weight_shapes
from meshax.layout.rules import LayoutRules

Rules = tuple[tuple[str, tuple[str, ...]], ...]  # ((tensor dim, mesh dims), ...) in dim-name order


def rules_string(rules: Rules) -> str:
    """The rule set as `meshax --layout` takes it ("" when nothing is split)."""
    return ";".join(f"{d}:{m}" for d, ms in rules for m in ms)


class Space:
    """The graph's dim names, their sizes, which of them share a tensor, and the options of each.
    `part`: "all" tensors (Mesh-TensorFlow's rules), only the "weights" (weight-shaped tensors,
    `layout.plan.weight_shapes`: the space of weight rules, `MeshImpl(weight_layout=...)`), or
    only the "activations" (the rest: rules beside weight rules of their own)."""

    def __init__(self, graph: Graph, mesh_shape: Shape, pinned: LayoutRules | None = None, part: str = "all"):
        self.mesh_shape = mesh_shape
        self.sizes: dict[str, int] = {}
        self.shapes: dict[tuple[str, ...], Shape] = {}
        weight_shaped = weight_shapes(graph.operations)
        for op in graph.operations:
            for t in op.outputs:
                if part != "all" and (frozenset(t.shape.dimension_names) in weight_shaped) != (part == "weights"):
                    continue
                self.shapes.setdefault(tuple(t.shape.dimension_names), t.shape)
                for d in t.shape:
                    self.sizes.setdefault(d.name, d.size)
        self.neighbours: dict[str, set[str]] = {d: set() for d in self.sizes}
        for names in self.shapes:
            for a, b in itertools.permutations(names, 2):
                self.neighbours[a].add(b)
        pinned = pinned or LayoutRules()
        self.pinned = {name: tuple(pinned.mesh_dims_for(name)) for name in pinned.tensor_dim_names}
        self._check_pinned()
        mesh = [(d.name, d.size) for d in mesh_shape]
        self.options: dict[str, list[tuple[str, ...]]] = {}
        for name, size in sorted(self.sizes.items()):
            if name in self.pinned:
                self.options[name] = [self.pinned[name]]
                continue
            opts: list[tuple[str, ...]] = [()]
            for r in range(1, len(mesh) + 1):
                for combo in itertools.combinations(mesh, r):
                    k = math.prod(s for _, s in combo)
                    if k > 1 and size % k == 0 and all(s > 1 for _, s in combo):
                        opts.append(tuple(m for m, _ in combo))
            self.options[name] = opts

    def _check_pinned(self) -> None:
        for d, ms in self.pinned.items():
            for m in ms:
                if m not in self.mesh_shape:
                    raise LayoutError(
                        f"pinned rule {d}:{m} names mesh dim {m!r}, but the mesh has only "
                        f"{self.mesh_shape.dimension_names}"
                    )
            if d not in self.sizes:
                raise LayoutError(f"pinned rule {d}:{','.join(ms)}: no tensor of the graph has a dim {d!r}")
            k = math.prod(self.mesh_shape.get_dim_by_name(m).size for m in ms)
            if self.sizes[d] % k:
                raise LayoutError(
                    f"pinned rule {d}:{','.join(ms)} splits {d} (size {self.sizes[d]}) into {k} parts, which does "
                    "not divide it: the search considers only even splits; pin another mesh dim or none"
                )
        for names, shape in self.shapes.items():
            used: dict[str, str] = {}
            for d in names:
                for m in self.pinned.get(d, ()):
                    if m in used:
                        raise LayoutError(
                            f"pinned rules split both {used[m]} and {d} of the tensors shaped [{shape}] over mesh dim "
                            f"{m!r}: no legal layout has that; pin one of them elsewhere"
                        )
                    used[m] = d

    def __iter__(self) -> Iterator[Rules]:
        """Every legal rule set, in a fixed order (deterministic), by backtracking over dim names."""
        names = sorted(self.sizes, key=lambda d: (-len(self.neighbours[d]), d))
        chosen: dict[str, tuple[str, ...]] = {}

        def extend(i: int) -> Iterator[Rules]:
            if i == len(names):
                yield tuple(sorted((d, ms) for d, ms in chosen.items() if ms))
                return
            d = names[i]
            for opt in self.options[d]:
                if any(set(opt) & set(chosen.get(n, ())) for n in self.neighbours[d]):  # (`clashes`, inline: hot)
                    continue
                chosen[d] = opt
                yield from extend(i + 1)
                del chosen[d]

        yield from extend(0)

    def clashes(self, chosen: Mapping[str, tuple[str, ...]], d: str, opt: tuple[str, ...]) -> bool:
        """Whether rule `opt` for d shares a mesh dim with the `chosen` rule of a dim d shares a
        tensor with."""
        return any(set(opt) & set(chosen.get(n, ())) for n in self.neighbours[d])

    def legal(self, chosen: Mapping[str, tuple[str, ...]], d: str) -> bool:
        """Whether d's `chosen` rule is one of its options and clashes with no other chosen rule."""
        opt = chosen.get(d, ())
        return opt in self.options[d] and not self.clashes(chosen, d, opt)

    def rules_of(self, rules: Mapping[str, tuple[str, ...]] | Rules) -> LayoutRules:
        items = rules.items() if isinstance(rules, Mapping) else rules
        return LayoutRules([(d, m) for d, ms in items for m in ms])
