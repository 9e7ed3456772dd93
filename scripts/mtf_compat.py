"""Write docs/reference/mesh-tensorflow.md: every public function of Mesh-TensorFlow 0.1.21's
`ops.py` and `layers.py` (the list in tests/data/mtf-0.1.21-api.json) with meshax's status,
read from the code: "same" where meshax has the function under Mesh-TensorFlow's name and takes
its arguments by their names in their order (older meshax names, where a function had them,
still work as keywords); otherwise why not. tests/test_mtf_compat.py checks the page against
this script and the code.

    python scripts/mtf_compat.py            # rewrite the page
    python scripts/mtf_compat.py --check    # exit 1 if the page is out of date
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "tests" / "data" / "mtf-0.1.21-api.json"
PAGE = ROOT / "docs" / "reference" / "mesh-tensorflow.md"

_GRADIENT = "a gradient kernel of Mesh-TensorFlow's own; meshax's autodiff builds the gradients of its ops"
_HELPER = "a helper of Mesh-TensorFlow's implementation, not an operation"
_DEVICES = "device numbering; a meshax mesh orders its devices as JAX's mesh does (`impl.devices`)"
_BLOCKS = (
    "the convolution splits its spatial dims itself: lay `h` (and `w`, `d`) out over mesh dims and "
    "`mx.layers.conv2d` exchanges the halos"
)
NOT_APPLICABLE = {
    "compatible_lazy_allreduce_sums": _HELPER,
    "convert_args_to_laid_out_tensors": _HELPER,
    "binary_arguments_to_tensors": _HELPER,
    "binary_op_with_broadcasting": "every meshax binary op broadcasts by dimension name; `mx.cwise` for a JAX function",
    "pool_backprop": _GRADIENT,
    "conv2d_backprop_input": _GRADIENT,
    "conv2d_backprop_filter": _GRADIENT,
    "conv3d_backprop_input": _GRADIENT,
    "conv3d_backprop_filter": _GRADIENT,
    "conv2d_transpose_backprop_input": _GRADIENT,
    "conv2d_transpose_backprop_filter": _GRADIENT,
    "conv3d_transpose_backprop_input": _GRADIENT,
    "conv3d_transpose_backprop_filter": _GRADIENT,
    "import_tf_tensor": "TensorFlow tensors: `mx.import_tensor(mesh, array, shape)` imports a NumPy or JAX array",
    "is_subsequence": _HELPER,
    "verify_no_new_dims": _HELPER,
    "pnum_to_processor_coordinates": _DEVICES,
    "processor_coordinates_to_pnum": _DEVICES,
    "pnum_to_processor_coordinates_nd": _DEVICES,
    "processor_coordinates_to_pnum_map_nd": _DEVICES,
    "pnum_to_group": _DEVICES,
    "processor_groups": _DEVICES,
    "list_product": "Python's `math.prod`",
    "parallel": "TensorFlow device placement; the placement backend (`mx.PlacementMeshImpl`) runs a program per device",
    "transpose_list_of_lists": _HELPER,
    "binary_reduction_fn": "maps a name to a TensorFlow function; pass the meshax function (`mx.reduce_max`)",
    "reduction_fn": "maps a name to a TensorFlow function; pass the meshax function (`mx.reduce_sum`)",
    "pool_fn": "maps a name to a TensorFlow function; `mx.max_pool2d` and the other pools are ops",
    "tensor_dim_to_mesh_dim_size": "a layout query: `impl.tensor_layout(shape)` and `impl.slice_shape(shape)`",
    "tensor_dim_to_size_per_split": "a layout query: `impl.slice_shape(shape)`",
    "summary_for_clip_activation_gradient": "writes TensorFlow summaries",
    "scalar_summary": "a TensorFlow summary: `mx.log_scalar(name, x)` logs a scalar with the training loop's metrics "
    "(JSON lines, TensorBoard)",
    "conv2d_with_blocks": _BLOCKS,
    "conv2d_transpose_with_blocks": _BLOCKS,
    "conv3d_with_blocks": _BLOCKS,
    "conv3d_transpose_with_blocks": _BLOCKS,
}
# Not built yet: what each will be.
NOT_YET: dict[str, str] = {}
# Arguments meshax takes differently, with why (the rest are taken by Mesh-TensorFlow's names).
ARGUMENT_NOTES = {
    "while_loop": "as there, not differentiable (`mx.scan` is, for a fixed trip count); accumulators are summed "
    "owed and settled once after the loop; `num_loop_vars` returns the first ones, then the accumulators",
    **{
        f"reduce_{k}": "`disable_positional_args` is not needed: meshax also takes `reduced_dim` second"
        for k in ("sum", "mean", "max", "min", "all", "any")
    },
    "serialize_training_step": "also `scale_loss=optimizer.scale_loss`: each microbatch's loss scaled (float16, "
    "`LossScaleOptimizer`)",
}
EXEMPT_ARGUMENTS = {f"reduce_{k}": {"disable_positional_args"} for k in ("sum", "mean", "max", "min", "all", "any")}


def meshax_function(module: str, name: str):
    """meshax's function for Mesh-TensorFlow's `module.name` (`mtf.x` is `mx.x`, `mtf.layers.x`
    is `mx.layers.x`), or None."""
    import meshax as mx

    return getattr(mx.layers if module == "layers" else mx, name, None)


def argument_problems(module: str, fn: dict) -> list[str]:
    """Mesh-TensorFlow's arguments that meshax's function does not take by name, or not in order."""
    obj = meshax_function(module, fn["name"])
    params = inspect.signature(obj).parameters
    wanted = [a for a in fn["args"] if a not in EXEMPT_ARGUMENTS.get(fn["name"], ())]
    problems = [f"no argument `{a}`" for a in wanted if a not in params]
    positional = [p for p in params if params[p].kind in (p_.POSITIONAL_OR_KEYWORD, p_.VAR_POSITIONAL)]
    if "disable_positional_args" in fn["args"]:  # (the rest are keywords in Mesh-TensorFlow)
        wanted_in_order = fn["args"][: fn["args"].index("disable_positional_args")]
    else:
        wanted_in_order = wanted
    order = [a for a in wanted_in_order if a in positional]
    if order != [p for p in positional if p in order]:
        problems.append(f"arguments in another order: {', '.join(order)}")
    return problems


p_ = inspect.Parameter


def table() -> list[dict]:
    """One row per Mesh-TensorFlow function: module, name, meshax's spelling, status, note."""
    api = json.loads(API.read_text())
    rows = []
    for module in ("ops", "layers"):
        for fn in api[module]:
            name = fn["name"]
            where = f"mx.layers.{name}" if module == "layers" else f"mx.{name}"
            row = {"module": module, "name": name, "args": fn["args"], "meshax": where}
            if meshax_function(module, name) is not None:
                problems = argument_problems(module, fn)
                older = getattr(meshax_function(module, name), "also_accepts", {})
                notes = [f"also `{old}=` for `{new}`" for old, new in older.items()]
                notes += [ARGUMENT_NOTES[name]] if name in ARGUMENT_NOTES else []
                row.update(status="differs" if problems else "same", note="; ".join(problems or notes))
            elif name in NOT_APPLICABLE:
                row.update(meshax="", status="not applicable", note=NOT_APPLICABLE[name])
            elif name in NOT_YET:
                row.update(meshax="", status="not yet", note=NOT_YET[name])
            else:
                raise SystemExit(f"{module}.{name}: not in meshax, and neither NOT_APPLICABLE nor NOT_YET says why")
            rows.append(row)
    return rows


