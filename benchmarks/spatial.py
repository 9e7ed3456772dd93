"""Section 8: spatially partitioned convolutions, meshax's halo exchange against XLA's.

A conv net's training step (three 3x3 SAME convolutions with relu, channels c -> c -> c -> c,
loss = mean of the squared output, SGD on the three filters) on images split over both mesh
dims in space ("h:rows;w:cols" on rows:2;cols:4; --quick: smaller images), once as meshax's
program and once as the same jnp under `jax.jit` with the same shardings, so that XLA's SPMD
partitioner does its own halo exchange. Both take the same host batch each step and return the
loss. Reported: the step-time ratio meshax / XLA (interleaved medians; target <= 1.0), and the
values each device sends in halos (meshax's counters, equal to the collective permutes of its
compiled HLO) against what allgathering the split spatial dims of every convolution's input
would receive instead (target: halos < allgather).
"""

from __future__ import annotations

import math

import numpy as np

from benchmarks import hlo
from benchmarks.records import collectives_records, record, side, step_ratio
from benchmarks.timing import interleaved
from meshax.lower.mesh_impl import jit_for_platform

MESH, LAYOUT = "rows:2;cols:4", "h:rows;w:cols"
QUICK = {"size": (4, 32, 32, 8), "steps": 10, "warmup": 3}
FULL = {"size": (8, 128, 128, 16), "steps": 30, "warmup": 5}
LR, LAYERS = 0.01, 3


class MeshaxNet:
    def __init__(self, size):
        import meshax as mx

        b, h, w, c = size
        self.graph = mx.Graph()
        mesh = mx.Mesh(self.graph, "mesh")
        x = mx.placeholder(mesh, "x", f"batch:{b};h:{h};w:{w};c0:{c}")
        self.filters = []
        y = x
        for i in range(LAYERS):
            f = mx.get_variable(
                mesh, f"f{i}", f"fh:3;fw:3;c{i}:{c};c{i + 1}:{c}", initializer=mx.initializers.normal(0.2)
            )
            self.filters.append(f)
            y = mx.conv2d(y, f, (1, 1), "SAME")
            y = mx.relu(y) if i < LAYERS - 1 else y
        self.loss = mx.reduce_mean(mx.square(y))
        grads = mx.gradients([self.loss], self.filters)
        updates = [mx.assign(f, f - LR * g) for f, g in zip(self.filters, grads)]
        self.lowering = mx.Lowering(self.graph, {mesh: mx.SimdMeshImpl(MESH, LAYOUT)})
        self.fn = self.lowering.function(self.loss, updates=updates)

    def step(self, x):
        return float(self.fn({"x": x}))


class JaxNet:
    """The same step in jnp, jitted with the shardings meshax's plan gives x and the filters."""

    def __init__(self, m: MeshaxNet):
        import jax
        import jax.numpy as jnp

        low = m.lowering
        x_t = next(t for op in m.graph.operations for t in op.outputs if t.name == "x")
        self.x_sharding = low.impl.named_sharding(low.plan[x_t])
        f_sh = [low.impl.named_sharding(low.plan[f]) for f in m.filters]
        self.params = [jax.device_put(low.variable_value(f), s) for f, s in zip(m.filters, f_sh)]

        def loss(params, x):
            y = x
            for i, f in enumerate(params):
                y = jax.lax.conv_general_dilated(y, f, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
                y = jax.nn.relu(y) if i < LAYERS - 1 else y
            return jnp.mean(jnp.square(y))

        def step(params, x):
            value, grads = jax.value_and_grad(loss)(params, x)
            return value, [p - LR * g for p, g in zip(params, grads)]

        self._step = jit_for_platform(
            step,
            in_shardings=(f_sh, self.x_sharding),
            out_shardings=(jax.sharding.NamedSharding(self.x_sharding.mesh, jax.sharding.PartitionSpec()), f_sh),
            donate_argnums=(0,),
        )

    def step(self, x):
        value, self.params = self._step(self.params, x)
        return float(value)

    def compiled_text(self, x) -> str:
        return self._step.lower(self.params, x).compile().as_text()


def _allgather_alternative(m: MeshaxNet) -> int:
    """Values one device would receive if every convolution-family op gathered the split
    spatial dims of its windowed input instead of exchanging halos."""
    from meshax.layout.rules import slice_shape, split_factor
    from meshax.ops.conv import ConvFilterGradOperation, ConvInputGradOperation, ConvOperation

    low, total = m.lowering, 0
    for op in m.graph.operations:
        if isinstance(op, ConvOperation | ConvFilterGradOperation):
            t = op.inputs[0]  # the input x, whose halos are exchanged
        elif isinstance(op, ConvInputGradOperation):
            t = op.inputs[1]  # the incoming gradient, laid out like the output
        else:
            continue
        layout = low.plan[t]
        spatial = [a for d, a in zip(t.shape, layout.axes) if d.name in op.window.names and a]
        parts = split_factor(tuple(m for a in spatial for m in a), low.impl.shape)
        total += math.prod(slice_shape(t.shape, layout, low.impl.shape)) * (parts - 1)
    return total


def run(quick: bool) -> list[dict]:
    p = QUICK if quick else FULL
    b, h, w, c = p["size"]
    cfg = {"mesh": MESH, "layout": LAYOUT, "size": f"b={b},h={h},w={w},c={c},layers={LAYERS}", "program": "train step"}
    x = np.random.default_rng(0).normal(size=p["size"]).astype(np.float32)
    m = MeshaxNet(p["size"])
    j = JaxNet(m)  # from meshax's initial filters, before meshax's first step
    l_mx, l_jax = m.step(x), j.step(x)
    agree = bool(np.isclose(l_mx, l_jax, rtol=1e-4))
    out = []
    if not agree:
        return [record(8, "step time meshax / XLA", cfg, None, "", status="not timed: first losses differ")]
    t = interleaved(lambda: m.step(x), lambda: j.step(x), p["steps"], p["warmup"])
    out.append(
        step_ratio(
            8,
            "step time meshax / XLA",
            cfg,
            t,
            "jax.jit + NamedSharding",
            first_loss={"meshax": l_mx, "xla": l_jax, "agree": agree},
        )
    )
    counters = m.fn.counters
    halo = int(counters["permute"].values)
    compiled = hlo.collectives(m.fn.compiled_text())
    gathered = _allgather_alternative(m)
    out.append(
        record(
            8,
            "halo values / allgather values",
            cfg,
            halo / gathered,
            "ratio",
            target="< 1.0",
            met=halo < gathered,
            numerator=side("halo exchange (permute values per device)", halo, "values"),
            denominator=side("allgather of the split spatial dims instead", gathered, "values"),
            hlo_permute=compiled["permute"],
            counters_equal_hlo=compiled["permute"] == {"count": counters["permute"].count, "values": halo},
        )
    )
    return out + collectives_records(
        8,
        cfg,
        {"meshax (compiled HLO)": compiled, "XLA partitioner (compiled HLO)": hlo.collectives(j.compiled_text(x))},
    )
