"""Layout rules and tensor layouts: which tensor dims are split over which mesh dims.

`LayoutRules` map tensor-dimension names to mesh-dimension names. Beyond Mesh-TensorFlow, a
tensor dim may be split over several mesh dims (GSPMD): repeat it, major to minor,
`"batch:rows;batch:cols"`. A `TensorLayout` is the restriction of the rules to one tensor,
with mesh dims as indices.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from meshax.core.errors import LayoutError
from meshax.core.shape import Shape, _parse_pairs, convert_to_shape


class LayoutRules:
    """An ordered set of (tensor_dim_name, mesh_dim_name) pairs."""

    def __init__(self, pairs: Iterable[tuple[str, str]] = ()):
        seen = []
        for pair in pairs:
            if not (isinstance(pair, tuple | list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
                raise LayoutError(
                    f"bad layout rule {pair!r}: a rule is a (tensor_dim, mesh_dim) pair of names; give rules as "
                    "'batch:rows;hidden:cols', [('batch', 'rows'), ('hidden', 'cols')] or {'batch': 'rows'}"
                )
            pair = (pair[0], pair[1])
            if pair in seen:
                raise LayoutError(f"layout rule {pair[0]}:{pair[1]} is given twice")
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
    """LayoutRules from LayoutRules, "batch:rows;hidden:cols", a list of (tensor_dim, mesh_dim),
    or a dict of tensor_dim -> mesh_dim (or mesh dims, major to minor: {"batch": ("rows", "cols")})."""
    if x is None:
        return LayoutRules()
    if isinstance(x, LayoutRules):
        return x
    if isinstance(x, str):
        return LayoutRules(_parse_pairs(x, what="layout", integer_values=False, example="batch:rows;hidden:cols"))
    if isinstance(x, Mapping):
        return LayoutRules((t, m) for t, ms in x.items() for m in (ms if isinstance(ms, tuple | list) else [ms]))
    if not isinstance(x, Iterable):
        raise LayoutError(f"layout rules {x!r}: give 'batch:rows;hidden:cols', pairs or a dict")
    return LayoutRules(x)


class WeightRules(LayoutRules):
    """The layout rules of weight-shaped tensors (weights, their gradients and optimizer slots:
    `MeshImpl(weight_layout=...)`), and the weight shapes they leave to the layout rules instead,
    each by its dim names: "d_model:x;heads:y except [vocab,d_model]" splits every weight by
    these rules but the embedding-shaped ones, which follow the layout rules like activations."""

    def __init__(self, pairs: Iterable[tuple[str, str]] = (), exempt: Iterable[Iterable[str]] = ()):
        super().__init__(pairs)
        self.exempt: frozenset[frozenset[str]] = frozenset(frozenset(s) for s in exempt)

    def __eq__(self, other) -> bool:
        return isinstance(other, LayoutRules) and self.pairs == other.pairs and self.exempt == _exempt(other)

    def __hash__(self) -> int:  # (equal LayoutRules when nothing is exempt: the same hash)
        return hash((self.pairs, self.exempt)) if self.exempt else hash(self.pairs)

    def __str__(self) -> str:
        shapes = " ".join(f"[{','.join(sorted(s))}]" for s in sorted(self.exempt, key=sorted))
        return " ".join(part for part in (super().__str__(), f"except {shapes}" if shapes else "") if part)

    def __repr__(self) -> str:
        return f"WeightRules({str(self)!r})"


def _exempt(rules: LayoutRules) -> frozenset:
    return getattr(rules, "exempt", frozenset())


def convert_to_weight_rules(x) -> WeightRules:
    """WeightRules from WeightRules, LayoutRules, pairs, or text: rules, then optionally "except"
    and the exempt weight shapes, each its dim names in brackets ("d_model:x except [vocab,d_model]")."""
    if isinstance(x, WeightRules):
        return x
    if not isinstance(x, str):
        return WeightRules(convert_to_layout_rules(x).pairs)
    m = re.search(r"\bexcept\b", x)
    rules, rest = (x[: m.start()], x[m.end() :]) if m else (x, "")
    shapes = re.findall(r"\[([^\]]*)\]", rest)
    if (m and not shapes) or re.sub(r"\[[^\]]*\]", "", rest).strip():
        raise LayoutError(
            f"bad weight layout {x!r}: after 'except', write each weight shape left to the layout rules as its "
            "dim names in brackets, e.g. 'd_model:x;heads:y except [vocab,d_model]'"
        )
    exempt = [[d for d in re.split(r"[\s,]+", s) if d] for s in shapes]
    return WeightRules(convert_to_layout_rules(rules).pairs, exempt)


class TensorLayout:
    """Per tensor dim, the mesh axes (indices, major to minor) it is split over; () = not split."""

    __slots__ = ("_hash", "axes")

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
        self._hash = hash(self.axes)  # (the search hashes layouts millions of times)

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
        return self is other or (isinstance(other, TensorLayout) and self.axes == other.axes)

    def __hash__(self) -> int:
        return self._hash

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
    """Raise LayoutError if two dims share a mesh dim. (A split need not divide: see `block_sizes`.)"""
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


def split_factor(axes: tuple[int, ...], mesh_shape: Shape) -> int:
    n = 1
    for m in axes:
        n *= mesh_shape[m].size
    return n


def block_sizes(size: int, axes: tuple[int, ...], mesh_shape: Shape) -> list[int]:
    """A dim of `size` split over `axes` (major to minor), one split at a time: [size, B1, ...],
    each block ceil(previous / parts). Sizes that do not divide are padded at the end of each
    block (GSPMD's uneven partitioning); nested splits pad each level, so that adding or removing
    the minor split is always local (allsplit, allgather and alltoall stay exact)."""
    blocks = [size]
    for m in axes:
        blocks.append(-(-blocks[-1] // mesh_shape[m].size))
    return blocks


def is_padded(size: int, axes: tuple[int, ...], mesh_shape: Shape) -> bool:
    """Whether a dim of `size` split over `axes` carries padding (the split does not divide)."""
    return block_sizes(size, axes, mesh_shape)[-1] * split_factor(axes, mesh_shape) != size


def slice_shape(shape: Shape, layout: TensorLayout, mesh_shape: Shape) -> list[int]:
    """One device's slice (padded where a split does not divide): ceil(size / parts) per dim."""
    return [block_sizes(d.size, a, mesh_shape)[-1] for d, a in zip(shape, layout.axes)]


def padded_shape(shape: Shape, layout: TensorLayout, mesh_shape: Shape) -> list[int]:
    """The shape of the padded global array the devices' slices tile."""
    return [s * split_factor(a, mesh_shape) for s, a in zip(slice_shape(shape, layout, mesh_shape), layout.axes)]


def slice_index(axes: tuple[int, ...], coords: list[int], mesh_shape: Shape) -> int:
    """Which stripe of a dim split over `axes` (major to minor) the processor at `coords` holds."""
    i = 0
    for m in axes:
        i = i * mesh_shape[m].size + coords[m]
    return i


def slice_begin(shape: Shape, layout: TensorLayout, mesh_shape: Shape, coords: list[int]) -> list[int]:
    """The global index of the first value of the slice at `coords`, per dim (its values, where
    not padding, are consecutive from there)."""
    begins = []
    for d, axes in zip(shape, layout.axes):
        blocks = block_sizes(d.size, axes, mesh_shape)
        begins.append(sum(coords[m] * b for m, b in zip(axes, blocks[1:])))
    return begins


def valid_size(size: int, axes: tuple[int, ...], mesh_shape: Shape, coords: list[int]) -> int:
    """How many values of the slice at `coords` are not padding (0 for an all-padding slice)."""
    blocks = block_sizes(size, axes, mesh_shape)
    valid = size
    for m, b in zip(axes, blocks[1:]):
        valid = min(max(valid - coords[m] * b, 0), b)
    return valid
