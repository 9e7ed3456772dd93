"""Training end to end: the MNIST classifier on the digits, and the data loaders (issue 3)."""

import gzip
import struct

import numpy as np
import pytest

import meshax as mx
from meshax.optimize import AdamWeightDecayOptimizer
from meshax.train import MlpTask, MnistTask, train
from meshax.train.data import DataError, load_mnist
from meshax.train.loop import build


def test_mnist_on_2x4_reaches_95_percent_and_matches_one_device():
    split = train(MnistTask(), "rows:2;cols:4", "batch:rows;hidden:cols", steps=300)
    single = train(MnistTask(), "all:1", "", steps=300)
    ((_, metrics),) = split.evals
    assert metrics["accuracy"] >= 0.95, metrics
    np.testing.assert_allclose(split.losses, single.losses, rtol=1e-4, atol=1e-5)
    assert split.losses[-1] < 0.3 * split.losses[0]


@pytest.mark.slow  # 10 s on 2 cores; the fuzzer and the op tests check the placement backend by default
def test_mlp_learns_the_identity_on_the_placement_backend():
    result = train(
        MlpTask(batch_size=16, io=8, hidden=32),
        "rows:2;cols:4",
        "batch:rows;hidden:cols",
        steps=30,
        backend="placement",
        optimizer=AdamWeightDecayOptimizer(0.01),
    )
    assert result.evals[-1][1]["loss"] < 0.5 * result.losses[0]


def test_the_digits_are_scikit_learns_read_without_importing_it(monkeypatch, tmp_path):
    """The digits come from the file scikit-learn ships, read without importing scikit-learn (a
    second of a short run's start); where that file is not, through scikit-learn's loader; without
    scikit-learn, an error saying what to install."""
    import importlib.util
    import sys

    from sklearn.datasets import load_digits as sk_load_digits

    from meshax.train.data import load_digits

    reference = sk_load_digits()
    want = load_digits(seed=3)
    x, y = np.concatenate([want[0], want[2]]), np.concatenate([want[1], want[3]])
    assert x.shape == (1797, 8, 8) and x.dtype == np.float32 and y.dtype == np.int32
    order = np.random.default_rng(3).permutation(1797)
    order = np.concatenate([order[len(want[2]) :], order[: len(want[2])]])  # train, then test
    np.testing.assert_array_equal(x, (reference.images[order] / 16.0).astype(np.float32))
    np.testing.assert_array_equal(y, reference.target[order])

    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # importing it now fails
    for got, expected in zip(load_digits(seed=3), want):
        np.testing.assert_array_equal(got, expected)
    monkeypatch.delitem(sys.modules, "sklearn.datasets")

    moved = importlib.util.spec_from_file_location("sklearn", tmp_path / "__init__.py")
    moved.submodule_search_locations = [str(tmp_path)]  # a scikit-learn that keeps the file elsewhere
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: moved)
    for got, expected in zip(load_digits(seed=3), want):
        np.testing.assert_array_equal(got, expected)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match=r"pip install 'meshax\[digits\]'"):
        load_digits()


def _write_idx(path, array, compress):
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    (gzip.open if compress else open)(path, "wb").write(data)


@pytest.mark.parametrize("compress", [False, True])
def test_mnist_idx_files_are_read(tmp_path, compress):
    rng = np.random.default_rng(0)
    imgs, labels = rng.integers(0, 256, (20, 28, 28)), rng.integers(0, 10, 20)
    suffix = ".gz" if compress else ""
    for stem, arr in [
        ("train-images-idx3-ubyte", imgs),
        ("train-labels-idx1-ubyte", labels),
        ("t10k-images-idx3-ubyte", imgs[:5]),
        ("t10k-labels-idx1-ubyte", labels[:5]),
    ]:
        _write_idx(tmp_path / (stem + suffix), arr, compress)
    x, y, xt, yt = load_mnist(str(tmp_path))
    np.testing.assert_allclose(x, imgs / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(y, labels)
    assert xt.shape == (5, 28, 28) and yt.shape == (5,)


def test_mnist_errors_name_the_problem(tmp_path):
    with pytest.raises(DataError, match="train-images-idx3-ubyte"):
        load_mnist(str(tmp_path))
    for stem in (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ):
        (tmp_path / stem).write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x09abc")  # says 9 bytes, holds 3
    with pytest.raises(DataError, match="truncated"):
        load_mnist(str(tmp_path))
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, (20, 28, 28))
    for labels, message in [
        (rng.integers(0, 10, 19), r"labels \(shape \[19\]\) do not pair up"),  # (it failed at a batch)
        (np.full(20, 12), "a train label is 12; the classes are 0 to 9"),  # (it trained on them)
    ]:
        for stem, arr in [
            ("train-images-idx3-ubyte", imgs),
            ("train-labels-idx1-ubyte", labels),
            ("t10k-images-idx3-ubyte", imgs[:5]),
            ("t10k-labels-idx1-ubyte", np.zeros(5)),
        ]:
            _write_idx(tmp_path / stem, arr, False)
        with pytest.raises(DataError, match=message):
            load_mnist(str(tmp_path))


