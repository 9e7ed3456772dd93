"""The command line: plan and train (issue 3)."""

import json

from meshax.cli import main


def test_plan_prints_layouts_and_report_without_running(capsys):
    assert main(["plan", "mnist", "--mesh", "rows:2;cols:4", "--layout", "batch:rows;hidden:cols"]) == 0
    out = capsys.readouterr().out
    assert "hidden/kernel" in out and "hidden over cols" in out and "[32, 8, 8]" not in out
    assert "[8, 8, 256]" in out  # the kernel's slice on each device: hidden split 4 ways
    assert "grad of hidden (Einsum)" in out and "allreduce" in out


def test_plan_works_for_a_mesh_larger_than_this_machine(capsys):
    assert main(["plan", "mlp", "--mesh", "rows:16;cols:32", "--layout", "batch:rows;hidden:cols",
                 "--batch-size", "512", "--hidden", "4096"]) == 0
    assert "allreduce" in capsys.readouterr().out


def test_train_writes_metrics(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    assert main(["train", "mlp", "--mesh", "all:8", "--layout", "batch:all", "--steps", "5", "--eval-every", "0",
                 "--no-progress", "--metrics", str(metrics)]) == 0
    lines = [json.loads(l) for l in metrics.read_text().splitlines()]
    assert [l["step"] for l in lines[:5]] == [0, 1, 2, 3, 4]
    assert "eval" in lines[-1] and lines[-1]["eval"]["loss"] > 0
    assert "eval after step 5" in capsys.readouterr().out


def test_bad_input_is_reported_not_raised(capsys):
    assert main(["plan", "mlp", "--mesh", "rows:2;cols", "--layout", ""]) == 2
    assert "cols" in capsys.readouterr().err
    assert main(["plan", "mlp", "--mesh", "all:8", "--layout", "batch:all;hidden:all"]) == 2
    assert "both split over mesh dim 'all'" in capsys.readouterr().out
    assert main(["plan", "mlp", "--mesh", "all:8", "--layout", "batch:nowhere"]) == 2
    assert "nowhere" in capsys.readouterr().out
