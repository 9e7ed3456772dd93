"""Dimension, Shape and convert_to_shape."""

import re

import numpy as np
import pytest

import meshax as mx

# ----------------------------------------------------------------- Dimension


def test_dimension_attributes():
    d = mx.Dimension("batch", 100)
    assert d.name == "batch"
    assert d.size == 100


def test_dimension_equality_and_hash():
    a = mx.Dimension("batch", 100)
    assert a == mx.Dimension("batch", 100)
    assert hash(a) == hash(mx.Dimension("batch", 100))
    assert a != mx.Dimension("batch", 50)
    assert a != mx.Dimension("batches", 100)
    assert len({a, mx.Dimension("batch", 100), mx.Dimension("batch", 50)}) == 2
    assert {a: 1}[mx.Dimension("batch", 100)] == 1


# --------------------------------------------------------------------- Shape


def _shape():
    return mx.Shape(
        [mx.Dimension("batch", 100), mx.Dimension("rows", 28), mx.Dimension("cols", 28), mx.Dimension("channels", 3)]
    )


def test_shape_properties():
    s = _shape()
    assert list(s.dims) == [
        mx.Dimension("batch", 100),
        mx.Dimension("rows", 28),
        mx.Dimension("cols", 28),
        mx.Dimension("channels", 3),
    ]
    assert list(s.dimension_names) == ["batch", "rows", "cols", "channels"]
    assert list(s.to_integer_list) == [100, 28, 28, 3]
    assert s.size == 100 * 28 * 28 * 3
    assert s.rank == 4
    assert len(s) == 4
    assert list(iter(s)) == list(s.dims)


def test_shape_get_dim_by_name():
    s = _shape()
    assert s.get_dim_by_name("cols") == mx.Dimension("cols", 28)
    assert s.get_dim_by_name("channels").size == 3
    with pytest.raises(KeyError, match="has no dimension named 'nope'"):
        s.get_dim_by_name("nope")


def test_shape_contains():
    s = _shape()
    assert "rows" in s
    assert mx.Dimension("rows", 28) in s
    assert "hidden" not in s
    assert mx.Dimension("hidden", 28) not in s
    assert mx.Dimension("rows", 27) not in s


def test_shape_equality():
    assert _shape() == _shape()
    assert _shape() != mx.Shape([mx.Dimension("batch", 100)])
    reordered = mx.Shape(
        [mx.Dimension("rows", 28), mx.Dimension("batch", 100), mx.Dimension("cols", 28), mx.Dimension("channels", 3)]
    )
    assert _shape() != reordered


def test_scalar_shape():
    s = mx.Shape([])
    assert s.rank == 0
    assert len(s) == 0
    assert s.size == 1
    assert list(s.to_integer_list) == []


def test_shape_repeated_name_raises():
    with pytest.raises(mx.ConfigError, match=re.escape("shape [a=2, a=3] repeats the dimension name(s) ['a']")):
        mx.Shape([mx.Dimension("a", 2), mx.Dimension("a", 3)])


# ---------------------------------------------------------- convert_to_shape

EXPECTED = mx.Shape([mx.Dimension("a", 2), mx.Dimension("bb", 4), mx.Dimension("c", 3)])


@pytest.mark.parametrize(
    "spec",
    [
        "a:2;bb:4;c:3",
        "a:2,bb:4,c:3",
        "a:2.bb:4.c:3",
        "a:2 bb:4 c:3",
        "a:2; bb:4; c:3",
        "  a:2  bb:4   c:3 ",
    ],
    ids=["semicolon", "comma", "dot", "space", "semicolon-space", "extra-spaces"],
)
def test_convert_to_shape_strings(spec):
    s = mx.convert_to_shape(spec)
    assert isinstance(s, mx.Shape)
    assert s == EXPECTED
    assert list(s.dimension_names) == ["a", "bb", "c"]
    assert list(s.to_integer_list) == [2, 4, 3]


def test_spaces_around_a_colon_join_its_pair_in_shapes_meshes_and_layouts():
    """'batch : 8' (or 'batch: rows') was split at the spaces into entries 'batch', ':' and '8',
    refused as a bad entry 'batch'."""
    assert mx.convert_to_shape("a : 2; bb: 4 c :3") == EXPECTED
    assert mx.SimdMeshImpl("rows : 2, cols: 4", "").shape == mx.convert_to_shape("rows:2;cols:4")
    assert mx.convert_to_layout_rules(" batch : rows ; io:cols ") == mx.convert_to_layout_rules("batch:rows;io:cols")
    with pytest.raises(mx.ConfigError, match=r"bad shape 'a: 2.5': a size is a whole number, not 2.5"):
        mx.convert_to_shape("a: 2.5")


def test_convert_to_shape_other_forms():
    dims = [mx.Dimension("a", 2), mx.Dimension("bb", 4), mx.Dimension("c", 3)]
    assert mx.convert_to_shape(EXPECTED) == EXPECTED
    assert mx.convert_to_shape(dims) == EXPECTED
    assert mx.convert_to_shape([("a", 2), ("bb", 4), ("c", 3)]) == EXPECTED
    assert mx.convert_to_shape(tuple(dims)) == EXPECTED


def test_convert_to_shape_empty():
    assert mx.convert_to_shape([]) == mx.Shape([])
    assert mx.convert_to_shape("").rank == 0


@pytest.mark.parametrize(
    "spec,bad",
    [
        ("alpha:2;betaz", "betaz"),
        ("alpha:2;gamma:x7", "x7"),
        ("alpha:2;delta:3:4", "3:4"),
        ("alpha:2;:5", ":5"),
        ("alpha:2;eps:-3", "-3"),
        ("alpha:2;zeta:", "zeta"),
    ],
)
def test_convert_to_shape_malformed(spec, bad):
    with pytest.raises(ValueError) as info:
        mx.convert_to_shape(spec)
    assert bad in str(info.value)


@pytest.mark.parametrize(
    "spec",
    [
        "a:2;a:3",
        "a:2;b:4;a:2",
        [("a", 2), ("a", 2)],
        [mx.Dimension("q", 2), mx.Dimension("q", 5)],
    ],
)
def test_convert_to_shape_repeated_name_raises(spec):
    with pytest.raises(mx.ConfigError, match=r"repeats the dimension name\(s\) \['[aq]'\]"):
        mx.convert_to_shape(spec)


@pytest.mark.parametrize(
    "spec,message",
    [
        ([("batch", 8.9)], "size 8.9 (float) is not a whole number"),
        ([("batch", 8.0)], "size 8.0 (float) is not a whole number"),
        ([("batch", True)], "size True (bool)"),
        ([mx.Dimension("batch", "8")], "size '8' (str)"),
        ([mx.Dimension("", 8)], "non-empty string"),
        (16, "16 is not a shape"),
    ],
)
def test_a_size_that_is_not_a_whole_number_is_refused_not_truncated(spec, message):
    with pytest.raises(mx.ConfigError, match=re.escape(message)):
        mx.convert_to_shape(spec)


def test_numpy_integer_sizes_are_whole_numbers():
    s = mx.convert_to_shape([mx.Dimension("flat", np.prod([8, 16])), ("x", np.int32(3)), ("y", "4")])
    assert s == mx.Shape([mx.Dimension("flat", 128), mx.Dimension("x", 3), mx.Dimension("y", 4)])
    assert all(type(d.size) is int for d in s)
