"""Layout rules and tensor layouts: which tensor dims are split over which mesh dims.

`LayoutRules` map tensor-dimension names to mesh-dimension names. Beyond Mesh-TensorFlow, a
tensor dim may be split over several mesh dims (GSPMD): repeat it, major to minor,
`"batch:rows;batch:cols"`. A `TensorLayout` is the restriction of the rules to one tensor,
with mesh dims as indices.
"""

from __future__ import annotations

from collections.abc import Iterable

from meshax.core.errors import LayoutError
from meshax.core.shape import Shape, _parse_pairs, convert_to_shape


class LayoutRules:
    """An ordered set of (tensor_dim_name, mesh_dim_name) pairs."""

    def __init__(self, pairs: Iterable[tuple[str, str]] = ()):
        seen = []
        for pair in pairs:
            if not (isinstance(pair, tuple | list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
                raise ValueError(f"bad layout rule {pair!r}: expected a (tensor_dim, mesh_dim) pair of names")
            pair = (pair[0], pair[1])
            if pair in seen:
                raise ValueError(f"layout rule {pair[0]}:{pair[1]} is given twice")
            seen.append(pair)
        self.pairs: tuple[tuple[str, str], ...] = tuple(seen)

    def mesh_dims_for(self, tensor_dim_name: str) -> list[str]:
        """Mesh dims this tensor dim is split over, major to minor (empty: not split)."""
        return [m for t, m in self.pairs if t == tensor_dim_name]

    @property
    def tensor_dim_names(self) -> list[str]:
        """The tensor dim names the rules split, each once, in order of first appearance."""
        return list(dict.fromkeys(t for t, _ in self.pairs))

    def __iter__(self):
        return iter(self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)

    def __eq__(self, other) -> bool:
        return isinstance(other, LayoutRules) and self.pairs == other.pairs

    def __hash__(self) -> int:
        return hash(self.pairs)

    def __str__(self) -> str:
        return ";".join(f"{t}:{m}" for t, m in self.pairs)

    def __repr__(self) -> str:
        return f"LayoutRules({str(self)!r})"


def convert_to_layout_rules(x) -> LayoutRules:
    """LayoutRules from LayoutRules, "batch:rows;hidden:cols", or a list of (tensor_dim, mesh_dim)."""
    if x is None:
        return LayoutRules()
    if isinstance(x, LayoutRules):
        return x
    if isinstance(x, str):
        return LayoutRules(_parse_pairs(x, what="layout", integer_values=False, example="batch:rows;hidden:cols"))
    return LayoutRules(x)


class TensorLayout:
    """Per tensor dim, the mesh axes (indices, major to minor) it is split over; () = not split."""

    __slots__ = ("axes",)

    def __init__(self, axes: Iterable):
        norm: list[tuple[int, ...]] = []
        for a in axes:
            if a is None:
                norm.append(())
            elif isinstance(a, int):
                norm.append((a,))
            else:
                norm.append(tuple(a))
        self.axes: tuple[tuple[int, ...], ...] = tuple(norm)

    @property
    def tensor_axis_to_mesh_axis(self) -> list:
        """Per tensor dim: None, a mesh axis index, or a tuple of indices (multi-dim split)."""
        return [None if not a else a[0] if len(a) == 1 else a for a in self.axes]

    @property
    def mesh_axes_used(self) -> set[int]:
        """The mesh axes (indices) that split some dim of the tensor."""
        return {m for a in self.axes for m in a}

    @property
    def is_fully_replicated(self) -> bool:
        """True when no dim is split: every device holds the whole tensor."""
        return not any(self.axes)

    def mesh_axis_to_tensor_axis(self, mesh_ndims: int) -> list[int | None]:
        """Per mesh axis, the tensor dim (index) it splits, or None (Mesh-TensorFlow's view of a layout)."""
        out: list[int | None] = [None] * mesh_ndims
        for i, a in enumerate(self.axes):
            for m in a:
                out[m] = i
        return out

    def __eq__(self, other) -> bool:
        return isinstance(other, TensorLayout) and self.axes == other.axes

    def __hash__(self) -> int:
        return hash(self.axes)

    def __repr__(self) -> str:
        return f"TensorLayout({self.tensor_axis_to_mesh_axis})"


def _describe(name: str | None, shape: Shape) -> str:
    dims = ", ".join(f"{d.name}={d.size}" for d in shape)
    return f"tensor {name!r} [{dims}]" if name else f"tensor [{dims}]"


def tensor_layout(shape, rules: LayoutRules, mesh_shape: Shape, name: str | None = None) -> TensorLayout:
    """The layout the rules give a tensor of `shape` on a mesh of `mesh_shape`, validated."""
    shape = convert_to_shape(shape)
    axes = []
    for d in shape:
        idx = []
        for m in rules.mesh_dims_for(d.name):
            if m not in mesh_shape:
                raise LayoutError(
                    f"layout rule {d.name}:{m} names mesh dim {m!r}, but the mesh has only {mesh_shape.dimension_names}"
                )
            idx.append(mesh_shape.index(m))
        axes.append(tuple(idx))
    layout = TensorLayout(axes)
    validate_layout(shape, layout, mesh_shape, name)
    return layout


def validate_layout(shape: Shape, layout: TensorLayout, mesh_shape: Shape, name: str | None = None) -> None:
    """Raise LayoutError if two dims share a mesh dim or a split does not divide."""
    owner: dict[int, str] = {}
    for d, axes in zip(shape, layout.axes):
        for m in axes:
            mname = mesh_shape[m].name
            if m in owner:
                other = owner[m]
                what = (
                    f"dimension {d.name!r} is split over mesh dim {mname!r} twice"
                    if other == d.name
                    else (f"dims {other!r} and {d.name!r} are both split over mesh dim {mname!r}")
                )
                raise LayoutError(
                    f"{_describe(name, shape)}: {what}; a mesh dim can split at most one dim of a tensor. "
                    "Drop one of the rules, or split one of the dims over another mesh dim"
                )
            owner[m] = d.name
        parts = 1
        for m in axes:
            parts *= mesh_shape[m].size
        if parts and d.size % parts:
            over = " x ".join(f"{mesh_shape[m].name}={mesh_shape[m].size}" for m in axes)
            raise LayoutError(
                f"{_describe(name, shape)}: dimension {d.name!r} of size {d.size} cannot be split evenly "
                f"over mesh dim(s) {over} ({parts} parts); choose sizes that divide, or another layout"
            )


def split_factor(axes: tuple[int, ...], mesh_shape: Shape) -> int:
    n = 1
    for m in axes:
        n *= mesh_shape[m].size
    return n


def slice_shape(shape: Shape, layout: TensorLayout, mesh_shape: Shape) -> list[int]:
    return [d.size // split_factor(a, mesh_shape) for d, a in zip(shape, layout.axes)]


def slice_index(axes: tuple[int, ...], coords: list[int], mesh_shape: Shape) -> int:
    """Which stripe of a dim split over `axes` (major to minor) the processor at `coords` holds."""
    i = 0
    for m in axes:
        i = i * mesh_shape[m].size + coords[m]
    return i


def slice_begin(shape: Shape, layout: TensorLayout, mesh_shape: Shape, coords: list[int]) -> list[int]:
    sizes = slice_shape(shape, layout, mesh_shape)
    return [s * slice_index(a, coords, mesh_shape) for s, a in zip(sizes, layout.axes)]
