"""The search's picture: the layouts it compared, as stacked bars of predicted time per device
(compute, each collective kind) beside their memory per device against the budget."""

from __future__ import annotations

import itertools

from meshax.lower.draw import check_picture_path, pyplot


def draw_comparison(result, path: str) -> str:
    """Stacked bars of each layout's predicted step time (compute, each collective kind; a
    diamond at its measured step where it was run) and its memory per device against the budget,
    for the layouts a search ranked (and the user's)."""
    check_picture_path(path)
    plt = pyplot()
    rows = [(f"#{i + 1}", c) for i, c in enumerate(result.ranked)]
    if result.baseline is not None:
        rows.append(("yours", result.baseline))
    labels = [f"{tag} {c.name}" for tag, c in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.55 * len(rows) + 1.8), sharey=True)
    kinds = ["compute", *[k for k in rows[0][1].comm_s if any(c.comm_s[k] for _, c in rows)]]
    lefts = [0.0] * len(rows)
    for k, colour in zip(kinds, itertools.cycle(plt.get_cmap("tab10").colors)):
        ms = [1e3 * (c.compute_s if k == "compute" else c.comm_s[k]) for _, c in rows]
        left.barh(labels, ms, left=lefts, label=k, color=colour)
        lefts = [a + b for a, b in zip(lefts, ms)]
    timed = [(label, 1e3 * c.measured_s) for label, (_, c) in zip(labels, rows) if c.measured_s is not None]
    if timed:  # (`measure_layouts`: each step as run, beside its prediction)
        left.scatter(
            [ms for _, ms in timed], [label for label, _ in timed], marker="D", color="black", label="measured"
        )
    left.set_xlabel("predicted step time per device (ms)" + (", and measured" if timed else ""))
    left.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3)
    left.invert_yaxis()
    most = max(max(c.memory_bytes for _, c in rows), 1)
    gb = next(u for u in (1 << 30, 1 << 20, 1 << 10, 1) if most >= u)
    unit = {1 << 30: "GiB", 1 << 20: "MiB", 1 << 10: "KiB", 1: "bytes"}[gb]
    parts = ["parameters", "gradients", "optimizer_state", "activations"]
    lefts = [0.0] * len(rows)
    for part, colour in zip(parts, ("tab:blue", "tab:cyan", "tab:orange", "tab:green")):
        vals = [c.cost.memory.get(part, 0) / gb for _, c in rows]
        right.barh(labels, vals, left=lefts, label=part.replace("_", " "), color=colour)
        lefts = [a + b for a, b in zip(lefts, vals)]
    if result.memory_budget <= 3 * most:
        right.axvline(result.memory_budget / gb, color="red", linestyle="--", label="budget")
        right.set_xlabel(f"memory per device ({unit})")
    else:
        right.set_xlabel(f"memory per device ({unit})")
        right.set_title(f"the budget, {result.memory_budget / gb:,.0f} {unit}, is off the chart", fontsize=8)
    right.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3)
    fig.suptitle(f"layout search on {result.device.name}: {result.legal} legal rule sets ({result.method})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
