"""Kill a training process mid-run, resume it, and get the uninterrupted run's losses (issue 4)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # end-to-end, in subprocesses: run with `pytest -m slow`

ARGS = [
    "train",
    "lm",
    "--model",
    "tiny",
    "--source",
    "markov",
    "--batch-size",
    "8",
    "--length",
    "16",
    "--mesh",
    "rows:2;cols:4",
    "--layout",
    "batch:rows;heads:cols",
    "--eval-every",
    "0",
    "--no-progress",
    "--steps",
    "40",
]
SAVING = ["--checkpoint-every", "4"]


def _cli(args, **kw):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.Popen(
        [sys.executable, "-m", "meshax.cli", *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **kw
    )


def _losses(path):
    out = {}
    for line in Path(path).read_text().splitlines():
        entry = json.loads(line)
        if "loss" in entry:
            out[entry["step"]] = entry["loss"]  # a resumed run overwrites the steps it repeats
    return out


def test_killed_run_resumes_exactly(tmp_path):
    ckpt, killed_log, full_log = tmp_path / "ckpt", tmp_path / "killed.jsonl", tmp_path / "full.jsonl"
    proc = _cli([*ARGS, *SAVING, "--checkpoint-dir", str(ckpt), "--metrics", str(killed_log)])
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if killed_log.exists() and len(_losses(killed_log)) >= 10:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before_kill = len(_losses(killed_log))
    assert 10 <= done_before_kill < 40

    resumed = _cli([*ARGS, *SAVING, "--resume", str(ckpt), "--metrics", str(killed_log)])
    full = _cli([*ARGS, "--metrics", str(full_log)])
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read().decode()
    assert full.wait(timeout=300) == 0, full.stderr.read().decode()
    got, want = _losses(killed_log), _losses(full_log)
    assert sorted(got) == sorted(want) == list(range(1, 41))
    np.testing.assert_array_equal([got[s] for s in range(1, 41)], [want[s] for s in range(1, 41)])
