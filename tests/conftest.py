"""Shared fixtures and helpers for the meshax test suite.

The CPU backend is split into 8 virtual devices *before* anything touches a
JAX backend, so that every test can use the 2x4 mesh "rows:2;cols:4".
"""

import os
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _fast_compile_flags() -> str:
    """XLA flags that cut compile time, which dominates here: the tests compile many small programs
    and run each a few times. LLVM's optimizations are skipped, and so are XLA:CPU's fusion emitters
    where this jaxlib has the flag (30-40% less compile time; an XLA flag a jaxlib does not know
    aborts it, so a child process tries it first). The compiled programs run the same collectives.
    Worked out once per run: the pytest-xdist workers inherit the environment variable."""
    if "MESHAX_TEST_XLA_FLAGS" not in os.environ:
        flags = "--xla_backend_optimization_level=0"
        probe = [sys.executable, "-c", "import jax; jax.devices()"]
        extra = " --xla_cpu_use_fusion_emitters=false"
        env = dict(os.environ, XLA_FLAGS=flags + extra, JAX_PLATFORMS="cpu")
        if subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0:
            flags += extra
        os.environ["MESHAX_TEST_XLA_FLAGS"] = flags
    return os.environ["MESHAX_TEST_XLA_FLAGS"]


_FLAGS = _fast_compile_flags()
if _FLAGS not in os.environ.get("XLA_FLAGS", ""):  # (a worker inherits them set)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAGS).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
# Started now, with 8: else a worker whose first test runs the command line on a 1-device mesh
# (`main(["plan", ..., "--mesh", "all:1"])`) starts it with 1 (`use_cpu_devices(1)`), and every
# later test of that worker that needs 8 fails ("JAX sees 1 cpu device(s)").
jax.devices()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import meshax as mx  # noqa: E402
from meshax.cli import _tune_gc  # noqa: E402

# Python's garbage collector, tuned for a long-lived test worker as the `meshax` command tunes it:
# JAX's caches make a worker's heap large, and each full collection walks all of it (about 0.8 s
# late in the run). Measured on the whole suite with 2 workers: 135 s of collection across the
# processes before, 47 s after.
_tune_gc()


def pytest_addoption(parser):
    group = parser.getgroup("fuzz", "the differential fuzzer's long profile (tests/test_fuzz.py)")
    group.addoption("--fuzz-cases", type=int, default=0, help="cases of the long profile (0: skip it)")
    group.addoption("--fuzz-seed", type=int, default=0, help="seed of the long profile's shards")
    group.addoption(
        "--fuzz-placement-every",
        type=int,
        default=4,
        help="run every k-th case on the placement backend too (0: never)",
    )
    group.addoption("--fuzz-report", default="", help="directory for each shard's JSON summary")


def pytest_configure(config):
    config.addinivalue_line("markers", "fuzz: the fuzzer's long profile (pytest -m fuzz --fuzz-cases N)")
    config.addinivalue_line("markers", "slow: an end-to-end test left out of the default run (pytest -m slow)")


