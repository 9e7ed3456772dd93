"""Every command in the README's code blocks runs (fast variants: fewer steps), or is listed
here with the reason it is not; a command added to a code block without either fails here.

The docs pages' shell blocks too: a command the README has as well runs with the README's, and
the others of a page run here in the page's order from one folder (later ones read what earlier
ones write), their step counts divided by 100, unless their block is marked
`<!-- not run: REASON -->` (tests/test_docs.py's marker)."""

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


SHELL = ("", "console", "bash", "sh")  # the languages of a shell block


def block_commands(code: str) -> list[str]:
    """Each shell command of a block (continuations joined, the parts of `a && b` apart,
    comments dropped)."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        line = "" if line.lstrip().startswith("#") else line.split("  #")[0].strip()
        commands += [part.strip() for part in line.split("&&") if part.strip()]
    return commands


def readme_commands() -> list[str]:
    """Each shell command in the README's non-Python code blocks."""
    blocks = [code for language, code, _ in fenced_blocks((ROOT / "README.md").read_text()) if language in SHELL]
    return [command for block in blocks for command in block_commands(block)]


def _fast(argv: list[str], steps=lambda n: 2) -> list[str]:
    """Fewer steps (`steps` of the steps written, 300 if none) and no progress bar; everything
    else as written."""
    argv = list(argv)
    if argv[0] == "launch":  # meshax launch ... -- meshax train ...
        cut = argv.index("--") + 2
        return argv[:cut] + _fast(argv[cut:], steps)
    if argv[0] == "train":
        written = 300
        if "--steps" in argv:
            written = int(argv[argv.index("--steps") + 1])
            del argv[argv.index("--steps") : argv.index("--steps") + 2]
        argv += ["--steps", str(steps(written)), "--no-progress", "--eval-every", "0"]
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


DOCS = sorted((ROOT / "docs").rglob("*.md"))
IN_README = {tuple(_fast(shlex.split(c)[1:])) for c in COMMANDS if c.startswith("meshax ")}


def docs_commands(page: Path) -> tuple[list[str], list[str], list[str]]:
    """A docs page's shell commands: (those to run here, in order; those no one runs or says
    why not; the reasons of its blocks marked not run)."""
    run, unaccounted, reasons = [], [], []
    for language, code, reason in fenced_blocks(page.read_text()):
        if language not in SHELL:
            continue
        if reason is not None:
            reasons.append(reason)
            continue
        for command in block_commands(code):
            if any(command.startswith(prefix) for prefix in NOT_RUN):
                continue
            if not command.startswith("meshax "):
                unaccounted.append(command)
            elif tuple(_fast(shlex.split(command)[1:])) not in IN_README:  # (else it runs with the README's)
                run.append(command)
    return run, unaccounted, reasons


RUN_HERE = {page: run for page in DOCS if (run := docs_commands(page)[0])}


def test_every_docs_command_is_run_or_said_why_not():
    for page in DOCS:
        _, unaccounted, reasons = docs_commands(page)
        assert unaccounted == [], f"{page.name}: neither run nor marked not run"
        assert all(reasons), f"{page.name}: a shell block marked not run gives no reason"
    assert {"checkpoints.md", "decoding.md"} <= {page.name for page in RUN_HERE}


@pytest.mark.slow
@pytest.mark.parametrize("page", list(RUN_HERE), ids=[str(p.relative_to(ROOT)) for p in RUN_HERE])
def test_docs_commands_run(page, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for command in RUN_HERE[page]:
        argv = _fast(shlex.split(command)[1:], steps=lambda n: max(2, n // 100))
        assert main(argv) == 0, f"{page.name}: {command}\n{capsys.readouterr().err}"
