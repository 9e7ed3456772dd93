"""The differential fuzzer (issue 9): random programs of every op family, random meshes and
layouts (annotations included), both backends, against jax.numpy; see tests/fuzz.py.

The default suite runs a short, fixed profile. The long one runs in shards, in parallel:

    pytest tests/test_fuzz.py -m fuzz --fuzz-cases 5000 [--fuzz-seed S] [--fuzz-report DIR] -n 16

Every case runs on the SIMD backend; every `--fuzz-placement-every`-th case also on the much
slower placement backend. Each shard writes its cases, time and op-family coverage to
DIR/shard-K.json when --fuzz-report is given (with the cases computing in bfloat16, those that
update variables, and those keeping bfloat16 weight copies between their two steps).
"""

import collections
import json
import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

import meshax as mx
from tests import fuzz

SETTINGS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck), print_blob=True)


def _run_case(data, impls, stats):
    draws = fuzz.Draws(lambda lo, hi: data.draw(st.integers(lo, hi)))
    program = fuzz.Program(draws, draws.int(2, 8))
    rules = program.rules()
    for impl in impls:
        try:
            fuzz.check(program, impl, rules)
        except Exception as err:
            raise AssertionError(
                f"{impl.__name__}: {type(err).__name__}: {err}\n{fuzz.describe(program, rules)}"
            ) from err
        stats[impl.__name__] += 1
    stats.update(program.families)
    stats.update(bfloat16=bool(program.approx), updates=bool(program.updates), cast_copies=program.cast_copies)
    stats["cases"] += 1


@pytest.mark.parametrize("impl", [mx.SimdMeshImpl, mx.PlacementMeshImpl], ids=["simd", "placement"])
def test_fuzz_short(impl):
    stats = collections.Counter()
    examples = 10 if impl is mx.SimdMeshImpl else 3

    @settings(max_examples=examples, derandomize=True, **SETTINGS)
    @given(st.data())
    def case(data):
        _run_case(data, [impl], stats)

    case()
    assert stats["cases"] >= examples


def pytest_generate_tests(metafunc):
    if "fuzz_shard" in metafunc.fixturenames:
        cases = metafunc.config.getoption("fuzz_cases")
        shards = max(1, min(cases // 50, 64)) if cases else 0
        metafunc.parametrize("fuzz_shard", [(k, shards) for k in range(shards)], ids=lambda s: f"shard{s[0]}")


@pytest.mark.fuzz
def test_fuzz_long(fuzz_shard, request):
    shard, shards = fuzz_shard
    config = request.config
    total = config.getoption("fuzz_cases")
    examples = total // shards + (shard < total % shards)
    every = config.getoption("fuzz_placement_every")
    stats = collections.Counter()
    start = time.perf_counter()

    @hypothesis_seed(config.getoption("fuzz_seed") * 1000 + shard)
    @settings(max_examples=examples, **SETTINGS)
    @given(st.data())
    def case(data):
        placement = every and stats["cases"] % every == 0
        _run_case(data, [mx.SimdMeshImpl] + ([mx.PlacementMeshImpl] if placement else []), stats)

    case()
    report = config.getoption("fuzz_report")
    if report:
        os.makedirs(report, exist_ok=True)
        with open(os.path.join(report, f"shard-{shard}.json"), "w") as f:
            json.dump({"seconds": time.perf_counter() - start, **stats}, f)
    assert stats["cases"] >= examples
