"""Layout rules, tensor layouts, slices and processor numbering."""

import itertools
import re

import numpy as np
import pytest

import meshax as mx
from meshax.layout.rules import block_sizes, valid_size
from tests.conftest import IMPL_IDS, IMPLS

IMAGE = [("batch", 100), ("rows", 28), ("cols", 28), ("channels", 3)]
README_MESH = "processor_rows:2;processor_cols:4"

impls = pytest.mark.parametrize("impl_cls", IMPLS, ids=IMPL_IDS)


def _axes(tl):
    return [tuple(a) if isinstance(a, (list, tuple)) else a for a in tl.tensor_axis_to_mesh_axis]


# --------------------------------------------------------------- layout rules


def test_convert_to_layout_rules_forms():
    r1 = mx.convert_to_layout_rules("batch:rows;hidden:cols")
    r2 = mx.convert_to_layout_rules([("batch", "rows"), ("hidden", "cols")])
    assert isinstance(r1, mx.LayoutRules)
    assert isinstance(r2, mx.LayoutRules)
    assert isinstance(mx.convert_to_layout_rules(r1), mx.LayoutRules)


@impls
def test_layout_rules_string_and_pairs_agree(impl_cls):
    shape = mx.convert_to_shape("batch:8;hidden:4;other:2")
    a = impl_cls("rows:2;cols:4", "batch:rows;hidden:cols")
    b = impl_cls([("rows", 2), ("cols", 4)], [("batch", "rows"), ("hidden", "cols")])
    c = impl_cls("rows:2;cols:4", mx.convert_to_layout_rules("batch:rows;hidden:cols"))
    for impl in (a, b, c):
        assert _axes(impl.tensor_layout(shape)) == [0, 1, None]
        assert list(impl.slice_shape(shape)) == [4, 1, 2]


def test_layout_error_is_value_error():
    assert issubclass(mx.LayoutError, ValueError)


def test_malformed_layout_rules_raise():
    with pytest.raises(mx.ConfigError, match="bad layout entry 'batch' in 'batch': write tensor_dim:mesh_dim pairs"):
        mx.convert_to_layout_rules("batch")


# ------------------------------------------------------------ mesh impl basics


@impls
def test_mesh_impl_shape_and_size(impl_cls):
    impl = impl_cls(README_MESH, "")
    assert isinstance(impl.shape, mx.Shape)
    assert list(impl.shape.dimension_names) == ["processor_rows", "processor_cols"]
    assert list(impl.shape.to_integer_list) == [2, 4]
    assert impl.size == 8


# ------------------------------------------------------------- README examples


@impls
def test_readme_empty_layout(impl_cls):
    impl = impl_cls(README_MESH, "")
    shape = mx.convert_to_shape(IMAGE)
    assert _axes(impl.tensor_layout(shape)) == [None, None, None, None]
    assert list(impl.slice_shape(shape)) == [100, 28, 28, 3]
    for pnum in range(8):
        assert list(impl.slice_begin(shape, pnum)) == [0, 0, 0, 0]


@impls
def test_readme_batch_over_cols(impl_cls):
    impl = impl_cls(README_MESH, "batch:processor_cols")
    shape = mx.convert_to_shape(IMAGE)
    assert _axes(impl.tensor_layout(shape)) == [1, None, None, None]
    assert list(impl.slice_shape(shape)) == [25, 28, 28, 3]
    # processors (0, 3) and (1, 3) hold image_batch[75:100, :, :, :]
    assert impl.processor_coordinates_to_pnum([0, 3]) == 3
    assert impl.processor_coordinates_to_pnum([1, 3]) == 7
    assert list(impl.slice_begin(shape, 3)) == [75, 0, 0, 0]
    assert list(impl.slice_begin(shape, 7)) == [75, 0, 0, 0]
    for pnum in range(8):
        col = pnum % 4
        assert list(impl.slice_begin(shape, pnum)) == [25 * col, 0, 0, 0]


@impls
def test_readme_rows_and_cols(impl_cls):
    impl = impl_cls(README_MESH, "rows:processor_rows;cols:processor_cols")
    shape = mx.convert_to_shape(IMAGE)
    assert _axes(impl.tensor_layout(shape)) == [None, 0, 1, None]
    assert list(impl.slice_shape(shape)) == [100, 14, 7, 3]
    # processor (0, 1) holds image_batch[:, 0:14, 7:14, :]
    pnum = impl.processor_coordinates_to_pnum([0, 1])
    assert pnum == 1
    assert list(impl.slice_begin(shape, pnum)) == [0, 0, 7, 0]
    for r, c in itertools.product(range(2), range(4)):
        p = impl.processor_coordinates_to_pnum([r, c])
        assert list(impl.slice_begin(shape, p)) == [0, 14 * r, 7 * c, 0]


