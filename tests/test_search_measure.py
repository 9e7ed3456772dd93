"""`measure_layouts` and `meshax plan --search --measure K`: a search's best layouts timed on the devices."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

import meshax as mx
import meshax.search.measure as measure
import meshax.train.loop as loop
from meshax.cli import main
from meshax.search import measure_layouts, search_layout
from meshax.train import MlpTask

MLP = MlpTask(hidden=128)
MESH = "rows:2;cols:4"


def test_the_best_and_yours_are_run_and_the_best_ranked_by_their_measured_time(monkeypatch):
    sgd = mx.optimize.SgdOptimizer(0.1)  # (the search's: each layout's step runs it)
    result = search_layout(MLP, MESH, top=4, baseline="batch:rows;hidden:cols", optimizer=sgd)
    built, losses, real = [], [], loop.build

    def build(task, mesh, layout, backend, optimizer, weight_layout=None):
        built.append((task, mesh, layout, weight_layout, optimizer))
        return real(task, mesh, layout, backend, optimizer, weight_layout=weight_layout)

    def in_blocks(fns, rounds, block):  # each step run once; the predicted order's times reversed
        losses.extend(float(np.asarray(fns[i]()[0])) for i in fns)
        return {i: 1.0 + len(fns) - i for i in fns}

    monkeypatch.setattr(loop, "build", build)
    monkeypatch.setattr(measure, "in_blocks", in_blocks)
    timed = measure_layouts(result, k=3, yours=MLP)  # (the task searched, result.task)
    assert built == [(MLP, MESH, c.layout, c.weight_layout, sgd) for c in [*result.ranked[:3], result.baseline]]
    assert np.isfinite(losses).all() and len(losses) == 4
    assert [c.layout for c in timed.ranked] == [c.layout for c in result.ranked[2::-1] + result.ranked[3:]]
    assert [c.measured_s for c in timed.ranked] == [3.0, 4.0, 5.0, None]
    assert timed.baseline is not None and timed.baseline.measured_s == 2.0
    assert result.ranked[0].measured_s is None and not result.measured  # (the search's own result is kept)
    text = timed.format()
    assert "measured ms" in text and "the 3 best and yours measured on 8 cpu devices" in text
    assert "2: measured 1.33x the best's time (predicted" in text


def test_yours_is_run_once_where_it_is_one_of_the_best(monkeypatch):
    best = search_layout(MLP, MESH, top=3).ranked
    result = search_layout(MLP, MESH, top=3, baseline=best[1].layout)
    runs = []
    monkeypatch.setattr(
        measure, "in_blocks", lambda fns, rounds, block: runs.append(len(fns)) or {i: 1.0 + i for i in fns}
    )
    timed = measure_layouts(result, MLP, k=3)
    assert runs == [3] and timed.baseline is not None and timed.baseline.measured_s == 2.0
    assert timed.ranked[1].layout == best[1].layout and "yours: measured 2.00x the best's time" in timed.format()


def test_measured_times_are_real_steps():
    result = search_layout(MLP, MESH, top=2)
    timed = measure_layouts(result, MLP, k=2, rounds=1, block=2)
    assert all(c.measured_s is not None and 0 < c.measured_s < 10 for c in timed.ranked)
    assert timed.ranked[0].measured_s <= timed.ranked[1].measured_s
    assert {c.layout for c in timed.ranked} == {c.layout for c in result.ranked}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"k": 0}, r"k=0\): give how many of the best layouts to time"),
        ({"rounds": 0}, r"rounds=0\): give a whole number"),
        ({"task": "graph"}, "times training steps: give the training task the search was given"),
    ],
)
def test_bad_arguments_say_what_to_give(change, message):
    result = search_layout(MLP, MESH, top=2)
    args = {"task": MLP, "k": 2, **change}
    with pytest.raises(mx.ConfigError, match=message):
        measure_layouts(result, **args)


def test_a_task_other_than_the_one_searched_is_refused():
    """The layouts and their predicted costs are the searched task's: timing another task's steps
    (another width, say) ranked them by a program that was not costed, without a word."""
    result = search_layout(MLP, MESH, top=2)
    with pytest.raises(mx.ConfigError, match=r"the search was of MlpTask\(.*hidden=128.*the task given is MlpTask"):
        measure_layouts(result, MlpTask(hidden=64), k=1)
    x = mx.import_tensor(mx.Mesh(mx.Graph(), "m"), np.ones((8, 4), np.float32), "b:8;f:4")
    graph = search_layout(x.graph, "all:8", outputs=[mx.reduce_sum(x * x)], top=1)
    with pytest.raises(mx.ConfigError, match="this search was of a graph: search a training task"):
        measure_layouts(graph)


def test_a_mesh_larger_than_the_devices_and_annotations_without_their_task_are_named():
    big = search_layout(MLP, "rows:4;cols:4", top=2)
    with pytest.raises(mx.ConfigError, match=r"the mesh needs 16, this process has 8 .*JAX_NUM_CPU_DEVICES=16"):
        measure_layouts(big, MLP)
    result = search_layout(MLP, MESH, top=2)
    labelled = dataclasses.replace(result, baseline=dataclasses.replace(result.ranked[1], label="annotations 2d"))
    with pytest.raises(mx.ConfigError, match="'annotations 2d': give yours="):
        measure_layouts(labelled, MLP, k=1)


def test_plan_search_measure_prints_the_measured_ranking(capsys):
    assert main(["plan", "mlp", "--mesh", MESH, "--search", "--top", "3", "--measure", "2"]) == 0
    out, err = capsys.readouterr()
    assert "measuring the 2 best layouts ..." in err
    lines = out.splitlines()
    assert "the 2 best and yours measured on 8 cpu devices" in lines[1] and "measured ms" in lines[2]
    measured = [line.split()[3] for line in lines[3:7]]  # (#, layout, step ms, measured ms)
    assert measured[2] == "-" and all(float(m) > 0 for m in measured[:2] + measured[3:])
    assert float(measured[0]) <= float(measured[1])


def test_plan_lists_every_layout_it_measures(capsys):
    assert main(["plan", "mlp", "--mesh", MESH, "--search", "--top", "1", "--measure", "2", "--layout", ""]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "the 2 best and yours measured" in lines[1] and [line.split()[0] for line in lines[3:6]] == [
        "1",
        "2",
        "yours",
    ]


def test_measure_without_a_search_is_refused(capsys):
    assert main(["plan", "mlp", "--mesh", MESH, "--measure", "2"]) == 2
    assert "--measure applies to a layout search: add --search" in capsys.readouterr().err


def test_layouts_measured_together_need_all_their_weights_and_one_steps_activations(monkeypatch):
    result = search_layout(MLP, MESH, top=2)
    kept = [c.cost.memory["parameters"] + c.cost.memory["optimizer_state"] for c in result.ranked]
    need = sum(kept) + max(c.memory_bytes - k for c, k in zip(result.ranked, kept))
    assert need < sum(c.memory_bytes for c in result.ranked)  # (each step's activations are freed after it)
    monkeypatch.setattr(measure, "in_blocks", lambda fns, rounds, block: dict.fromkeys(fns, 1.0))
    assert measure_layouts(dataclasses.replace(result, memory_budget=need), MLP, k=2).measured
    together = r"to measure \(the 2 best\) are predicted to need .*B per device together, over the memory budget"
    with pytest.raises(mx.ConfigError, match=together + ".* measure fewer"):
        measure_layouts(dataclasses.replace(result, memory_budget=need - 1), MLP, k=2)


def test_yours_over_the_budget_alone_is_shown_not_run(monkeypatch, capsys):
    result = search_layout(MLP, MESH, top=2, baseline="batch:rows;hidden:cols")
    best = result.ranked[0]
    big = {**result.baseline.cost.memory, "activations": best.memory_bytes}  # (over the budget alone)
    mine = dataclasses.replace(result.baseline, cost=dataclasses.replace(result.baseline.cost, memory=big))
    lean = dataclasses.replace(result, memory_budget=best.memory_bytes, baseline=mine)
    runs = []
    monkeypatch.setattr(
        measure, "in_blocks", lambda fns, rounds, block: runs.append(len(fns)) or dict.fromkeys(fns, 1.0)
    )
    timed = measure_layouts(lean, MLP, k=1)
    assert runs == [1] and timed.ranked[0].measured_s == 1.0 and timed.baseline.measured_s is None
    assert "the 1 best (not yours, over the memory budget) measured on 8 cpu devices" in timed.format()
    assert main(["plan", "lm", "--mesh", MESH, "--search", "--measure", "1", "--memory-budget", "8MB"]) == 0
    out, err = capsys.readouterr()
    assert "measuring the 1 best layout ..." in err and "(not yours, over the memory budget)" in out


def test_a_search_for_an_accelerator_is_not_ranked_by_the_cpus_times(capsys):
    result = search_layout(MLP, MESH, top=2, device="h100")
    with pytest.raises(mx.ConfigError, match="predicted for NVIDIA H100 SXM, and this process's devices are CPUs"):
        measure_layouts(result, MLP, k=2)
    assert main(["plan", "mlp", "--mesh", MESH, "--search", "--measure", "1", "--device", "tpu-v4"]) == 2
    assert "search for these (device cpu" in capsys.readouterr().err


def test_plan_search_json_is_the_result_as_data_and_pictures_say_so_on_stderr(capsys, tmp_path):
    """`plan --search --json` was refused ("--search prints its own table")."""
    pictures = tmp_path / "pictures"
    argv = ["plan", "mlp", "--mesh", MESH, "--search", "--top", "2", "--measure", "1", "--json"]
    assert main([*argv, "--picture", str(pictures)]) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    best, second, yours = data["ranked"][0], data["ranked"][1], data["baseline"]
    assert data["legal"] == 16 and data["measured"].startswith("the 1 best and yours measured on 8 cpu devices")
    assert best["measured_ms"] > 0 and second["measured_ms"] is None and yours["measured_ms"] > 0
    assert best["mesh"] == MESH and best["step_ms"] <= second["step_ms"] and yours["layout"] == "batch:rows;hidden:cols"
    assert best["memory_bytes"] == sum(best["memory"].values()) and set(best["communication_ms"]) >= {"allreduce"}
    assert err.count("wrote ") == len(os.listdir(pictures)) >= 2


def test_train_search_measured_trains_yours_where_it_ran_fastest(monkeypatch, capsys):
    """`meshax train --search --measure 1`: the best and yours (mlp's default) timed, yours the
    faster here, so yours is trained, as the table's measured column has it."""
    monkeypatch.setattr(measure, "in_blocks", lambda fns, rounds, block: {i: 2.0 - i for i in fns})
    flags = ["--mesh", MESH, "--search", "--measure", "1", "--steps", "1", "--no-progress"]
    assert main(["train", "mlp", *flags]) == 0
    out = capsys.readouterr().out
    assert "yours: measured 0.50x the best's time" in out and "training yours, measured faster" in out
    assert f"mesh '{MESH}', layout 'batch:rows;hidden:cols'" in out


def test_measure_runs_the_optimizer_the_search_costed(monkeypatch):
    """A search costed SGD's step: measuring its best runs SGD's too, not Adam's, unless told."""
    from meshax.search.search import search_mesh_and_layout

    sgd, used, real = mx.optimize.SgdOptimizer(0.1), [], loop.build

    def build(task, mesh, layout, backend, optimizer, weight_layout=None):
        used.append(optimizer)
        return real(task, mesh, layout, backend, optimizer, weight_layout=weight_layout)

    monkeypatch.setattr(loop, "build", build)
    monkeypatch.setattr(measure, "in_blocks", lambda fns, rounds, block: {i: 1.0 + i for i in fns})
    result = search_layout(MLP, MESH, top=1, optimizer=sgd)
    measure_layouts(result, MLP, k=1)
    assert used == [sgd] and search_mesh_and_layout(MLP, 8, top=1, optimizer=sgd).optimizer is sgd


def test_plan_measures_the_steps_of_the_optimizer_training_runs(monkeypatch):
    """`plan --search --measure --optimizer adafactor` timed Adam's steps (the search's result keeps its optimizer)."""
    optimizers, real = [], loop.build

    def build(task, mesh, layout, backend, optimizer=None, **kwargs):
        optimizers.append(type(optimizer).__name__)
        return real(task, mesh, layout, backend, optimizer, **kwargs)

    monkeypatch.setattr(loop, "build", build)
    monkeypatch.setattr(measure, "in_blocks", lambda fns, rounds, block: dict.fromkeys(fns, 1.0))
    assert main(["plan", "mlp", "--mesh", MESH, "--search", "--measure", "1", "--optimizer", "adafactor"]) == 0
    assert optimizers == ["AdafactorOptimizer", "AdafactorOptimizer"]  # (the best and yours)
