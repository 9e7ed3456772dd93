"""Dimension names for a jaxpr's array axes, by a union-find over the axes its equations tie.

Every axis of every variable is a node; each equation unites the axes that share a role
(`roles`). A tensor's dims must have distinct names, so a union that would put two axes of one
variable into one class is refused (x @ x.T, attention's query and key lengths): the equation
then renames an operand where it is used (`emit`), as Mesh-TensorFlow's `memory_length` does.
A class takes its name from the first argument axis in it (`params/w1[1]`: axis 1 of that
argument), else `d<k>` in order of appearance.
"""

from __future__ import annotations

import dataclasses

from meshax.core.shape import Dimension, Shape
from meshax.jaxpr.flatten import Flat, is_var
from meshax.jaxpr.roles import loop_ties, rank, roles


@dataclasses.dataclass
class DimInfo:
    """What a name stands for: its size, where it first appears and the array axes it names."""

    name: str
    size: int
    source: str
    axes: list[str]


class Names:
    """name(var, axis) and shape(var) for every variable of a flattened jaxpr."""

    def __init__(self, flat: Flat, arg_paths: dict):
        self._parent: dict = {}
        self._vars: dict = {}  # root -> the variables with an axis in its class
        self.refused = 0  # unions refused: each is a rename where an operand is used
        where: dict = {}  # node -> a description of the axis
        for v, path in arg_paths.items():
            for i in range(rank(v)):
                self._add((v, i))
                where[(v, i)] = (f"{path}[{i}]", "argument")
        self._visit(flat, where)
        self._names: dict = {}  # root -> name
        self.dims: dict[str, DimInfo] = {}
        count = 0
        for node, (text, source) in where.items():  # arguments first: their names win
            root = self._find(node)
            if root not in self._names:
                v, i = node
                if source == "argument":
                    name = text
                else:
                    name, count = f"d{count}", count + 1
                self._names[root] = name
                self.dims[name] = DimInfo(name, int(v.aval.shape[i]), source, [])
            info = self.dims[self._names[root]]
            if len(info.axes) < 6:
                info.axes.append(text if source in ("argument", "constant") else f"{text} ({source})")

    def _visit(self, flat: Flat, where: dict) -> None:
        """Unite the axes each equation ties (a loop's body and condition and a cond's branches included,
        and the axes they tie across their boundary)."""
        for e in flat.eqns:
            for v in e.outs:
                if is_var(v):
                    for i in range(rank(v)):
                        self._add((v, i))
                        where.setdefault((v, i), (f"{e.name} output axis {i}", e.source))
            in_roles, out_roles = roles(e)
            groups: dict = {}
            for atoms, rs in ((e.outs, out_roles), (e.ins, in_roles)):
                for a, r in zip(atoms, rs):
                    if not is_var(a):
                        continue
                    for i, role in enumerate(r):
                        if role is not None:
                            groups.setdefault(role, []).append((a, i))
            for nodes in groups.values():
                for n in nodes:
                    self._add(n)
                for n in nodes[1:]:
                    self._union(nodes[0], n)
            if (e.body is not None or e.branches) and not e.replicated:
                for sub, ties in loop_ties(e):
                    for v in sub.invars:
                        for i in range(rank(v)):
                            self._add((v, i))
                            where.setdefault((v, i), (f"a loop variable's axis {i}", e.source))
                    self._visit(sub, where)
                    for a, i, b, k in ties:
                        if is_var(a) and is_var(b):
                            self._add((a, i))
                            self._add((b, k))
                            self._union((a, i), (b, k))
        for v in flat.consts:
            for i in range(rank(v)):
                self._add((v, i))
                where.setdefault((v, i), (f"a constant's axis {i}", "constant"))

    def _add(self, node) -> None:
        if node not in self._parent:
            self._parent[node] = node
            self._vars[node] = {node[0]}

    def _find(self, node):
        root = node
        while self._parent[root] != root:
            root = self._parent[root]
        while self._parent[node] != root:
            self._parent[node], node = root, self._parent[node]
        return root

    def _union(self, a, b) -> None:
        ra, rb = self._find(a), self._find(b)
        if ra == rb:
            return
        if self._vars[ra] & self._vars[rb]:  # one variable would have two axes of one name
            self.refused += 1
            return
        if len(self._vars[ra]) < len(self._vars[rb]):
            ra, rb = rb, ra
        self._parent[rb] = ra
        self._vars[ra] |= self._vars.pop(rb)

    def name(self, var, axis: int) -> str:
        return self._names[self._find((var, axis))]

    def shape(self, var) -> Shape:
        return Shape([Dimension(self.name(var, i), int(n)) for i, n in enumerate(var.aval.shape)])
