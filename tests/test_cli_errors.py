"""A catalogue of bad command lines: each exits 2 with one line on stderr that names the flag or
the value, no traceback, and nothing written."""

import os
import sys

import pytest

from meshax.cli import main
from meshax.core.errors import GraphError, MeshaxError

MLP = ["--mesh", "all:8", "--layout", "batch:all"]
CASES = [  # (argv, a piece of the message)
    (["plan", "lm", "--mesh", "all:8", "--layout", "vocab:all;d_model:all"], "both split over mesh dim 'all'"),
    (["plan", "mlp", "--mesh", "rows:2;cols:4", "--layout", "batch:rows;hiden:cols"], "did you mean 'hidden'"),
    (["plan", "mlp", *MLP, "--layout", "batch:al"], "did you mean 'all'"),
    (["plan", "mlp", *MLP, "--batch-size", "-8"], "--batch-size"),
    (["plan", "mlp", *MLP, "--batch-size", "0"], "'0' is not a whole number from 1"),
    (["plan", "mlp", *MLP, "--batch-size", "abc"], "'abc'"),
    (["plan", "mlp", *MLP, "--batch-size", "1.5"], "'1.5'"),
    (["train", "mlp", *MLP, "--steps", "-5"], "--steps"),
    (["plan", "mlp", "--mesh", "rows:0;cols:4", "--layout", ""], "size 0"),
    (["plan", "mlp", "--mesh", "", "--layout", ""], "has no dims"),
    (["plan", "mlp", "--mesh", "rows:2;rows:4", "--layout", ""], "twice"),
    (["plan", "mlp", "--mesh", "rows:2;cols", "--layout", ""], "'cols'"),
    (["plan", "mlp", "--mesh", "rows:two", "--layout", ""], "'two'"),
    (["plan", "mlp", "--mesh", "rows:2.5", "--layout", ""], "a size is a whole number, not 2.5"),
    # past JAX's 32-bit device count: it failed inside JAX with 'std::bad_cast' (plan) or on its CPU client's arguments
    (["plan", "mlp", "--mesh", "rows:65536;cols:32768", "--layout", ""], "has 2147483648 devices; JAX's meshes hold"),
    (["train", "mlp", "--mesh", "rows:9999999999", "--layout", ""], "JAX's meshes hold at most 2**31 - 1"),
    (["plan", "lm", "--weight-layout", "d_ff:cols except [nosuch,dims]"], "[dims,nosuch] exempts nothing"),
    (  # a dim of activations only: weight rules lay out weight-shaped tensors alone (it was accepted)
        ["plan", "mlp", "--mesh", "rows:2;cols:4", "--layout", "batch:rows", "--weight-layout", "batch:cols"],
        "weight layout rule batch:cols splits nothing: no weight has a dim 'batch' (the weights' dims: hidden, io)",
    ),
    (["plan", "mlp", "--mesh", "all:8", "--layout", "batch=all"], "e.g. 'batch:rows;hidden:cols'"),
    # (the flag named: the four rule texts' messages were the same, quoting the text alone)
    (["plan", "mlp", "--mesh", "all:8", "--layout", "batch=all"], "--layout: bad layout entry 'batch=all'"),
    (["plan", "mlp", *MLP, "--weight-layout", "hidden=all"], "--weight-layout: bad layout entry 'hidden=all'"),
    (["plan", "mlp", *MLP, "--search", "--pin", "batch=all"], "--pin: bad layout entry 'batch=all'"),
    (["plan", "mlp", "--mesh", "all=8", "--layout", ""], "--mesh: bad mesh entry 'all=8'"),
    (["calibrate", "--mesh", "all=8", "--out", "d.json"], "--mesh: bad mesh entry 'all=8'"),
    (["plan", "mlp", "--mesh", "all:8", "--layout", "batch:nowhere"], "'nowhere'"),
    (["plan", "mlp", "--mesh", "all:8", "--layout", "batch:all;hidden:all"], "both split over mesh dim 'all'"),
    (["plan", "mlp", "--mesh", "all:8", "--layout", "batch:all;batch:all"], "twice"),
    (["plan", "mlp", "--mesh", "rows:2;cols:4", "--layout", "batch:rows;hidden:rows"], "'rows'"),
    (["plan", "lm", "--length", "0"], "--length"),
    (["plan", "mlp", *MLP, "--hidden", "-1"], "--hidden"),
    (["plan", "mlp", *MLP, "--seed", "-1"], "--seed"),
    (["train", "mlp", *MLP, "--lr", "-0.1"], "--lr"),
    (["plan", "lm", "--search", "--memory-budget", "-5GB"], "memory budget '-5GB': give a size like 16GB"),
    # (the table was printed, and no explanation: --explain was passed over)
    (["plan", "mlp", *MLP, "--search", "--explain"], "--explain explains the tensors of one layout, and --search"),
    (["train", "mlp", *MLP, "--lr", "nan"], "'nan'"),
    (["train", "mlp", *MLP, "--lr", "fast"], "'fast'"),
    # (inf in the float32 step: NumPy's overflow warning, then a nan loss at step 2)
    (["train", "mlp", *MLP, "--lr", "1e308"], "'1e308' is not a number from 0 to 3.4e38 (the largest float32"),
    (["train", "mlp", *MLP, "--warmup", "-1"], "--warmup"),
    (["train", "mlp", *MLP, "--steps", "100", "--warmup", "500"], "--warmup 500"),
    (["train", "mlp", *MLP, "--optimizer", "adafactor", "--warmup", "5"], "Adafactor without --lr has its own"),
    (["train", "mlp", *MLP, "--eval-every", "-1"], "--eval-every"),
    (["train", "mlp", *MLP, "--checkpoint-every", "-2"], "--checkpoint-every"),
    (["train", "mlp", *MLP, "--checkpoint-every", "5"], "--checkpoint-dir"),
    (["train", "mlp", *MLP, "--resume", "no_such_dir"], "no checkpoint"),
    (["train", "mlp", *MLP, "--resume", "a", "--checkpoint-dir", "b"], "differ"),
    (["train", "mlp", *MLP, "--metrics", "no/such/dir/m.jsonl"], "--metrics"),
    (["train", "mlp", *MLP, "--optimizer", "sgd"], "'sgd'"),
    (["plan", "mlp", *MLP, "--backend", "gpu"], "'gpu'"),
    (["plan", "lm", "--sharding", "gspmd-3d"], "'gspmd-3d'"),
    (["plan", "lm", "--sharding", "gspmd-2d-finalized"], 'has no x or y: give e.g. --mesh "x:2;y:4"'),
    (["plan", "mlp", *MLP, "--sharding", "gspmd-2d-finalized"], "--sharding"),
    (["plan", "lm", "--model", "huge"], "unknown model 'huge'"),
    (["plan", "lm", "--model", "tinny"], "did you mean 'tiny'"),
    (["plan", "mnist", *MLP, "--model", "tiny"], "--model"),
    (["plan", "lm", "--hidden", "64"], "--hidden"),
    (["plan", "mnist", *MLP, "--length", "8"], "--length"),
    (["plan", "mnist", *MLP, "--data", "no/such/folder"], "no/such/folder"),
    (["plan", "lm", "--data", "."], "--data"),
    (["plan", "lm", "--text", "/no/such/corpus"], "/no/such/corpus"),
    (["plan", "lm", "--source", "markov", "--text", "corpus.txt"], "--source"),
    (["plan", "seq2seq", "--problem", "shuffle"], "'shuffle'"),
    (["plan", "lm", "--source", "web"], "'web'"),
    (["plan", "convnet"], "'convnet'"),
    (["plan", "mlp", *MLP, "--channels", "8"], "--channels applies to cnn and unet"),
    (["plan", "cnn", "--image-size", "32"], "--image-size applies to unet"),
    (["plan", "unet", "--spatial-dims", "4"], "--spatial-dims"),
    (["plan", "unet", "--image-size", "18"], "image_size=18 must be a multiple of 2**depth = 4"),
    (["train"], "task"),
    (["fly"], "'fly'"),
    (["plan", "mlp", *MLP, "--seed", "9223372036854775808"], "--seed"),
    (["plan", "mlp", *MLP, "--batch-size", "9" * 400], "--batch-size"),
    (["plan", "lm", "--problem", "sort"], "--problem applies to seq2seq"),
    (["plan", "seq2seq", "--source", "markov"], "--source applies to lm"),
    (["plan", "mnist", "--mesh", "all:8"], "no --layout given"),
    (["plot", "missing.jsonl"], "does not exist"),
    (["plan", "lm", "--pipeline-stages", "3"], "3 pipeline stages x 1 circular repeats do not divide the 2 layers"),
    (  # (the pipeline said so of its input, naming an internal tensor: "add's batch dim")
        ["plan", "lm", "--pipeline-stages", "2", "--microbatches", "3"],
        "3 microbatches do not divide the batch of 16 examples (--microbatches, --batch-size)",
    ),
    (["plan", "lm", "--microbatches", "4"], "--microbatches needs --pipeline-stages"),
    (["plan", "lm", "--pipeline-stages", "2", "--circular-repeats", "2"], "do not divide the 2 layers"),
    (["plan", "mlp", *MLP, "--moe-experts", "4"], "--moe-experts applies to lm and seq2seq"),
    (["plan", "lm", "--moe-experts", "4", "--pipeline-stages", "2"], "MoE layers inside a pipeline"),
    (["plan", "lm", "--moe-experts", "512"], "512 experts are more than a group of 64 tokens"),
    # (it said "moe with top_2 gating needs at least 2 experts", naming neither the flag's value nor a fix)
    (["plan", "lm", "--moe-experts", "1"], "moe_experts=1: an MoE layer's top-2 gating sends each token to 2 experts"),
    (["plan", "lm", "--weight-layout", "d_model:cols except"], "after 'except', write each weight shape"),
    # --picture's folder is made when the pictures are drawn (it was left behind, empty, by a plan that failed)
    (["plan", "mlp", "--mesh", "all:8", "--layout", "batch:all;hidden:all", "--picture", "pics"], "both split"),
    (["plan", "mlp", "--mesh", "all:8", "--layout", "batch:al", "--search", "--picture", "pics"], "'al'"),
    # an empty path (an unset shell variable) was taken for the flag left out: no checkpoint, a fresh start
    (["train", "mlp", *MLP, "--checkpoint-dir", ""], "--checkpoint-dir '' is empty (an unset shell variable?)"),
    (["train", "mlp", *MLP, "--resume", ""], "--resume '' is empty"),
    (
        ["train", "mlp", *MLP, "--metrics", ""],
        "--metrics '' is empty (an unset shell variable?): give the file to append JSON lines to",
    ),
    (["plan", "mnist", *MLP, "--data", ""], "--data '' is empty"),
    # (it was the default preset, tiny, for lm and seq2seq, and passed for the other tasks)
    (
        ["train", "lm", "--model", "", "--steps", "2"],
        "--model '' is empty (an unset shell variable?): give a preset (tiny",
    ),
    (["plan", "mlp", *MLP, "--model", ""], "--model '' is empty"),
    (["calibrate", "--mesh", "all:2", "--out", ""], "give the file to write"),
    # a folder its permissions would allow, which the system refuses: found before the run, not at its save
    (["train", "mlp", *MLP, "--checkpoint-dir", "/proc/meshax/ck"], "--checkpoint-dir '/proc/meshax/ck'"),
    # a file there too: calibrate measured first and then failed with '[Errno 2] No such file or directory'
    (["calibrate", "--mesh", "all:2", "--out", "/proc/device.json"], "--out '/proc/device.json' cannot be created"),
    (["train", "mlp", *MLP, "--metrics", "/proc/m.jsonl"], "--metrics '/proc/m.jsonl' cannot be created"),
    # one path for a folder and the metrics file: it trained, then failed at the save ("'ck' is a
    # file"), or at the metrics' first line ("[Errno 21] Is a directory"), leaving the file or folder
    (
        ["train", "mlp", *MLP, "--steps", "2", "--checkpoint-dir", "ck", "--metrics", "ck"],
        "--metrics 'ck' is the folder --checkpoint-dir names: give the metrics file a path of its own",
    ),
    (["train", "mlp", *MLP, "--steps", "2", "--tensorboard", "./tb", "--metrics", "tb"], "the folder --tensorboard"),
]