def test_mnist_files_of_no_images_are_refused(tmp_path):
    """A test set of no images: training ran and its evaluation said 'loss 0.0000 accuracy 0.0000'
    (of nothing); no train images ended at the first batch. Both are named when read."""
    rng = np.random.default_rng(0)
    imgs, labels = rng.integers(0, 256, (20, 28, 28)), rng.integers(0, 10, 20)
    for part, (train_n, test_n) in (("test", (20, 0)), ("train", (0, 5))):
        for stem, arr in [
            ("train-images-idx3-ubyte", imgs[:train_n]),
            ("train-labels-idx1-ubyte", labels[:train_n]),
            ("t10k-images-idx3-ubyte", imgs[:test_n]),
            ("t10k-labels-idx1-ubyte", labels[:test_n]),
        ]:
            _write_idx(tmp_path / stem, arr, False)
        with pytest.raises(DataError, match=f"MNIST in .*: the {part} files hold no images: give at least one"):
            load_mnist(str(tmp_path))


@pytest.mark.parametrize(
    "name,data,said",
    [
        # a header cut short (its dims' sizes missing): struct.error, a traceback from the command
        ("train-images-idx3-ubyte", b"\x00\x00\x08\x03garbage", r"train-images-idx3-ubyte: its header .* 3 dims"),
        # not gzip, or gzip cut short: 'Not a gzipped file (b'no')', naming no file; EOFError, a traceback
        ("train-images-idx3-ubyte.gz", b"not gzip at all", r"train-images-idx3-ubyte.gz is no gzip file"),
        (
            "train-images-idx3-ubyte.gz",
            gzip.compress(b"\x00\x00\x08\x01\x00\x00\x10\x00" + np.random.default_rng(0).bytes(4096))[:2000],
            r"idx3-ubyte.gz is no gzip file .*ended",
        ),
    ],
    ids=["header cut short", "not gzip", "gzip cut short"],
)
def test_an_idx_file_that_cannot_be_read_is_named(tmp_path, name, data, said):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(DataError, match=said):
        load_mnist(str(tmp_path))


def test_a_diverging_run_stops_with_the_step_and_what_to_change(tmp_path):
    metrics = tmp_path / "m.jsonl"
    with pytest.raises(
        mx.ConfigError, match=r"training diverged: the loss is (nan|inf) at step \d+ .*lower the learning"
    ):
        train(
            MlpTask(),
            "all:2",
            "batch:all",
            steps=20,
            optimizer=AdamWeightDecayOptimizer(1e30),
            metrics_path=str(metrics),
        )
    assert "NaN" in metrics.read_text() or "Infinity" in metrics.read_text()  # the step that diverged is logged


def test_a_model_whose_weights_do_not_fit_is_refused_before_anything_is_allocated(monkeypatch):
    from meshax.train import loop

    monkeypatch.setattr(loop, "_host_available_bytes", lambda: 1000)
    with pytest.raises(
        mx.ConfigError, match=r"weights, gradients and optimizer state alone take .* on this host's 2 CPU"
    ):
        loop.build(MlpTask(), "all:2", "batch:all")


