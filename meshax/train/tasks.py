"""Tasks: a model's graph, its loss and metrics, and its data, for the training loop.

A task's metrics are *sums* over the batch (loss_sum, count, correct, ...) so that evaluation
over several batches, the last one padded with weight 0, adds up exactly. Batches are a pure
function of (seed, step), so a run resumed at step s sees exactly the data it would have seen;
each row is drawn by its own generator (seed, step, row), so each process of a multi-process run
draws only the rows its devices hold and together they feed the single-process batch.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from meshax.core.errors import ConfigError, did_you_mean
from meshax.core.graph import Mesh, Tensor
from meshax.core.shape import Dimension
from meshax.layers import softmax_cross_entropy_with_logits
from meshax.models.cnn import cnn_classifier, unet
from meshax.models.mlp import mnist_classifier, two_layer
from meshax.models.transformer import PRESETS, Transformer, TransformerConfig
from meshax.ops import elementwise as ew
from meshax.ops.indexing import one_hot
from meshax.ops.inputs import placeholder
from meshax.ops.reduce import argmax, reduce_min, reduce_sum
from meshax.ops.shape_ops import broadcast, reshape
from meshax.train import data, synthetic, text


@dataclasses.dataclass
class Built:
    loss: Tensor  # scalar: the weighted mean loss of the batch
    metrics: dict[str, Tensor]  # name -> scalar sum over the batch


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([k & 0xFFFFFFFF for k in key])


def _row_rngs(key: tuple[int, ...], rows: tuple[int, int]) -> list[np.random.Generator]:
    """One generator per row of a batch, so any process can draw just the rows it feeds."""
    return [_rng(*key, r) for r in range(*rows)]


def _classification(logits: Tensor, labels: Tensor, weights: Tensor, classes: Dimension) -> Built:
    """Cross-entropy and accuracy sums, weighted per example (or per token)."""
    xent = softmax_cross_entropy_with_logits(logits, one_hot(labels, classes), classes)
    loss_sum = reduce_sum(xent * weights)
    count = reduce_sum(weights)
    hit = ew.cast(ew.equal(argmax(logits, classes), labels), "float32")
    metrics = {"loss_sum": loss_sum, "count": count, "correct": reduce_sum(hit * weights)}
    return Built(loss=loss_sum / ew.maximum(count, 1.0), metrics=metrics)


def _with_moe(built: Built, transformer: Transformer) -> Built:
    """The MoE layers' balancing losses (times the config's coefficient) added to the loss, and
    their mean loss and dropped fraction as metrics (per-token sums, like the others)."""
    outs = transformer.moe_outputs
    if outs:
        aux = outs[0].loss
        dropped = outs[0].dropped_fraction
        for o in outs[1:]:
            aux, dropped = aux + o.loss, dropped + o.dropped_fraction
        built.loss = built.loss + transformer.config.moe_loss_coef * aux
        count = built.metrics["count"]
        built.metrics["moe_loss_sum"] = aux * (1.0 / len(outs)) * count
        built.metrics["moe_dropped_sum"] = dropped * (1.0 / len(outs)) * count
    return built


class Task:
    name = "task"
    batch_size: int
    seed: int = 0
    tokens_per_batch: int = 0  # for tokens/s; 0: examples are not tokens

    def build(self, mesh: Mesh) -> Built:
        raise NotImplementedError

    eval_batches_count: int = 8

    def __post_init__(self):
        """Sizes are whole numbers >= 1 (a ConfigError names the option and the value)."""
        for field in ("batch_size", "length", "hidden", "io", "eval_batches_count"):
            value = getattr(self, field, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{type(self).__name__}: {field}={value!r} must be a whole number >= 1")

    def data_settings(self) -> dict:
        """The task's settings that decide the batches each step trains on, as JSON (its fields
        but the model and its sharding): each checkpoint keeps them, and a run resumed with
        others trains on other batches than the first run would have (the CLI says so)."""
        return {
            f.name: v
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if f.name not in ("model", "sharding") and isinstance(v := getattr(self, f.name), str | int | float | None)
        }

    def depths(self) -> dict[str, int]:
        """The model's stacks of identical layers, by config field, and their depths: a layout
        search costs the model at small depths and extrapolates (`meshax.search.program`).
        None by default."""
        return {}

    def at_depths(self, depths: dict[str, int]) -> Task:
        """A copy of the task whose stacks have these depths (fields of `depths`)."""
        raise NotImplementedError(f"{type(self).__name__} has no stacks of layers to deepen")

    def _feeds(self, rngs: list[np.random.Generator], val: bool) -> dict:
        """Rows of synthetic (or sampled) feeds, row i drawn with rngs[i]; `val`: held-out data."""
        raise NotImplementedError

    def train_batch(self, step: int, rows: tuple[int, int] | None = None) -> dict:
        """The feeds of training step `step` (a pure function of the task's seed and step); with
        `rows` (lo, hi), only those rows of the batch (what one process of many feeds)."""
        return self._feeds(_row_rngs((self.seed, step), rows or (0, self.batch_size)), val=False)

    def eval_batches(self, rows: tuple[int, int] | None = None):
        """One pass of feeds dicts over the evaluation set (the same batches every time); with
        `rows`, only those rows of each batch."""
        for i in range(self.eval_batches_count):
            yield self._feeds(_row_rngs((self.seed, 1 << 30, i), rows or (0, self.batch_size)), val=True)

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        count = max(sums.get("count", 1.0), 1e-9)
        out = {"loss": sums["loss_sum"] / count}
        if "correct" in sums:
            out["accuracy"] = sums["correct"] / count
        if "moe_loss_sum" in sums:
            out["moe_loss"] = sums["moe_loss_sum"] / count
            out["moe_dropped_fraction"] = sums["moe_dropped_sum"] / count
        return out


@dataclasses.dataclass
class MlpTask(Task):
    """The paper's two-layer network learning the identity f(x) = x on Gaussian inputs."""

    batch_size: int = 64
    io: int = 32
    hidden: int = 128
    seed: int = 0
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

    def _feeds(self, rngs, val):
        return {
            "x": np.array([g.normal(size=self.io) for g in rngs], np.float32).reshape(len(rngs), self.io),
            "weights": np.ones(len(rngs), np.float32),
        }


@dataclasses.dataclass
class _DigitsTask(Task):
    """Classifying scikit-learn's digits, or MNIST when `data_dir` has its files."""

    batch_size: int = 64
    data_dir: str | None = None
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        load = (lambda: data.load_mnist(self.data_dir)) if self.data_dir else (lambda: data.load_digits(self.seed))
        self.x_train, self.y_train, self.x_test, self.y_test = load()
        if len(self.x_train) < self.batch_size:
            raise data.DataError(f"{len(self.x_train)} training examples, fewer than the batch size {self.batch_size}")

    def train_batch(self, step, rows=None):
        per_epoch = len(self.x_train) // self.batch_size
        epoch, i = divmod(step, per_epoch)
        order = _rng(self.seed, epoch).permutation(len(self.x_train))  # indices only: cheap
        lo, hi = rows or (0, self.batch_size)
        idx = order[i * self.batch_size + lo : i * self.batch_size + hi]
        return {"images": self.x_train[idx], "labels": self.y_train[idx], "weights": np.ones(hi - lo, np.float32)}

    def eval_batches(self, rows=None):
        for xb, yb, w in data.padded_batches(self.x_test, self.y_test, self.batch_size, rows):
            yield {"images": xb, "labels": yb, "weights": w}


@dataclasses.dataclass
class MnistTask(_DigitsTask):
    """The README's MNIST classifier; scikit-learn's digits unless `data_dir` has MNIST files."""

    hidden: int = 1024
    name = "mnist"

    def build(self, mesh):
        _, rows, cols = self.x_train.shape
        batch = Dimension("batch", self.batch_size)
        pix = [Dimension("pixel_rows", rows), Dimension("pixel_cols", cols)]
        classes = Dimension("classes", 10)
        images = placeholder(mesh, "images", [batch, *pix])
        labels = placeholder(mesh, "labels", [batch], dtype="int32")
        w = placeholder(mesh, "weights", [batch])
        logits = mnist_classifier(images, pix, Dimension("hidden", self.hidden), classes)
        return _classification(logits, labels, w, classes)


@dataclasses.dataclass
class CnnTask(_DigitsTask):
    """A convolutional classifier of the digits (or MNIST) with named spatial dims h and w, so
    that "h:rows;w:cols" partitions every activation in space (halo exchange)."""

    channels: int = 16  # of the first convolution; the second has twice as many
    name = "cnn"

    def build(self, mesh):
        _, rows, cols = self.x_train.shape
        batch = Dimension("batch", self.batch_size)
        images = placeholder(mesh, "images", [batch, Dimension("h", rows), Dimension("w", cols)])
        labels = placeholder(mesh, "labels", [batch], dtype="int32")
        w = placeholder(mesh, "weights", [batch])
        classes = Dimension("classes", 10)
        x = reshape(images, [*images.shape.dims, Dimension("channels", 1)])
        logits = cnn_classifier(x, classes, (self.channels, 2 * self.channels))
        return _classification(logits, labels, w, classes)


@dataclasses.dataclass
class UNetTask(Task):
    """A U-Net segmenting noisy balls from background (`synthetic.segmentation_batch`, a known
    answer) in 2-D images or 3-D volumes; the per-pixel cross-entropy and pixel accuracy."""

    batch_size: int = 8
    image_size: int = 16
    spatial_dims: int = 2
    channels: int = 8
    depth: int = 2
    seed: int = 0
    eval_batches_count: int = 4
    name = "unet"

    def __post_init__(self):
        super().__post_init__()
        if self.spatial_dims not in (2, 3):
            raise ConfigError(f"UNetTask: spatial_dims={self.spatial_dims!r} must be 2 or 3")
        if self.image_size % (1 << self.depth):
            raise ConfigError(
                f"UNetTask: image_size={self.image_size} must be a multiple of 2**depth = {1 << self.depth} "
                "(each level halves it, and the way up doubles it back)"
            )

    def build(self, mesh):
        batch = Dimension("batch", self.batch_size)
        spatial = [Dimension(n, self.image_size) for n in "dhw"[-self.spatial_dims :]]
        images = placeholder(mesh, "images", [batch, *spatial, Dimension("channels", 1)])
        labels = placeholder(mesh, "labels", [batch, *spatial], dtype="int32")
        w = placeholder(mesh, "weights", [batch])
        classes = Dimension("classes", 2)
        logits = unet(images, classes, self.channels, self.depth)
        built = _classification(logits, labels, broadcast(w, labels.shape), classes)
        built.metrics["examples"] = reduce_sum(w)
        return built

    def _feeds(self, rngs, val):
        images, labels = synthetic.segmentation_batch(rngs, self.image_size, self.spatial_dims)
        return {"images": images, "labels": labels, "weights": np.ones(len(rngs), np.float32)}

    def summarize(self, sums):
        out = super().summarize(sums)
        out["pixel_accuracy"] = out.pop("accuracy")
        return out


def model_config(model: str | TransformerConfig, **overrides) -> TransformerConfig:
    """A Transformer config: a preset's name (or a config) with fields replaced."""
    if isinstance(model, TransformerConfig):
        return dataclasses.replace(model, **overrides) if overrides else model
    if model not in PRESETS:
        raise ConfigError(f"unknown model {model!r}{did_you_mean(model, PRESETS)}: the presets are {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[model], **overrides)


class _TransformerTask(Task):
    """A task of a `Transformer` (`self.config`): its stacks are the decoder's and the encoder's
    layers, identical layer by layer unless pipelined (stages) or MoE (every other layer)."""

    config: TransformerConfig

    def _check_microbatches(self) -> None:
        """A pipeline's microbatches divide the batch (else the pipeline said so of its input,
        naming an internal tensor)."""
        c = self.config
        if c.pipeline_stages > 1 and self.batch_size % c.microbatches:
            raise ConfigError(
                f"{c.microbatches} microbatches do not divide the batch of {self.batch_size} examples "
                "(--microbatches, --batch-size): choose a number of microbatches that divides the batch size"
            )

    def depths(self) -> dict[str, int]:
        c = self.config
        if c.pipeline_stages > 1 or c.moe_experts:
            return {}
        stacks = {"num_layers": c.num_layers, "num_encoder_layers": c.num_encoder_layers}
        return {k: v for k, v in stacks.items() if v}

    def at_depths(self, depths: dict[str, int]) -> Task:
        config = dataclasses.replace(self.config, **depths)  # type: ignore[arg-type]
        return dataclasses.replace(self, model=config)  # type: ignore[type-var]


@dataclasses.dataclass
class LmTask(_TransformerTask):
    """Decoder-only language model on bytes of text (source="text") or a Markov chain ("markov")."""

    model: str | TransformerConfig = "tiny"
    batch_size: int = 16
    length: int = 64
    source: str = "text"
    text_path: str | None = None
    markov_vocab: int = 16
    markov_order: int = 2
    sharding: str = ""  # a GSPMD sharding of meshax.models.transformer.GSPMD_SHARDINGS
    seed: int = 0
    eval_batches_count: int = 8
    name = "lm"

    def __post_init__(self):
        super().__post_init__()
        if self.source == "text":
            self.config = model_config(self.model, num_encoder_layers=0, sharding=self.sharding)
            if self.config.vocab_size < 256:
                raise ConfigError(
                    f"byte-level text needs a vocab of at least 256, the model has {self.config.vocab_size}"
                )
            if self.text_path and not os.path.exists(self.text_path):
                raise data.DataError(f"text path {self.text_path!r} does not exist; give a text file or a folder")
            if self.text_path:
                text.check_text(self.text_path, self.length)
            self._bytes = None  # read on first use: planning needs no data
        elif self.source == "markov":
            self.config = model_config(
                self.model, num_encoder_layers=0, vocab_size=self.markov_vocab, sharding=self.sharding
            )
            self.markov = synthetic.MarkovSource(self.markov_vocab, self.markov_order, seed=self.seed)
        else:
            raise ConfigError(f"unknown source {self.source!r}: use 'text' or 'markov'")
        self._check_microbatches()
        self.tokens_per_batch = self.batch_size * self.length

    def build(self, mesh):
        batch, length = Dimension("batch", self.batch_size), Dimension("length", self.length)
        ids = placeholder(mesh, "ids", [batch, length], dtype="int32")
        targets = placeholder(mesh, "targets", [batch, length], dtype="int32")
        weights = placeholder(mesh, "weights", [batch, length])
        self.transformer = Transformer(self.config, mesh)
        logits = self.transformer.language_model(ids)
        return _with_moe(_classification(logits, targets, weights, self.transformer.vocab), self.transformer)

    def _feeds(self, rngs, val: bool):
        weights = np.ones((len(rngs), self.length), np.float32)
        if self.source == "text":
            if self._bytes is None:
                self._bytes = text.load_bytes(self.text_path)
            seqs = text.windows(self._bytes[1 if val else 0], rngs, self.length)
        else:
            seqs = self.markov.sample(rngs, self.length + 1)
            weights[:, : self.markov_order - 1] = 0.0  # predictions before a full context
        return {"ids": seqs[:, :-1], "targets": seqs[:, 1:], "weights": weights}

    def summarize(self, sums):
        out = super().summarize(sums)
        if self.source == "text":
            out["bits_per_byte"] = out["loss"] / math.log(2)
        else:
            out["entropy_rate"] = self.markov.entropy_rate
        return out


@dataclasses.dataclass
class Seq2SeqTask(_TransformerTask):
    """Encoder-decoder on reversing (or sorting) random sequences, scored by exact match.

    Exact match under teacher forcing equals greedy decoding's: if every position's argmax is
    right given the right prefix, greedy decoding reproduces the target, and the first wrong
    position is wrong in both."""

    model: str | TransformerConfig = "tiny"
    batch_size: int = 32
    length: int = 8
    vocab: int = 16  # tokens 2..vocab-1 (0: unused, 1: BOS); the model's vocab may be larger
    problem: str = "reverse"
    num_encoder_layers: int = 2  # when the model preset has none
    sharding: str = ""  # a GSPMD sharding of meshax.models.transformer.GSPMD_SHARDINGS
    seed: int = 0
    eval_batches_count: int = 8
    name = "seq2seq"

    def __post_init__(self):
        super().__post_init__()
        if self.problem not in ("reverse", "sort"):
            raise ConfigError(f"unknown problem {self.problem!r}: use 'reverse' or 'sort'")
        config = model_config(self.model)
        self.config = model_config(
            config, num_encoder_layers=config.num_encoder_layers or self.num_encoder_layers, sharding=self.sharding
        )
        if self.config.vocab_size < self.vocab:
            raise ConfigError(
                f"the task's {self.vocab} tokens do not fit the model's vocab of {self.config.vocab_size}"
            )
        self._check_microbatches()
        self.tokens_per_batch = self.batch_size * self.length

    def build(self, mesh):
        batch, length = Dimension("batch", self.batch_size), Dimension("length", self.length)
        inputs = placeholder(mesh, "inputs", [batch, length], dtype="int32")
        targets_in = placeholder(mesh, "targets_in", [batch, length], dtype="int32")
        targets = placeholder(mesh, "targets", [batch, length], dtype="int32")
        weights = placeholder(mesh, "weights", [batch, length])
        self.transformer = Transformer(self.config, mesh)
        logits = self.transformer.encoder_decoder(inputs, targets_in, pad_id=None)
        built = _with_moe(_classification(logits, targets, weights, self.transformer.vocab), self.transformer)
        right = ew.cast(ew.equal(argmax(logits, self.transformer.vocab), targets), "float32")
        built.metrics["exact"] = reduce_sum(reduce_min(right, reduced_dim=length))
        built.metrics["sequences"] = reduce_sum(reduce_min(weights, reduced_dim=length))
        return built

    def _feeds(self, rngs, val):
        make = synthetic.reversal_batch if self.problem == "reverse" else synthetic.sorting_batch
        inputs, targets_in, targets = make(rngs, self.length, self.vocab)
        return {
            "inputs": inputs,
            "targets_in": targets_in,
            "targets": targets,
            "weights": np.ones((len(rngs), self.length), np.float32),
        }

    def summarize(self, sums):
        out = super().summarize(sums)
        out["exact_match"] = sums["exact"] / max(sums["sequences"], 1e-9)
        return out


TASKS = {
    "mlp": MlpTask,
    "mnist": MnistTask,
    "cnn": CnnTask,
    "unet": UNetTask,
    "lm": LmTask,
    "seq2seq": Seq2SeqTask,
}