def render(rows: list[dict]) -> str:
    counts = {s: sum(r["status"] == s for r in rows) for s in ("same", "differs", "not applicable", "not yet")}
    lines = [
        "# Mesh-TensorFlow compatibility",
        "",
        "<!-- Generated by scripts/mtf_compat.py from the code; tests/test_mtf_compat.py checks it. -->",
        "",
        f"Every public function of Mesh-TensorFlow {json.loads(API.read_text())['version']}'s `ops.py` and "
        "`layers.py`, and what meshax has for it. **same**: the function has Mesh-TensorFlow's name, and takes "
        "its arguments by Mesh-TensorFlow's names in Mesh-TensorFlow's order (`mtf.x` is `mx.x`, `mtf.layers.x` "
        "is `mx.layers.x`); where meshax named an argument differently before, the older name still works as a "
        "keyword. **not applicable**: TensorFlow's, or a piece of Mesh-TensorFlow's implementation, with "
        "meshax's way to do the same. **not yet**: to be built.",
        "",
        ", ".join(f"{n} {s}" for s, n in counts.items() if n) + f", of {len(rows)}.",
        "",
    ]
    for module, title in (("ops", "ops.py (`mtf.`)"), ("layers", "layers.py (`mtf.layers.`)")):
        lines += [f"## {title}", "", "| Mesh-TensorFlow | meshax | status | note |", "|---|---|---|---|"]
        for r in rows:
            if r["module"] == module:
                meshax = f"`{r['meshax']}`" if r["meshax"] else ""
                lines.append(f"| `{r['name']}({', '.join(r['args'])})` | {meshax} | {r['status']} | {r['note']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    text = render(table())
    if "--check" in argv:
        if PAGE.read_text() != text:
            print(f"{PAGE} is out of date: run python scripts/mtf_compat.py")
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
