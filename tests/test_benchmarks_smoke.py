"""Smoke test of the benchmark suite: `python -m benchmarks --quick` writes sound JSON.

Runs the entry point in a subprocess (it must set the number of virtual CPU devices before JAX
starts), sections 1, 3, 4 and 5 (section 2, the timed comparison with XLA, is left to the
full run to keep this under a minute on two cores; section 6's run without a GPU, its cost row
and its "skipped" record, is tests/test_benchmark_gpu.py's, in process).
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # end-to-end, in subprocesses: run with `pytest -m slow`

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = ("section", "name", "config", "value", "unit")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "results.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("JAX_NUM_CPU_DEVICES", None)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--sections", "1,3,4,5", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (out.parent / "RESULTS.md").exists()  # --quick writes its summary next to the JSON
    return json.loads(out.read_text())


def by_section(results, section):
    return [r for r in results["records"] if r["section"] == section]


def test_records_have_the_fields(results):
    assert results["machine"]["devices"] == 8
    for section in (1, 3, 4, 5):
        recs = by_section(results, section)
        assert recs, f"no records for section {section}"
        for r in recs:
            for f in FIELDS:
                assert f in r, (f, r)
            if r["unit"] == "ratio":
                for s in ("numerator", "denominator"):
                    assert {"name", "value", "unit"} <= set(r[s]), r


def test_section1_matches_table1(results):
    recs = by_section(results, 1)
    ratios = [r for r in recs if r["name"].endswith("(lower-order subtracted)")]
    layouts = {r["config"]["layout"] for r in ratios}
    assert layouts == {"batch:all", "hidden:all", "batch:rows;hidden:cols", "batch:rows;hidden:cols;io:planes"}
    for r in ratios:
        assert r["value"] == pytest.approx(1.0, abs=0.01), r
        assert r["numerator"]["value"] == r["measured"] - r["lower_order"]
        assert not r["other_collectives"], r
    for r in recs:
        if r["config"]["layout"] == "":
            assert r["value"] == 0, r


def test_section3_overhead_measured(results):
    for r in by_section(results, 3):
        assert r["numerator"]["value"] > 0 and r["denominator"]["value"] > 0
        assert r["first_loss"]["agree"] and r["params_agree_after"], r


def test_section3_and_5_cover_the_transformer(results):
    (r3,) = [r for r in by_section(results, 3) if r["config"].get("model") == "transformer tiny"]
    assert r3["first_outputs"]["agree"] and r3["first_outputs"]["loss_rel_diff"] < 1e-4, r3["first_outputs"]
    assert r3["numerator"]["value"] > 0 and r3["denominator"]["value"] > 0
    (r5,) = [r for r in by_section(results, 5) if r["config"].get("model") == "transformer tiny"]
    assert r5["config"]["layout"] == "batch:all" and r5["meshax"]["allreduce"]["count"] > 0, r5


def test_section4_program_is_flat(results):
    recs = by_section(results, 4)
    meshes = {r["config"].get("devices") for r in recs if "devices" in r["config"]}
    assert meshes == {8, 64, 512}
    size = next(r for r in recs if r["name"] == "program size 512 / 8 devices")
    assert size["value"] <= 1.2 and size["met"], size


def test_section5_no_counter_mismatch(results):
    recs = by_section(results, 5)
    assert len(recs) >= 10
    for r in recs:
        assert r["value"] == 0 and r["mismatched"] == [], r["summary"]
