"""Named dimensions and shapes: the vocabulary every other layer speaks.

A `Dimension` is a (name, size) pair; a `Shape` is an ordered tuple of dimensions with unique
names. Names, not positions, are what layouts and ops refer to, so the user never tracks axis
numbers.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import numpy as np

from meshax.core.errors import ConfigError


class Dimension(NamedTuple):
    """A named tensor (or mesh) dimension. Equal by name and size, hashable."""

    name: str
    size: int

    def __repr__(self) -> str:
        return f"Dimension({self.name!r}, {self.size})"


def _as_dimension(x) -> Dimension:
    if isinstance(x, Dimension):
        if type(x.size) is int and x.size >= 0 and type(x.name) is str and x.name:
            return x  # (the common case, checked first: shapes are built often)
        if isinstance(x.name, numbers.Integral) and isinstance(x.size, str) and x.size:
            raise ConfigError(f"{x!r}: the name comes first: Dimension({x.size!r}, {x.name})")
        if not (isinstance(x.name, str) and x.name):
            raise ConfigError(f"{x!r}: a dimension's name must be a non-empty string")
        return Dimension(x.name, _size(x.name, x.size))
    if isinstance(x, tuple | list) and len(x) == 2 and isinstance(x[0], str):
        name, size = x
        if isinstance(size, str) and size.strip().isdigit():  # ("batch", "8"), as parsed from text
            size = int(size)
        return Dimension(name, _size(name, size))
    raise TypeError(f"cannot make a Dimension from {x!r}: give Dimension(name, size) or (name, size)")


def _size(name: str, size) -> int:
    """A dimension's size as an int: a whole number (Python's or NumPy's), not negative."""
    if isinstance(size, bool | np.bool_) or not isinstance(size, numbers.Integral):
        raise ConfigError(
            f"dimension {name!r}: size {size!r} ({type(size).__name__}) is not a whole number; "
            "give an int (e.g. n // 2, not n / 2)"
        )
    if size < 0:
        raise ConfigError(f"dimension {name!r}: size {size} is negative")
    return int(size)


class Shape:
    """An ordered collection of `Dimension`s with unique names."""

    __slots__ = ("_dims",)

    def __init__(self, dims: Iterable = ()):
        if isinstance(dims, str) and dims:  # (read letter by letter: "cannot make a Dimension from 'b'")
            raise ConfigError(
                f"mx.Shape({dims!r}): a Shape is made from a list of Dimensions; parse text with "
                f"mx.convert_to_shape({dims!r}) (ops take the text as it is)"
            )
        dims = tuple(_as_dimension(d) for d in dims)
        names = [d.name for d in dims]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ConfigError(
                f"shape {_fmt(dims)} repeats the dimension name(s) {repeated}: "
                "each dimension of a tensor needs its own name (rename one, e.g. 'length' -> 'memory_length')"
            )
        self._dims = dims

    @property
    def dims(self) -> list[Dimension]:
        """The dims, in order (a new list)."""
        return list(self._dims)

    @property
    def dimension_names(self) -> list[str]:
        """The dims' names, in order."""
        return [d.name for d in self._dims]

    @property
    def to_integer_list(self) -> list[int]:
        """The dims' sizes, in order."""
        return [d.size for d in self._dims]

    @property
    def size(self) -> int:
        """The number of elements: the product of the dims' sizes (1 for a scalar)."""
        n = 1
        for d in self._dims:
            n *= d.size
        return n

    @property
    def rank(self) -> int:
        """The number of dims."""
        return len(self._dims)

    def get_dim_by_name(self, name: str) -> Dimension:
        """The dim called `name`; KeyError if the shape has none."""
        for d in self._dims:
            if d.name == name:
                return d
        raise KeyError(f"shape {self} has no dimension named {name!r}")

    def index(self, dim: Dimension | str) -> int:
        """Position of `dim` (a Dimension or a name) in this shape."""
        name = dim if isinstance(dim, str) else dim.name
        for i, d in enumerate(self._dims):
            if d.name == name:
                if not isinstance(dim, str) and d != dim:
                    raise ConfigError(f"shape {self} has {d}, not {dim}")
                return i
        raise ConfigError(f"shape {self} has no dimension {name!r}")

    def __contains__(self, x) -> bool:
        if isinstance(x, str):
            return x in self.dimension_names
        return x in self._dims

    def __len__(self) -> int:
        return len(self._dims)

    def __iter__(self) -> Iterator[Dimension]:
        return iter(self._dims)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Shape(self._dims[i])
        return self._dims[i]

    def __eq__(self, other) -> bool:
        if isinstance(other, Shape):
            return self._dims == other._dims
        if isinstance(other, list | tuple):
            try:
                return self._dims == Shape(other)._dims
            except (TypeError, ValueError):
                return False
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._dims)

    def __add__(self, other) -> Shape:
        return Shape(self._dims + tuple(convert_to_shape(other)))

    def __repr__(self) -> str:
        return f"Shape({_fmt(self._dims)})"

    __str__ = __repr__


