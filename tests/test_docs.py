"""Docs cannot drift: every Python block of the README and of each docs page runs.

A page's blocks run in order in one fresh interpreter (a tutorial builds on its earlier
blocks), from a temporary directory. A block preceded by `<!-- not run: REASON -->` is skipped,
and must say why.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(p for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")] if "```python" in p.read_text())
NOT_RUN = re.compile(r"<!--\s*not run:([^>]*)-->")


def fenced_blocks(text: str) -> list[tuple[str, str, str | None]]:
    """(language, code, the reason of a `<!-- not run: ... -->` on the line before, or None) of
    each fenced code block, its fences paired in order."""
    blocks, code, language, reason, previous = [], None, "", None, ""
    for line in text.splitlines():
        if line.startswith("```"):
            if code is None:
                code, language = [], line[3:].strip()
                marker = NOT_RUN.fullmatch(previous.strip())
                reason = marker[1].strip() if marker else None
            else:
                blocks.append((language, "".join(code), reason))
                code = None
        elif code is not None:
            code.append(line + "\n")
        previous = line
    return blocks


def python_blocks(text: str) -> tuple[list[str], list[str]]:
    """(blocks to run, reasons of the blocks marked not run)."""
    blocks = [(code, reason) for language, code, reason in fenced_blocks(text) if language == "python"]
    return [code for code, reason in blocks if reason is None], [reason for _, reason in blocks if reason is not None]


def test_the_block_finder_sees_marked_and_unmarked_blocks():
    text = "a\n```python\nx = 1\n```\n<!-- not run: needs a GPU -->\n```python\ny = 2\n```\n```console\nz\n```\n"
    assert python_blocks(text) == (["x = 1\n"], ["needs a GPU"])


SLOW = {"transformer.md"}  # trains a Transformer under four layouts: run with `pytest -m slow`


@pytest.mark.parametrize(
    "page",
    [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW else p for p in PAGES],
    ids=[str(p.relative_to(ROOT)) for p in PAGES],
)
def test_python_blocks_run(page, tmp_path):
    run, skipped = python_blocks(page.read_text())
    assert all(skipped), f"{page.name}: a block marked not run gives no reason"
    script = "\n\n".join(run)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_NUM_CPU_DEVICES", None)  # each page asks for its devices itself, as a reader would
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{page.name}: its Python blocks fail:\n{done.stderr[-3000:]}"
