"""What a layout costs, before anything runs: parameters, memory, FLOPs and communication.

Everything here comes from the layout plan and an abstract trace of the training step (no
devices, no memory), so it works for meshes far larger than the machine it runs on.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np

from meshax.core.graph import Operation
from meshax.lower.counters import KINDS, Counters
from meshax.lower.lowering import Lowering, _needed_ops


def _family(op_type: str) -> str:
    return op_type.removesuffix("Operation") or "?"


@dataclasses.dataclass
class PlanSummary:
    parameters: int  # trainable values, whole model
    parameter_bytes_per_device: int
    replicated_parameters: int  # trainable values no mesh dim splits
    optimizer_state_bytes_per_device: int
    activation_bytes_per_device: int  # every forward tensor's slice: an upper bound (no freeing)
    flops_per_device: int
    families: dict[str, dict[str, float]]  # op family -> {"flops": ..., "<kind>": values ...}
    by_mesh_dim: dict[str, int]  # mesh dim name -> values allreduced over it (per device)
    counters: Counters

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("counters")
        return d


def summarize(lowering: Lowering, counters: Counters, forward_outputs) -> PlanSummary:
    impl, plan = lowering.impl, lowering.plan

    def slice_bytes(t) -> int:
        return int(np.prod(impl.slice_shape(t.shape, plan[t]), dtype=np.int64)) * t.dtype.itemsize

    params = lowering.graph.trainable_variables
    others = [v for v in lowering.graph.all_variables if not v.trainable]
    forward: list[Operation] = [
        op
        for op in _needed_ops(lowering.graph, [t.operation for t in forward_outputs])
        if not getattr(op, "is_input", False)
    ]
    families: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for name, flops in counters.flops.items():
        families[_family(counters.op_types.get(name, ""))]["flops"] += flops
    by_mesh_dim: dict[str, int] = defaultdict(int)
    for site in counters.sites():
        families[_family(site.op_type)][site.kind] += site.values
        if site.kind == "allreduce":
            for m in site.mesh_axes:
                by_mesh_dim[m] += site.values
    return PlanSummary(
        parameters=sum(v.value.size for v in params),
        parameter_bytes_per_device=sum(slice_bytes(v.value) for v in params),
        replicated_parameters=sum(v.value.size for v in params if plan[v.value].is_fully_replicated),
        optimizer_state_bytes_per_device=sum(slice_bytes(v.value) for v in others),
        activation_bytes_per_device=sum(slice_bytes(t) for op in forward for t in op.outputs),
        flops_per_device=counters.total_flops,
        families={k: dict(v) for k, v in sorted(families.items())},
        by_mesh_dim=dict(by_mesh_dim),
        counters=counters,
    )


def format_summary(s: PlanSummary) -> str:
    from meshax.lower.report import _human

    lines = [
        f"parameters                 {_human(s.parameters)}  ({_human(s.replicated_parameters)} replicated)",
        f"parameter memory / device  {_human(s.parameter_bytes_per_device)}B",
        f"optimizer state / device   {_human(s.optimizer_state_bytes_per_device)}B",
        f"activation memory / device {_human(s.activation_bytes_per_device)}B (forward tensors, none freed)",
        f"FLOPs / device / step      {_human(s.flops_per_device)}",
        "allreduced / device / step " + ", ".join(f"over {m}: {_human(v)}" for m, v in s.by_mesh_dim.items()),
        "",
        f"{'op family':<14}{'FLOPs':>10}" + "".join(f"{k:>16}" for k in KINDS),
    ]
    for fam, row in s.families.items():
        lines.append(
            f"{fam:<14}{_human(row.get('flops', 0)):>10}" + "".join(f"{_human(row.get(k, 0)):>16}" for k in KINDS)
        )
    return "\n".join(lines) + "\n"
