"""`Lowering`: a graph plus its mesh implementation becomes runnable SPMD programs.

`Lowering(graph, {mesh: impl})` fixes every tensor's layout (the plan). `lowering.function(
outputs, updates=[...])` selects the ops those need and compiles them into one program: under
`jax.shard_map` for the SIMD backend, a loop over devices for the placement one. Collectives
are recorded while the program is traced, so the counters are exactly what runs. Variables
live here, between runs, in the backend's own form (a sharded global jax.Array for SIMD).
"""

from __future__ import annotations

import functools
import numbers
import operator
import warnings
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from meshax.core.errors import ConfigError, GraphError, LayoutWarning, MeshaxError, did_you_mean
from meshax.core.graph import Graph, Mesh, Operation, Tensor, check_mesh
from meshax.layout.plan import make_plan, weight_shapes
from meshax.lower.context import LoweringContext, count_reads
from meshax.lower.counters import Counters
from meshax.lower.mesh_impl import MeshImpl
from meshax.lower.padding import padded_dims

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


def _fed(t: Tensor, value, who: str = "", verb: str = "fed") -> np.ndarray:
    """A value fed to placeholder t (or, `who` and `verb` saying so, set to a variable whose value t
    is) as an array of t's dtype; refused where the cast would change it: floats given to integers
    or bools, integers outside the dtype's range, finite values past a float dtype's (float32 past
    65504 given as float16: inf), text."""
    who = who or f"placeholder {t.name!r}"
    value = np.asarray(value)
    have, want = value.dtype, t.dtype
    if have == want:
        return value
    problem = ""
    have_kind, want_kind = (("f" if jnp.issubdtype(d, jnp.floating) else d.kind) for d in (have, want))  # (bf16: 'V')
    if have_kind not in "biufc":
        problem = f"an array of {have}"
    elif want_kind in "biuf" and have_kind in "fc" and have_kind != want_kind:
        dropped = "the fractions" if have_kind == "f" else "the imaginary parts"
        problem = f"{have} values (cast them yourself if dropping {dropped} is meant)"
    elif want_kind in "biu" and have_kind in "iu" and value.size:
        low, high = (0, 1) if want.kind == "b" else (np.iinfo(want).min, np.iinfo(want).max)
        if value.min() < low or value.max() > high:
            problem = f"values from {value.min()} to {value.max()}, outside {want}'s {low}..{high}"
    if problem:
        raise MeshaxError(f"{who} is {want} {t.shape}; it was {verb} {problem}")
    with np.errstate(over="ignore"):
        out = value.astype(want, copy=False)
    if want_kind == "f" and have_kind in "iuf" and value.size and np.isinf(out).any():
        overflowed = np.isinf(out) & ~np.isinf(value)  # (finite values past a narrower float's range)
        if overflowed.any():
            raise MeshaxError(
                f"{who} is {want} {t.shape}; it was {verb} {have} values up to "
                f"{np.abs(value[overflowed]).max()}, which are inf in {want} (largest {float(jnp.finfo(want).max)})"
            )
    return out


def _extremes(array: jax.Array) -> np.ndarray:
    """The least and the greatest finite value of a jax.Array, on the host: what decides whether
    `_fed` refuses its cast (where its dtype's kind alone does not), for an array left on the
    devices. A complex array's kind decides alone: none of its values."""
    if jnp.issubdtype(array.dtype, jnp.complexfloating):
        return np.empty(0, array.dtype)
    finite = jnp.where(jnp.isfinite(array), array, 0) if jnp.issubdtype(array.dtype, jnp.floating) else array
    return np.asarray(jnp.stack([jnp.min(finite), jnp.max(finite)]))


def _not_a_tensor(x, what: str) -> TypeError:
    """The error for `x` given where `what` takes a meshax Tensor, saying what to give instead."""
    if isinstance(x, str):
        hint = ": give the tensor itself, not its name"
    elif getattr(x, "is_variable", False):
        hint = f": give the variable's value, {x.name}.value"
    else:
        hint = ""
    return TypeError(f"{what}: {x!r} ({type(x).__name__}) is not a meshax Tensor{hint}")