@impls
def test_readme_two_dims_same_mesh_dim_is_illegal(impl_cls):
    impl = impl_cls(README_MESH, "batch:processor_rows;rows:processor_rows")
    shape = mx.convert_to_shape(IMAGE)
    with pytest.raises(mx.LayoutError) as info:
        impl.tensor_layout(shape)
    msg = str(info.value)
    assert "batch" in msg
    assert re.search(r"\brows\b", msg), msg  # the tensor dim, not just the mesh dim
    assert "processor_rows" in msg


@impls
def test_readme_non_divisible_is_padded(impl_cls):
    """Mesh-TensorFlow's README calls this layout illegal; as in GSPMD, meshax pads: 3 channels
    over 2 rows are 2 per device, the second device's second channel padding."""
    impl = impl_cls(README_MESH, "channels:processor_rows")
    shape = mx.convert_to_shape(IMAGE)
    assert list(impl.slice_shape(shape))[-1] == 2
    rows = impl.tensor_layout(shape).axes[-1]
    second = impl.processor_coordinates_to_pnum([1, 0])
    assert impl.slice_begin(shape, second)[-1] == 2
    assert valid_size(3, rows, impl.shape, [1, 0]) == 1


@impls
def test_rules_for_absent_dims_are_ignored(impl_cls):
    impl = impl_cls(README_MESH, "channels:processor_rows;batch:processor_cols")
    shape = mx.convert_to_shape("batch:100;hidden:6")
    assert _axes(impl.tensor_layout(shape)) == [1, None]
    assert list(impl.slice_shape(shape)) == [25, 6]


# ----------------------------------------------------- multi-mesh-dim splits


@impls
def test_split_over_two_mesh_dims(impl_cls):
    impl = impl_cls("rows:2;cols:4", "batch:rows;batch:cols")
    shape = mx.convert_to_shape("batch:16;x:3")
    assert _axes(impl.tensor_layout(shape)) == [(0, 1), None]
    assert list(impl.slice_shape(shape)) == [2, 3]
    for r, c in itertools.product(range(2), range(4)):
        p = impl.processor_coordinates_to_pnum([r, c])
        assert list(impl.slice_begin(shape, p)) == [2 * (r * 4 + c), 0]


@impls
def test_split_over_two_of_three_mesh_dims(impl_cls):
    impl = impl_cls("a:2;b:3;c:2", "t:a;t:c;u:b")
    shape = mx.convert_to_shape("u:6;t:8;v:5")
    assert _axes(impl.tensor_layout(shape)) == [1, (0, 2), None]
    assert list(impl.slice_shape(shape)) == [2, 2, 5]
    for ca, cb, cc in itertools.product(range(2), range(3), range(2)):
        p = impl.processor_coordinates_to_pnum([ca, cb, cc])
        assert list(impl.slice_begin(shape, p)) == [2 * cb, 2 * (ca * 2 + cc), 0]


@impls
def test_split_over_two_mesh_dims_not_divisible(impl_cls):
    """12 over rows:2 then cols:4 is padded at each level: blocks of 6, then of 2 (6 = 2+2+2+0),
    so every device but the last of each row holds 2 values, and the last none."""
    impl = impl_cls("rows:2;cols:4", "batchy:rows;batchy:cols")
    shape = mx.convert_to_shape("batchy:12")
    axes = impl.tensor_layout(shape).axes[0]
    assert block_sizes(12, axes, impl.shape) == [12, 6, 2]
    begins, valid = [], []
    for p in range(8):
        coords = impl.pnum_to_processor_coordinates(p)
        begins.append(impl.slice_begin(shape, p)[0])
        valid.append(valid_size(12, axes, impl.shape, coords))
    assert begins == [0, 2, 4, 6, 6, 8, 10, 12]
    assert valid == [2, 2, 2, 0, 2, 2, 2, 0]


@impls
def test_multi_split_conflicts_with_other_dim(impl_cls):
    impl = impl_cls("rows:2;cols:4", "b:rows;b:cols;d:cols")
    with pytest.raises(mx.LayoutError, match="dims 'b' and 'd' are both split over mesh dim 'cols'"):
        impl.tensor_layout(mx.convert_to_shape("b:8;d:8"))
    # each dim alone is fine
    assert _axes(impl.tensor_layout(mx.convert_to_shape("b:8"))) == [(0, 1)]
    assert _axes(impl.tensor_layout(mx.convert_to_shape("d:8"))) == [1]


@impls
def test_scalar_layout(impl_cls):
    impl = impl_cls("rows:2;cols:4", "b:rows")
    shape = mx.Shape([])
    assert _axes(impl.tensor_layout(shape)) == []
    assert list(impl.slice_shape(shape)) == []
    assert list(impl.slice_begin(shape, 5)) == []


# --------------------------------------------------------- processor numbering


@impls
@pytest.mark.parametrize(
    "mesh_shape,dims",
    [
        ("rows:2;cols:4", [2, 4]),
        ("a:2;b:3;c:4", [2, 3, 4]),
        ("all:8", [8]),
    ],
)
def test_pnum_coordinates_row_major(impl_cls, mesh_shape, dims):
    impl = impl_cls(mesh_shape, "")
    coords = list(itertools.product(*[range(n) for n in dims]))  # last dim fastest
    assert impl.size == len(coords)
    for pnum, c in enumerate(coords):
        assert list(impl.pnum_to_processor_coordinates(pnum)) == list(c)
        assert impl.processor_coordinates_to_pnum(list(c)) == pnum