# The placement backend runs a program per device (~2-5 s per case set here): where a test
# is parametrized over the canonical layouts, it runs the one that splits two dims over both mesh
# dims (every collective it has is an independent check of SIMD's; with nothing split it has none)
# and SIMD runs them all. A test with no layout parameter runs on both backends. The fuzzer runs
# the placement backend on random layouts.
PLACEMENT_LAYOUTS = {"b:rows;d:cols"}


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        canonical = "layout" in params and params["layout"] in LAYOUTS
        placement = params.get("impl_cls") is mx.PlacementMeshImpl
        (drop if placement and canonical and params.get("layout", "") not in PLACEMENT_LAYOUTS else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    # The long end-to-end tests first (a stable sort keeps each module's tests together): the run
    # then ends on short tests, so no worker sits idle waiting for one long test to finish.
    items[:] = sorted(keep, key=lambda item: item.get_closest_marker("slow") is None)


IMPLS = [mx.SimdMeshImpl, mx.PlacementMeshImpl]
IMPL_IDS = ["simd", "placement"]

MESH_SHAPE = "rows:2;cols:4"

# The four canonical layouts every op is checked under (dims b:8, h:4, d:8):
#   nothing split / one dim split / two dims on both mesh dims /
#   one dim split over two mesh dims.
LAYOUTS = ["", "b:cols", "b:rows;d:cols", "b:rows;b:cols"]

B = mx.Dimension("b", 8)
H = mx.Dimension("h", 4)
D = mx.Dimension("d", 8)

ATOL = 1e-5
RTOL = 1e-5


@pytest.fixture(params=IMPLS, ids=IMPL_IDS)
def impl_cls(request):
    return request.param


@pytest.fixture(params=LAYOUTS, ids=lambda s: s or "replicated")
def layout(request):
    return request.param


def impls_and_layouts(layouts=LAYOUTS, simd_extra=()):
    """Parametrize (impl_cls, layout): every impl under `layouts`, plus extra
    layouts for the SIMD impl only (the placement impl is much slower)."""
    params = [
        pytest.param(impl, lay, id=f"{iid}-{lay or 'replicated'}")
        for impl, iid in zip(IMPLS, IMPL_IDS)
        for lay in layouts
    ]
    params += [pytest.param(mx.SimdMeshImpl, lay, id=f"simd-{lay}") for lay in simd_extra]
    return pytest.mark.parametrize("impl_cls,layout", params)


def new_mesh():
    """A fresh (graph, mesh) pair."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "mesh")
    return graph, mesh


def make_impl(impl_cls, mesh_shape=MESH_SHAPE, layout=""):
    return impl_cls(mesh_shape, layout)


def lower(outputs, impl_cls, mesh_shape=MESH_SHAPE, layout="", graph=None):
    """Build a Lowering for the graph of `outputs`; returns (lowering, fn)."""
    first = outputs[0] if isinstance(outputs, (list, tuple)) else outputs
    mesh = first.mesh
    if graph is None:
        graph = mesh.graph
    lowering = mx.Lowering(graph, {mesh: impl_cls(mesh_shape, layout)})
    fn = lowering.function(list(outputs) if isinstance(outputs, tuple) else outputs)
    return lowering, fn


def run(outputs, impl_cls, mesh_shape=MESH_SHAPE, layout="", feeds=None):
    """Lower the graph of `outputs` on `impl_cls(mesh_shape, layout)` and run it."""
    _, fn = lower(outputs, impl_cls, mesh_shape, layout)
    return fn(feeds or {})


def counted_and_compiled(fn) -> tuple[dict, dict]:
    """A lowered function's counters and the collectives its compiled program runs (per run: loop
    bodies times their trip counts), each as {kind: (count, values)} for the kinds that ran."""
    counted = {k: (fn.counters[k].count, fn.counters[k].values) for k in fn.counters if fn.counters[k].count}
    compiled = mx.hlo_collectives(fn.compiled_text(), per_run=True)
    return counted, {k: (v["count"], v["values"]) for k, v in compiled.items() if v["count"]}


def moved(cost) -> list:
    """A StepCost's collectives as (kind, mesh dims, bytes in all), sorted: the estimate's and the
    exact trace's compare equal where they move the same."""
    return sorted((x.kind, x.mesh_dims, x.bytes * x.count) for x in cost.collectives)


