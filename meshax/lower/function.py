"""`LoweredFunction`: one compiled SPMD program of a `Lowering` (`lowering.function(...)`), called
with host feeds (`fn(feeds)`) or with global jax.Arrays (`fn.call_global`)."""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.sharding import NamedSharding

from meshax.core.errors import GraphError, MeshaxError, did_you_mean
from meshax.core.graph import Tensor
from meshax.lower.counters import Counters
from meshax.lower.feeds import checked_seed, fed, output_list, update_list
from meshax.lower.padding import padded_dims

if TYPE_CHECKING:
    from meshax.lower.lowering import Lowering


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
        outs = output_list(lowering, outputs, "lowering.function's outputs")
        updates = update_list(lowering, updates)
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
                value = fed(t, resolved[t])
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
        seed = checked_seed(seed, "the seed of a call")  # (1.5 was 1; -1 an OverflowError from NumPy)
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
        fn, seed = self.global_function, checked_seed(seed, "the seed of a call")
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
                and list(a.shape) == t.shape.to_integer_list  # (else `_laid_out` names it: any shape is replicated)
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
