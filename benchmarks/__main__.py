"""`python -m benchmarks [--quick] [--sections 1,2,3,4,5,6,7,8,9,10] [--devices 8] [--out PATH]`

Runs the benchmark sections in one process on the embedded default (virtual CPU devices; 8
unless --devices says otherwise), prints a table, writes one JSON record per measurement to
--out (default benchmarks/out/results.json) and the markdown summary (default: RESULTS.md next
to --out, in a folder git ignores; `--markdown benchmarks/RESULTS.md` updates the committed
results).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ALL_SECTIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
NEEDS_8 = {1, 2, 5, 7, 8, 9, 10}  # the paper's layouts run on 8 devices


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[1])
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sizes, few steps (the smoke test; about a minute and a half on 2 cores)",
    )
    p.add_argument(
        "--sections", default=",".join(map(str, ALL_SECTIONS)), help="comma-separated sections to run (default: all)"
    )
    p.add_argument("--devices", type=int, default=8, help="virtual CPU devices to start JAX with (default 8)")
    p.add_argument("--out", default=os.path.join(HERE, "out", "results.json"), help="JSON output path")
    p.add_argument("--markdown", default=None, help="markdown summary path (see above for the default)")
    args = p.parse_args(argv)
    try:
        args.sections = sorted({int(s) for s in args.sections.split(",") if s.strip()})
    except ValueError:
        p.error(f"--sections takes numbers like 1,3,4; got {args.sections!r}")
    bad = [s for s in args.sections if s not in ALL_SECTIONS]
    if bad:
        p.error(f"unknown sections {bad}; the sections are {list(ALL_SECTIONS)}")
    if args.markdown is None:
        args.markdown = os.path.join(os.path.dirname(os.path.abspath(args.out)), "RESULTS.md")
    return args


def start_jax(devices: int) -> int:
    """Ask for `devices` virtual CPU devices before anything touches a backend; returns the
    number JAX has (more or fewer if the backend was already up, e.g. when run in-process)."""
    import jax

    with contextlib.suppress(RuntimeError):  # backend already initialized: use what is there
        jax.config.update("jax_num_cpu_devices", devices)
    return len(jax.devices())


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    have = start_jax(args.devices)  # first thing that touches JAX

    from benchmarks import (
        counter_truth,
        gpu,
        gspmd,
        overhead,
        paper_comm,
        partition,
        report,
        scaling,
        search,
        spatial,
        vs_xla,
    )
    from benchmarks.records import record

    modules = {
        1: paper_comm,
        2: vs_xla,
        3: overhead,
        4: scaling,
        5: counter_truth,
        6: gpu,
        7: gspmd,
        8: spatial,
        9: partition,
        10: search,
    }

    t0 = time.perf_counter()
    records: list[dict] = []
    for s in args.sections:
        if s in NEEDS_8 and have < 8:
            records.append(
                record(
                    s, f"section {s}", {"devices": have}, None, "", status=f"skipped: needs 8 devices, JAX has {have}"
                )
            )
            continue
        ts = time.perf_counter()
        records.extend(modules[s].run(args.quick))
        print(f"section {s} done in {time.perf_counter() - ts:.1f} s", file=sys.stderr, flush=True)
    wall = time.perf_counter() - t0

    info = report.machine(args)
    report.write_json(args.out, info, records, wall)
    command = "python -m benchmarks " + " ".join(argv if argv is not None else sys.argv[1:])
    report.write_markdown(args.markdown, info, records, wall, command.strip())
    report.print_table(info, records, wall)
    print(f"wrote {args.out} and {args.markdown}", file=sys.stderr)
    return records


if __name__ == "__main__":
    main()