# Cases that need a file and a folder to exist first ("afile", "adir"): nothing else may appear.
WITH_PATHS = [
    (["train", "mlp", *MLP, "--checkpoint-dir", "afile"], "is a file"),
    (["train", "mlp", *MLP, "--tensorboard", "afile"], "is a file"),
    (["train", "mlp", *MLP, "--metrics", "adir"], "is a folder"),
    # (a file of the user's, not metrics: the run appended its JSON lines to it)
    (["train", "mlp", *MLP, "--steps", "2", "--metrics", "afile"], "--metrics 'afile' holds something other than"),
    (["plot", "afile"], "not a line of meshax metrics"),
    (["plan", "lm", "--text", "afile"], "text file 'afile' has 7 bytes; sequences of 64 need at least 1320"),
    (["train", "lm", "--text", "afile", "--length", "8"], "sequences of 8 need at least 200"),
    (["train", "lm", "--text", "adir", "--steps", "2"], "no text files (.py .txt .md .rst) under 'adir'"),
    (["plot", "afile", "--out", "nodir/x.png"], "its folder does not exist"),
    (["train", "mlp", *MLP, "--checkpoint-dir", "afile/ck"], "'afile/ck' cannot be created"),
    (["train", "mlp", *MLP, "--tensorboard", "afile/tb"], "--tensorboard 'afile/tb' cannot be created"),
    (["plan", "mlp", *MLP, "--picture", "afile"], "--picture 'afile' is a file"),
    (["plan", "mlp", *MLP, "--picture", "afile/pics"], "--picture 'afile/pics' cannot be created"),
    (["calibrate", "--mesh", "all:8", "--out", "adir"], "--out 'adir' is a folder"),
    # (it measured no link, and wrote a device whose collectives cost nothing: 'links ;')
    (["calibrate", "--mesh", "all:1", "--out", "adir/d.json"], "mesh 'all:1' has one device, and calibrate measures"),
    (["plot", "adir"], "'adir' is a folder: give the JSON-lines file"),
    (["plot", "afile", "--out", "adir"], "--out 'adir': give a .png file"),
    # a file of the user's, not a device file: calibrate wrote its JSON over it
    (["calibrate", "--mesh", "all:2", "--out", "afile"], "--out 'afile' is a file that is no device file"),
]


