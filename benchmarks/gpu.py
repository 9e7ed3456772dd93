"""Section 6: GPU. Runs only when JAX's first device is a GPU; otherwise one "skipped" record.

Nothing is measured here yet even on a GPU: the record says so rather than inventing numbers.
"""

from __future__ import annotations

from benchmarks.records import record


def run(quick: bool) -> list[dict]:
    import jax

    platform = jax.devices()[0].platform
    if platform != "gpu":
        return [
            record(
                6, "GPU benchmarks", {"platform": platform}, None, "", status="skipped: no GPU", note="skipped: no GPU"
            )
        ]
    return [
        record(
            6,
            "GPU benchmarks",
            {"platform": platform, "device": str(jax.devices()[0])},
            None,
            "",
            status="skipped: GPU present, but no GPU benchmark is defined yet",
            note="skipped: no GPU benchmark defined yet",
        )
    ]
