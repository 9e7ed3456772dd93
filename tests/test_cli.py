"""The command line: plan and train (issue 3)."""

import json
import os
import sys

import pytest

from meshax.cli import main


def test_plan_prints_layouts_and_report_without_running(capsys):
    assert main(["plan", "mnist", "--mesh", "rows:2;cols:4", "--layout", "batch:rows;hidden:cols"]) == 0
    out = capsys.readouterr().out
    assert "hidden/kernel" in out and "hidden over cols" in out and "[32, 8, 8]" not in out
    assert "[8, 8, 256]" in out  # the kernel's slice on each device: hidden split 4 ways
    assert "grad of hidden (Einsum)" in out and "allreduce" in out


def test_plan_works_for_a_mesh_larger_than_this_machine(capsys):
    assert (
        main(
            [
                "plan",
                "mlp",
                "--mesh",
                "rows:16;cols:32",
                "--layout",
                "batch:rows;hidden:cols",
                "--batch-size",
                "512",
                "--hidden",
                "4096",
            ]
        )
        == 0
    )
    assert "allreduce" in capsys.readouterr().out


def test_train_writes_metrics(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    assert (
        main(
            [
                "train",
                "mlp",
                "--mesh",
                "all:8",
                "--layout",
                "batch:all",
                "--steps",
                "5",
                "--eval-every",
                "0",
                "--no-progress",
                "--metrics",
                str(metrics),
            ]
        )
        == 0
    )
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    run = lines.pop(0)  # (what ran, first: the layout `--search` chose, say)
    assert run["step"] == 0 and run["run"]["mesh"] == "all:8" and run["run"]["layout"] == "batch:all"
    assert run["run"]["task"] == "mlp" and run["run"]["weight_layout"] is None
    assert [line["step"] for line in lines[:5]] == [1, 2, 3, 4, 5]  # steps completed
    assert "eval" in lines[-1] and lines[-1]["eval"]["loss"] > 0
    assert "eval after step 5" in capsys.readouterr().out


def test_bad_input_is_reported_not_raised(capsys):
    assert main(["plan", "mlp", "--mesh", "rows:2;cols", "--layout", ""]) == 2
    assert "cols" in capsys.readouterr().err
    assert main(["plan", "mlp", "--mesh", "all:8", "--layout", "batch:all;hidden:all"]) == 2
    assert "both split over mesh dim 'all'" in capsys.readouterr().err
    assert main(["plan", "mlp", "--mesh", "all:8", "--layout", "batch:nowhere"]) == 2
    assert "nowhere" in capsys.readouterr().err
    assert main(["plan", "lm", "--text", "/no/such/corpus"]) == 2
    assert "/no/such/corpus" in capsys.readouterr().err
    assert main(["plan", "lm", "--model", "huge"]) == 2
    assert "unknown model 'huge'" in capsys.readouterr().err


def test_plan_of_a_paper_transformer_on_a_16x32_mesh(capsys):
    assert (
        main(
            [
                "plan",
                "seq2seq",
                "--model",
                "paper-ff65536",
                "--mesh",
                "rows:16;cols:32",
                "--batch-size",
                "256",
                "--length",
                "256",
                "--json",
            ]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert plan["parameters"] == 2_886_545_408
    per_device = (plan["parameters"] - plan["replicated_parameters"]) // 32 + plan["replicated_parameters"]
    assert plan["parameter_bytes_per_device"] == 4 * per_device
    assert plan["by_mesh_dim"]["rows"] > 0 and plan["by_mesh_dim"]["cols"] > 0


def test_train_lm_with_checkpoints_and_resume(tmp_path, capsys, monkeypatch):
    from meshax.train.decode import Decoder

    load = Decoder.load
    ckpt = str(tmp_path / "ckpt")
    common = [
        "--model",
        "tiny",
        "--source",
        "markov",
        "--batch-size",
        "8",
        "--length",
        "16",
        "--eval-every",
        "0",
        "--no-progress",
        "--mesh",
        "all:8",
        "--layout",
        "batch:all",
    ]
    assert main(["train", "lm", *common, "--steps", "3", "--checkpoint-dir", ckpt]) == 0
    assert main(["train", "lm", *common, "--steps", "5", "--resume", ckpt, "--metrics", str(tmp_path / "m.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "resuming from step 3" in out
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records[:3]] == [3, 4, 5] and records[0]["run"]["layout"] == "batch:all"
    # decoding from the checkpoint (the tokens themselves: tests/test_decode.py)
    model = ["--model", "tiny", "--source", "markov", "--length", "16", "--resume", ckpt, "--prompt", "3,5,2"]
    sampled = ["--samples", "2", "--temperature", "0.8"]
    assert main(["generate", "lm", *model, "--mesh", "all:4", "--layout", "heads:all", *sampled]) == 0
    lines = capsys.readouterr().out.split("\n")
    assert len([line for line in lines if line.count(",") == 13]) == 2  # 14 new: positions 3 .. --length
    assert main(["generate", "lm", *model, "--mesh", "all:1", "--layout", "", "--new", "4", "--beam-size", "2"]) == 0
    assert "score" in capsys.readouterr().out
    # --report: first what each token's step costs (heads split: its attention's sums allreduced)
    assert main(["generate", "lm", *model, "--mesh", "all:4", "--layout", "heads:all", "--new", "4", "--report"]) == 0
    out = capsys.readouterr().out
    *report, tokens = out.rstrip().splitlines()
    assert tokens.count(",") == 3 and "heads:all" in out and "allreduce" in "\n".join(report)
    assert main(["generate", "lm", *model[:-2], "--mesh", "all:1", "--layout", ""]) == 2
    assert "needs --prompt" in capsys.readouterr().err
    # another task or --source: said so (it was 'it holds another model' and the variables that differ)
    assert main(["generate", "seq2seq", "--resume", ckpt, "--prompt", "1,2", "--mesh", "all:1", "--layout", ""]) == 2
    assert (
        "holds a checkpoint of the task lm, not seq2seq: decode it with `meshax generate lm" in capsys.readouterr().err
    )
    assert main(["generate", "lm", *model[:2], *model[4:], "--mesh", "all:1", "--layout", ""]) == 2  # (no --source)
    assert "holds a model of --source markov, whose vocabulary differs from --source text's: give --source markov" in (
        capsys.readouterr().err
    )
    assert main(["generate", "mlp", "--resume", ckpt, "--mesh", "all:1", "--layout", ""]) == 2
    one = ["--mesh", "all:1", "--layout", ""]
    for flags, message in [
        (["--samples", "2"], "--samples 2 at --temperature 0"),
        (["--top-k", "3"], "add --temperature"),
        (["--top-k", "100000", "--temperature", "1"], "--top-k 100000: the model has 16 tokens; give 1 to 16"),
        (["--beam-size", "2", "--top-k", "3"], "takes no --top-k"),
        (["--beam-size", "2", "--samples", "2"], "--samples 2 would repeat it: drop --samples"),
        (["--alpha", "0.8"], "--alpha is beam search's length penalty: give --beam-size too"),
        (["--new", "15"], "--new 15 after a prompt of 3 tokens passes --length 16: give --new 14 or less, or a "),
        (["--batch-size", "4"], "--batch-size 4 is training's; generate decodes --samples"),  # (it was ignored)
    ]:
        capsys.readouterr()
        assert main(["generate", "lm", *model, *one, *flags]) == 2, flags
        assert message in capsys.readouterr().err, flags
    # the training layout decodes: its rule for `length` (the step has one position) is dropped there
    assert main(["generate", "lm", *model, "--mesh", "rows:2;cols:4", "--layout", "batch:rows;length:cols"]) == 0
    out_of_vocab = [*model[:-1], "3,5,300"]
    assert main(["generate", "lm", *out_of_vocab, *one]) == 2
    assert "prompt token 300 is not in the vocabulary 0.." in capsys.readouterr().err
    # an id past int32 (it ended in numpy's OverflowError, a traceback)
    assert main(["generate", "lm", *model[:-1], "3,99999999999", *one]) == 2
    assert "--prompt token 99999999999 is not in the vocabulary 0..15" in capsys.readouterr().err
    # --backend and --weight-layout decode (they were dropped: SIMD and --layout alone), the same tokens
    import meshax.train.decode as decode

    built = []
    monkeypatch.setattr(decode.Decoder, "load", lambda self, *a, **k: (built.append(self), load(self, *a, **k))[1])
    outputs = []
    for flags in ([], ["--backend", "placement", "--weight-layout", "d_model:all"]):
        assert main(["generate", "lm", *model, "--mesh", "all:2", "--layout", "heads:all", "--new", "4", *flags]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    impl = built[-1].lowering.impl
    assert type(impl).__name__ == "PlacementMeshImpl" and str(impl.weight_rules) == "d_model:all"


def test_plan_with_a_gspmd_sharding_and_explain(capsys):
    """--sharding annotates the GSPMD paper's Table 1 tensors; --explain says where each layout
    came from (here: the embedding table's d_model follows BSM's y, by propagation)."""
    assert (
        main(
            [
                "plan",
                "lm",
                "--model",
                "tiny",
                "--mesh",
                "x:2;y:4",
                "--layout",
                "",
                "--sharding",
                "gspmd-2d-finalized",
                "--batch-size",
                "8",
                "--length",
                "16",
                "--explain",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "reduce_scatter" in out and "allgather" in out
    lines = [line for line in out.splitlines() if line.startswith("transformer/embedding ")]
    assert lines and "d_model:y" in lines[0] and "propagated" in lines[0]
    assert "annotation at" in out and "transformer.py" in out


def test_unknown_sharding_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "lm", "--sharding", "gspmd-3d"])
    assert "invalid choice" in capsys.readouterr().err


def test_tensorboard_files_hold_the_losses_and_plot_draws_the_runs(tmp_path, capsys):
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = []
    for layout in ("batch:all", "hidden:all"):
        metrics, board = tmp_path / f"{layout.split(':')[0]}.jsonl", tmp_path / f"tb-{layout.split(':')[0]}"
        argv = ["train", "mlp", "--mesh", "all:8", "--layout", layout, "--steps", "4", "--eval-every", "2"]
        assert main([*argv, "--no-progress", "--metrics", str(metrics), "--tensorboard", str(board)]) == 0
        logged = [json.loads(line) for line in metrics.read_text().splitlines()]
        events = EventAccumulator(str(board))
        events.Reload()
        read = {e.step: e.value for e in events.Scalars("train/loss")}
        assert read == pytest.approx({r["step"]: r["loss"] for r in logged if "loss" in r})
        assert [e.step for e in events.Scalars("eval/loss")] == [2, 4]
        runs.append(str(metrics))
    out = tmp_path / "curves.png"
    assert main(["plot", *runs, "--out", str(out)]) == 0
    assert Image.open(out).size == (1200, 400)  # 12 x 4 inches at 100 dpi
    assert main(["plot", str(tmp_path / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_plot_draws_a_resumed_runs_repeated_steps_once(tmp_path, monkeypatch):
    """A run killed after step 12 and resumed from its checkpoint at step 8 appends steps 9-20
    to the same --metrics file: the plot's lines go forward in the step, each step once (the
    resumed run's record), not back from step 12 to step 9."""
    import matplotlib.pyplot as plt

    from meshax.train import metrics as metrics_module

    path = tmp_path / "run.jsonl"
    records = [{"step": s, "loss": 10.0 / s, "step_seconds": 0.01} for s in [*range(1, 13), *range(9, 21)]]
    records += [{"step": 10, "eval": {"loss": 1.0}}, {"step": 10, "eval": {"loss": 0.5}}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    metrics_module.plot_metrics([str(path)], str(tmp_path / "out.png"))
    loss_line, eval_line = figs[0].axes[0].lines
    assert list(loss_line.get_xdata()) == list(range(1, 21))
    assert list(loss_line.get_ydata()) == pytest.approx([10.0 / s for s in range(1, 21)])
    assert list(eval_line.get_xdata()) == [10] and list(eval_line.get_ydata()) == [0.5]
    assert list(figs[0].axes[1].lines[0].get_xdata()) == list(range(1, 21))


def test_plot_draws_the_last_run_of_a_file(tmp_path, monkeypatch):
    """A fresh run appended to a file an earlier, longer run wrote (steps 1-20) replaces it: the
    curve mixed the new run's steps 1-5 with the old run's 6-20. A run resumed at step 3 keeps
    what came before its checkpoint. Each run's first record says where it starts."""
    import matplotlib.pyplot as plt

    from meshax.train import metrics as metrics_module

    def run(first, last, loss):
        return [{"step": first, "run": {"mesh": "all:8"}}] + [{"step": s, "loss": loss} for s in range(first + 1, last)]

    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*run(0, 21, 1.0), *run(0, 6, 2.0), *run(3, 9, 3.0)]))
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    metrics_module.plot_metrics([str(path)], str(tmp_path / "out.png"))
    (line,) = figs[0].axes[0].lines
    assert list(line.get_xdata()) == list(range(1, 9))
    assert list(line.get_ydata()) == [2.0, 2.0, 2.0, 3.0, 3.0, 3.0, 3.0, 3.0]


def test_plot_draws_the_loss_scale_of_a_float16_run(tmp_path, monkeypatch):
    """A run that logs a loss scale (float16) gets a third panel with it, on a log scale; a run
    without one keeps its two panels."""
    import matplotlib.pyplot as plt

    from meshax.train import metrics as metrics_module

    scales = [2.0**15, 2.0**14, 2.0**14, 2.0**15]
    path = tmp_path / "f16.jsonl"
    path.write_text(
        "".join(json.dumps({"step": s + 1, "loss": 1.0, "loss_scale": v}) + "\n" for s, v in enumerate(scales))
    )
    plain = tmp_path / "f32.jsonl"
    plain.write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    metrics_module.plot_metrics([str(path), str(plain)], str(tmp_path / "out.png"))
    scale_ax = figs[0].axes[2]
    assert list(scale_ax.lines[0].get_ydata()) == scales and len(scale_ax.lines) == 1
    assert scale_ax.get_yscale() == "log"
    metrics_module.plot_metrics([str(plain)], str(tmp_path / "out.png"))
    assert len(figs[1].axes) == 2


def test_plot_keeps_apart_runs_whose_files_share_a_name(tmp_path, monkeypatch, capsys):
    """runs/a/m.jsonl and runs/b/m.jsonl were both labelled "m", and the second hid the first:
    one line drawn for two runs. Each is drawn, labelled by its path; a file given twice is refused."""
    import matplotlib.pyplot as plt

    monkeypatch.chdir(tmp_path)
    for run, loss in (("a", 2.0), ("b", 3.0)):
        os.makedirs(f"runs/{run}")
        (tmp_path / "runs" / run / "m.jsonl").write_text(json.dumps({"step": 1, "loss": loss}) + "\n")
    (tmp_path / "m.jsonl").write_text(json.dumps({"step": 1, "loss": 4.0}) + "\n")
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    assert main(["plot", "runs/a/m.jsonl", "runs/b/m.jsonl", "m.jsonl", "--out", "out.png"]) == 0
    lines = figs[0].axes[0].lines
    assert [line.get_label() for line in lines] == ["runs/a/m.jsonl", "runs/b/m.jsonl", "m.jsonl"]
    assert [list(line.get_ydata()) for line in lines] == [[2.0], [3.0], [4.0]]
    capsys.readouterr()
    assert main(["plot", "m.jsonl", "./m.jsonl", "--out", "again.png"]) == 2
    assert "metrics file './m.jsonl' is given twice (as 'm.jsonl' too): give each run once" in capsys.readouterr().err
    assert not os.path.exists("again.png")


def test_plan_json_with_explain_carries_the_explanation(capsys):
    argv = ["plan", "mlp", "--mesh", "all:8", "--layout", "batch:all", "--json"]
    assert main([*argv, "--explain"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert "batch" in plan["explain"]
    assert main(argv) == 0
    assert "explain" not in json.loads(capsys.readouterr().out)


def test_plan_costs_the_optimizer_asked_for_and_json_still_draws_pictures(capsys, tmp_path):
    """`plan --optimizer adafactor` costs Adafactor (plan refused the flag, so it costed Adam's
    state and collectives while train ran Adafactor's); `--json --picture` draws the pictures too,
    and says so on stderr (its 'wrote ...' lines went before the JSON, which no reader then parsed)."""
    argv = ["plan", "lm", "--model", "small", "--mesh", "rows:2;cols:4", "--json"]  # (dims of 128 and up: factored)
    state = {}
    for name in ("adam", "adafactor"):
        assert main([*argv, "--optimizer", name]) == 0
        state[name] = json.loads(capsys.readouterr().out)["optimizer_state_bytes_per_device"]
    assert state["adafactor"] < state["adam"] / 4  # (factored second moments, no first)
    assert main([*argv, "--picture", str(tmp_path / "pics")]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["optimizer_state_bytes_per_device"] == state["adam"]
    assert os.listdir(tmp_path / "pics") and err.count("wrote ") == len(os.listdir(tmp_path / "pics"))


def test_the_command_tunes_its_garbage_collector_and_a_python_caller_keeps_its_own(monkeypatch, capsys):
    import meshax.cli

    tuned = []
    monkeypatch.setattr(meshax.cli, "_tune_gc", lambda: tuned.append(True))
    monkeypatch.setattr(sys, "argv", ["meshax", "plan", "mlp", "--mesh", "all:3", "--layout", "nothing:all"])
    assert meshax.cli.main() == 2 and tuned == [True]  # as the command: tuned, then the bad input said
    assert meshax.cli.main(sys.argv[1:]) == 2 and tuned == [True]  # from Python with argv: left alone
    assert "nothing" in capsys.readouterr().err


def test_generated_text_shows_control_bytes_as_escapes():
    """A text model's bytes are printed as text, but a control byte (an escape sequence, a NUL)
    is shown as `\\x..`, so it cannot drive the terminal or a log; newlines, tabs and other
    characters stay as they are."""
    from meshax.cli.generate import printable

    assert printable("a\x1b[31mb\x00c\td\ne\x7ff\u00e9\x85") == "a\\x1b[31mb\\x00c\td\ne\\x7ff\u00e9\\x85"


def test_generate_continues_a_prompt_of_bytes_that_are_not_utf8(tmp_path, capsys):
    """A command line's bytes that are not UTF-8 reach Python as surrogates ('ab\\udcff'):
    `--prompt` is those bytes (it was an error, "'utf-8' codec can't encode character '\\udcff'",
    that named no flag); prompt and continuation print as one decoded text."""
    ckpt = str(tmp_path / "ckpt")
    run = ["--mesh", "all:1", "--layout", "", "--length", "8"]
    assert main(["train", "lm", *run, "--steps", "1", "--batch-size", "2", "--eval-every", "0", "--no-progress",
                 "--checkpoint-dir", ckpt]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["generate", "lm", *run, "--resume", ckpt, "--prompt", "ab\udcff", "--new", "2"]) == 0
    assert capsys.readouterr().out.startswith("ab\ufffd")


def test_plan_on_the_placement_backend_needs_no_devices(capsys):
    """`meshax plan` allocates nothing, on either backend: the placement backend's trace asked for
    the mesh's devices ('needs 512 devices but JAX sees 8'), on a mesh of 8 devices too when run
    alone. Its plan is the SIMD backend's."""
    argv = ["plan", "mlp", "--mesh", "rows:16;cols:32", "--layout", "batch:rows;hidden:cols"]
    plans = []
    for backend in ("simd", "placement"):
        assert main([*argv, "--backend", backend]) == 0, capsys.readouterr().err
        plans.append(capsys.readouterr().out)
    assert plans[0] == plans[1] and "allreduce" in plans[0]
