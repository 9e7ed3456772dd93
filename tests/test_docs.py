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
FENCE = re.compile(r"(?P<marker><!--\s*not run:(?P<reason>[^>]*)-->\s*\n)?^```python\n(?P<code>.*?)^```", re.M | re.S)


def python_blocks(text: str) -> tuple[list[str], list[str]]:
    """(blocks to run, reasons of the blocks marked not run)."""
    run, skipped = [], []
    for m in FENCE.finditer(text):
        if m["marker"]:
            skipped.append(m["reason"].strip())
        else:
            run.append(m["code"])
    return run, skipped


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
