"""Section 1: values allreduced per device against Table 1 of the paper.

For each of the five layouts of the two-layer example and each size: meshax's
`fn.counters["allreduce"].values` for the program Table 1 describes (loss, dx and the SGD
updates of w, bias, v), divided by the formula. Two ratios: raw (counter / main term) and after
subtracting the lower-order terms (bias gradient d_h/split(hidden), scalar loss 1): the target
is 1.00 for the latter. Other collective kinds must not appear.
"""

from __future__ import annotations

from benchmarks.records import record, side
from benchmarks.two_layer import LAYOUTS, Size, model, table1

QUICK_SIZES = [Size(32, 16, 64), Size(64, 32, 128)]
FULL_SIZES = [Size(32, 16, 64), Size(256, 128, 512), Size(1024, 512, 2048)]


def run(quick: bool) -> list[dict]:
    out = []
    for s in QUICK_SIZES if quick else FULL_SIZES:
        for mesh_shape, layout in LAYOUTS:
            c = model(s, mesh_shape, layout).comm_fn.counters
            measured = c["allreduce"].values
            main, lower, formula = table1(mesh_shape, layout, s)
            others = {k: c[k].count for k in ("allgather", "alltoall", "reduce_scatter", "permute") if c[k].count}
            cfg = {
                "mesh": mesh_shape,
                "layout": layout,
                "size": str(s),
                "formula": formula,
                "program": "loss, dx, SGD updates of w, bias, v",
            }
            if main:
                ratio = (measured - lower) / main
                met = abs(ratio - 1.0) < 1e-6 and not others
                out.append(
                    record(
                        1,
                        "allreduce values / Table 1 (lower-order subtracted)",
                        cfg,
                        ratio,
                        "ratio",
                        target="1.00",
                        met=met,
                        numerator=side("meshax allreduce values - lower-order", measured - lower, "values/device"),
                        denominator=side(f"Table 1: {formula}", main, "values/device"),
                        lower_order=lower,
                        measured=measured,
                        other_collectives=others,
                    )
                )
                out.append(
                    record(
                        1,
                        "allreduce values / Table 1 (raw)",
                        cfg,
                        measured / main,
                        "ratio",
                        numerator=side("meshax allreduce values", measured, "values/device"),
                        denominator=side(f"Table 1: {formula}", main, "values/device"),
                        lower_order=lower,
                        measured=measured,
                    )
                )
            else:  # nothing split: Table 1 says no communication
                out.append(
                    record(
                        1,
                        "allreduce values (Table 1: none)",
                        cfg,
                        measured,
                        "values/device",
                        target="0",
                        met=measured == 0 and not others,
                        lower_order=lower,
                        measured=measured,
                        other_collectives=others,
                    )
                )
    return out
