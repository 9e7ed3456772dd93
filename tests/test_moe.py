"""mx.layers.moe: routing equal to a direct NumPy computation (dropped tokens included), the
balancing loss, and the all-to-all that splitting experts and batch over one mesh dim costs."""

import jax.numpy as jnp
import numpy as np
import pytest

import meshax as mx
from meshax.lower.hlo import hlo_collectives
from meshax.moe import expert_capacity

B, L, M = mx.Dimension("batch", 4), mx.Dimension("length", 8), mx.Dimension("d_model", 6)


def _reference(x, gate_w, wi, wo, group_size, capacity, gating):
    """The layer token by token: softmax gates, top-1 / top-2 (renormalized), then every first
    choice of a group in token order and after them every second choice, each kept while its
    expert has room; the output is the kept experts' ReLU MLPs weighted by their gates."""
    b, length, m = x.shape
    experts = gate_w.shape[1]
    groups = x.reshape(b, length // group_size, group_size, m)
    out, wanted, kept = np.zeros_like(groups), 0, 0
    for i in np.ndindex(groups.shape[:2]):
        tokens = groups[i]
        logits = tokens @ gate_w
        gates = np.exp(logits - logits.max(-1, keepdims=True))
        gates /= gates.sum(-1, keepdims=True)
        first = gates.argmax(-1)
        choices = [(first, gates[np.arange(group_size), first])]
        if gating == "top_2":
            rest = gates.copy()
            rest[np.arange(group_size), first] = 0
            second = rest.argmax(-1)
            g1, g2 = choices[0][1], rest[np.arange(group_size), second]
            choices = [(first, g1 / (g1 + g2 + 1e-9)), (second, g2 / (g1 + g2 + 1e-9))]
        fill = np.zeros(experts, int)
        for index, gate in choices:
            for n, e in enumerate(index):
                wanted += 1
                if fill[e] < capacity:
                    fill[e] += 1
                    kept += 1
                    out[i][n] += gate[n] * (np.maximum(tokens[n] @ wi[e], 0) @ wo[e])
    return out.reshape(x.shape), 1 - kept / wanted


def _layer(gating="top_2", capacity_factor=1.0, experts=4, group_size=4):
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", [B, L, M])
    result = mx.layers.moe(
        x, 5, num_experts=experts, group_size=group_size, gating=gating, capacity_factor=capacity_factor
    )
    return graph, mesh, result


CASES = [
    (mx.SimdMeshImpl, "rows:2;cols:4", "", "top_2", 1.0),
    (mx.SimdMeshImpl, "rows:2;cols:4", "batch:rows;experts:rows", "top_1", 1.25),
    (mx.SimdMeshImpl, "rows:2;cols:4", "batch:cols;experts:cols;expert_hidden:rows", "top_2", 1.0),
    (mx.SimdMeshImpl, "rows:2;cols:4", "batch:rows;experts:rows;d_model:cols", "top_2", 2.0),
    pytest.param(
        mx.PlacementMeshImpl, "rows:2;cols:2", "batch:cols;experts:cols", "top_2", 1.25, marks=pytest.mark.slow
    ),
]


@pytest.mark.parametrize("backend,mesh_shape,layout,gating,factor", CASES)
def test_moe_equals_numpy_routing(backend, mesh_shape, layout, gating, factor):
    graph, mesh, result = _layer(gating, factor)
    lowering = mx.Lowering(graph, {mesh: backend(mesh_shape, layout)})
    x = np.random.RandomState(0).randn(4, 8, 6).astype(np.float32)
    out, _, dropped = lowering.function(list(result))({"x": x})
    var = {v.name: lowering.variable_value(v) for v in graph.all_variables}
    capacity = expert_capacity(4, 4, factor)
    want, want_dropped = _reference(x, var["moe/gate"], var["moe/wi"], var["moe/wo"], 4, capacity, gating)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    assert dropped == pytest.approx(want_dropped)
    if factor <= 1.0:
        assert want_dropped > 0  # the case does exercise dropping at capacity


def test_balancing_loss_is_one_when_routing_is_balanced():
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    experts = mx.Dimension("d_model", 4)
    x = mx.placeholder(mesh, "x", [B, L, experts])
    result = mx.layers.moe(x, 3, num_experts=4, group_size=8, gating="top_1", capacity_factor=1.0)
    lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "batch:rows;experts:rows")})
    lowering.set_variable_value(graph.all_variables[0], np.eye(4, dtype=np.float32))  # gate: token -> its expert
    tokens = 5.0 * np.eye(4, dtype=np.float32)[np.arange(8) % 4]  # each expert is first for 2 of 8 tokens
    loss, dropped = lowering.function([result.loss, result.dropped_fraction])({"x": np.broadcast_to(tokens, (4, 8, 4))})
    assert loss == pytest.approx(1.0, abs=1e-6)
    assert dropped == 0.0


