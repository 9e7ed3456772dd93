"""`Lowering`: a graph plus mesh implementations becomes runnable SPMD programs.

`Lowering(graph, {mesh: impl})` fixes every tensor's layout (the plan). `lowering.function(
outputs)` selects the ops the outputs need and compiles them into one program: under
`jax.shard_map` for the SIMD backend, a loop over devices for the placement one. The program
is traced once; its collectives are recorded while it is traced, so the counters are exactly
what runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from meshax.core.graph import Graph, Mesh, Operation, Tensor
from meshax.layout.plan import make_plan
from meshax.lower.context import LoweringContext
from meshax.lower.counters import Counters
from meshax.lower.mesh_impl import MeshImpl


def _needed_ops(graph: Graph, outputs: Sequence[Tensor]) -> list[Operation]:
    """The ops the outputs depend on, in graph (topological) order."""
    needed: set[Operation] = set()
    stack = [t.operation for t in outputs]
    while stack:
        op = stack.pop()
        if op in needed:
            continue
        needed.add(op)
        stack.extend(t.operation for t in op.inputs)
    return [op for op in graph.operations if op in needed]


class Lowering:
    """Lays out a graph on its mesh and builds SPMD programs from it."""

    def __init__(self, graph: Graph, mesh_to_impl: Mapping[Mesh, MeshImpl]):
        if len(mesh_to_impl) != 1:
            raise ValueError(
                f"Lowering takes exactly one mesh and its implementation, got {len(mesh_to_impl)}; "
                "meshax lowers one mesh per graph"
            )
        (self.mesh, self.impl), = mesh_to_impl.items()
        if not isinstance(self.impl, MeshImpl):
            raise TypeError(f"the implementation of mesh {self.mesh.name!r} must be a MeshImpl, got {self.impl!r}")
        self.graph = graph
        for op in graph.operations:
            if op.mesh is not self.mesh:
                raise ValueError(f"op {op.name} is on mesh {op.mesh.name!r}, which has no implementation")
        self.plan = make_plan(graph.operations, self.impl.layout_rules, self.impl.shape)
        self._counters: Counters | None = None

    # ---- building and running programs ------------------------------------------------------
    def _inputs_of(self, ops: list[Operation]) -> list[Tensor]:
        """Tensors the program takes as arguments: placeholders and imported constants."""
        return [t for op in ops if getattr(op, "is_input", False) for t in op.outputs]

    def _body(self, ops: list[Operation], inputs: list[Tensor], outputs: list[Tensor], counters: Counters):
        """The program on slice lists; every collective it emits is recorded in `counters`."""
        impl, plan = self.impl, self.plan

        def body(input_slices: list[list], seed_slices: list) -> list[list]:
            ctx = LoweringContext(impl, plan, counters, seed_slices)
            for t, slices in zip(inputs, input_slices):
                ctx.set_output(t, slices)
            for op in ops:
                if getattr(op, "is_input", False):
                    continue
                ctx.op = op
                op.lower(ctx)
            ctx.op = None
            return [ctx.get(t).slices for t in outputs]

        return body

    def _specs(self, tensors: list[Tensor]) -> list[tuple]:
        return [(t.shape, t.dtype, self.plan[t]) for t in tensors]

    def _trace(self, outputs: list[Tensor]) -> Counters:
        ops = _needed_ops(self.graph, outputs)
        inputs = self._inputs_of(ops)
        counters = Counters()
        self.impl.trace(self._body(ops, inputs, outputs, counters), self._specs(inputs))
        return counters

    @property
    def counters(self) -> Counters:
        """The collectives and FLOPs of the whole graph (every tensor computed once)."""
        if self._counters is None:
            sinks = [t for op in self.graph.operations for t in op.outputs]
            self._counters = self._trace(sinks)
        return self._counters

    def function(self, outputs: Tensor | Sequence[Tensor]) -> LoweredFunction:
        return LoweredFunction(self, outputs)

    def report(self, counters: Counters | None = None) -> str:
        from meshax.lower.report import format_report
        return format_report(self, counters or self.counters)

    def tensor_layout(self, t: Tensor):
        return self.plan[t]


class LoweredFunction:
    """A compiled SPMD program computing `outputs` from fed placeholders.

    Call it with `{placeholder or its name: array}`; it returns full NumPy arrays.
    """

    def __init__(self, lowering: Lowering, outputs: Tensor | Sequence[Tensor]):
        self._single = isinstance(outputs, Tensor)
        outs = [outputs] if self._single else list(outputs)
        for t in outs:
            if not isinstance(t, Tensor):
                raise TypeError(f"outputs must be meshax Tensors, got {t!r}")
            if t not in lowering.plan:
                raise ValueError(f"tensor {t.name} is not in the lowered graph (was it built after the Lowering?)")
        self.lowering = lowering
        self.outputs = outs
        self.ops = _needed_ops(lowering.graph, outs)
        self.inputs = lowering._inputs_of(self.ops)
        impl, in_specs = lowering.impl, lowering._specs(self.inputs)
        # The counters come from an abstract trace, before anything runs; the compiled program is
        # traced again from the same code, so it emits exactly the collectives recorded here.
        self.counters = Counters()
        impl.trace(lowering._body(self.ops, self.inputs, outs, self.counters), in_specs)
        self._run = impl.compile(lowering._body(self.ops, self.inputs, outs, Counters()), in_specs,
                                 lowering._specs(outs))

    @property
    def placeholders(self) -> list[Tensor]:
        return [t for t in self.inputs if getattr(t.operation, "is_placeholder", False)]

    def _arguments(self, feeds: Mapping | None) -> list:
        feeds = dict(feeds or {})
        by_name = {t.name: t for t in self.placeholders}
        resolved: dict[Tensor, object] = {}
        for key, value in feeds.items():
            t = by_name.get(key) if isinstance(key, str) else key
            if t is None or t not in by_name.values():
                if isinstance(key, str) or getattr(getattr(key, "operation", None), "is_placeholder", False):
                    continue  # a placeholder this function does not need
                raise ValueError(f"cannot feed {key!r}: only placeholders can be fed")
            resolved[t] = value
        args = []
        for t in self.inputs:
            if getattr(t.operation, "is_placeholder", False):
                if t not in resolved:
                    raise ValueError(
                        f"placeholder {t.name!r} {t.shape} is needed but was not fed; pass {{{t.name!r}: array}}"
                    )
                value = np.asarray(resolved[t])
                if list(value.shape) != t.shape.to_integer_list:
                    raise ValueError(
                        f"placeholder {t.name!r} expects shape {t.shape.to_integer_list} ({t.shape}), "
                        f"got an array of shape {list(value.shape)}"
                    )
                args.append(value.astype(t.dtype, copy=False))
            else:
                args.append(t.operation.value)
        return args

    def __call__(self, feeds: Mapping | None = None, seed: int = 0):
        results = self._run(self._arguments(feeds), seed)
        results = [np.asarray(r) for r in results]
        return results[0] if self._single else results

    def compiled_text(self, feeds: Mapping | None = None, seed: int = 0) -> str:
        """The compiled program's text (HLO for the SIMD backend), for checking what runs."""
        return self._run.compiled_text(self._arguments(feeds), seed)