def _exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's own errors
        return e.code


def test_the_catalogue_is_long_enough():
    assert len(CASES) >= 40


@pytest.mark.parametrize("argv,expected", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_bad_input_is_one_line_on_stderr(argv, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = _exit_code(argv)
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert expected in lines[0], lines[0]
    assert "Traceback" not in err and "Traceback" not in out
    assert os.listdir(tmp_path) == []  # nothing written: no metrics, no checkpoint


@pytest.mark.parametrize("argv,expected", WITH_PATHS, ids=[" ".join(a)[:60] for a, _ in WITH_PATHS])
def test_bad_paths_are_one_line_on_stderr(argv, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("[1, 2]\n")
    (tmp_path / "adir").mkdir()
    assert _exit_code(argv) == 2
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and expected in err, err
    assert out == ""  # (found before the run: no layout table or cost report first)
    assert sorted(os.listdir(tmp_path)) == ["adir", "afile"] and os.listdir(tmp_path / "adir") == []
    assert (tmp_path / "afile").read_text() == "[1, 2]\n"  # (as it was)


def test_a_text_folder_whose_files_all_fall_in_one_split_is_refused_before_the_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    os.mkdir("texts")
    (tmp_path / "texts" / "a.txt").write_text("some text " * 500)
    assert _exit_code(["train", "lm", "--text", "texts", "--steps", "2"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "'texts' has too few files to split into train and validation" in err


def test_plotting_a_file_with_no_losses_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    assert _exit_code(["plot", "empty.jsonl"]) == 2
    assert "has no training step's loss: nothing to plot" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["empty.jsonl"]


@pytest.mark.parametrize(
    "line,said",
    [
        # each of these ended `meshax plot` in a traceback (TypeError, ZeroDivisionError), or a
        # UnicodeDecodeError that named no file; a loss that was text was drawn as a category
        (
            '{"step": 1, "loss": 1.0, "step_seconds": "fast"}',
            "m.jsonl:2 is not a line of meshax metrics: its step_seconds is 'fast', not a number",
        ),
        ('{"step": 1, "loss": 1.0, "step_seconds": 0}', "its step_seconds is 0, not above 0"),
        ('{"step": 1, "loss": 1.0, "eval": 5}', "its eval is 5, not an object of metrics"),
        ('{"step": 1, "loss": 1.0, "eval": {"loss": "low"}}', "its eval loss is 'low', not a number"),
        ('{"step": 1, "loss": "x"}', "its loss is 'x', not a number"),
        ('{"step": 1, "loss": true}', "its loss is True, not a number"),
        ('{"step": 1, "loss": 1.0, "tokens_per_second": null}', "its tokens_per_second is None, not a number"),
        ("\udcff", "metrics file 'm.jsonl' is not text (not UTF-8)"),
    ],
)
def test_a_metrics_line_plot_cannot_draw_is_named(line, said, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.jsonl").write_bytes(os.fsencode('{"step": 0, "loss": 2.0}\n' + line + "\n"))
    assert _exit_code(["plot", "m.jsonl"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and said in err, err
    assert os.listdir(tmp_path) == ["m.jsonl"]


def test_a_used_checkpoint_folder_is_refused_before_training(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run = ["train", "mlp", *MLP, "--steps", "2", "--eval-every", "0", "--no-progress", "--checkpoint-dir", "ck"]
    assert main([*run, "--metrics", "first.jsonl"]) == 0
    capsys.readouterr()
    assert _exit_code([*run, "--metrics", "second.jsonl"]) == 2  # without --resume: it would be overwritten
    assert "already holds the checkpoint of step 2" in capsys.readouterr().err
    resumed = ["train", "mlp", *MLP, "--steps", "2", "--resume", "ck", "--metrics", "second.jsonl"]
    assert _exit_code(resumed) == 2  # nothing left to train
    assert "give --steps beyond it" in capsys.readouterr().err
    assert not os.path.exists("second.jsonl")


def test_a_checkpoint_of_another_model_or_task_is_refused_before_the_run_says_anything(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert (
        main(["train", "mlp", *MLP, "--steps", "2", "--eval-every", "0", "--no-progress", "--checkpoint-dir", "ck"])
        == 0
    )
    capsys.readouterr()
    assert main(["train", "mlp", *MLP, "--steps", "4", "--hidden", "32", "--resume", "ck", "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # (no layout table or cost report of a run that cannot start)
    assert "cannot restore step 2 from ck: it holds another model" in err and "'w' ([32, 32] here" in err
    assert main(["train", "lm", "--mesh", "all:1", "--layout", "", "--steps", "4", "--resume", "ck"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "holds a checkpoint of the task mlp, not lm: resume it with `meshax train mlp" in err
    assert sorted(os.listdir("ck")) == ["2"]


def test_a_run_resumed_on_other_batches_says_so(tmp_path, monkeypatch, capsys):
    """Another --seed or --batch-size trains on other batches than the first run would have: the
    run goes on (a user may mean it) and says which settings differ."""
    monkeypatch.chdir(tmp_path)
    run = ["train", "mlp", *MLP, "--eval-every", "0", "--no-progress"]
    assert main([*run, "--steps", "2", "--checkpoint-dir", "ck"]) == 0
    assert main([*run, "--steps", "3", "--resume", "ck"]) == 0
    assert "note:" not in capsys.readouterr().out
    assert main([*run, "--steps", "4", "--resume", "ck", "--seed", "5", "--batch-size", "16"]) == 0
    out = capsys.readouterr().out
    assert (
        "resuming from step 3 of ck\nnote: it was trained with batch-size 64, seed 0; this run has batch-size 16, "
        "seed 5: from step 3 on it trains on other batches than the first run would have"
    ) in out


def test_a_checkpoint_step_folder_is_no_place_to_resume_from_or_write_to(tmp_path, monkeypatch, capsys):
    """`--resume ck/2` names the checkpoint folder to give; a path in a step folder (which goes
    when newer steps replace it) is refused for everything a run writes; nothing is written."""
    monkeypatch.chdir(tmp_path)
    run = ["train", "mlp", *MLP, "--steps", "4", "--no-progress"]
    assert main(["train", "mlp", *MLP, "--steps", "2", "--eval-every", "0", "--checkpoint-dir", "ck"]) == 0
    capsys.readouterr()
    before = sorted(os.walk("ck"))
    for flags, said in [
        (["--resume", "ck/2"], "--resume 'ck/2' is the folder of step 2 of the checkpoints in"),
        (["--resume", "ck/2/state"], "--resume 'ck/2/state' is inside the folder of step 2"),
        (["--checkpoint-dir", "ck/2/more"], "--checkpoint-dir 'ck/2/more' is inside the folder of step 2"),
        (["--checkpoint-dir", "new", "--tensorboard", "ck/2/tb"], "--tensorboard 'ck/2/tb' is inside"),
        (["--metrics", "ck/2/m.jsonl"], "--metrics 'ck/2/m.jsonl' is inside the folder of step 2"),
    ]:
        assert _exit_code([*run, *flags]) == 2, flags
        assert said in capsys.readouterr().err, flags
    assert _exit_code(["generate", "lm", "--resume", "ck/2", "--prompt", "hi"]) == 2
    assert "give --resume 'ck'" in capsys.readouterr().err
    assert sorted(os.walk("ck")) == before and sorted(os.listdir()) == ["ck"]


def test_a_checkpoint_folder_that_cannot_be_written_is_refused_before_resuming(tmp_path, monkeypatch, capsys):
    """A resumed run saves where it resumed from: a folder it cannot write to (a read-only mount,
    another user's) was not checked, as --checkpoint-dir's is, and showed only at the first save,
    after training. (Not writable is told here by os.access, as the check reads it.)"""
    monkeypatch.chdir(tmp_path)
    run = ["train", "mlp", *MLP, "--eval-every", "0", "--no-progress"]
    assert main([*run, "--steps", "2", "--checkpoint-dir", "ck"]) == 0
    capsys.readouterr()
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: access(p, mode) and not (p == "ck" and mode & os.W_OK))
    assert _exit_code([*run, "--steps", "4", "--resume", "ck"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "--resume 'ck' is not writable, and a resumed run saves its checkpoints there: copy it" in err
    assert sorted(os.listdir("ck")) == ["2"]


def test_a_folder_of_digits_is_no_checkpoint_to_resume(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    os.makedirs("ck/3")
    assert _exit_code(["train", "mlp", *MLP, "--steps", "4", "--resume", "ck"]) == 2
    assert "--resume 'ck': no checkpoint there" in capsys.readouterr().err


def test_a_step_folder_cut_short_is_named_before_training(tmp_path, monkeypatch, capsys):
    """A step folder that began as a checkpoint and lost an item: resuming passed over it for the
    older step in silence, and a fresh run saving there trained until that step, then failed
    ("checkpoint step 2 not saved: ... already has steps [2]")."""
    monkeypatch.chdir(tmp_path)
    for step, items in ((2, ("state", "meta")), (4, ("state",))):
        for item in items:
            os.makedirs(f"ck/{step}/{item}")
    os.makedirs("cut/2/meta")
    before = sorted(os.walk("."))
    resume = ["train", "mlp", *MLP, "--steps", "6", "--resume", "ck"]
    assert _exit_code(resume) == 2
    assert (
        "--resume 'ck': the step folder ck/4 (no meta/) is no whole checkpoint: move it away to go on from step 2"
        in (capsys.readouterr().err)
    )
    assert _exit_code(["train", "mlp", *MLP, "--steps", "6", "--checkpoint-dir", "cut"]) == 2
    assert "--checkpoint-dir 'cut': the step folder cut/2 (no state/) is no whole checkpoint: move it away" in (
        capsys.readouterr().err
    )
    assert _exit_code(["generate", "lm", "--resume", "cut", "--prompt", "hi"]) == 2
    assert "no whole checkpoint: there is no older whole checkpoint there" in capsys.readouterr().err
    assert sorted(os.walk(".")) == before


def test_a_folder_of_the_users_named_as_a_step_is_not_deleted_with_old_checkpoints(tmp_path, monkeypatch, capsys):
    """A folder "1" of the user's in --checkpoint-dir (a year, a numbered run) is a step to Orbax:
    training with checkpoints there deleted it, with what it held, as newer checkpoints replaced
    the old. Refused before training, for --resume too; an empty one (nothing to lose) is not."""
    monkeypatch.chdir(tmp_path)
    os.makedirs("ck/1")
    (tmp_path / "ck" / "1" / "photo.txt").write_text("precious")
    run = ["train", "mlp", *MLP, "--steps", "8", "--checkpoint-every", "2", "--eval-every", "0", "--no-progress"]
    for flag in ("--checkpoint-dir", "--resume"):
        assert _exit_code([*run, flag, "ck"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1
        assert (
            f"meshax: error: {flag} 'ck': ck/1 is named as a checkpoint's step but holds something else, which " in err
        )
        assert "move it away, or save checkpoints in a folder of their own" in err
    assert sorted(os.walk(".")) == [(".", ["ck"], []), ("./ck", ["1"], []), ("./ck/1", [], ["photo.txt"])]
    os.makedirs("ck2/1")
    assert _exit_code([*run, "--checkpoint-dir", "ck2"]) == 0


def test_a_closed_pipe_ends_the_command_quietly():
    """`meshax plan lm | head -1`: the reader goes away; no error is printed."""
    import subprocess
    import sys

    p = subprocess.Popen(
        [sys.executable, "-m", "meshax", "plan", "mlp", *MLP],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "COLUMNS": "80"},
    )
    p.stdout.readline()
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) in (0, 1) and "error" not in err, err


def test_debug_shows_the_traceback():
    with pytest.raises(Exception, match="did you mean 'hidden'"):
        main(["plan", "mlp", "--mesh", "all:8", "--layout", "batch:all;hiden:all", "--debug"])


LIBRARY = [  # (a call that builds something from a bad value, a piece of the message)
    (lambda mx: mx.Shape([mx.Dimension("batch", -1)]), "negative"),
    (lambda mx: mx.Shape([mx.Dimension("", 4)]), "non-empty string"),
    (lambda mx: mx.Shape([mx.Dimension(4, "batch")]), r"the name comes first: Dimension\('batch', 4\)"),
    (lambda mx: mx.Shape("batch:8;io:4"), r"a Shape is made from a list of Dimensions; .*convert_to_shape\('batch:8"),
    (lambda mx: mx.optimize.SgdOptimizer(-0.1), "learning_rate -0.1"),
    (lambda mx: mx.optimize.SgdOptimizer("fast"), "not a number"),
    (lambda mx: mx.optimize.SgdOptimizer(1e39), r"learning_rate 1e\+39 is more than a float32 holds"),
    (lambda mx: mx.optimize.AdamWeightDecayOptimizer(1e-3, beta_1=1.0), "beta_1 1.0"),
    (lambda mx: mx.optimize.MomentumOptimizer(0.1, momentum=-0.5), "momentum -0.5"),
    # (a negative rate or warmup was accepted, the rate stepping uphill; text was a TypeError from max())
    (lambda mx: mx.optimize.linear_decay(-1e-3, 10, 100), "learning_rate -0.001 must be a finite number >= 0"),
    (lambda mx: mx.optimize.linear_decay(1e-3, -5, 100), "linear_decay: warmup_steps -5 is not a number of steps >= 0"),
    (lambda mx: mx.optimize.linear_decay(1e-3, 10, "100"), "linear_decay: total_steps '100' is not a number of steps"),
    # (no rate: a TypeError, 'NoneType' object is not callable, when the updates were built)
    (lambda mx: mx.optimize.SgdOptimizer(None), r"SgdOptimizer needs a learning_rate: .* SgdOptimizer\(1e-3\)"),
    (lambda mx: mx.optimize.AdamWeightDecayOptimizer(None), "AdamWeightDecayOptimizer needs a learning_rate"),
    (lambda mx: mx.optimize.MomentumOptimizer(None), "MomentumOptimizer needs a learning_rate"),
    (lambda mx: __import__("meshax.train", fromlist=["MlpTask"]).MlpTask(batch_size=0), "batch_size=0"),
    (lambda mx: __import__("meshax.train", fromlist=["LmTask"]).LmTask(length=-3), "length=-3"),
    (lambda mx: mx.SimdMeshImpl("rows:2;cols:4", "batch=rows"), "tensor_dim:mesh_dim"),
    (lambda mx: mx.use_cpu_devices(0), "give a whole number of devices, 1 or more"),
    (lambda mx: mx.use_cpu_devices("8"), r"use_cpu_devices\('8'\)"),
    (lambda mx: mx.use_cpu_devices(2**40), r"JAX makes at most 2\*\*31 - 1 devices"),
    (lambda mx: mx.SimdMeshImpl("rows:65536;cols:65536"), "has 4294967296 devices"),
    (lambda mx: mx.dropout(mx.placeholder(mx.Mesh(mx.Graph(), "m"), "x", "b:4"), keep_prob=1.5), "keep_prob 1.5"),
    (lambda mx: mx.search.load_device(__file__), "is not one `meshax calibrate` wrote"),
    # (None filled the variable with NaN; text failed inside JAX when the variable was made)
    (lambda mx: mx.initializers.constant(None), r"initializers.constant: value is None \(NoneType\), not a number"),
    (lambda mx: mx.initializers.normal("0.02"), "initializers.normal: stddev is '0.02' \\(str\\), not a number"),
    (lambda mx: mx.initializers.uniform(0.0, None), "initializers.uniform: maxval is None"),
    # a mesh that is no mx.Mesh: an AttributeError ('str' object has no attribute 'graph') where it was first used
    (lambda mx: mx.Mesh("graph", "m"), "the graph given is 'graph' \\(str\\), not an mx.Graph"),
    (lambda mx: mx.Mesh("m", mx.Graph()), r"the graph comes first: mx.Mesh\(graph, 'm'\)"),
    (lambda mx: mx.Mesh(mx.Graph(), 5), "the name 5 is not a non-empty string"),
    (lambda mx: mx.placeholder(mx.Graph(), "x", "b:4"), "the mesh given is Graph.*not an mx.Mesh"),
    (lambda mx: mx.get_variable("m", "w", "b:4"), "get_variable 'w': the mesh given is 'm' \\(str\\), not an mx.Mesh"),
    (
        lambda mx: mx.Lowering(
            mx.placeholder(mx.Mesh(mx.Graph(), "m"), "x", "b:4").graph,
            {mx.Mesh(mx.Graph(), "m"): mx.SimdMeshImpl("all:1")},
        ),
        "is for mesh 'm' of another graph",
    ),
]


@pytest.mark.parametrize("build,expected", LIBRARY, ids=[m for _, m in LIBRARY])
def test_bad_values_in_the_library_are_meshax_errors(build, expected):
    import meshax as mx

    with pytest.raises(mx.MeshaxError, match=expected):
        build(mx)


def test_a_dash_value_is_joined_only_to_meshaxs_own_options():
    """`--memory-budget -5GB` reaches meshax's check (the catalogue's row); a flag's following
    argument, and anything in `launch` (another command's arguments), are left alone."""
    from meshax.cli.parser import build_parser, join_dash_values

    p = build_parser()
    assert join_dash_values(p, ["plan", "lm", "--memory-budget", "-5GB", "--seed", "-1", "--debug", "-1"]) == [
        *["plan", "lm", "--memory-budget=-5GB", "--seed=-1", "--debug", "-1"]
    ]
    launch = ["launch", "-n", "2", "python", "w.py", "--offset", "-3"]
    assert join_dash_values(p, launch) == launch


def test_a_step_too_big_for_memory_says_what_to_change(capsys):
    """XLA's RESOURCE_EXHAUSTED (a 200k-token sequence's attention: terabytes) ends in one line
    that names what the user can change, not XLA's allocation alone."""
    argv = ["train", "lm", "--source", "markov", "--length", "200000", "--batch-size", "1", "--mesh", "all:1"]
    assert _exit_code([*argv, "--layout", "", "--steps", "1", "--eval-every", "0", "--no-progress"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "RESOURCE_EXHAUSTED" in line and "does not fit in the devices' memory. `meshax plan` with the same" in line


def test_a_size_too_big_for_this_machines_memory_is_one_line(monkeypatch, capsys):
    """A host array of the sizes given that does not fit (plan lm --length 2147483647: the
    sinusoid table, 512 GiB) ended in a traceback of NumPy's MemoryError; now one line naming
    the flags to lower. (Raised here without allocating it.)"""
    import meshax.models.transformer as transformer

    def too_big(length, d_model):
        raise MemoryError(f"Unable to allocate 512. GiB for an array with shape ({length}, {d_model // 2})")

    monkeypatch.setattr(transformer, "_sinusoids", too_big)
    assert _exit_code(["plan", "lm", "--mesh", "all:8", "--layout", "batch:all", "--length", "2147483647"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("meshax: error: this machine's memory cannot hold what the sizes given ask for: give")
    assert "(Unable to allocate 512. GiB for an array with shape (2147483647, 32))" in err
    with pytest.raises(MemoryError):
        main(["plan", "lm", "--mesh", "all:8", "--layout", "batch:all", "--length", "2147483647", "--debug"])


def test_jax_platforms_naming_no_platform_of_this_machine_is_one_line():
    """JAX_PLATFORMS=cuda without a GPU: JAX's backend setup fails on a bare AssertionError (a
    traceback with no message); the command says what to change."""
    import subprocess
    import sys

    from jax._src import hardware_utils

    if hardware_utils.has_visible_nvidia_gpu():
        pytest.skip("this machine has a GPU: JAX_PLATFORMS=cuda names its platform")
    done = subprocess.run(
        [sys.executable, "-m", "meshax", "train", "mlp", *MLP, "--steps", "1", "--no-progress"],
        env={**os.environ, "JAX_PLATFORMS": "cuda"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == "", done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "JAX_PLATFORMS='cuda' names no platform this machine has" in done.stderr


@pytest.mark.parametrize(
    "module,argv,said",
    [
        (
            "tensorboardX",
            ["train", "mlp", *MLP, "--steps", "2", "--tensorboard", "tb"],
            "--tensorboard needs tensorboardX",
        ),
        ("matplotlib", ["plan", "mlp", *MLP, "--picture", "pics"], "--picture needs matplotlib"),
    ],
)
def test_a_missing_optional_package_is_named_before_the_run(module, argv, said, tmp_path, monkeypatch, capsys):
    """Without the package a flag needs, the command stops before anything runs; it printed the
    layout table and the cost report first (after the compile), and left --picture's folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, module, None)  # (an import of it fails, as when not installed)
    assert _exit_code(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and said in err and "pip install" in err
    assert os.listdir(tmp_path) == []


def test_ctrl_c_says_what_the_run_keeps_in_one_line(tmp_path, monkeypatch, capsys):
    """An interrupt (Ctrl-C) mid-run printed a traceback into JAX's dispatch; now one line that
    names the latest checkpoint and how to go on from it (exit status 130, as a shell's)."""
    from meshax.train import MlpTask

    monkeypatch.chdir(tmp_path)
    batch = MlpTask.train_batch

    def interrupted_at_step_3(self, step, *args, **kwargs):
        if step == 3:
            raise KeyboardInterrupt
        return batch(self, step, *args, **kwargs)

    monkeypatch.setattr(MlpTask, "train_batch", interrupted_at_step_3)
    run = ["train", "mlp", *MLP, "--steps", "10", "--eval-every", "0", "--no-progress"]
    assert main([*run, "--checkpoint-dir", "ck", "--checkpoint-every", "2"]) == 130
    err = capsys.readouterr().err
    assert err == "meshax: interrupted; the latest checkpoint in 'ck' is of step 2: continue with --resume ck\n"
    assert main([*run, "--checkpoint-dir", "ck2", "--checkpoint-every", "5"]) == 130
    assert capsys.readouterr().err == "meshax: interrupted; no checkpoint was saved in 'ck2' yet\n"
    with pytest.raises(KeyboardInterrupt):
        main([*run, "--debug"])


def _lowered_mlp(mx):
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    x = mx.placeholder(mesh, "x", "batch:8;io:4")
    w = mx.get_variable(mesh, "w", "io:4;hidden:16")
    loss = mx.reduce_mean(mx.square(mx.einsum(x, w, output_shape="batch:8;hidden:16")))
    return mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", "batch:all")}), loss, w


LOWERING = [  # (a call on a lowering, its loss and its variable w, the error, a piece of the message)
    # each of these was an AttributeError or TypeError from inside meshax ("'str' object has no
    # attribute 'shape'", "'NoneType' object is not iterable", "got 'l'": a name read letter by letter)
    (lambda mx, lo, loss, w: lo.layout_of("w"), TypeError, r"layout_of: 'w' \(str\) is not a meshax Tensor: give the"),
    (lambda mx, lo, loss, w: lo.layout_of(w.operation), TypeError, "give the variable's value, w.value"),
    (lambda mx, lo, loss, w: lo.draw("w", "w.png"), TypeError, "give the tensor itself, not its name"),
    (lambda mx, lo, loss, w: lo.function("loss"), TypeError, r"outputs: 'loss' \(str\) is not a meshax Tensor"),
    (lambda mx, lo, loss, w: lo.function(None), TypeError, r"outputs: None \(NoneType\) is not a meshax Tensor"),
    (lambda mx, lo, loss, w: lo.trace_step("loss"), TypeError, "give the tensor itself, not its name"),
    (lambda mx, lo, loss, w: mx.Lowering(lo.graph, {"m": lo.impl}), GraphError, "the mesh given is 'm' \\(str\\)"),
    (lambda mx, lo, loss, w: mx.Lowering("g", {lo.mesh: lo.impl}), GraphError, "the graph given is 'g'"),
    # a tensor of another graph: its layout was '' (replicated) and its feed was ignored ("... was not fed")
    (lambda mx, lo, loss, w: lo.layout_of(_lowered_mlp(mx)[1]), GraphError, "belongs to another graph"),
    (
        lambda mx, lo, loss, w: lo.function(loss)({_lowered_mlp(mx)[0].graph.operations[0].outputs[0]: 0}),
        MeshaxError,
        "feeds placeholder 'x' of another graph than the one lowered",
    ),
]


@pytest.mark.parametrize("call,error,expected", LOWERING, ids=[m for _, _, m in LOWERING])
def test_a_lowering_given_what_is_no_tensor_of_its_graph_says_so(call, error, expected, tmp_path, monkeypatch):
    import meshax as mx

    monkeypatch.chdir(tmp_path)
    lowering, loss, w = _lowered_mlp(mx)
    with pytest.raises(error, match=expected):
        call(mx, lowering, loss, w)
    assert os.listdir(tmp_path) == []


def test_a_prompt_with_an_empty_entry_is_refused():
    """`--prompt 1,,2` (it was read as 1,2: the empty entry dropped)."""
    from meshax.cli.generate import token_ids
    from meshax.core.errors import ConfigError

    assert token_ids(" 1, 2,3", 16) == [1, 2, 3]
    for text in ("1,,2", "1,2,", ","):
        with pytest.raises(ConfigError, match="give token ids separated by commas, like 5,3,9,2"):
            token_ids(text, 16)
