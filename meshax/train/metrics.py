"""Where training metrics go: JSON lines, TensorBoard event files, and plots of them.

Each record is `{"step": n, "loss": ..., "step_seconds": ..., "tokens_per_second": ...}` for a
training step, `{"step": n, "eval": {metric: value}}` for an evaluation, or, first for each run
(a resumed one too), `{"step": n, "run": {"mesh": ..., "layout": ..., "weight_layout": ...,
"task": ..., "data": {...}}}`: what ran from step n on (the layout `meshax train --search` chose,
say).
"""

from __future__ import annotations

import json
import os

from meshax.core.errors import ConfigError


class MetricsWriter:
    """Appends each record to a JSON-lines file (written and closed at once: a killed run loses
    nothing it reported) and, with `tensorboard_dir`, to TensorBoard event files (tensorboardX)."""

    def __init__(self, metrics_path: str | None = None, tensorboard_dir: str | None = None):
        self.metrics_path = metrics_path
        self._board = None
        if tensorboard_dir:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                raise ConfigError(
                    "--tensorboard needs tensorboardX: pip install 'meshax[tensorboard]' (or tensorboardX)"
                ) from None
            self._board = SummaryWriter(tensorboard_dir)

    def record(self, entry: dict) -> None:
        if self.metrics_path:
            with open(self.metrics_path, "a") as log:
                log.write(json.dumps(entry) + "\n")
        if self._board is not None and "run" in entry:  # (no scalars: the settings, as text)
            self._board.add_text("run", json.dumps(entry["run"]), entry["step"])
            self._board.flush()
        elif self._board is not None:
            step = entry["step"]
            for key, value in entry.items():
                if key == "eval":
                    for name, v in value.items():
                        self._board.add_scalar(f"eval/{name}", v, step)
                elif key != "step":
                    self._board.add_scalar(f"train/{key}", value, step)
            self._board.flush()

    def close(self) -> None:
        if self._board is not None:
            self._board.close()


def read_metrics(path: str) -> list[dict]:
    """The records of a JSON-lines metrics file; a ConfigError naming the file and line if bad."""
    if os.path.isdir(path):
        raise ConfigError(f"metrics file {path!r} is a folder: give the JSON-lines file meshax train --metrics wrote")
    if not os.path.isfile(path):
        raise ConfigError(f"metrics file {path!r} does not exist (write one with meshax train --metrics FILE)")
    records = []
    with open(path, encoding="utf-8") as f:
        try:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:
                        record = None
                    if not isinstance(record, dict) or type(record.get("step")) is not int:
                        raise ConfigError(
                            f"{path}:{number} is not a line of meshax metrics (a JSON object with a step)"
                        )
                    bad = _not_a_number(record)
                    if bad:
                        raise ConfigError(f"{path}:{number} is not a line of meshax metrics: {bad}")
                    records.append(record)
        except UnicodeDecodeError:
            raise ConfigError(
                f"metrics file {path!r} is not text (not UTF-8): give the JSON-lines file meshax train --metrics wrote"
            ) from None
    if not any("loss" in r for r in records):
        raise ConfigError(f"metrics file {path!r} has no training step's loss: nothing to plot")
    return records


def _is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _not_a_number(record: dict) -> str:
    """What of a record's values that a plot draws is no number ('' if all are): a loss, an
    evaluation's loss, a step's seconds (above 0: its inverse is drawn) or tokens per second."""
    for key in ("loss", "tokens_per_second", "step_seconds"):
        if key in record and not _is_number(record[key]):
            return f"its {key} is {record[key]!r}, not a number"
    if "step_seconds" in record and not record["step_seconds"] > 0:
        return f"its step_seconds is {record['step_seconds']!r}, not above 0"
    if "eval" in record:
        if not isinstance(record["eval"], dict):
            return f"its eval is {record['eval']!r}, not an object of metrics"
        if "loss" in record["eval"] and not _is_number(record["eval"]["loss"]):
            return f"its eval loss is {record['eval']['loss']!r}, not a number"
    return ""


def _latest_run(records: list[dict]) -> list[dict]:
    """The records the file's last run stands on: each run first writes `{"step": n, "run": ...}`
    (n steps done: 0 for a fresh run, the checkpoint's step for a resumed one), and replaces the
    records past step n that an earlier run in the file wrote. A fresh run appended to a file
    drew its curve mixed with the earlier run's, where the earlier run went on further."""
    out: list[dict] = []
    for r in records:
        if "run" in r:
            out = [q for q in out if q["step"] <= r["step"]]
        out.append(r)
    return out


def _last_per_step(records: list[dict]) -> list[dict]:
    """The last record of each step, by step: a run resumed from a checkpoint appends again the
    steps after it that the interrupted run had written, and its records are the ones that count."""
    return sorted({r["step"]: r for r in records}.values(), key=lambda r: r["step"])


def plot_metrics(paths: list[str], out: str, width: float = 12.0, height: float = 4.0, dpi: int = 100) -> str:
    """Training loss (and evaluation loss, dashed) and throughput against the step, one line
    per run (labelled by file name, or by path where names repeat), side by side in a PNG of width x
    height inches at `dpi`; where a run logs a loss scale (float16: `LossScaleOptimizer`), a third
    panel draws it on a log scale (each drop is a step skipped for non-finite gradients)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {label: _latest_run(read_metrics(p)) for label, p in zip(_labels(paths), paths)}
    scaled = any("loss_scale" in r for records in runs.values() for r in records)
    fig, axes = plt.subplots(1, 3 if scaled else 2, figsize=(width, height), dpi=dpi)
    loss_ax, speed_ax = axes[:2]
    for name, records in runs.items():
        steps = _last_per_step([r for r in records if "loss" in r])
        line = loss_ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], label=name)[0]
        evals = _last_per_step([r for r in records if "loss" in r.get("eval", {})])
        if evals:
            loss_ax.plot([r["step"] for r in evals], [r["eval"]["loss"] for r in evals], "--", color=line.get_color())
        key = "tokens_per_second" if any("tokens_per_second" in r for r in steps) else "step_seconds"
        values = [r[key] if key == "tokens_per_second" else 1.0 / r[key] for r in steps if key in r]
        speed_ax.plot([r["step"] for r in steps if key in r], values, label=name, color=line.get_color())
        speed_ax.set_ylabel("tokens / s" if key == "tokens_per_second" else "steps / s")
        kept = [r for r in steps if _is_number(r.get("loss_scale"))]
        if kept:
            axes[2].plot([r["step"] for r in kept], [r["loss_scale"] for r in kept], label=name, color=line.get_color())
    loss_ax.set(xlabel="step", ylabel="loss (dashed: evaluation)", title="loss")
    speed_ax.set(xlabel="step", title="throughput")
    if scaled:
        axes[2].set(xlabel="step", title="loss scale (drops: steps skipped)", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def _labels(paths: list[str]) -> list[str]:
    """Each run's label: its file's name without the extension, or, where two files share one
    (runs/a/m.jsonl, runs/b/m.jsonl), its path as given, so that neither run hides the other.
    A file given twice is a ConfigError."""
    seen: dict[str, str] = {}
    for p in paths:
        where = os.path.realpath(p)
        if where in seen:
            also = "" if seen[where] == p else f" (as {seen[where]!r} too)"
            raise ConfigError(f"metrics file {p!r} is given twice{also}: give each run once")
        seen[where] = p
    names = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    return [n if names.count(n) == 1 else os.path.normpath(p) for n, p in zip(names, paths)]