def _fmt(dims) -> str:
    return "[" + ", ".join(f"{d.name}={d.size}" for d in dims) + "]"


_SEPARATORS = re.compile(r"[;,.\s]+")


def convert_to_shape(x) -> Shape:
    """A Shape from a Shape, a list of Dimensions or (name, size) pairs, or "a:2;b:4".

    Strings may separate dims with ';', ',', '.' or whitespace; each token is `name:size`.
    """
    if x is None:
        raise ConfigError("a shape is required, got None")
    if isinstance(x, Shape):
        return x
    if isinstance(x, Dimension):
        return Shape([x])
    if isinstance(x, str):
        return Shape(_parse_pairs(x, what="shape", integer_values=True, example="batch:8"))
    if not isinstance(x, Iterable):
        raise ConfigError(
            f"{x!r} is not a shape: a shape is a list of Dimensions or 'name:size' text, "
            "e.g. [mx.Dimension('hidden', 16)] or 'hidden:16'"
        )
    return Shape(x)


def convert_to_dimension(d) -> Dimension | None:
    """A Dimension from a Dimension, a (name, size) pair, or "name:size"; None stays None."""
    if d is None or isinstance(d, Dimension):
        return d
    (dim,) = convert_to_shape(d if isinstance(d, str) else [d]).dims
    return dim


def anonymous_shape(shape) -> Shape:
    """`shape` with each dim renamed "_" + its name: layout rules name no such dim, so a tensor
    of it is replicated (Mesh-TensorFlow's anonymous dims)."""
    return Shape([d._replace(name="_" + d.name) for d in convert_to_shape(shape)])


def combined_dimension(dims, name=None) -> Dimension:
    """One Dimension as large as `dims` together, named `name` (default: their names joined by "_")."""
    dims = list(convert_to_shape(dims))
    return Dimension(name or "_".join(d.name for d in dims), math.prod(d.size for d in dims))


_FORMS = {"shape": "dim_name:size", "mesh": "mesh_dim:devices", "layout": "tensor_dim:mesh_dim"}


def _parse_pairs(text: str, what: str, integer_values: bool, example: str) -> list[tuple]:
    """Parse "k:v;k:v" (any of ; , . or spaces between) into pairs, naming a bad token."""
    # (spaces around a colon join its pair: "batch : rows" was split into the entries 'batch', ':', 'rows')
    joined = re.sub(r"\s*:\s*", ":", text.strip())
    fraction = re.search(r":(\d+\.\d+)", joined)
    if integer_values and fraction:
        raise ConfigError(f"bad {what} {text!r}: a size is a whole number, not {fraction.group(1)}")
    pairs = []
    for token in _SEPARATORS.split(joined):
        if not token:
            continue
        parts = token.split(":")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            form = _FORMS.get(what, "name:value")
            raise ConfigError(f"bad {what} entry {token!r} in {text!r}: write {form} pairs, e.g. {example!r}")
        key, value = parts
        if integer_values:
            if not value.isdigit():
                raise ConfigError(f"bad {what} entry {token!r} in {text!r}: size {value!r} is not a whole number >= 0")
            value = int(value)
        pairs.append((key, value))
    return pairs
