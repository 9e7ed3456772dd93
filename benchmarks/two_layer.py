"""The paper's section 8 example, y = relu(x w + bias) v, in meshax and in plain JAX.

Loss `reduce_sum(y * g)` with g a placeholder; gradients of w, bias, v (and of x, which the
paper's Table 1 counts: the layer sits inside a deeper network, so its input gradient is
needed); SGD updates with `mx.optimize.SgdOptimizer`, which also counts a `global_step`.

`MeshaxModel` holds one graph and two programs on it:
  * `comm_fn`:  loss and dx, plus the updates: the program Table 1 describes (section 1, 5);
  * `step_fn`:  loss plus the updates: a training step (sections 2, 3, 5).
`JaxModel` is the same training step written with jnp and `jax.grad`, jitted with the
`NamedSharding`s that meshax's plan gives x, g, w, bias and v on the same devices.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from meshax.lower.mesh_impl import jit_for_platform

LR = 0.001

# (mesh, layout) of the paper's five layouts, on 8 devices.
LAYOUTS = [
    ("all:8", ""),
    ("all:8", "batch:all"),
    ("all:8", "hidden:all"),
    ("rows:2;cols:4", "batch:rows;hidden:cols"),
    ("rows:2;cols:2;planes:2", "batch:rows;hidden:cols;io:planes"),
]


@dataclasses.dataclass(frozen=True)
class Size:
    b: int
    io: int
    h: int

    def __str__(self) -> str:
        return f"b={self.b},io={self.io},h={self.h}"


def _mesh_dims(mesh_shape: str) -> dict[str, int]:
    return {k: int(v) for k, v in (p.split(":") for p in mesh_shape.split(";"))}


def table1(mesh_shape: str, layout: str, s: Size) -> tuple[float, float, str]:
    """(main term, lower-order terms, formula) of the values allreduced per device.

    Main terms are Table 1 of the paper. Lower-order terms: the bias gradient, d_h divided by
    the split of hidden, allreduced whenever batch is split; the scalar loss (1) whenever its
    sum runs over split dims (batch or io)."""
    m = _mesh_dims(mesh_shape)
    b, io, h = s.b, s.io, s.h
    if layout == "":
        return 0.0, 0.0, "0"
    if layout == "batch:all":
        return 2 * io * h, h + 1, "2·d_io·d_h"
    if layout == "hidden:all":
        return 2 * b * io, 0.0, "2·b·d_io"
    if layout == "batch:rows;hidden:cols":
        r, c = m["rows"], m["cols"]
        return 2 * b * io / r + 2 * io * h / c, h / c + 1, "2·b·d_io/r + 2·d_io·d_h/c"
    if layout == "batch:rows;hidden:cols;io:planes":
        r, c, p = m["rows"], m["cols"], m["planes"]
        return (
            2 * b * io / (r * p) + 2 * b * h / (r * c) + 2 * io * h / (p * c),
            h / c + 1,
            "2·b·d_io/(r·p) + 2·b·d_h/(r·c) + 2·d_io·d_h/(p·c)",
        )
    raise ValueError(f"no Table 1 formula for layout {layout!r}")


def feeds(s: Size, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(s.b, s.io)).astype(np.float32),
        "g": rng.normal(size=(s.b, s.io)).astype(np.float32) * 0.1,
    }


def build_graph(s: Size, annotations: dict | None = None):
    """(graph, mesh, tensors) of the two-layer network; tensors is a dict by name.
    `annotations` {"x" / "w" / "v": dims_mapping} are mesh_split on the reads of those tensors."""
    import meshax as mx

    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    batch, io, hidden = mx.Dimension("batch", s.b), mx.Dimension("io", s.io), mx.Dimension("hidden", s.h)
    x = mx.placeholder(mesh, "x", [batch, io])
    g = mx.placeholder(mesh, "g", [batch, io])
    w = mx.get_variable(mesh, "w", [io, hidden], initializer=mx.initializers.normal(0.1))
    bias = mx.get_variable(mesh, "bias", [hidden])
    v = mx.get_variable(mesh, "v", [hidden, io], initializer=mx.initializers.normal(0.1))

    def read(name, t):  # t as the annotations say, where they say anything
        return mx.mesh_split(t, annotations[name]) if annotations and name in annotations else t

    h = mx.relu(mx.einsum(read("x", x), read("w", w), output_shape=[batch, hidden]) + bias)
    y = mx.einsum(h, read("v", v), output_shape=[batch, io])
    loss = mx.reduce_sum(y * g)
    dx, dw, dbias, dv = mx.gradients(loss, [x, w, bias, v])
    updates = mx.optimize.SgdOptimizer(LR).apply_grads([dw, dbias, dv], [w, bias, v])
    t = dict(x=x, g=g, w=w, bias=bias, v=v, y=y, loss=loss, dx=dx)
    return graph, mesh, t, updates


class MeshaxModel:
    """The meshax graph lowered on one mesh; programs are built lazily and kept."""

    def __init__(self, s: Size, mesh_shape: str, layout: str, devices=None, annotations: dict | None = None):
        import meshax as mx

        self.size, self.mesh_shape, self.layout = s, mesh_shape, layout
        self.graph, self.mesh, self.t, self.updates = build_graph(s, annotations)
        self.impl = mx.SimdMeshImpl(mesh_shape, layout, devices=devices)
        self.lowering = mx.Lowering(self.graph, {self.mesh: self.impl})
        self._comm_fn = self._step_fn = None
        self._hlo: dict[str, str] = {}

    @property
    def comm_fn(self):
        if self._comm_fn is None:
            self._comm_fn = self.lowering.function([self.t["loss"], self.t["dx"]], updates=self.updates)
        return self._comm_fn

    @property
    def step_fn(self):
        if self._step_fn is None:
            self._step_fn = self.lowering.function(self.t["loss"], updates=self.updates)
        return self._step_fn

    def params(self) -> list[np.ndarray]:
        return [self.lowering.variable_value(self.t[n]) for n in ("w", "bias", "v")]

    def compiled_text(self, program: str) -> str:
        """XLA's compiled HLO of `program` ("comm" or "step"), compiled once per model."""
        if program not in self._hlo:
            fn = self.comm_fn if program == "comm" else self.step_fn
            self._hlo[program] = fn.compiled_text()
        return self._hlo[program]

    def sharding(self, name: str):
        return self.impl.named_sharding(self.lowering.plan[self.t[name]])

    def step(self, f) -> float:
        return float(self.step_fn(f))