@impls
def test_pnum_examples(impl_cls):
    impl = impl_cls("a:2;b:3;c:4", "")
    assert list(impl.pnum_to_processor_coordinates(23)) == [1, 2, 3]
    assert list(impl.pnum_to_processor_coordinates(7)) == [0, 1, 3]
    assert list(impl.pnum_to_processor_coordinates(12)) == [1, 0, 0]
    assert impl.processor_coordinates_to_pnum([1, 1, 1]) == 12 + 4 + 1


def test_a_rule_that_splits_nothing_warns_with_the_closest_name():
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    x = mx.placeholder(mesh, "x", [mx.Dimension("batch", 8), mx.Dimension("hidden", 4)])
    with pytest.warns(
        mx.LayoutWarning, match="no tensor of the graph has a dim 'hiden' \\(did you mean 'hidden'\\?\\)"
    ):
        mx.Lowering(x.graph, {mesh: mx.SimdMeshImpl("all:8", "batch:all;hiden:all")})


def test_a_rule_for_a_mesh_dim_the_mesh_lacks_is_an_error_with_the_closest_name():
    with pytest.raises(mx.LayoutError, match="did you mean 'rows'"):
        mx.SimdMeshImpl("rows:2;cols:4", "batch:row")
    for bad, message in [("", "has no dims"), ("rows:2;rows:4", "twice"), ("rows:0", "at least one device")]:
        with pytest.raises(mx.ConfigError, match=message):
            mx.SimdMeshImpl(bad, "")


def test_layout_rules_as_a_dict_and_bad_rules_named():
    rules = mx.convert_to_layout_rules({"batch": "rows", "hidden": ("rows", "cols")})
    assert rules == mx.convert_to_layout_rules("batch:rows;hidden:rows;hidden:cols")
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    w = mx.shard(mx.placeholder(mesh, "w", "io:8;hidden:16"), {"hidden": "all"})
    assert mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "")}).layout_of(w) == "hidden:all"
    for bad in [{"batch": 3}, [("batch",)], 5]:
        with pytest.raises(mx.LayoutError, match="'batch:rows;hidden:cols'"):
            mx.convert_to_layout_rules(bad)


@pytest.mark.parametrize(
    "platform,fix",
    [
        ("cpu", "set JAX_NUM_CPU_DEVICES=16"),
        ("gpu", 'give a mesh of at most 8 (e.g. --mesh "all:8"), or run on the CPU'),
    ],
)
def test_too_few_devices_says_how_to_have_enough(monkeypatch, platform, fix):
    import jax

    class Device:
        pass

    Device.platform = platform
    monkeypatch.setattr(jax, "devices", lambda: [Device() for _ in range(8)])
    with pytest.raises(mx.ConfigError, match=re.escape(f"needs 16 devices but JAX sees 8 {platform} device(s): {fix}")):
        _ = mx.SimdMeshImpl("all:16", "").devices


@pytest.mark.parametrize("impl_cls", IMPLS, ids=IMPL_IDS)
def test_devices_that_are_no_jax_devices_or_repeat_one_are_refused_when_the_mesh_is_made(impl_cls):
    """A device given twice, or something that is no JAX device (an int, a name beside devices),
    is a ConfigError naming it when the mesh is made: they were a ValueError from JAX's pxla
    ('safe_zip() argument 1 has length 2 but argument 0 has length 1') at the first run, and an
    AttributeError ('int' object has no attribute 'id') from jax.sharding.Mesh. A NumPy array of
    devices, as jax.sharding.Mesh takes, is its devices in pnum order."""
    import jax

    d = jax.devices()
    with pytest.raises(mx.ConfigError, match=re.escape(f"devices: {d[0]} given more than once")):
        impl_cls("rows:2", "", devices=[d[0], d[0]])
    with pytest.raises(mx.ConfigError, match=r"devices: 0 \(int\) is not a JAX device"):
        impl_cls("rows:2", "", devices=[0, 1])
    with pytest.raises(mx.ConfigError, match=r"devices: 'cpu:1' \(str\) is not a JAX device"):
        impl_cls("rows:2", "", devices=[d[0], "cpu:1"])
    with pytest.raises(mx.ConfigError, match=r"mesh Shape\(\[rows=2\]\) needs 2 devices, but 3 were given"):
        impl_cls("rows:2", "", devices=d[:3])
    assert impl_cls("rows:2;cols:2", "", devices=np.array(d[4:8], dtype=object).reshape(2, 2)).devices == d[4:8]
    assert impl_cls("rows:2", "", devices=["cpu:0", "cpu:0"]).devices == d[:2]  # (TensorFlow names: JAX's first)