def test_the_fit_check_counts_the_devices_of_every_process_on_this_host(monkeypatch):
    """`meshax launch -n 2` runs its processes on one host: each process's 2 CPU devices fitting
    its memory, the job's 4 may not (each process checked its own, and together they ran out)."""
    from meshax.plan import memory_per_device
    from meshax.train import loop

    lowering, outputs, _ = loop.build(MlpTask(), "all:2", "batch:all", compile=False)
    m = memory_per_device(lowering, outputs)
    per_device = 2 * m["parameters"] + m["optimizer_state"]
    monkeypatch.setattr(loop, "_host_available_bytes", lambda: 3 * per_device)
    assert loop.build(MlpTask(), "all:2", "batch:all").train_fn  # (one process: 2 devices' worth fits)
    monkeypatch.setattr(loop, "processes_on_this_host", lambda: 2)
    with pytest.raises(mx.ConfigError, match=r"alone take .* on this host's 4 CPU devices \(2 processes\)"):
        loop.build(MlpTask(), "all:2", "batch:all")


def test_the_fit_check_counts_the_bfloat16_copies_a_step_keeps(monkeypatch):
    """A step that keeps bfloat16 copies of its weights (a GPU's default) needs their bytes too:
    where the weights, gradients and optimizer state fit and the copies tip it over, the build is
    refused, naming them; the same build without copies goes on."""
    import dataclasses

    from meshax.models.transformer import PRESETS
    from meshax.plan import memory_per_device
    from meshax.train import LmTask, loop

    task = LmTask(model=dataclasses.replace(PRESETS["tiny"], dtype="bfloat16"), batch_size=4, length=16)
    lowering, outputs, _ = loop.build(task, "all:2", "batch:all", compile=False)
    m = memory_per_device(lowering, outputs)
    without = 2 * m["parameters"] + m["optimizer_state"]
    copies = m["parameters"] // 2  # (every weight but the norms' is read in bfloat16: a little less)
    monkeypatch.setattr(loop, "_host_available_bytes", lambda: 2 * (without + copies // 4))  # (2 CPU devices)
    with pytest.raises(mx.ConfigError, match=r"their 16-bit copies 0\.\d+ GiB\), and there are"):
        loop.build(task, "all:2", "batch:all", cast_copies=True)
    assert loop.build(task, "all:2", "batch:all", cast_copies=False).train_fn.copies_bytes() == 0


def test_a_training_step_computes_the_loss_not_the_evaluations_metrics():
    """The metrics (an accuracy's argmax over the vocabulary: a pass over the float32 logits, and
    under a split vocabulary an allreduce of its min) are computed by the evaluation only: the
    training step returns the loss, and evaluation still reports every metric."""
    from meshax.train import LmTask
    from meshax.train.loop import build, evaluate

    task = LmTask(model="tiny", source="markov", markov_vocab=16, batch_size=8, length=8, eval_batches_count=1)
    program = build(task, "all:8", "vocab:all;d_ff:all;heads:all")
    assert len(program.train_fn(task.train_batch(0), seed=0)) == 1
    assert {"loss", "accuracy"} <= set(evaluate(task, program))

    def argmax_allreduces(fn):
        return [s for s in fn.counters.sites() if s.kind == "allreduce" and s.op_name.startswith("reduce_min")]

    assert argmax_allreduces(program.eval_fn) and not argmax_allreduces(program.train_fn)


@pytest.mark.parametrize("backend", ["simd", "placement"])
def test_the_loop_queues_the_next_step_before_it_fetches_a_loss_and_waits_where_the_variables_are_read(
    tmp_path, backend
):
    """On SIMD the host feeds step k + 1 while the devices run step k: each loss is fetched (and
    `on_step` called) after the next step is dispatched, except before an evaluation, a
    checkpoint or the end, which read that step's variables. The placement backend runs a step
    as it is dispatched: nothing is queued. The losses are those of a loop that waits on every
    step."""
    from meshax.train.loop import build

    task = MlpTask()
    program = build(task, "all:2", "batch:all", backend)
    events = []
    dispatch = program.train_fn.dispatch

    def dispatching(feeds, seed=0, rows=None):
        events.append(f"dispatch {seed}")
        return dispatch(feeds, seed, rows)

    program.train_fn.dispatch = dispatching
    result = train(
        task,
        program=program,
        steps=7,
        eval_every=3,
        checkpoint_dir=str(tmp_path),
        checkpoint_every=5,
        on_step=lambda step, *_: events.append(f"step {step}"),
        on_eval=lambda step, _: events.append(f"eval {step}"),
    )
    if backend == "simd":
        assert events == [
            *("dispatch 0", "dispatch 1", "step 0", "dispatch 2", "step 1", "step 2", "eval 3"),
            *("dispatch 3", "dispatch 4", "step 3", "step 4"),  # then the checkpoint of step 5
            *("dispatch 5", "step 5", "eval 6", "dispatch 6", "step 6", "eval 7"),
        ]
    else:
        steps = [
            (f"dispatch {s}", f"step {s}") + (("eval 3",) if s == 2 else ("eval 6",) if s == 5 else ())
            for s in range(7)
        ]
        assert events == [e for s in steps for e in s] + ["eval 7"]
    waiting = build(task, "all:2", "batch:all")
    rows = waiting.train_fn.feed_rows()
    losses = [float(waiting.train_fn(task.train_batch(s, rows), seed=s, rows=rows)[0]) for s in range(7)]
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)
    assert len(result.step_seconds) == 7 and all(t > 0 for t in result.step_seconds)


def test_a_step_that_cannot_start_still_leaves_the_step_before_recorded():
    """Step k + 1 is started before step k's loss is fetched: when starting it fails (no batch,
    an interrupt), step k is still recorded before the error goes up."""

    class NoThirdBatch(MlpTask):
        def train_batch(self, step, rows=None):
            if step == 2:
                raise RuntimeError("no batch 2")
            return super().train_batch(step, rows)

    seen = []
    with pytest.raises(RuntimeError, match="no batch 2"):
        train(NoThirdBatch(), "all:2", "batch:all", steps=5, on_step=lambda step, *_: seen.append(step))
    assert seen == [0, 1]


@pytest.mark.parametrize("impl_cls", [mx.SimdMeshImpl, mx.PlacementMeshImpl])
def test_compiler_options_reach_the_programs_a_backend_compiles(impl_cls, tmp_path):
    """XLA's `xla_dump_to` writes each program it compiles: the SIMD program (`jit_local`) or the
    placement backend's per-op kernels, besides the trivial program that checked the options."""
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", "b:8;d:4")
    y = mx.reduce_sum(mx.exp(x))
    impl = impl_cls("all:8", "b:all", compiler_options={"xla_dump_to": str(tmp_path)})
    checked = {f.name.split(".")[1] for f in tmp_path.iterdir()}
    fn = mx.Lowering(graph, {mesh: impl}).function(y)
    xv = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    np.testing.assert_allclose(fn({"x": xv}), np.exp(xv).sum(), rtol=1e-5)
    assert checked == {"jit__lambda"}
    assert {f.name.split(".")[1] for f in tmp_path.iterdir()} - checked  # the program's own modules


def test_meshaxs_platform_options_reach_the_programs_under_the_backends_own(monkeypatch, tmp_path):
    """Each backend's programs get meshax's options for their devices' platform (cuBLAS for
    every matmul on GPUs), each overridden by the backend's `compiler_options` and left out
    where XLA_FLAGS sets it: shown on the CPU with a CPU entry made for the test."""
    from meshax.lower import mesh_impl
    from meshax.lower.mesh_impl import compiler_options_for

    own = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_dot_merger_threshold_mb": 0}
    assert mesh_impl.PLATFORM_COMPILER_OPTIONS["gpu"] == own and list(mesh_impl.PLATFORM_COMPILER_OPTIONS) == ["gpu"]
    assert compiler_options_for("gpu", {"xla_gpu_enable_triton_gemm": True, "xla_dump_to": "d"}) == {
        "xla_gpu_enable_triton_gemm": True,
        "xla_gpu_dot_merger_threshold_mb": 0,
        "xla_dump_to": "d",
    }
    assert compiler_options_for("cpu", None) is None and compiler_options_for("tpu", {"a": 1}) == {"a": 1}
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_gpu_enable_triton_gemm=true")
    assert compiler_options_for("gpu", None) == {"xla_gpu_dot_merger_threshold_mb": 0}  # XLA_FLAGS's value stands
    flag_file = tmp_path / "flags"
    flag_file.write_text("--xla_gpu_enable_triton_gemm=true\n")
    monkeypatch.setenv("XLA_FLAGS", str(flag_file))  # XLA_FLAGS naming a file of flags, as XLA reads it
    assert compiler_options_for("gpu", None) == {"xla_gpu_dot_merger_threshold_mb": 0}
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm_any=true")  # another option
    assert compiler_options_for("gpu", None) == own

    monkeypatch.delenv("XLA_FLAGS")

    def run(impl_cls, **kw):
        graph = mx.Graph()
        mesh = mx.Mesh(graph, "m")
        y = mx.reduce_sum(mx.exp(mx.placeholder(mesh, "x", "b:8;d:4")))
        mx.Lowering(graph, {mesh: impl_cls("all:8", "b:all", **kw)}).function(y)({"x": np.ones((8, 4), np.float32)})

    def dumped(directory) -> set[str]:  # files XLA dumped there (not those of the options' check)
        return {f.name for f in directory.iterdir() if ".jit__lambda." not in f.name} if directory.exists() else set()

    for impl_cls in (mx.SimdMeshImpl, mx.PlacementMeshImpl):
        own, mine = tmp_path / f"own-{impl_cls.__name__}", tmp_path / f"mine-{impl_cls.__name__}"
        monkeypatch.setitem(mesh_impl.PLATFORM_COMPILER_OPTIONS, "cpu", {"xla_dump_to": str(own)})
        run(impl_cls)
        before = dumped(own)
        assert before and not dumped(mine)
        run(impl_cls, compiler_options={"xla_dump_to": str(mine)})
        assert dumped(mine) and dumped(own) == before  # the backend's own option overrode meshax's


def test_unknown_compiler_options_are_refused_when_the_backend_is_made():
    with pytest.raises(mx.ConfigError, match=r"xla_no_such_option.*XLA refuses them.*No such compile option"):
        mx.SimdMeshImpl("all:8", "", compiler_options={"xla_no_such_option": 1})
    with pytest.raises(mx.ConfigError, match="'high' is not a valid int32"):
        build(MlpTask(), "all:8", "", compiler_options={"xla_backend_optimization_level": "high"})
    with pytest.raises(mx.ConfigError, match=r"unhashable type: 'list'.*a bool, int or string"):
        mx.PlacementMeshImpl("all:8", "", compiler_options={"xla_backend_optimization_level": [3]})
    # (no dict: a TypeError from dict() in the message of the error for it, 'int' object is not iterable)
    for options in (5, "xla_backend_optimization_level=3", ["xla_backend_optimization_level"]):
        with pytest.raises(mx.ConfigError, match=r"compiler_options .*: give a dict of XLA's options"):
            mx.SimdMeshImpl("all:8", "", compiler_options=options)


@pytest.mark.parametrize(("vocab", "order"), [(5, 1), (4, 2), (3, 3)])
def test_the_markov_sources_stationary_distribution_is_the_chains_fixed_point(vocab, order):
    """Checked against the chain written out: context c goes with token t to (c * vocab + t) mod
    vocab^order with probability P[c, t]."""
    from meshax.train.synthetic import MarkovSource

    source = MarkovSource(vocab, order, alpha=0.5, seed=1)
    pi, n = source.stationary, vocab**order
    step = np.zeros(n)
    for c in range(n):
        for t in range(vocab):
            step[(c * vocab + t) % n] += pi[c] * source.probs[c, t]
    np.testing.assert_allclose(step, pi, atol=1e-12)
    assert pi.min() >= 0 and abs(pi.sum() - 1) < 1e-12
    assert 0 < source.entropy_rate < np.log(vocab)


def test_train_refuses_settings_that_would_fail_later_or_do_nothing():
    """Before the first step: checkpoint_every without a checkpoint_dir saved nothing, silently;
    steps=-1 evaluated at step -1; a text optimizer was an AttributeError ('str' object has no
    attribute 'scale_loss') and an on_step that is no function a TypeError after the first step."""
    for kwargs, message in (
        ({"steps": 2, "checkpoint_every": 1}, r"checkpoint_every=1 without a checkpoint_dir would save nothing"),
        ({"steps": -1}, r"train: steps=-1 must be a whole number >= 0"),
        ({"steps": 2.5}, r"train: steps=2.5 must be a whole number >= 0"),
        ({"steps": 1, "on_step": 3}, r"train: on_step=3 is not a function"),
        ({"steps": 1, "optimizer": "adam"}, r"optimizer 'adam' is not a meshax optimizer"),
    ):
        with pytest.raises(mx.ConfigError, match=message):
            train(MlpTask(), "all:2", "", **kwargs)
