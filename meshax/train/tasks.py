"""Tasks: a model's graph, its loss and metrics, and its data, for the training loop.

A task's metrics are *sums* over the batch (loss_sum, correct, count) so that evaluation over
several batches, the last one padded with weight 0, adds up exactly.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from meshax.core.graph import Mesh, Tensor
from meshax.core.shape import Dimension
from meshax.layers import softmax_cross_entropy_with_logits
from meshax.models.mlp import mnist_classifier, two_layer
from meshax.ops import elementwise as ew
from meshax.ops.indexing import one_hot
from meshax.ops.inputs import placeholder
from meshax.ops.reduce import argmax, reduce_sum
from meshax.train import data


@dataclasses.dataclass
class Built:
    loss: Tensor  # scalar: the weighted mean loss of the batch
    metrics: dict[str, Tensor]  # name -> scalar sum over the batch


class Task:
    name = "task"
    batch_size: int

    def build(self, mesh: Mesh) -> Built:
        raise NotImplementedError

    def train_batches(self, seed: int):
        """Endless feeds dicts for training."""
        raise NotImplementedError

    def eval_batches(self):
        """One pass of feeds dicts over the evaluation set."""
        raise NotImplementedError

    @staticmethod
    def summarize(sums: dict[str, float]) -> dict[str, float]:
        count = max(sums.get("count", 1.0), 1e-9)
        out = {"loss": sums["loss_sum"] / count}
        if "correct" in sums:
            out["accuracy"] = sums["correct"] / count
        return out


@dataclasses.dataclass
class MlpTask(Task):
    """The paper's two-layer network learning the identity f(x) = x on Gaussian inputs."""

    batch_size: int = 64
    io: int = 32
    hidden: int = 128
    eval_batches_count: int = 4
    name = "mlp"

    def build(self, mesh):
        batch, io = Dimension("batch", self.batch_size), Dimension("io", self.io)
        x = placeholder(mesh, "x", [batch, io])
        w = placeholder(mesh, "weights", [batch])
        y = two_layer(x, Dimension("hidden", self.hidden))
        per_example = reduce_sum(ew.square(y - x), reduced_dim=io) * (1.0 / self.io)
        loss_sum = reduce_sum(per_example * w)
        count = reduce_sum(w)
        return Built(loss=loss_sum / count, metrics={"loss_sum": loss_sum, "count": count})

    def _feeds(self, rng):
        return {"x": rng.normal(size=(self.batch_size, self.io)).astype(np.float32),
                "weights": np.ones(self.batch_size, np.float32)}

    def train_batches(self, seed):
        rng = np.random.default_rng(seed)
        while True:
            yield self._feeds(rng)

    def eval_batches(self):
        rng = np.random.default_rng(12345)
        for _ in range(self.eval_batches_count):
            yield self._feeds(rng)


@dataclasses.dataclass
class MnistTask(Task):
    """The README's MNIST classifier; scikit-learn's digits unless `data_dir` has MNIST files."""

    batch_size: int = 64
    hidden: int = 1024
    data_dir: str | None = None
    seed: int = 0
    name = "mnist"

    def __post_init__(self):
        if self.data_dir:
            self.x_train, self.y_train, self.x_test, self.y_test = data.load_mnist(self.data_dir)
        else:
            self.x_train, self.y_train, self.x_test, self.y_test = data.load_digits(self.seed)

    def build(self, mesh):
        n, rows, cols = self.x_train.shape
        batch = Dimension("batch", self.batch_size)
        pix = [Dimension("pixel_rows", rows), Dimension("pixel_cols", cols)]
        classes = Dimension("classes", 10)
        images = placeholder(mesh, "images", [batch] + pix)
        labels = placeholder(mesh, "labels", [batch], dtype="int32")
        w = placeholder(mesh, "weights", [batch])
        logits = mnist_classifier(images, pix, Dimension("hidden", self.hidden), classes)
        xent = softmax_cross_entropy_with_logits(logits, one_hot(labels, classes), classes)
        loss_sum = reduce_sum(xent * w)
        count = reduce_sum(w)
        correct = reduce_sum(ew.cast(ew.equal(argmax(logits, classes), labels), "float32") * w)
        return Built(loss=loss_sum / count, metrics={"loss_sum": loss_sum, "correct": correct, "count": count})

    def train_batches(self, seed):
        for xb, yb in data.batches(self.x_train, self.y_train, self.batch_size, seed):
            yield {"images": xb, "labels": yb, "weights": np.ones(self.batch_size, np.float32)}

    def eval_batches(self):
        for xb, yb, w in data.padded_batches(self.x_test, self.y_test, self.batch_size):
            yield {"images": xb, "labels": yb, "weights": w}


TASKS = {"mlp": MlpTask, "mnist": MnistTask}
