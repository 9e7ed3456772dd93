"""What a layout costs, before anything runs: parameters, memory, FLOPs and communication.

Everything here comes from the layout plan and an abstract trace of the training step (no
devices, no memory), so it works for meshes far larger than the machine it runs on.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from meshax.core.graph import Operation, Tensor
from meshax.layout.plan import weight_shapes
from meshax.layout.sharding_rule import choose
from meshax.lower.counters import KINDS, Counters
from meshax.lower.lowering import Lowering, _needed_ops
from meshax.ops.cond import CondOperation
from meshax.ops.loops import ScanOperation, WhileOperation
from meshax.ops.recompute import RecomputeOperation
from meshax.search.cost import family


@dataclasses.dataclass
class PlanSummary:
    parameters: int  # trainable values, whole model
    parameter_bytes_per_device: int
    replicated_parameters: int  # trainable values no mesh dim splits
    optimizer_state_bytes_per_device: int
    activation_bytes_per_device: int  # every forward tensor's slice, none freed: an estimate
    gathered_weight_bytes_per_device: int  # of the activations, the weights gathered for their readers
    input_bytes_per_device: int  # the placeholders' slices (the batch fed) and imported arrays
    flops_per_device: int
    families: dict[str, dict[str, float]]  # op family -> {"flops": ..., "<kind>": values ...}
    by_mesh_dim: dict[str, int]  # mesh dim name -> values allreduced over it (per device)
    counters: Counters
    pipelines: list[dict] = dataclasses.field(default_factory=list)  # `_pipelines`
    moe_layers: list[dict] = dataclasses.field(default_factory=list)  # `_moe_layers`

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("counters")
        return d


def recomputed_bodies(op: Operation) -> list[list[Operation]]:
    """The recorded bodies of an op whose internals the step holds one body at a time: a
    rematerialized region's (recompute_grad) and a scan's (one iteration: its backward loop
    recomputes each iteration's body, a pipeline's stages among them), while their gradients
    run; each branch of a cond (its gradient recomputes the branch); a while loop's condition
    and body (one iteration, in the forward pass). [] for any other op."""
    if isinstance(op, RecomputeOperation | ScanOperation):
        return [op.body]
    if isinstance(op, WhileOperation):
        return [[*op.cond_ops, *op.body_ops]]
    if isinstance(op, CondOperation):
        return [ops for _, _, ops in op.branches]
    return []


def _fed(op: Operation) -> bool:
    """A program argument other than a variable: a placeholder (the batch) or an imported array
    (mx.import_tensor: a sinusoid table, a pipeline's stage tables), which the step takes as an
    argument as it takes the batch."""
    return getattr(op, "is_input", False) and not getattr(op, "is_variable", False)


def weight_reads(forward: list[Operation], shapes: frozenset) -> dict[Tensor, list[tuple[Operation, int]]]:
    """Weight-shaped tensors (dims as a variable's, `shapes`: the weights, and their casts to a
    compute dtype) that `forward`'s ops read, each with its readers (op, operand index); loops,
    branches, rematerialized layers and relabellings are not readers here."""
    reads: dict[Tensor, list[tuple[Operation, int]]] = defaultdict(list)
    for op in forward:
        if recomputed_bodies(op) or getattr(op, "is_rename", False):
            continue
        for i, t in enumerate(op.inputs):
            if frozenset(t.shape.dimension_names) in shapes:
                reads[t].append((op, i))
    return reads


def _gathered_weights(lowering: Lowering, forward: list[Operation], slice_bytes) -> int:
    """Bytes of the copies of weights that forward ops read in a layout other than their own
    (weights that weight rules split, gathered for the einsums that read them), each weight once
    per layout it is read in, none freed: XLA keeps them for the backward pass (for the CPU, 93%
    of them in the tiny LM under `batch:x`, weights `d_model:x`)."""
    plan, mesh = lowering.plan, lowering.impl.shape
    total = 0
    for t, readers in weight_reads(forward, weight_shapes(lowering.graph.operations)).items():
        wants = set()
        for op, i in readers:
            wants.add(choose(op, [plan[x] for x in op.inputs], [plan[x] for x in op.outputs], mesh).operands[i])
        total += sum(slice_bytes(t, want) for want in wants - {plan[t]})
    return total


def memory_per_device(lowering: Lowering, forward_outputs) -> dict[str, int]:
    """Bytes per device by the plan: "parameters" (trainable variables), "optimizer_state" (the
    other variables), "activations" (every forward tensor's slice, none freed: an estimate, not a bound;
    of a rematerialized layer, a loop or a branch, its outputs, plus the largest body's internals
    once: `recomputed_bodies`; and the weights read in another layout than their own, gathered:
    `_gathered_weights`, and alone as "gathered_weights") and "inputs" (the placeholders'
    slices, the batch fed, and the imported arrays': the step's arguments besides the variables)."""
    slice_bytes, graph = lowering.slice_bytes, lowering.graph
    forward: list[Operation] = [
        op for op in _needed_ops(graph, [t.operation for t in forward_outputs]) if not getattr(op, "is_input", False)
    ]
    gathered = _gathered_weights(lowering, forward, slice_bytes)
    # a rematerialized region (recompute_grad) keeps only its outputs, a loop its carries at the
    # start of each iteration; their internals live again, one body at a time, while their
    # gradients run
    recomputed = max(
        (sum(slice_bytes(t) for b in body for t in b.outputs) for op in forward for body in recomputed_bodies(op)),
        default=0,
    )
    return {
        "parameters": sum(slice_bytes(v.value) for v in graph.trainable_variables),
        "optimizer_state": sum(slice_bytes(v.value) for v in graph.all_variables if not v.trainable),
        "activations": sum(slice_bytes(t) for op in forward for t in op.outputs) + recomputed + gathered,
        "gathered_weights": gathered,
        "inputs": sum(slice_bytes(op.outputs[0]) for op in graph.operations if _fed(op)),
    }


def summarize(lowering: Lowering, counters: Counters, forward_outputs) -> PlanSummary:
    plan, slice_bytes = lowering.plan, lowering.slice_bytes
    params = lowering.graph.trainable_variables
    memory = memory_per_device(lowering, forward_outputs)
    families: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for name, flops in counters.flops.items():
        families[family(counters.op_types.get(name, ""))]["flops"] += flops
    by_mesh_dim: dict[str, int] = defaultdict(int)
    for site in counters.sites():
        families[family(site.op_type)][site.kind] += site.values
        if site.kind == "allreduce":
            for m in site.mesh_axes:
                by_mesh_dim[m] += site.values
    return PlanSummary(
        parameters=sum(v.value.size for v in params),
        parameter_bytes_per_device=memory["parameters"],
        replicated_parameters=sum(v.value.size for v in params if plan[v.value].is_fully_replicated),
        optimizer_state_bytes_per_device=memory["optimizer_state"],
        activation_bytes_per_device=memory["activations"],
        gathered_weight_bytes_per_device=memory["gathered_weights"],
        input_bytes_per_device=memory["inputs"],
        flops_per_device=counters.total_flops,
        families={k: dict(v) for k, v in sorted(families.items())},
        by_mesh_dim=dict(by_mesh_dim),
        counters=counters,
        pipelines=_pipelines(lowering, counters, slice_bytes),
        moe_layers=_moe_layers(lowering, counters, slice_bytes),
    )


def _pipelines(lowering: Lowering, counters: Counters, slice_bytes) -> list[dict]:
    """Per pipeline (mx.pipeline): its schedule and bubble fraction, the stage weights and
    buffers one device holds, and the values it permutes per iteration (forward and backward)."""
    ops = lowering.graph.operations
    out = []
    for op in ops:
        if not (isinstance(op, ScanOperation) and op.info and "schedule" in op.info):
            continue
        s = op.info["schedule"]
        loops = [o for o in ops if o is op or o.grad_of is op]  # the loop and its backward loop
        body = {b.name for loop in loops for b in getattr(loop, "body", ())}
        stage = op.carry_vars[0].shape[0].name
        weights = [t for t in op.captured if getattr(t.operation, "is_variable", False) and stage in t.shape]
        buffers = sum(slice_bytes(v) for v in op.carry_vars)
        out.append(
            {
                "name": op.info["pipeline"],
                "stages": s.stages,
                "microbatches": s.microbatches,
                "repeats": s.repeats,
                "iterations": s.iterations,
                "bubble_fraction": s.bubble_fraction,
                "stage_weight_bytes_per_device": sum(slice_bytes(t) for t in weights),
                "buffer_bytes_per_device": buffers,
                "saved_for_backward_bytes_per_device": s.iterations * buffers,
                "permute_values_per_iteration": sum(
                    site.values for site in counters["permute"].sites if site.op_name in body
                )
                // s.iterations,
            }
        )
    return out


def _moe_layers(lowering: Lowering, counters: Counters, slice_bytes) -> list[dict]:
    """Per MoE layer (mx.layers.moe): experts, capacity, group size, the expert weights one
    device holds, and the values it sends by all-to-all per step (both ways, backward too)."""
    ops = lowering.graph.operations
    variables = {v.name: v.value for v in lowering.graph.all_variables}
    out = []
    for op in ops:
        if not (op.info and "experts" in op.info):
            continue
        name = op.info["moe"]
        moved = {o.name for o in ops if o.info and o.info.get("moe") == name}
        out.append(
            {
                "name": name,
                "experts": op.info["experts"],
                "capacity": op.info["capacity"],
                "group_size": op.info["group_size"],
                "expert_weight_bytes_per_device": sum(slice_bytes(variables[f"{name}/{w}"]) for w in ("wi", "wo")),
                "alltoall_values_per_step": sum(
                    site.values for site in counters["alltoall"].sites if site.op_name in moved or site.grad_of in moved
                ),
            }
        )
    return out


def format_summary(s: PlanSummary) -> str:
    from meshax.lower.report import _human

    lines = [
        f"parameters                 {_human(s.parameters)}  ({_human(s.replicated_parameters)} replicated)",
        f"parameter memory / device  {_human(s.parameter_bytes_per_device)}B",
        f"optimizer state / device   {_human(s.optimizer_state_bytes_per_device)}B",
        f"activation memory / device {_human(s.activation_bytes_per_device)}B (forward tensors, none freed"
        + (
            f"; {_human(s.gathered_weight_bytes_per_device)}B of it weights gathered for their readers)"
            if s.gathered_weight_bytes_per_device
            else ")"
        ),
        f"FLOPs / device / step      {_human(s.flops_per_device)}",
        "allreduced / device / step " + ", ".join(f"over {m}: {_human(v)}" for m, v in s.by_mesh_dim.items()),
        "",
        f"{'op family':<14}{'FLOPs':>10}" + "".join(f"{k:>16}" for k in KINDS),
    ]
    for fam, row in s.families.items():
        lines.append(
            f"{fam:<14}{_human(row.get('flops', 0)):>10}" + "".join(f"{_human(row.get(k, 0)):>16}" for k in KINDS)
        )
    for p in s.pipelines:
        lines += [
            "",
            f"pipeline {p['name']}: {p['stages']} stages, {p['microbatches']} microbatches"
            + (f", circular x{p['repeats']}" if p["repeats"] > 1 else "")
            + f", {p['iterations']} iterations, bubble {p['bubble_fraction']:.1%}",
            f"  stage weights / device   {_human(p['stage_weight_bytes_per_device'])}B",
            f"  buffers / device         {_human(p['buffer_bytes_per_device'])}B"
            f" ({_human(p['saved_for_backward_bytes_per_device'])}B kept for the backward pass)",
            f"  permuted / iteration     {_human(p['permute_values_per_iteration'])} values (forward and backward)",
        ]
    if s.moe_layers:
        head = f"{'MoE layer':<36}{'experts':>8}{'capacity':>9}{'group':>7}{'experts B/dev':>15}{'all-to-all':>12}"
        lines += ["", head]
        for m in s.moe_layers:
            lines.append(
                f"{m['name']:<36}{m['experts']:>8}{m['capacity']:>9}{m['group_size']:>7}"
                f"{_human(m['expert_weight_bytes_per_device']):>15}{_human(m['alltoall_values_per_step']):>12}"
            )
    return "\n".join(lines) + "\n"
