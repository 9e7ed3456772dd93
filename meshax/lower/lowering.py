"""`Lowering`: a graph plus its mesh implementation becomes runnable SPMD programs.

`Lowering(graph, {mesh: impl})` fixes every tensor's layout (the plan). `lowering.function(
outputs, updates=[...])` selects the ops those need and compiles them into one program: under
`jax.shard_map` for the SIMD backend, a loop over devices for the placement one. Collectives
are recorded while the program is traced, so the counters are exactly what runs. Variables
live here, between runs, in the backend's own form (a sharded global jax.Array for SIMD).
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np

from meshax.core.errors import ConfigError, GraphError, LayoutWarning, MeshaxError, did_you_mean
from meshax.core.graph import Graph, Mesh, Operation, Tensor, check_mesh
from meshax.layout.plan import make_plan, weight_shapes
from meshax.lower.context import LoweringContext, count_reads
from meshax.lower.counters import Counters
from meshax.lower.feeds import checked_seed, extremes, fed, output_list, tensor_of, update_list
from meshax.lower.function import LoweredFunction
from meshax.lower.mesh_impl import MeshImpl

if TYPE_CHECKING:
    from meshax.ops.variables import AssignOperation, VariableOperation


def _needed_ops(graph: Graph, roots: Sequence[Operation]) -> list[Operation]:
    """The ops the roots depend on (and the roots), in graph (topological) order. An op that
    makes its values without reading its inputs (`fill`: a shift that moves every value out)
    does not depend on them: XLA drops what only such an op reads."""
    needed: set[Operation] = set()
    stack = list(roots)
    while stack:
        op = stack.pop()
        if op in needed:
            continue
        needed.add(op)
        if getattr(op, "fill", None) is None:
            stack.extend(t.operation for t in op.inputs)
    return [op for op in graph.operations if op in needed]


def _output_slices(ctx: LoweringContext, t: Tensor, layout) -> list:
    """An output's slices in `layout`; what moving it there costs is blamed on the op that made
    it, so that the report names the line the output comes from."""
    if layout == ctx.plan[t]:
        return ctx.get(t).slices
    with ctx.blame(t.operation):
        return ctx.get(t, layout).slices


def _variable(x, lowering: Lowering, what: str):
    op = x.operation if isinstance(x, Tensor) else x
    if not getattr(op, "is_variable", False):
        raise TypeError(f"{x!r} is not a variable (make one with mx.get_variable)")
    if op.graph is not lowering.graph:  # (was taken: initialized as if it were this graph's, from its name)
        raise GraphError(f"{what}: variable {op.name!r} belongs to another graph than the one lowered")
    return op


def _warn_unused_rules(graph: Graph, impl: MeshImpl) -> None:
    """A rule for a dim no tensor has splits nothing: most likely a typo, so say so. Weight rules
    lay out only weight-shaped tensors: theirs is a dim no weight has."""
    names = {d.name for op in graph.operations for t in op.outputs for d in t.shape}
    shapes = weight_shapes(graph.operations)
    checks = [(impl.layout_rules, names, "no tensor of the graph has")]
    if impl.weight_rules is not None:
        checks.append((impl.weight_rules, {d for s in shapes for d in s}, "no weight has"))
    for rules, have, who in checks:
        for tensor_dim in rules.tensor_dim_names:
            if tensor_dim not in have:
                kind = "weight layout rule" if rules is impl.weight_rules else "layout rule"
                also = f" (the weights' dims: {', '.join(sorted(have))})" if rules is impl.weight_rules else ""
                warnings.warn(
                    f"{kind} {tensor_dim}:{','.join(rules.mesh_dims_for(tensor_dim))} splits nothing: "
                    f"{who} a dim {tensor_dim!r}{did_you_mean(tensor_dim, have) or also}",
                    LayoutWarning,
                    stacklevel=3,
                )
    for exempt in sorted(getattr(impl.weight_rules, "exempt", ()), key=sorted):
        if exempt not in shapes:
            known = ", ".join(f"[{','.join(sorted(s))}]" for s in sorted(shapes, key=sorted))
            warnings.warn(
                f"weight layout exception [{','.join(sorted(exempt))}] exempts nothing: no variable has exactly "
                f"these dims (the variables' shapes: {known})",
                LayoutWarning,
                stacklevel=3,
            )


class Lowering:
    """Lays out a graph on its mesh, keeps its variables, and builds SPMD programs from it."""

    def __init__(self, graph: Graph, mesh_to_impl: Mapping[Mesh, MeshImpl], seed: int = 0):
        if not isinstance(mesh_to_impl, Mapping):
            raise TypeError(
                f"Lowering takes the graph and a dict {{mesh: its implementation}}, got {type(mesh_to_impl).__name__} "
                "as the second argument: mx.Lowering(graph, {mesh: mx.SimdMeshImpl(...)})"
            )
        if len(mesh_to_impl) != 1:
            raise ConfigError(
                f"Lowering takes exactly one mesh and its implementation, got {len(mesh_to_impl)}; "
                "meshax lowers one mesh per graph"
            )
        ((self.mesh, self.impl),) = mesh_to_impl.items()
        if not isinstance(graph, Graph):
            raise GraphError(
                f"mx.Lowering: the graph given is {graph!r} ({type(graph).__name__}), not an mx.Graph: "
                "mx.Lowering(graph, {mesh: mx.SimdMeshImpl(...)})"
            )
        check_mesh(self.mesh, "mx.Lowering's dict {mesh: implementation}")
        if not isinstance(self.impl, MeshImpl):
            raise TypeError(f"the implementation of mesh {self.mesh.name!r} must be a MeshImpl, got {self.impl!r}")
        self.graph = graph
        for op in graph.operations:
            if op.mesh is not self.mesh:
                other = " of another graph" if self.mesh.graph is not graph else ""
                raise GraphError(
                    f"op {op.name} is on mesh {op.mesh.name!r}, but the implementation given is for mesh "
                    f"{self.mesh.name!r}{other}: give the mesh this graph's ops are on (mx.Mesh(graph, ...))"
                )
        _warn_unused_rules(graph, self.impl)
        self.plan = make_plan(graph.operations, self.impl.layout_rules, self.impl.shape, self.impl.weight_rules)
        self.seed = checked_seed(seed, "mx.Lowering's seed", low=-(2**31))  # (was refused by JAX at the first run)
        self._variables: dict[Operation, object] = {}  # variable op -> backend value
        # (variable op, dtype) -> the variable's value cast to dtype, dropped when that changes
        self._copies: dict[tuple[Operation, np.dtype], object] = {}
        self._counters: Counters | None = None

    # ---- variables ---------------------------------------------------------------------------
    def _spec(self, t: Tensor) -> tuple:
        return (t.shape, t.dtype, self.plan[t])

    def initialize(self, variables: Sequence[VariableOperation] | None = None) -> None:
        """Give variables (default: all) that have no value yet their initial values, sharded on
        the devices. Keyed by (seed, variable name), so the values do not depend on the layout."""
        todo = [v for v in (self.graph.all_variables if variables is None else variables) if v not in self._variables]
        if todo:  # (checked first: this runs before every step)
            todo = [v for v in (_variable(v, self, "lowering.initialize") for v in todo) if v not in self._variables]
            base = jax.random.key(self.seed)
            for v in todo:
                key = jax.random.fold_in(base, zlib.crc32(v.name.encode()))
                try:
                    self._variables[v] = self.impl.initialize(v.initializer, key, self._spec(v.outputs[0]))
                except MeshaxError as e:
                    raise type(e)(f"variable {v.name!r} {v.outputs[0].shape}: {e}") from None

    def _variable_state(self, var: VariableOperation):
        """The variable's current value, initialized (sharded, on the devices) on first use."""
        if var not in self._variables:
            self.initialize([var])
        return self._variables[var]

    def variable_value(self, var) -> np.ndarray:
        """The variable's full value, as a NumPy array."""
        var = _variable(var, self, "lowering.variable_value")
        return self.impl.fetch(self._variable_state(var), self._spec(var.outputs[0]))

    def set_variable_value(self, var, value) -> None:
        """Set the variable from a full array, split onto the devices by its layout. A jax.Array
        (e.g. restored from a checkpoint) is resharded on the devices, never gathered to the host.
        Values the cast to the variable's dtype would change are refused, as a feed's are (70000
        to a float16 variable: inf; 2.5 to an int32 one)."""
        var = _variable(var, self, "lowering.set_variable_value")
        t = var.outputs[0]
        if list(np.shape(value)) != t.shape.to_integer_list:
            raise GraphError(
                f"variable {var.name} has shape {t.shape.to_integer_list} ({t.shape}); got {list(np.shape(value))}"
            )
        spec = self._spec(t)
        if isinstance(value, jax.Array):
            if value.dtype != t.dtype and value.size:  # (checked as a feed is, on two values: never gathered)
                fed(t, extremes(value), f"variable {var.name!r}", "set to")
            # Always a copy (may_alias=False): the next step donates the variable's buffer, which
            # must never be the caller's array (another Lowering's state, a restored checkpoint).
            sharding = self.impl.global_sharding(t.shape, spec[2])  # (the layout's, where its splits divide)
            array = jax.device_put(value.astype(t.dtype), sharding, may_alias=False)
            self._variables[var] = self.impl.from_global(array, spec)
        else:  # (cast as a feed is: values it would change, 70000 to float16 say, are refused)
            self._variables[var] = self.impl.put(fed(t, value, f"variable {var.name!r}", "set to"), spec)
        self._drop_copies([var])

    def _drop_copies(self, variables) -> None:
        """Forget the kept copies of `variables`, whose values changed (`_cast_copy` makes the
        next where a program that keeps copies needs one)."""
        dtypes = {dtype for _, dtype in self._copies}
        for var in variables:
            for dtype in dtypes:
                self._copies.pop((var, dtype), None)

    def _cast_copy(self, var: VariableOperation, dtype: np.dtype):
        """The variable's value cast to `dtype`, kept while the variable keeps that value: made
        here once (the first call, or after the value was set from outside), then by the
        programs that update the variable (`_cast_copies`)."""
        if (var, dtype) not in self._copies:
            shape, _, layout = self._spec(var.outputs[0])
            state = self.impl.to_padded(self._variable_state(var), (shape, var.outputs[0].dtype, layout))
            self._copies[(var, dtype)] = self.impl.from_padded(state.astype(dtype), (shape, dtype, layout))
        return self._copies[(var, dtype)]

    def variable_state(self, var) -> jax.Array:
        """The variable as a global jax.Array with its layout's NamedSharding, for either backend:
        each device holds only its slice (checkpoints write it as it is); a dim whose split does
        not divide is replicated (`MeshImpl.global_sharding`). It is the live state,
        not a copy: a step that updates the variable consumes it (donation), so keep a copy
        (`jnp.copy`) or the value (`variable_value`) to hold it across steps."""
        var = _variable(var, self, "lowering.variable_state")
        return self.impl.to_global(self._variable_state(var), self._spec(var.outputs[0]))

    # ---- building programs -------------------------------------------------------------------
    @staticmethod
    def _inputs_of(ops: list[Operation]) -> list[Tensor]:
        """Tensors a program takes as arguments: placeholders, imported arrays, variables."""
        return [t for op in ops if getattr(op, "is_input", False) for t in op.outputs]

    def _cast_copies(self, ops: list[Operation], updated: list[VariableOperation]) -> dict[tuple, list[Operation]]:
        """{(variable, dtype): its casts}: the casts among `ops` (outside loops) of a variable the
        program updates to a narrower dtype, laid out as the variable, so that a copy kept in
        that layout is their value: a bfloat16 weight of a float32 master, say. The program
        reads the copy kept from the step before and writes the next from the updated value, so
        no step casts its weights again (the same values: fewer bytes moved each step)."""
        kept = set(updated)
        copies: dict[tuple, list[Operation]] = {}
        for op in ops:
            if getattr(op, "is_cast", False) and not op.in_loop:
                (x,), (out,) = op.inputs, op.outputs
                if x.operation in kept and out.dtype.itemsize < x.dtype.itemsize and self.plan[x] == self.plan[out]:
                    copies.setdefault((x.operation, out.dtype), []).append(op)
        return copies

    def _body(self, ops, inputs, outputs, updated, counters: Counters, copies=None, out_layouts=None):
        """The program on slice lists; every collective it emits is recorded in `counters`. With
        `copies` (`_cast_copies`), the casts read the copies that follow the inputs' slices, and
        the program returns the next copies after the variables' new values. The outputs come
        out in `out_layouts` (default: their planned ones), moved there at the end of the step."""
        impl, plan, copies = self.impl, self.plan, copies or {}
        out_layouts = out_layouts or [plan[t] for t in outputs]
        copied = {op for casts in copies.values() for op in casts}

        def body(input_slices: list[list], seed_slices: list) -> list[list]:
            ctx = LoweringContext(impl, plan, counters, seed_slices, count_reads(ops, outputs))
            for t, slices in zip(inputs, input_slices):
                ctx.set_output(t, slices)
            for casts, slices in zip(copies.values(), input_slices[len(inputs) :]):
                for op in casts:
                    ctx.set_output(op.outputs[0], slices)
            for op in ops:
                if getattr(op, "is_input", False) or op in copied:
                    continue
                ctx.op = op
                op.lower(ctx)
            ctx.op = None
            # the variables' new values first, in the variables' argument order: JAX gives each
            # output the first donated argument of its shape and dtype, so each new value then
            # reuses its own variable's buffer (a loss must not take a scalar variable's, which
            # forces XLA to copy every variable in and out)
            new = [ctx.updates[v] for v in updated]
            new_copies = [ctx.slicewise(lambda a, d=d: a.astype(d), ctx.updates[v]) for v, d in copies]
            return new + new_copies + [_output_slices(ctx, t, layout) for t, layout in zip(outputs, out_layouts)]

        return body

    def _program(
        self,
        outputs: list[Tensor],
        updates: list[AssignOperation],
        counters: Counters,
        cast_copies: bool = False,
        out_layouts=None,
    ):
        ops = _needed_ops(self.graph, [*(t.operation for t in outputs), *updates])
        inputs = self._inputs_of(ops)
        position = {t.operation: i for i, t in enumerate(inputs)}
        updated = sorted((u.variable for u in updates), key=lambda v: position.get(v, len(inputs)))
        copies = self._cast_copies(ops, updated) if cast_copies else {}
        return ops, inputs, updated, copies, self._body(ops, inputs, outputs, updated, counters, copies, out_layouts)

    @property
    def counters(self) -> Counters:
        """The collectives and FLOPs of the whole graph (every tensor computed once)."""
        if self._counters is None:
            self._counters = self.trace_step(
                [t for op in self.graph.operations if not op.in_loop for t in op.outputs],
                [op for op in self.graph.operations if hasattr(op, "variable")],
            )
        return self._counters

    def trace_step(self, outputs: Sequence[Tensor] = (), updates: Sequence = ()) -> Counters:
        """The counters of a program computing `outputs` and `updates`, by tracing alone: no
        device, no memory, so it works for meshes far larger than this machine."""
        return self.trace_program(outputs, updates)[0]

    def trace_program(self, outputs: Sequence[Tensor] = (), updates: Sequence = ()):
        """(counters, jaxpr) of the program, traced abstractly; the jaxpr's size is the program's."""
        counters = Counters()
        outputs = output_list(self, outputs, "lowering.trace_program's outputs")
        _, inputs, _, _, body = self._program(outputs, update_list(self, updates), counters)
        jaxpr = self.impl.trace(body, [self._spec(t) for t in inputs])
        return counters, jaxpr

    def function(
        self,
        outputs: Tensor | Sequence[Tensor] = (),
        updates: Sequence = (),
        donate: Sequence[Tensor] = (),
        cast_copies: bool | None = None,
    ) -> LoweredFunction:
        """A compiled program computing `outputs` and applying `updates` (assign ops); the
        buffers of the placeholders in `donate` may be consumed by it (`call_global`). With
        `cast_copies`, a variable it updates and reads in a narrower dtype (a bfloat16 weight of a
        float32 master) is read from a copy in that dtype kept between calls, which the update
        writes: the same values, without casting every weight again at every step. By default
        on GPUs only (there XLA writes the copy in the update's own kernel; on the CPU it reads
        the new weight again, and the step moved more bytes, not fewer)."""
        return LoweredFunction(self, outputs, updates, donate, cast_copies)

    def report(self, counters: Counters | None = None, width: int = 132) -> str:
        """The cost report: every collective with its op and source line, values, bytes and
        FLOPs, then totals per kind (default: of the whole graph, `Lowering.counters`), as a
        table at most `width` characters wide."""
        from meshax.lower.report import format_report

        return format_report(self, counters or self.counters, width)

    def tensor_layout(self, t: Tensor):
        """t's planned layout, as a TensorLayout (mesh axis indices per dim); `layout_of` gives it as a string."""
        return self.plan[tensor_of(self, t, "lowering.tensor_layout")]

    def slice_bytes(self, t: Tensor, layout=None, dtype=None) -> int:
        """Bytes of one device's slice of `t` in `layout` (default: its planned one), at `dtype`
        (default: t's own)."""
        elements = int(np.prod(self.impl.slice_shape(t.shape, layout or self.plan[t]), dtype=np.int64))
        return elements * np.dtype(dtype or t.dtype).itemsize

    def layout_of(self, t: Tensor) -> str:
        """t's final layout as rules, e.g. "batch:rows;d_ff:cols" ("" when replicated)."""
        from meshax.lower.explain import layout_string

        t = tensor_of(self, t, "lowering.layout_of")
        return layout_string(t.shape, self.plan[t], self.impl.shape)

    def draw(self, t: Tensor, path: str) -> str:
        """Draw which device holds which block of `t` in its planned layout, to a PNG or SVG file
        (`lower.draw.draw_layout`; needs matplotlib); returns the path."""
        from meshax.lower.draw import draw_layout

        t = tensor_of(self, t, "lowering.draw")
        return draw_layout(t.name, t.shape, self.plan[t], self.impl.shape, path)

    def explain(self, threshold: int = 1 << 20) -> str:
        """Every tensor's layout and where it came from (a rule, an annotation at file:line, or
        propagated from which tensor through which op), then warnings: tensors of at least
        `threshold` values left replicated over a mesh dim, and reshards that annotations force."""
        from meshax.lower.explain import explain

        return explain(self, threshold)