def test_all_to_all_values_equal_the_formula_and_the_hlo():
    """Per MoE layer and direction, one all-to-all over the mesh dim that splits batch and
    experts, of each device's slice of [experts E, groups G, capacity C, d_model M]:
    E * G * C * M / n values (n devices on that mesh dim); twice forward, twice backward."""
    graph, mesh, result = _layer("top_2", 1.25)
    loss = mx.reduce_sum(result.output * result.output) + result.loss
    x = graph.operations[0].outputs[0]
    grads = mx.gradients(loss, [*graph.trainable_variables, x])  # (x: as a layer inside a model)
    lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("rows:2;cols:4", "batch:cols;experts:cols")})
    forward = lowering.function(result.output)
    E, G, C, n = 4, 4 * 8 // 4, expert_capacity(4, 4, 1.25), 4
    assert [s.values for s in forward.counters["alltoall"].sites] == [E * G * C * 6 // n] * 2
    step = lowering.function([loss, *grads])
    sites = step.counters["alltoall"].sites
    assert len(sites) == 4 and {s.values for s in sites} == {E * G * C * 6 // n}
    hlo = hlo_collectives(step.compiled_text())["alltoall"]
    assert (hlo["count"], hlo["values"]) == (4, 4 * E * G * C * 6 // n)


def test_moe_errors():
    for bad in (0.0, "2", float("nan"), float("inf")):  # ('2' a TypeError, nan a ValueError, inf an OverflowError)
        with pytest.raises(mx.GraphError, match="capacity_factor must be a finite number > 0"):
            _layer(capacity_factor=bad)
    _layer(capacity_factor=jnp.float32(1.25))  # (JAX's numbers are numbers)
    with pytest.raises(mx.GraphError, match="more than a group of 4 tokens can fill"):
        _layer(experts=8, capacity_factor=0.25)
    with pytest.raises(mx.GraphError, match="group_size 3 does not divide"):
        _layer(group_size=3)
    with pytest.raises(mx.GraphError, match="choose one of"):
        _layer(gating="top_3")
    with pytest.raises(mx.GraphError, match="at least 2 experts"):
        _layer(experts=1)
    graph = mx.Graph()
    x = mx.placeholder(mx.Mesh(graph, "m"), "x", [B, L, M])
    with pytest.raises(mx.GraphError, match="model_dim 'd' is not a dim of x"):
        mx.layers.moe(x, 5, num_experts=4, model_dim="d")  # (a KeyError)


def test_moe_refuses_bad_sizes_and_dim_names_by_name():
    for bad in (0, -4, 2.5):  # (0 meant the whole token dim; hidden_dim=0: ZeroDivisionError)
        with pytest.raises(mx.GraphError, match=rf"group_size={bad} is not a whole number of at least 1"):
            _layer(group_size=bad)
        graph = mx.Graph()
        x = mx.placeholder(mx.Mesh(graph, "m"), "x", [B, L, M])
        with pytest.raises(mx.GraphError, match=rf"hidden_dim={bad} is not a whole number of at least 1"):
            mx.layers.moe(x, bad, num_experts=4)  # (2.5 was cut to 2)
    # x's dims may not take the names of the layer's own dims (they made repeated dim names, or
    # a size clash); the token dim is renamed, and an outer dim named 'experts' works
    for dims, taken in (
        ([B, mx.Dimension("expert_capacity", 2), L, M], "expert_capacity"),
        ([mx.Dimension("group", 2), L, M], "group"),
        ([B, L, mx.Dimension("experts", 6)], "experts"),
        ([mx.Dimension("length_chunk", 2), L, M], "length_chunk"),
    ):
        graph = mx.Graph()
        x = mx.placeholder(mx.Mesh(graph, "m"), "x", dims)
        with pytest.raises(mx.GraphError, match=f"has a dim '{taken}', a name the layer gives its own dims"):
            mx.layers.moe(x, 5, num_experts=4, group_size=4)
    graph = mx.Graph()
    x = mx.placeholder(mx.Mesh(graph, "m"), "x", [mx.Dimension("experts", 2), mx.Dimension("group", 8), M])
    assert mx.layers.moe(x, 5, num_experts=4, group_size=4).output.shape == x.shape