def rand(shape, seed=0, low=-1.0, high=1.0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    shape = tuple(shape.to_integer_list) if isinstance(shape, mx.Shape) else tuple(shape)
    return rng.uniform(low, high, size=shape).astype(dtype)


def randint(shape, high, seed=0, dtype=np.int32):
    rng = np.random.default_rng(seed)
    return rng.integers(0, high, size=tuple(shape)).astype(dtype)


def train_optimized(task, mesh_shape, layout, steps):
    """`train`, its programs compiled at XLA's full optimization despite the suite's fast-compile
    flags: for the long trainings whose run time, not compile time, dominates. The CNN's
    convolutions run 2x faster (150 steps under h:rows;w:cols: 13.8 s, and 6.4 s so)."""
    from meshax.train.loop import build, train

    program = build(task, mesh_shape, layout, compiler_options={"xla_backend_optimization_level": 3})
    return train(task, mesh_shape, layout, steps=steps, program=program)


def assert_close(actual, expected, rtol=RTOL, atol=ATOL):
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


def assert_equal(actual, expected):
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    np.testing.assert_array_equal(actual, expected)


def names(t):
    return list(t.shape.dimension_names)


# --------------------------------------------------------------- batched cases
#
# Lowering and compiling dominates the run time, so a family of cases is run
# as ONE program per (impl, layout).  Each case is a builder
#     builder(mesh) -> (pairs, feeds)
# where pairs is a list of (output tensor, expected numpy array) and feeds a
# dict {placeholder: value}.  Builders may assert (e.g. on output names).
# When the combined program fails to lower or run, every case is re-run on its
# own, so that the failure report names the guilty case(s).


def _compare(got, want):
    want = np.asarray(want)
    got = np.asarray(got)
    if want.dtype == np.bool_ or np.issubdtype(want.dtype, np.integer):
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
        assert_equal(got, want)
    else:
        assert_close(got, want.astype(np.float32))


def _build(name, builder, mesh, errors):
    # Placeholder names identify feeds and must be unique in a graph: while a
    # case builds, its placeholders get the case name as a prefix.
    original = mx.placeholder

    def prefixed(mesh_, ph_name, *args, **kwargs):
        return original(mesh_, f"{name}/{ph_name}", *args, **kwargs)

    mx.placeholder = prefixed
    try:
        pairs, feeds = builder(mesh)
    except Exception as err:
        errors.append(f"{name}: building the graph raised {type(err).__name__}: {err}")
        return None
    finally:
        mx.placeholder = original
    return pairs, feeds


def _run_one(name, builder, impl_cls, layout, mesh_shape, errors):
    _, mesh = new_mesh()
    built = _build(name, builder, mesh, errors)
    if built is None:
        return
    pairs, feeds = built
    try:
        results = run([t for t, _ in pairs], impl_cls, mesh_shape, layout, feeds)
    except Exception as err:
        errors.append(f"{name}: lowering/running raised {type(err).__name__}: {err}")
        return
    for i, (res, (_, want)) in enumerate(zip(results, pairs)):
        try:
            _compare(res, want)
        except AssertionError as err:
            errors.append(f"{name} (output {i}): {err}")


def check_cases(cases, impl_cls, layout, mesh_shape=MESH_SHAPE):
    """Run all `cases` ({name: builder}) as one program and compare with NumPy."""
    errors = []
    _, mesh = new_mesh()
    outputs, expected, owners, feeds = [], [], [], {}
    for name, builder in cases.items():
        built = _build(name, builder, mesh, errors)
        if built is None:
            continue
        pairs, case_feeds = built
        feeds.update(case_feeds)
        for t, want in pairs:
            outputs.append(t)
            expected.append(want)
            owners.append(name)
    try:
        results = run(outputs, impl_cls, mesh_shape, layout, feeds)
    except Exception:
        for name, builder in cases.items():
            if not any(e.startswith(name + ":") for e in errors):
                _run_one(name, builder, impl_cls, layout, mesh_shape, errors)
        if not errors:
            raise  # only the combination fails: show the original error
    else:
        assert len(results) == len(outputs)
        for name, res, want in zip(owners, results, expected):
            try:
                _compare(res, want)
            except AssertionError as err:
                errors.append(f"{name}: {err}")
    assert not errors, "\n".join(errors)
