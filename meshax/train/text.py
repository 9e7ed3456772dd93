"""Byte-level text, all local: any file or folder, by default the Python standard library's own
source files of the running interpreter (real text on every machine). Split by file."""

from __future__ import annotations

import math
import os
import sysconfig
import zlib
from collections.abc import Sequence

import numpy as np

from meshax.train.data import DataError

VALIDATION_FRACTION = 0.05  # of a single file: its last 5%


def default_corpus() -> str:
    return sysconfig.get_paths()["stdlib"]


_TOO_FEW_FILES = "{path!r} has too few files to split into train and validation; point at a bigger folder"


def _files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise DataError(f"text path {path!r} is neither a file nor a folder")
    out = []
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__") and not d.startswith("."))
        out += [os.path.join(root, n) for n in sorted(names) if n.endswith((".py", ".txt", ".md", ".rst"))]
    if not out:
        raise DataError(f"no text files (.py .txt .md .rst) under {path!r}")
    return out


def _in_validation(relative: str, validation_fraction: float) -> bool:
    """Whether the file at `relative` (to the folder given) goes to validation: by a hash of its
    name, so the split is the same on every machine with the same files."""
    return zlib.crc32(relative.encode()) % 1000 < validation_fraction * 1000


def check_text(path: str, length: int) -> None:
    """A DataError, before anything runs, where `path` holds no text to train on: a folder
    without text files, or whose files all fall in one split; a single file too short for
    windows of `length` + 1 bytes in its validation split (its last VALIDATION_FRACTION) and
    training split."""
    if os.path.isdir(path):
        splits = {_in_validation(os.path.relpath(f, path), VALIDATION_FRACTION) for f in _files(path)}
        if len(splits) < 2:
            raise DataError(_TOO_FEW_FILES.format(path=path))
    elif os.path.isfile(path):
        size, need = os.path.getsize(path), math.ceil((length + 2) / VALIDATION_FRACTION)
        if size < need:
            raise DataError(
                f"text file {path!r} has {size} bytes; sequences of {length} need at least {need} (its last "
                f"{VALIDATION_FRACTION:.0%} is the validation split): give a longer text, or a shorter --length"
            )


def load_bytes(
    path: str | None = None, validation_fraction: float = VALIDATION_FRACTION, max_bytes: int = 64 << 20
) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) uint8 arrays; a file goes to validation by a hash of its name, so the
    split is the same on every machine with the same files. A single file is split 95/5."""
    path = path or default_corpus()
    files = _files(path)
    if len(files) == 1:
        data = np.fromfile(files[0], dtype=np.uint8)[:max_bytes]
        cut = int(len(data) * (1 - validation_fraction))
        return data[:cut], data[cut:]
    train: list[np.ndarray] = []
    val: list[np.ndarray] = []
    total = 0
    for f in files:
        try:
            data = np.fromfile(f, dtype=np.uint8)
        except OSError:
            continue
        (val if _in_validation(os.path.relpath(f, path), validation_fraction) else train).append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not train or not val:
        raise DataError(_TOO_FEW_FILES.format(path=path))
    return np.concatenate(train), np.concatenate(val)


def windows(data: np.ndarray, rngs: Sequence[np.random.Generator], length: int) -> np.ndarray:
    """[len(rngs), length + 1] random windows of the byte stream, row i drawn with rngs[i]."""
    if len(data) <= length + 1:
        raise DataError(f"the text has {len(data)} bytes, too few for sequences of {length}")
    starts = [int(g.integers(0, len(data) - length - 1)) for g in rngs]
    return np.array([data[s : s + length + 1] for s in starts], np.int32).reshape(len(rngs), length + 1)
