"""The GSPMD paper's Transformer shardings (Table 1) and models (Table 2), planned at the paper's
scale by abstract tracing (nothing allocated), and one trained on 8 CPU devices.

Notation as in the paper: B batch, S length, M d_model, H d_ff, N heads, D d_kv, V vocab; the
mesh is (X, Y) with dims x and y. Only the tensors Table 1 names are annotated (six weights,
and BSM, BSND, BSH activations); everything else is propagated.
"""

import dataclasses
import functools

import numpy as np
import pytest

import meshax as mx
from meshax.models.transformer import GSPMD_SHARDINGS, PRESETS, Transformer, TransformerConfig
from meshax.optimize import AdamWeightDecayOptimizer
from meshax.plan import summarize
from meshax.train import LmTask
from meshax.train.loop import build

M, H, N, D, V = 8192, 65536, 128, 256, 32000
B, S = 128, 1024
SHARDINGS = sorted(GSPMD_SHARDINGS)
MESHES = [(8, 16), (16, 32), (32, 64)]
KERNELS = (
    "self_attention/q",
    "self_attention/k",
    "self_attention/v",
    "self_attention/o",
    "ffn/wi/kernel",
    "ffn/wo/kernel",
)


@functools.cache
def _plan(sharding: str, X: int, Y: int):
    config = dataclasses.replace(PRESETS["gspmd-64b"], num_layers=1, sharding=sharding)
    task = LmTask(model=config, batch_size=B, length=S, sharding=sharding)
    lowering, outputs, updates = build(
        task, f"x:{X};y:{Y}", "", "simd", AdamWeightDecayOptimizer(1e-3), 0, compile=False
    )
    counters = lowering.trace_step(outputs, updates)
    return lowering, counters, summarize(lowering, counters, outputs)


def _bytes(lowering, t) -> int:
    return 4 * int(np.prod(lowering.impl.slice_shape(t.shape, lowering.plan[t])))


@pytest.mark.parametrize("sharding", SHARDINGS)
@pytest.mark.parametrize("X,Y", MESHES, ids=lambda v: str(v))
def test_weight_and_optimizer_memory_per_device(sharding, X, Y):
    """Each Table 1 weight (and its two Adam slots) is split X*Y ways. What the table does not
    name is propagated from the activations: the embedding table [V, M], the six layer-norm
    vectors and W_out's bias [M] follow BSM's M (x in Attempt 1, nothing in Attempt 2, y when
    finalized), W_in's bias [H] follows BSH's H (y)."""
    lowering, _, s = _plan(sharding, X, Y)
    variables = {v.name.removeprefix("transformer/decoder/0/"): v for v in lowering.graph.all_variables}
    for name in KERNELS:
        for suffix in ("", "/adam_m", "/adam_v"):
            t = variables[name + suffix].value
            assert _bytes(lowering, t) == 4 * t.size // (X * Y), name + suffix
    m_split = {"gspmd-2d-attempt1": X, "gspmd-2d-attempt2": 1, "gspmd-2d-finalized": Y}[sharding]
    per_device = (4 * M * N * D + 2 * M * H) // (X * Y) + V * M // m_split + 7 * M // m_split + H // Y
    assert s.parameter_bytes_per_device == 4 * per_device
    assert s.optimizer_state_bytes_per_device == 2 * 4 * per_device + 4  # two Adam slots, the step


