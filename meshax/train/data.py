"""Data sources, all local: scikit-learn's handwritten digits, MNIST files, synthetic data."""

from __future__ import annotations

import gzip
import importlib.util
import os
import struct
import zlib

import numpy as np

from meshax.core.errors import MeshaxError


class DataError(MeshaxError):
    """Data that cannot be found or read; the message says what to install or where to point."""


def load_digits(seed: int = 0, test_fraction: float = 0.2):
    """scikit-learn's 8x8 handwritten digits (1797 images, shipped with the package), scaled to
    [0, 1] and split into train and test. Returns (x_train, y_train, x_test, y_test)."""
    data = _digits_csv()
    x = (data[:, :64].reshape(-1, 8, 8) / 16.0).astype(np.float32)
    y = data[:, 64].astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = round(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def _digits_csv() -> np.ndarray:
    """The digits' rows (64 pixels, then the label), read from the file scikit-learn ships, without
    importing scikit-learn where that file is where it has always been (its import takes a second,
    through SciPy: most of the start of a short MNIST run); through scikit-learn's own loader if not."""
    spec = importlib.util.find_spec("sklearn")  # (finds the package without importing it)
    if spec is None:
        raise DataError(
            "the default MNIST data set is scikit-learn's handwritten digits: install it with "
            "`pip install 'meshax[digits]'` (or scikit-learn), or pass --data DIR with the MNIST files"
        )
    for root in spec.submodule_search_locations or ():
        path = os.path.join(root, "datasets", "data", "digits.csv.gz")
        if os.path.exists(path):
            with gzip.open(path, "rt") as f:
                return np.loadtxt(f, delimiter=",")
    from sklearn.datasets import load_digits as sk_load_digits

    d = sk_load_digits()
    return np.concatenate([d.data, d.target[:, None]], axis=1)


_MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


def _read_idx(path: str) -> np.ndarray:
    if path.endswith(".gz"):
        try:
            with gzip.open(path, "rb") as f:
                data = f.read()
        except (gzip.BadGzipFile, EOFError, zlib.error) as err:  # (not gzip, cut short, corrupt)
            raise DataError(
                f"{path} is no gzip file that can be read ({err}): download it again, or unpack it"
            ) from None
    else:
        with open(path, "rb") as f:
            data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise DataError(f"{path} is not an IDX file (bad magic number)")
    dtype_code, ndim = data[2], data[3]
    if dtype_code != 0x08:
        raise DataError(f"{path}: expected unsigned bytes (type 0x08), found type {dtype_code:#x}")
    if len(data) < 4 + 4 * ndim:
        raise DataError(
            f"{path}: its header names {ndim} dims but holds {len(data) - 4} bytes of their sizes, not "
            f"{4 * ndim}; the file is truncated"
        )
    dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise DataError(f"{path}: header says {dims} but holds {body.size} bytes; the file is truncated")
    return body.reshape(dims)


def load_mnist(folder: str):
    """Real MNIST from the four standard IDX files (optionally .gz) in `folder`.
    Returns (x_train, y_train, x_test, y_test), images scaled to [0, 1]."""
    arrays = {}
    for key, stem in _MNIST_FILES.items():
        for candidate in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
            path = os.path.join(folder, candidate)
            if os.path.exists(path):
                arrays[key] = _read_idx(path)
                break
        else:
            raise DataError(
                f"MNIST file {stem}[.gz] not found in {folder!r}; it needs the four standard files "
                f"{sorted(_MNIST_FILES.values())}"
            )
    for part in ("train", "test"):
        images, labels = arrays[f"{part}_images"], arrays[f"{part}_labels"]
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise DataError(
                f"MNIST in {folder!r}: the {part} images (shape {list(images.shape)}) and labels (shape "
                f"{list(labels.shape)}) do not pair up: give [n, rows, cols] images and n labels"
            )
        if not len(images):  # (an evaluation of none said loss 0.0000, accuracy 0.0000)
            raise DataError(f"MNIST in {folder!r}: the {part} files hold no images: give at least one")
        if labels.size and labels.max() > 9:
            raise DataError(f"MNIST in {folder!r}: a {part} label is {int(labels.max())}; the classes are 0 to 9")
    return (
        arrays["train_images"].astype(np.float32) / 255.0,
        arrays["train_labels"].astype(np.int32),
        arrays["test_images"].astype(np.float32) / 255.0,
        arrays["test_labels"].astype(np.int32),
    )


def batches(x: np.ndarray, y: np.ndarray, batch_size: int, seed: int):
    """Endless shuffled batches (a new permutation each epoch); yields (x, y)."""
    if len(x) < batch_size:
        raise DataError(f"the data set has {len(x)} examples, fewer than the batch size {batch_size}")
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(x))
        for i in range(0, len(x) - batch_size + 1, batch_size):
            idx = order[i : i + batch_size]
            yield x[idx], y[idx]


def padded_batches(x: np.ndarray, y: np.ndarray, batch_size: int, rows: tuple[int, int] | None = None):
    """One pass in order; the last batch is padded, with weights 0 on the padding. With `rows`
    (lo, hi), each batch has only those rows of the full batch."""
    lo, hi = rows or (0, batch_size)
    for i in range(0, len(x), batch_size):
        idx = np.arange(i + lo, i + hi)
        w = (idx < len(x)).astype(np.float32)
        idx = np.minimum(idx, len(x) - 1)  # padding repeats the last example, with weight 0
        yield x[idx], y[idx], w