class JaxModel:
    """The same training step in plain JAX: jax.jit with NamedShardings, or one device."""

    def __init__(
        self, params: list[np.ndarray], shardings: dict | None = None, device=None, constraints: dict | None = None
    ):
        """`shardings`: {"x","g","w","bias","v","scalar"} -> NamedSharding; else all on `device`.
        `constraints`: {"x" / "w" / "v": NamedSharding}, with_sharding_constraint on their reads."""
        import jax
        import jax.numpy as jnp

        def c(a, name):
            return jax.lax.with_sharding_constraint(a, constraints[name]) if name in (constraints or {}) else a

        def loss_fn(params, x, g):
            w, bias, v = params
            y = jax.nn.relu(c(x, "x") @ c(w, "w") + bias) @ c(v, "v")
            return jnp.sum(y * g)

        def step(params, global_step, x, g):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, g)
            return loss, tuple(p - LR * d for p, d in zip(params, grads)), global_step + 1.0

        if shardings is not None:
            p_sh = tuple(shardings[n] for n in ("w", "bias", "v"))
            sc = shardings["scalar"]
            self._jit = jit_for_platform(
                step,
                in_shardings=(p_sh, sc, shardings["x"], shardings["g"]),
                out_shardings=(sc, p_sh, sc),
                donate_argnums=(0, 1),
            )
            self._x_sh, self._g_sh = shardings["x"], shardings["g"]
            put_p = [jax.device_put(p, s) for p, s in zip(params, p_sh)]
            self._gs = jax.device_put(np.float32(0), sc)
        else:
            self._jit = jit_for_platform(step, donate_argnums=(0, 1))
            self._x_sh = self._g_sh = device
            put_p = [jax.device_put(p, device) for p in params]
            self._gs = jax.device_put(np.float32(0), device)
        self._params = tuple(put_p)

    def _args(self, f):
        import jax

        return (self._params, self._gs, jax.device_put(f["x"], self._x_sh), jax.device_put(f["g"], self._g_sh))

    def step(self, f) -> float:
        loss, self._params, self._gs = self._jit(*self._args(f))
        return float(np.asarray(loss))

    def compiled_text(self, f) -> str:
        return self._jit.lower(*self._args(f)).compile().as_text()

    def params(self) -> list[np.ndarray]:
        return [np.asarray(p) for p in self._params]


def jax_twin(model: MeshaxModel) -> JaxModel:
    """The plain-JAX model with meshax's initial parameters and the shardings of its plan."""
    from jax.sharding import NamedSharding, PartitionSpec

    sh = {n: model.sharding(n) for n in ("x", "g", "w", "bias", "v")}
    sh["scalar"] = NamedSharding(model.impl.jax_mesh, PartitionSpec())
    return JaxModel(model.params(), shardings=sh)


_MODELS: dict = {}


def model(s: Size, mesh_shape: str, layout: str) -> MeshaxModel:
    """One MeshaxModel per (size, mesh, layout) per run, shared by the sections (and their
    compiled programs with it)."""
    key = (s, mesh_shape, layout)
    if key not in _MODELS:
        _MODELS[key] = MeshaxModel(s, mesh_shape, layout)
    return _MODELS[key]


def params_agree(a: list[np.ndarray], b: list[np.ndarray], tol: float = 1e-3) -> bool:
    """Whether two parameter lists are equal to `tol` (the two sides ran the same steps)."""
    return all(np.allclose(x, y, rtol=tol, atol=tol) for x, y in zip(a, b))