def _annotated(lowering, sharding: str, kind: str):
    """The first tensor annotated as `kind` (BSM: the layer's input; BSND: q; BSH: relu's output)."""
    names = {
        "BSM": ["batch", "length", "d_model"],
        "BSND": ["batch", "length", "heads", "d_kv"],
        "BSH": ["batch", "length", "d_ff"],
    }[kind]
    for op in lowering.graph.operations:
        if getattr(op, "annotation", None) is not None and op.grad_of is None:
            (t,) = op.outputs
            if t.shape.dimension_names == names:
                assert {d.name: m for d, e in zip(t.shape, op.annotation) for m in e} == GSPMD_SHARDINGS[sharding][kind]
                return t
    raise AssertionError(f"no {kind} annotation")


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_activation_memory_scales_as_table_1_says(sharding):
    """Per device: Attempt 1 holds BSM/X, BSND/Y, BSH/Y; Attempt 2 BSM/X and the others /(XY);
    finalized everything /(XY). From mesh (8,16) to (16,32) BSM/X halves and /(XY) quarters."""
    split = {
        "gspmd-2d-attempt1": {"BSM": "X", "BSND": "Y", "BSH": "Y"},
        "gspmd-2d-attempt2": {"BSM": "X", "BSND": "XY", "BSH": "XY"},
        "gspmd-2d-finalized": {"BSM": "XY", "BSND": "XY", "BSH": "XY"},
    }[sharding]
    sizes = {"BSM": B * S * M, "BSND": B * S * N * D, "BSH": B * S * H}
    per_mesh = []
    for X, Y in MESHES[:2]:
        lowering = _plan(sharding, X, Y)[0]
        got = {k: _bytes(lowering, _annotated(lowering, sharding, k)) for k in sizes}
        parts = {"X": X, "Y": Y, "XY": X * Y}
        assert got == {k: 4 * sizes[k] // parts[split[k]] for k in sizes}
        per_mesh.append(got)
    for k in sizes:
        assert per_mesh[1][k] * (4 if split[k] == "XY" else 2) == per_mesh[0][k]


def _sites(counters, op_name: str, kind: str | None = None, grad: bool = False):
    return [
        (s.kind, s.mesh_axes, s.values)
        for s in counters.sites()
        if (s.grad_of if grad else s.op_name) == op_name and (kind is None or s.kind == kind)
    ]


WI, WO = "transformer/decoder/0/ffn/wi", "transformer/decoder/0/ffn/wo"


@pytest.mark.parametrize("X,Y", MESHES[:2], ids=lambda v: str(v))
def test_attempt1_allreduces_over_x_and_y_and_gathers_nothing(X, Y):
    _, c, _ = _plan("gspmd-2d-attempt1", X, Y)
    assert {k for k in c if c[k].count} == {"allreduce"}
    assert {s.mesh_axes for s in c.sites()} == {("x",), ("y",)}
    # W_in's einsum sums M over x: BSH (H over y) is allreduced over x; W_out's sums H over y:
    # BSM (M over x) over y. Values per device are the slices put in.
    assert _sites(c, WI) == [("allreduce", ("x",), B * S * H // Y)]
    assert _sites(c, WO) == [("allreduce", ("y",), B * S * M // X)]


@pytest.mark.parametrize("X,Y", MESHES[:2], ids=lambda v: str(v))
def test_attempt2_gathers_weights_over_x_and_reduce_scatters_their_gradients(X, Y):
    _, c, _ = _plan("gspmd-2d-attempt2", X, Y)
    assert _sites(c, WI) == [("allgather", ("x",), M * H // (X * Y))]
    assert sorted(_sites(c, WO)) == [("allgather", ("x",), M * H // (X * Y)), ("allreduce", ("y",), B * S * M // X)]
    # each weight's gradient: its partial sum over the batch split over x, reduce-scattered over x
    for op in (WI, WO):
        assert ("reduce_scatter", ("x",), M * H // Y) in _sites(c, op, grad=True)
    assert not [s for s in c.sites() if s.kind in ("allgather", "reduce_scatter") and s.mesh_axes != ("x",)]
    assert c["alltoall"].count == 0


@pytest.mark.parametrize("X,Y", MESHES[:2], ids=lambda v: str(v))
def test_finalized_gathers_bsm_over_y_and_reduce_scatters_instead_of_allreducing(X, Y):
    _, c, _ = _plan("gspmd-2d-finalized", X, Y)
    assert sorted(_sites(c, WI)) == [
        ("allgather", ("x",), M * H // (X * Y)),
        ("allgather", ("y",), B * S * M // (X * Y)),
    ]
    assert sorted(_sites(c, WO)) == [
        ("allgather", ("x",), M * H // (X * Y)),
        ("reduce_scatter", ("y",), B * S * M // X),
    ]
    for op in (WI, WO):
        assert ("reduce_scatter", ("x",), M * H // Y) in _sites(c, op, grad=True)
    # no activation-sized allreduce is left in the layers (the logits' sum over the embedding
    # table's M, which Table 1 does not name, is the one allreduce over y of that size)
    layer_ar = [
        s
        for s in c.sites()
        if s.kind == "allreduce"
        and s.values >= B * S * M // (X * Y)
        and "transformer.py" in s.source
        and s.op_name != "einsum_6"
    ]
    assert layer_ar == []
    assert c["alltoall"].count == 0


@pytest.mark.parametrize(
    "name,billions",
    [("gspmd-64b", 64), ("gspmd-128b", 128), ("gspmd-256b", 256), ("gspmd-512b", 512), ("gspmd-1t", 1024)],
)
def test_table_2_parameter_counts(name, billions):
    """Weights per model, embeddings (and the small norm and bias vectors) aside, in units of
    2^30: one layer built, times the layer count (a 64B layer holds 2^31 weights)."""
    config = dataclasses.replace(PRESETS[name], num_layers=1)
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    ids = mx.placeholder(mesh, "ids", [mx.Dimension("batch", 2), mx.Dimension("length", 4)], dtype="int32")
    Transformer(config, mesh).language_model(ids)
    per_layer = sum(
        v.value.size for v in graph.trainable_variables if v.value.shape.rank >= 2 and "embedding" not in v.name
    )
    assert per_layer * PRESETS[name].num_layers == billions * 2**30
    if name == "gspmd-64b":
        assert per_layer == 2**31


def test_finalized_trains_like_one_device_with_sharded_adam_slots():
    """2D finalized on x:2;y:4 (8 CPU devices): the same losses as one device, and each device's
    Adam slots hold 1/8 of every Table 1 weight."""
    config = TransformerConfig(vocab_size=32, d_model=16, d_ff=32, num_heads=4, d_kv=4, num_layers=1)
    losses = []
    for mesh_shape, sharding in (("x:1", ""), ("x:2;y:4", "gspmd-2d-finalized")):
        task = LmTask(model=config, source="markov", markov_vocab=32, batch_size=8, length=8, sharding=sharding)
        program = build(task, mesh_shape, "", "simd", AdamWeightDecayOptimizer(1e-2), 0)
        batch = task.train_batch(0)
        losses.append([float(program.train_fn(batch, seed=i)[0]) for i in range(6)])
        low = program.lowering
    np.testing.assert_allclose(losses[1], losses[0], rtol=2e-5, atol=2e-6)
    assert losses[0][-1] < losses[0][0]
    for v in low.graph.all_variables:
        if v.name.endswith(("/adam_m", "/adam_v")) and v.name.split("/decoder/0/")[-1].rsplit("/", 1)[0] in KERNELS:
            state = low.variable_state(v)
            assert {s.data.size for s in state.addressable_shards} == {v.value.size // 8}, v.name
