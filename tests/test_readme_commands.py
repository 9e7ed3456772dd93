"""Every command in the README's code blocks runs (fast variants: fewer steps), or is listed
here with the reason it is not; a command added to a code block without either fails here."""

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from meshax.cli import main
from tests.test_docs import fenced_blocks

ROOT = Path(__file__).resolve().parent.parent
NOT_RUN = {  # command prefix -> why it is not run here
    "python3 -m venv": "creates the environment .ci/run creates; the meshax command after it runs below",
    ". .venv/bin/activate": "activates that environment",
    "pip install -e": "installs extras scripts/test.sh installs",
    "bash scripts/test.sh": "the test command itself",
    "mkdocs serve": "serves the site until stopped; scripts/test.sh builds it (mkdocs build --strict)",
    "pytest tests/test_fuzz.py": "the fuzzer's long profile; the suite runs its short one",
    "python -m benchmarks": "minutes; tests/test_benchmarks_smoke.py runs --quick",
    "python examples/transformer_convergence.py": "minutes per check; tests/test_transformer.py trains the same models",
    "srun ": "needs a SLURM cluster; tests/test_multiprocess.py runs the same train command in 2 processes",
}


def readme_commands() -> list[str]:
    """Each shell command in the README's non-Python code blocks (continuations joined, the
    parts of `a && b` apart, comments dropped)."""
    shell = ("", "console", "bash", "sh")
    blocks = [code for language, code, _ in fenced_blocks((ROOT / "README.md").read_text()) if language in shell]
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            commands += [part.strip() for part in line.split("&&") if part.strip()]
    return commands


def _fast(argv: list[str]) -> list[str]:
    """Fewer steps and no progress bar; everything else as written."""
    argv = list(argv)
    if argv[0] == "launch":  # meshax launch ... -- meshax train ...
        cut = argv.index("--") + 2
        return argv[:cut] + _fast(argv[cut:])
    if argv[0] == "train":
        if "--steps" in argv:
            del argv[argv.index("--steps") : argv.index("--steps") + 2]
        argv += ["--steps", "2", "--no-progress", "--eval-every", "0"]
    return argv


PAPER_SEARCH = "--search --memory-budget 16GB --device tpu-v3"
RUN_ELSEWHERE = {  # words of a command -> the test that runs it and checks what the README says of it
    PAPER_SEARCH: "tests/test_search.py::test_the_readmes_paper_scale_search_finds_the_papers_layout",
}
COMMANDS = readme_commands()


def _has(command: str, words: str) -> bool:
    return words in " ".join(command.split())  # (continuation lines joined: spaces collapsed)


def readme_command_with(words: str) -> str:
    """The one README command containing `words`."""
    (command,) = [c for c in COMMANDS if _has(c, words)]
    return command


MESHAX = [c for c in COMMANDS if c.startswith("meshax ") and not any(_has(c, w) for w in RUN_ELSEWHERE)]


def test_every_readme_command_is_run_or_said_why_not():
    assert len(MESHAX) >= 10
    assert all(sum(_has(c, words) for c in COMMANDS) == 1 for words in RUN_ELSEWHERE)
    unaccounted = [c for c in COMMANDS if not c.startswith("meshax ") and not any(c.startswith(p) for p in NOT_RUN)]
    assert unaccounted == []


@pytest.mark.slow
@pytest.mark.parametrize("command", MESHAX, ids=[c[:70] for c in MESHAX])
def test_readme_command_runs(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = _fast(shlex.split(command)[1:])
    assert main(argv) == 0, capsys.readouterr().err


@pytest.mark.slow
def test_python_m_meshax_trains_and_a_redirected_plan_keeps_whole_names(tmp_path):
    run = [sys.executable, "-m", "meshax"]
    trained = subprocess.run([*run, "train", "mnist", "--steps", "5"], capture_output=True, text=True, cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert "eval after step 5" in trained.stdout and "\x1b[" not in trained.stdout  # no terminal codes in a log
    plan = subprocess.run(
        [*run, "plan", "lm", "--model", "small", "--mesh", "rows:2;cols:4"], capture_output=True, text=True
    )
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "transformer/decoder/0/self_attention/q" in plan.stdout and "…" not in plan.stdout