def _tensor_of(lowering: Lowering, t, what: str) -> Tensor:
    """`t`, a Tensor of the lowered graph; else an error saying what it is."""
    if not isinstance(t, Tensor):
        raise _not_a_tensor(t, what)
    if t.graph is not lowering.graph:
        raise GraphError(f"{what}: tensor {t.name} belongs to another graph than the one lowered")
    return t


def _checked_seed(seed, what: str, low: int = 0) -> int:
    """A seed as an int where it is one JAX tells apart from every other: a whole number in
    low..2**32 - 1 (JAX keeps a seed's low 32 bits: 2**40 is 0)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not low <= int(seed) < 2**32:
        raise ConfigError(
            f"{what} {seed!r} is not a whole number from {low} to 2**32 - 1 (a larger one is the same seed as its "
            "low 32 bits)"
        )
    return int(seed)


def _update_list(lowering: Lowering, updates) -> list[AssignOperation]:
    """A program's updates (an assign op or a sequence of them) as a list of the lowered graph's
    assign ops, each variable assigned once."""
    if isinstance(updates, Tensor):
        raise TypeError(
            f"updates take assign operations (mx.assign(variable, value)), got the tensor {updates.name}: "
            "compute it as an output, or assign it to a variable"
        )
    updates = [updates] if isinstance(updates, Operation) else list(updates)
    for u in updates:
        if not hasattr(u, "variable") or u.graph is not lowering.graph:
            raise TypeError(f"updates must be assign operations of this graph (mx.assign ...), got {u!r}")
    targets = [u.variable.name for u in updates]
    twice = sorted({n for n in targets if targets.count(n) > 1})
    if twice:
        raise GraphError(f"variables {twice} are assigned more than once in one function; combine the updates")
    return updates


def _output_list(lowering: Lowering, outputs, what: str) -> list[Tensor]:
    """A program's outputs (a Tensor or a sequence of them) as a list of the lowered graph's tensors."""
    if isinstance(outputs, Tensor):
        outputs = [outputs]
    elif isinstance(outputs, str) or not isinstance(outputs, Iterable):
        raise _not_a_tensor(outputs, what)
    return [_tensor_of(lowering, t, what) for t in outputs]


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
        self.seed = _checked_seed(seed, "mx.Lowering's seed", low=-(2**31))  # (was refused by JAX at the first run)
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
                _fed(t, _extremes(value), f"variable {var.name!r}", "set to")
            # Always a copy (may_alias=False): the next step donates the variable's buffer, which
            # must never be the caller's array (another Lowering's state, a restored checkpoint).
            sharding = self.impl.global_sharding(t.shape, spec[2])  # (the layout's, where its splits divide)
            array = jax.device_put(value.astype(t.dtype), sharding, may_alias=False)
            self._variables[var] = self.impl.from_global(array, spec)
        else:  # (cast as a feed is: values it would change, 70000 to float16 say, are refused)
            self._variables[var] = self.impl.put(_fed(t, value, f"variable {var.name!r}", "set to"), spec)
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
        outputs = _output_list(self, outputs, "lowering.trace_program's outputs")
        _, inputs, _, _, body = self._program(outputs, _update_list(self, updates), counters)
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
        return self.plan[_tensor_of(self, t, "lowering.tensor_layout")]

    def slice_bytes(self, t: Tensor, layout=None, dtype=None) -> int:
        """Bytes of one device's slice of `t` in `layout` (default: its planned one), at `dtype`
        (default: t's own)."""
        elements = int(np.prod(self.impl.slice_shape(t.shape, layout or self.plan[t]), dtype=np.int64))
        return elements * np.dtype(dtype or t.dtype).itemsize

    def layout_of(self, t: Tensor) -> str:
        """t's final layout as rules, e.g. "batch:rows;d_ff:cols" ("" when replicated)."""
        from meshax.lower.explain import layout_string

        t = _tensor_of(self, t, "lowering.layout_of")
        return layout_string(t.shape, self.plan[t], self.impl.shape)

    def draw(self, t: Tensor, path: str) -> str:
        """Draw which device holds which block of `t` in its planned layout, to a PNG or SVG file
        (`lower.draw.draw_layout`; needs matplotlib); returns the path."""
        from meshax.lower.draw import draw_layout

        t = _tensor_of(self, t, "lowering.draw")
        return draw_layout(t.name, t.shape, self.plan[t], self.impl.shape, path)

    def explain(self, threshold: int = 1 << 20) -> str:
        """Every tensor's layout and where it came from (a rule, an annotation at file:line, or
        propagated from which tensor through which op), then warnings: tensors of at least
        `threshold` values left replicated over a mesh dim, and reshards that annotations force."""
        from meshax.lower.explain import explain

        return explain(self, threshold)


class LoweredFunction:
    """A compiled SPMD program. Call it with `{placeholder or its name: array}` (and a `seed`
    for random ops, e.g. the step); it returns full NumPy arrays and updates the variables.
    `dispatch` and `fetch` split a call in two, for a host that works while the program runs."""

    def __init__(
        self,
        lowering: Lowering,
        outputs,
        updates=(),
        donate: Sequence[Tensor] = (),
        cast_copies: bool | None = None,
        gather_padded: bool = False,
    ):
        self._single = isinstance(outputs, Tensor)
        outs = _output_list(lowering, outputs, "lowering.function's outputs")
        updates = _update_list(lowering, updates)
        for t in donate:  # (a variable's buffer was handed to the program to consume; anything else left out)
            placeholder = isinstance(t, Tensor) and getattr(t.operation, "is_placeholder", False)
            if not (placeholder and t.graph is lowering.graph):
                variable = isinstance(t, Tensor) and getattr(t.operation, "is_variable", False)
                raise GraphError(
                    f"donate takes placeholders of the lowered graph (call_global may consume the arrays fed to "
                    f"them), got {t!r}"
                    + (": a variable's buffer is donated already where the function updates it" if variable else "")
                )
        self.lowering = lowering
        self.outputs = outs
        self.updates = updates
        self._options = (list(donate), cast_copies)  # (`global_function` is built with the same)
        self._gathers_padded = gather_padded  # (then it is its own `global_function`)
        self.counters = Counters()
        # With `gather_padded`, an output whose layout pads a dim comes out replicated along it,
        # gathered at the end of the step, as a jax.Array's shards must divide it (`call_global`)
        impl = lowering.impl
        self._out_layouts = [
            impl.global_layout(t.shape, lowering.plan[t]) if gather_padded else lowering.plan[t] for t in outs
        ]
        # The counters are filled before anything runs: by the trace of the program itself where
        # the backend compiles one trace (SIMD), else by an abstract trace of the same code, which
        # emits exactly the collectives the program runs.
        if cast_copies is None:
            cast_copies = lowering.impl.platform == "gpu"
        self.ops, self.inputs, self._updated, copies, body = lowering._program(
            outs, updates, self.counters, cast_copies, self._out_layouts
        )
        self._copy_keys = list(copies)  # (variable, dtype): the kept copies it reads and writes, after the inputs
        copy_specs = [lowering._spec(casts[0].outputs[0]) for casts in copies.values()]
        specs = [lowering._spec(t) for t in self.inputs] + copy_specs
        if not lowering.impl.compile_traces_once:
            lowering.impl.trace(body, specs)
            body = lowering._body(self.ops, self.inputs, outs, self._updated, Counters(), copies, self._out_layouts)
        out_specs = [lowering._spec(v.outputs[0]) for v in self._updated] + copy_specs
        out_specs += [self._out_spec(t, i) for i, t in enumerate(outs)]
        donated = set(donate)
        consumed = [i for i, t in enumerate(self.inputs) if t.operation in self._updated or t in donated]
        consumed += range(len(self.inputs), len(specs))  # (each copy's buffer takes the next copy)
        self._run = lowering.impl.compile(body, specs, out_specs, consumed)
        self._constants: dict[Tensor, object] = {}  # imported arrays, put on the devices once
        self._placeholder_names: tuple[int, set[str]] = (-1, set())  # (graph size, names): `_graph_placeholders`

    def _out_spec(self, t: Tensor, i: int) -> tuple:
        """The spec of output i (t), in the layout it comes out in."""
        return (t.shape, t.dtype, self._out_layouts[i])

    def copies_bytes(self) -> int:
        """Bytes per device of the narrower copies of its weights that it keeps between calls."""
        return sum(self.lowering.slice_bytes(var.outputs[0], dtype=dtype) for var, dtype in self._copy_keys)

    @property
    def placeholders(self) -> list[Tensor]:
        """The placeholders the program reads: each must be fed, by name, when it is called."""
        return [t for t in self.inputs if getattr(t.operation, "is_placeholder", False)]

    def _graph_placeholders(self) -> set[str]:
        """The names of the graph's placeholders (worked out again when the graph has grown)."""
        ops = self.lowering.graph.operations
        if self._placeholder_names[0] != len(ops):
            names = {t.name for op in ops if getattr(op, "is_placeholder", False) for t in op.outputs}
            self._placeholder_names = (len(ops), names)
        return self._placeholder_names[1]

    def feed_rows(self) -> tuple[int, int]:
        """The rows [lo, hi) of the placeholders' first dim that this process's devices hold: in a
        multi-process run, feed only those (`fn(feeds, rows=fn.feed_rows())`), as arrays of
        hi - lo rows; in one process, every row. The placeholders must share their first dim."""
        holders = [t for t in self.placeholders if t.shape.rank]
        firsts = {t.shape[0] for t in holders}
        if len(firsts) > 1:
            raise GraphError(
                f"feed_rows: the placeholders' first dims differ ({sorted(str(d) for d in firsts)}); "
                "rows are defined only when every placeholder starts with the same (batch) dim"
            )
        spans = [self.lowering.impl.feed_rows(self.lowering._spec(t)) for t in holders]
        spans = [s for s in spans if s[1] > s[0]]
        if not spans:
            return (0, 0)
        return min(s[0] for s in spans), max(s[1] for s in spans)

    def _arguments(
        self, feeds: Mapping | None, rows: tuple[int, int] | None = None, ready: Mapping | None = None
    ) -> list:
        """The program's arguments: placeholders from `feeds` (host arrays) or `ready` (values
        already in the backend's form), then variables and imported constants."""
        resolved = self._resolved_feeds(feeds)
        self.lowering.initialize(self._variable_ops)
        args: list = []
        for t in self.inputs:
            op = t.operation
            if ready is not None and t in ready:
                args.append(ready[t])
            elif getattr(op, "is_placeholder", False):
                if t not in resolved:
                    raise GraphError(
                        f"placeholder {t.name!r} {t.shape} is needed but was not fed; pass {{{t.name!r}: array}}"
                    )
                value = _fed(t, resolved[t])
                want = t.shape.to_integer_list
                if rows is not None and want:
                    if not 0 <= rows[0] <= rows[1] <= want[0]:  # (was asked for as the array's shape)
                        raise GraphError(
                            f"rows {tuple(rows)} are not rows of {t.shape[0]} (placeholder {t.name!r}): feed the "
                            "rows feed_rows() gives"
                        )
                    want[0] = rows[1] - rows[0]
                if list(value.shape) != want:
                    part = f" (rows {rows[0]}..{rows[1] - 1} of {t.shape[0].name})" if rows is not None else ""
                    raise GraphError(
                        f"placeholder {t.name!r} expects shape {want}{part} ({t.shape}), "
                        f"got an array of shape {list(value.shape)}"
                    )
                # a part: this process's rows. In a multi-process run always so, even where they are every
                # row (a process whose slices hold the first and the last of a dim split unevenly): the whole
                # array takes another path, JAX's check that every process passed the same, a collective the
                # processes feeding a part do not join, so the job hung
                if rows is not None and want and (tuple(rows) != (0, t.shape[0].size) or jax.process_count() > 1):
                    value = self.lowering.impl.put_rows(value, rows[0], self.lowering._spec(t))
                args.append(value)
            elif getattr(op, "is_variable", False):
                args.append(self.lowering._variable_state(op))
            else:
                if t not in self._constants:
                    impl = self.lowering.impl
                    value = op.value_on(impl) if hasattr(op, "value_on") else op.value  # (imported slices)
                    self._constants[t] = impl.put(value, self.lowering._spec(t))
                args.append(self._constants[t])
        return args + [self.lowering._cast_copy(var, dtype) for var, dtype in self._copy_keys]

    def _resolved_feeds(self, feeds: Mapping | None) -> dict:
        """`feeds` keyed by this function's placeholders, from placeholders or their names."""
        if feeds is not None and not isinstance(feeds, Mapping):
            raise TypeError(
                f"feeds are a dict {{placeholder or its name: array}}, got {type(feeds).__name__}: "
                f"call it as fn({{{', '.join(f'{t.name!r}: ...' for t in self.placeholders)}}})"
            )
        by_name = {t.name: t for t in self.placeholders} if feeds else {}
        resolved: dict[Tensor, object] = {}
        for key, value in dict(feeds or {}).items():
            if isinstance(key, str):
                t = by_name.get(key)
            elif isinstance(key, Tensor) and getattr(key.operation, "is_placeholder", False):
                if key.graph is not self.lowering.graph:  # (was ignored: "... is needed but was not fed")
                    raise MeshaxError(
                        f"feeds placeholder {key.name!r} of another graph than the one lowered: feed this "
                        f"graph's placeholder, or its name {key.name!r}"
                    )
                t = key if key in by_name.values() else None
            else:
                raise GraphError(f"cannot feed {key!r}: only placeholders (or their names) can be fed")
            if t is not None:  # placeholders this function does not need are ignored
                resolved[t] = value
            elif isinstance(key, str) and key not in self._graph_placeholders():
                raise MeshaxError(
                    f"feeds name {key!r}, which is no placeholder of the graph{did_you_mean(key, by_name)} "
                    f"(this function reads {sorted(by_name)})"
                )
        return resolved

    def __call__(self, feeds: Mapping | None = None, seed: int = 0, rows: tuple[int, int] | None = None):
        """Run the program; with `rows` (from `feed_rows`), each fed array holds only those rows."""
        return self.fetch(self.dispatch(feeds, seed, rows))

    def dispatch(self, feeds: Mapping | None = None, seed: int = 0, rows: tuple[int, int] | None = None) -> list:
        """Start the program as `__call__` does and return its outputs unfetched, as the
        backend's values (`fetch` them). The SIMD backend returns as soon as the program is
        queued on the devices: the host can prepare the next step while this one runs."""
        seed = _checked_seed(seed, "the seed of a call")  # (1.5 was 1; -1 an OverflowError from NumPy)
        if rows is not None:
            try:
                lo, hi = (operator.index(r) for r in rows)
            except (TypeError, ValueError):  # (was an IndexError, or a TypeError from slicing, from inside)
                raise GraphError("rows are (lo, hi), whole numbers, as feed_rows() gives them") from None
            rows = (lo, hi)
        return self._start(self._arguments(feeds, rows), seed)

    def fetch(self, values: list):
        """`dispatch`'s outputs as full NumPy arrays (waiting for the program to finish)."""
        impl = self.lowering.impl
        outs = [impl.fetch(r, self._out_spec(t, i)) for i, (r, t) in enumerate(zip(values, self.outputs))]
        return outs[0] if self._single else outs

    def _start(self, args: list, seed: int) -> list:
        """Run on `args`; the variables take their new values (the program's first outputs)."""
        results = self._run(args, seed)
        k, c = len(self._updated), len(self._copy_keys)
        for var, value in zip(self._updated, results[:k]):
            self.lowering._variables[var] = value
        self.lowering._drop_copies(self._updated)  # (copies this program does not write are stale)
        for key, copy in zip(self._copy_keys, results[k : k + c]):
            self.lowering._copies[key] = copy
        return results[k + c :]

    def call_global(self, feeds: Mapping[Tensor, jax.Array], seed: int = 0) -> list[jax.Array]:
        """Run with every placeholder fed a global jax.Array (its logical value, any sharding:
        arrays not laid out as the plan says are moved there first); the outputs come back as
        logical global jax.Arrays with their layouts' shardings, nothing fetched to the host.
        An output split unevenly comes back replicated along that dim, gathered in the step by
        the program `global_function` (whose counters count it), not by one of its own after."""
        fn, seed = self.global_function, _checked_seed(seed, "the seed of a call")
        results = fn._start(fn._global_arguments(feeds), seed)
        impl = self.lowering.impl
        return [impl.to_padded(r, fn._out_spec(t, i)) for i, (r, t) in enumerate(zip(results, self.outputs))]

    @functools.cached_property
    def global_function(self) -> LoweredFunction:
        """The program `call_global` runs: this one, unless an output's layout pads a dim. A
        jax.Array's shards must divide its dims, so such an output is returned replicated along
        it; gathered after the step, by a program of its own, that allgather was counted nowhere
        (a [64, 1001] gradient split 4 ways: 16,064 values a device). That program (built on
        first use) gathers it at the end of the step, where its counters, `report` and
        `compiled_text` see it; a host call (`fn(feeds)`) fetches the slices and needs no gather."""
        if self._gathers_padded or not any(t in self._padded for t in self.outputs):
            return self
        outputs = self.outputs[0] if self._single else self.outputs
        program = LoweredFunction(self.lowering, outputs, self.updates, *self._options, gather_padded=True)
        program._constants = self._constants  # (the same inputs: imported arrays put on the devices once, not twice)
        return program

    @functools.cached_property
    def _variable_ops(self) -> list:
        return [t.operation for t in self.inputs if getattr(t.operation, "is_variable", False)]

    @functools.cached_property
    def _padded(self) -> set[Tensor]:
        """Inputs and outputs whose layout pads them (uneven splits): such inputs are converted
        on every `call_global`, such outputs gathered in its program (`global_function`)."""
        mesh_shape = self.lowering.impl.shape
        return {t for t in (*self.inputs, *self.outputs) if padded_dims(t.shape, self.lowering.plan[t], mesh_shape)}

    @functools.cached_property
    def _global_shardings(self) -> dict[Tensor, NamedSharding]:
        impl = self.lowering.impl
        return {t: impl.global_sharding(t.shape, self.lowering.plan[t]) for t in self.placeholders}

    def _global_arguments(self, feeds: Mapping[Tensor, jax.Array]) -> list:
        ready: dict[Tensor, object] = {}
        given = self._resolved_feeds(feeds)  # (keyed by placeholders or their names, as fn(feeds) takes them)
        for t, want in self._global_shardings.items():
            if t not in given:  # (was a KeyError: the tensor, from the dict)
                raise GraphError(
                    f"placeholder {t.name!r} {t.shape} is needed but was not fed; pass {{{t.name!r}: array}}"
                )
            a = given[t]
            if (
                isinstance(a, jax.Array)
                and a.dtype == t.dtype
                and t not in self._padded
                and (a.sharding == want or a.sharding.is_equivalent_to(want, a.ndim))  # (P("y") is P("y", None))
            ):
                ready[t] = self.lowering.impl.from_padded(a, self.lowering._spec(t))  # (laid out as planned)
            else:
                ready[t] = self._laid_out(t, a)
        return self._arguments({}, ready=ready)

    def _laid_out(self, t: Tensor, array) -> object:
        impl, spec = self.lowering.impl, self.lowering._spec(t)
        if list(np.shape(array)) != t.shape.to_integer_list:  # (a host array too: it failed in JAX or NumPy)
            raise GraphError(
                f"placeholder {t.name!r} expects shape {t.shape.to_integer_list}, got {list(np.shape(array))}"
            )
        if not isinstance(array, jax.Array):
            return impl.put(np.asarray(array, dtype=t.dtype), spec)
        want = self._global_shardings[t]
        if not array.sharding.is_equivalent_to(want, array.ndim):
            array = jax.device_put(array, want)
        return impl.from_global(array.astype(t.dtype) if array.dtype != t.dtype else array, spec)

    def compiled_text(self) -> str:
        """The compiled program's text (HLO for the SIMD backend), for checking what runs. The
        program is traced from the inputs' shapes and layouts, so it needs no arguments."""
        return self._run.compiled().as_text()

    def cost_analysis(self) -> dict[str, float]:
        """XLA's cost analysis of the compiled program ("flops", "bytes accessed", ...)."""
        cost = self._run.compiled().cost_analysis()
        return dict(cost[0] if isinstance(cost, list) else cost)

    def peak_memory_bytes(self) -> int:
        """What the compiled program needs on one device at its peak, by XLA's memory analysis:
        arguments, outputs and temporaries, less the outputs that reuse donated arguments."""
        m = self._run.compiled().memory_analysis()
        return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
