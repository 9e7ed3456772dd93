"""Autoregressive decoding of the Transformer (`meshax.models.transformer`), as Mesh-TensorFlow's
transformer decodes: one compiled step per token, attention incremental over key/value caches.

`Decoder(config, mesh_shape, layout, batch)` lays out a step graph with the training graph's
variable names (so a checkpoint, or a trained lowering's values, loads into it) and the training
tensors' dim names: the caches [batch, heads, memory_length, d_kv] of each layer are split by
the same layout rules as the keys and values in training, and a model-parallel layout decodes
model-parallel. The step takes the token at position t and the caches, writes the token's keys
and values at t, attends to positions up to t, and returns the logits and the new caches. An
encoder-decoder runs its encoder once (`encode_fn`): its keys and values are computed once per
layer and fed to every step. The encoder attends to every input position, as `Seq2SeqTask`
trains it (no padding mask). A mixture-of-experts layer routes each step's tokens as groups of
one, dropping none (`_moe`); a pipelined stack runs its stages one after another, each layer
reading its block's weights from the pipeline's stacked variables (`_block`).

Search runs on the host over the step's logits: `greedy`, `sample` (temperature, top-k; 0 is
greedy) and `beam_search` (beams in the batch dim, caches reordered by each step's choice,
length penalty ((5 + length) / 6) ** alpha as in Mesh-TensorFlow's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import operator
import os
from collections.abc import Iterator

import numpy as np

from meshax.core.errors import ConfigError
from meshax.core.graph import Graph, Mesh, Tensor
from meshax.core.shape import Dimension, Shape
from meshax.layout.rules import LayoutRules, convert_to_layout_rules
from meshax.models.transformer import Transformer, TransformerConfig
from meshax.ops import elementwise as ew
from meshax.ops.einsum import einsum
from meshax.ops.indexing import gather, one_hot
from meshax.ops.inputs import import_tensor, placeholder
from meshax.ops.inputs import range as mrange
from meshax.ops.reduce import softmax
from meshax.ops.shape_ops import reshape
from meshax.ops.variables import reuse_variables, stacked_variables

NEG = -1e9


class Decoder:
    """The Transformer's decoding step (and encoder), laid out on a mesh. `batch`: sequences
    decoded together (beams included); `length`: the longest output; `input_length`: the
    encoder's input length (encoder-decoders); `backend` and `weight_layout` as training's
    (`meshax.train.build`)."""

    def __init__(
        self,
        config: TransformerConfig,
        mesh_shape="all:1",
        layout="",
        batch: int = 1,
        length: int | None = None,
        input_length: int | None = None,
        backend: str = "simd",
        weight_layout: str | None = None,
    ):
        from meshax.train.loop import BACKENDS

        if backend not in BACKENDS:  # (a KeyError)
            raise ConfigError(f"unknown backend {backend!r}; choose one of {sorted(BACKENDS)}")
        for what, n in (("batch", batch), ("length", length), ("input_length", input_length)):
            if n is not None and (isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1):
                # (length 0 decoded to the model's max_length; batch 0 built a step of no rows)
                raise ConfigError(f"Decoder: {what}={n!r} must be a whole number of at least 1")
        self.config = dataclasses.replace(config, dropout=0.0)
        self.encoder_decoder = config.num_encoder_layers > 0
        if self.encoder_decoder and not input_length:
            raise ConfigError("an encoder-decoder decodes from inputs: give input_length")
        if input_length is not None and not self.encoder_decoder:  # (it was ignored)
            raise ConfigError("input_length is for an encoder-decoder; this model has no encoder (give None)")
        self.batch_size, self.length = batch, config.max_length if length is None else length
        if config.positions == "learned" and self.length > config.max_length:
            raise ConfigError(
                f"length {self.length} passes the model's max_length {config.max_length}: its learned "
                "positions end there"
            )
        graph = Graph()
        self.mesh = Mesh(graph, "mesh")
        self._picks: dict[int, Tensor] = {}  # (block -> its one-hot over the stacked dims: `_block`)
        self.model = Transformer(self.config, self.mesh)
        m = self.model
        self.batch = Dimension("batch", batch)
        self.memory_length = Dimension("memory_length", self.length)
        self.cache_shape = Shape([self.batch, m.heads, self.memory_length, m.d_kv])
        enc_outputs: list[Tensor] = []
        if input_length is not None and self.encoder_decoder:
            enc_outputs = self._encoder(Dimension("length", input_length))
        step_outputs = self._step()
        from meshax.lower.lowering import Lowering

        impl = BACKENDS[backend](mesh_shape, _decoding_rules(layout, graph), weight_layout=weight_layout)
        self.lowering = Lowering(graph, {self.mesh: impl})
        self.step_fn = self.lowering.function(step_outputs)
        self.encode_fn = self.lowering.function(enc_outputs) if self.encoder_decoder else None

    # ---- the graphs --------------------------------------------------------------------------
    def _prefix(self) -> tuple[str, str]:
        """The decoder's embedding table and layer prefix, as the training graph names them."""
        return ("target_embedding" if self.encoder_decoder else "embedding"), "decoder"

    def _encoder(self, length: Dimension) -> list[Tensor]:
        """The encoder over inputs [batch, length] and, per decoder layer, the keys and values of
        its cross-attention over the encoder's output, [batch, heads, encoder_length, d_kv]."""
        m, c = self.model, self.config
        inputs = placeholder(self.mesh, "inputs", [self.batch, length], dtype="int32")
        x = m.embed(inputs, "input_embedding", length)
        if c.pipeline_stages > 1:  # (the stages' blocks one after another, on the whole batch)
            per_block = c.num_encoder_layers // self._blocks
            for b in range(self._blocks):
                with self._block(b):
                    x = m.layers(x, per_block, "encoder", None)
            x = m.norm(x, "encoder/final_norm")
        else:
            x = m.stack(x, c.num_encoder_layers, "encoder", None)
        memory = m.as_memory(x)
        out: list[Tensor] = []
        for i in range(self.config.num_layers):
            with self._layer(i) as j:
                wk, wv = (self._weight(f"decoder/{j}/cross_attention/{n}") for n in "kv")
            self.encoder_length = memory.shape.get_dim_by_name("memory_length")
            shape = [self.batch, m.heads, self.encoder_length, m.d_kv]
            out += [einsum(memory, wk, output_shape=shape), einsum(memory, wv, output_shape=shape)]
        return out

    @property
    def _blocks(self) -> int:
        """A pipelined stack's blocks of layers: stages x circular repeats (`Transformer.stack`)."""
        return self.config.pipeline_stages * self.config.circular_repeats

    @contextlib.contextmanager
    def _block(self, b: int) -> Iterator[None]:
        """Inside, a pipelined stack's layer weights are those of block b: the variables
        [stage, ...] ([repeat, stage, ...] circular) that training's pipeline made, read at stage
        b mod S (repeat b // S). The stages run one after another: each step reads a stage's
        weights where the layout keeps them (split over `stage`: from the device holding them)."""
        m, c = self.model, self.config
        stage = Dimension("stage", c.pipeline_stages)
        lead = [Dimension("repeat", c.circular_repeats), stage] if c.circular_repeats > 1 else [stage]
        if b not in self._picks:  # (one constant per block, whichever of its layers read it)
            pick = np.zeros([d.size for d in lead], np.float32)
            pick[np.unravel_index(b, pick.shape)] = 1  # (block b = r * S + s: repeat r, stage s)
            self._picks[b] = import_tensor(self.mesh, pick, lead, name=f"block_{b}")
        which = self._picks[b]
        shared, m._vars = m._vars, {}  # (each block's weights read afresh under the same names)
        try:
            with (
                reuse_variables(),
                stacked_variables(lead, lambda v: einsum(v, which, output_shape=v.shape[len(lead) :])),
            ):
                yield
        finally:
            m._vars = shared

    @contextlib.contextmanager
    def _layer(self, i: int) -> Iterator[int]:
        """The name index of the stack's layer i (in a pipeline, its index within its block,
        whose weights are read inside: `_block`)."""
        if self.config.pipeline_stages <= 1:
            yield i
            return
        b, j = divmod(i, self.config.num_layers // self._blocks)
        with self._block(b):
            yield j

    def _weight(self, name: str, dims=None) -> Tensor:
        m = self.model
        if dims is None:
            dims = [m.heads, m.d_kv, m.d_model] if name.endswith("/o") else [m.d_model, m.heads, m.d_kv]
        return m._compute(m._var(name, dims, None))

    def _position(self, step: Tensor, table: str) -> Tensor:
        """The position encoding of `step` [d_model]: a row of the model's own encodings (learned:
        its table of max_length rows; sinusoidal: of every position the decoder reaches, which
        may pass max_length, as training's sequence may)."""
        c = self.config
        positions = Dimension("positions", c.max_length if c.positions == "learned" else self.length)
        return self.model._compute(gather(self.model.positions(positions, table), step, positions))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, bias, memory_length: Dimension, name: str) -> Tensor:
        m = self.model
        logits = einsum(q, k, output_shape=[self.batch, m.heads, memory_length], dtype=m._wide())
        weights = m._compute(softmax(logits + bias if bias is not None else logits, memory_length))
        out = einsum(weights, v, reduced_dims=[memory_length])
        return einsum(out, self._weight(f"{name}/o"), reduced_dims=[m.heads, m.d_kv])

    def _moe(self, y: Tensor, name: str) -> Tensor:
        """The MoE feed-forward block on the step's tokens y [batch, d_model]: each token a group
        of its own (a dim `token` of 1 beside the batch, which the groups keep, as training's
        keep it), with room for it at each of its experts (capacity 1), so no token is dropped:
        the step's output is the forward pass's wherever training's capacity dropped none."""
        m = self.model
        tokens = reshape(y, [self.batch, Dimension("token", 1), m.d_model])
        return reshape(m.moe(tokens, name, group_size=1, capacity_factor=float(self.config.moe_experts)), y.shape)

    def _step(self) -> list[Tensor]:
        """ids [batch] at position `step`, the caches -> logits [batch, vocab] and the new caches."""
        m, c = self.model, self.config
        table, prefix = self._prefix()
        ids = placeholder(self.mesh, "ids", [self.batch], dtype="int32")
        step = placeholder(self.mesh, "step", [], dtype="int32")
        x = gather(m._compute(m._table(table)), ids, m.vocab) * math.sqrt(c.d_model) + self._position(step, table)
        here = one_hot(step, self.memory_length, dtype="float32")
        future = ew.greater(mrange(self.mesh, self.memory_length, "int32"), step)
        self_bias = ew.where(future, NEG, 0.0)
        caches: list[Tensor] = []
        for i in range(c.num_layers):
            with self._layer(i) as j:
                x = self._decoder_layer(x, i, f"{prefix}/{j}", here, self_bias, caches)
        logits = m.logits(m.norm(x, f"{prefix}/final_norm"), table)
        return [logits, *caches]

    def _decoder_layer(self, x: Tensor, i: int, prefix: str, here: Tensor, self_bias: Tensor, caches: list) -> Tensor:
        """The step through decoder layer i (its weights named `prefix`), its caches appended."""
        m, c = self.model, self.config
        name = f"{prefix}/self_attention"
        y = m.norm(x, f"{prefix}/self_attention_norm")
        q, k, v = (einsum(y, self._weight(f"{name}/{n}"), reduced_dims=[m.d_model]) for n in "qkv")
        prev_k, prev_v = (placeholder(self.mesh, f"cache/{i}/{n}", self.cache_shape, dtype=c.dtype) for n in "kv")
        k = prev_k + ew.multiply(k, ew.cast(here, k.dtype), output_shape=self.cache_shape)
        v = prev_v + ew.multiply(v, ew.cast(here, v.dtype), output_shape=self.cache_shape)
        caches += [k, v]
        x = x + self._attend(q, k, v, self_bias, self.memory_length, name)
        if self.encoder_decoder:
            name = f"{prefix}/cross_attention"
            y = m.norm(x, f"{prefix}/cross_attention_norm")
            q = einsum(y, self._weight(f"{name}/q"), reduced_dims=[m.d_model])
            enc_shape = Shape([self.batch, m.heads, self.encoder_length, m.d_kv])
            ek, ev = (placeholder(self.mesh, f"encoded/{i}/{n}", enc_shape, dtype=c.dtype) for n in "kv")
            x = x + self._attend(q, ek, ev, None, self.encoder_length, name)
        y = m.norm(x, f"{prefix}/ffn_norm")
        block = self._moe if c.is_moe(i) else m.feed_forward
        return x + m._compute(block(y, f"{prefix}/ffn"))

    # ---- running ---------------------------------------------------------------------------------
    def load(self, source, step: int | None = None) -> None:
        """The weights from a checkpoint directory, or from a trained `Lowering` (by variable name).
        A model of variables the decoder's lacks (more layers: its first ones decoded, without a
        word) is refused."""
        ours = {v.name for v in self.lowering.graph.all_variables}

        def refuse(extra: list[str], of: str) -> None:
            if extra:
                raise ConfigError(
                    f"the decoder's model has no variable {extra[0]!r} of the {of} ({len(extra)} such): "
                    "is it the same model config?"
                )

        if isinstance(source, str | os.PathLike):  # (a pathlib.Path was an AttributeError)
            import warnings

            from meshax.optimize import LOSS_SCALE_SCOPE
            from meshax.train.checkpoint import restore_checkpoint, saved_variable_names

            extra = [
                n
                for n in saved_variable_names(os.fspath(source), step)
                if n not in ours
                and n.rsplit("/", 1)[0] not in ours  # (an optimizer's slot of a variable: `name/adam_m`)
                and n != "global_step"
                and not n.startswith(LOSS_SCALE_SCOPE + "/")
            ]
            refuse(extra, "checkpoint's model")
            with warnings.catch_warnings():  # (the optimizer's slots, which decoding does not need)
                warnings.filterwarnings("ignore", message=".*the graph lacks")
                restore_checkpoint(os.fspath(source), self.lowering, step)
            return
        if not hasattr(source, "graph") or not hasattr(source, "variable_value"):  # (an AttributeError)
            raise ConfigError(f"load takes a checkpoint directory or a trained Lowering, got {type(source).__name__}")
        trained = {v.name: v for v in source.graph.all_variables}
        refuse(sorted(v.name for v in source.graph.trainable_variables if v.name not in ours), "trained model")
        for v in self.lowering.graph.all_variables:
            if v.name not in trained:
                raise ConfigError(f"the trained model has no variable {v.name!r}: is it the same model config?")
            self.lowering.set_variable_value(v, source.variable_value(trained[v.name]))

    def _zeros(self) -> list[np.ndarray]:
        dtype = np.dtype(self.config.dtype) if self.config.dtype != "bfloat16" else np.float32
        shape = tuple(self.cache_shape.to_integer_list)
        return [np.zeros(shape, dtype) for _ in range(2 * self.config.num_layers)]

    def _feeds(self, ids, step: int, caches, encoded) -> dict:
        feeds = {"ids": np.asarray(ids, np.int32), "step": np.int32(step)}
        for i in range(self.config.num_layers):
            feeds[f"cache/{i}/k"], feeds[f"cache/{i}/v"] = caches[2 * i], caches[2 * i + 1]
            if encoded is not None:
                feeds[f"encoded/{i}/k"], feeds[f"encoded/{i}/v"] = encoded[2 * i], encoded[2 * i + 1]
        return feeds

    def _start(self, prompt, inputs):
        """(the tokens so far [batch, n], caches after them, the encoder's keys and values, the
        last logits): the prompt run through the decoder (an encoder-decoder starts from BOS)."""
        encoded = None
        if inputs is not None and not self.encoder_decoder:  # (they were ignored: the prompt alone decoded)
            raise ConfigError("inputs are for an encoder-decoder; a decoder-only model continues the prompt alone")
        if self.encoder_decoder:
            inputs = self._rows("inputs", self._token_ids("inputs", inputs), self.batch_size)
            encoded = [np.asarray(t) for t in self.encode_fn({"inputs": inputs})]
            prompt = np.ones((self.batch_size, 1), np.int32) if prompt is None else prompt
        prompt = self._rows("prompt", self._token_ids("prompt", prompt), self.batch_size)
        if prompt.shape[1] == 0 or prompt.shape[1] > self.length:
            raise ConfigError(f"a prompt of 1 to {self.length} tokens is needed, got {prompt.shape[1]}")
        caches = self._zeros()
        for t in range(prompt.shape[1]):
            logits, caches = self._advance(prompt[:, t], t, caches, encoded)
        return prompt, caches, encoded, logits

    def _token_ids(self, what: str, ids) -> np.ndarray:
        """`ids` as int32 token ids, each in the vocabulary (an id outside it would read no
        embedding row: the model would see zeros)."""
        if ids is None:
            raise ConfigError(f"decoding needs the {what} (token ids)")
        try:
            ids = np.asarray(ids)
        except ValueError:  # (NumPy's "inhomogeneous shape")
            raise ConfigError(f"the {what} must be token ids, a row per sequence, all rows of one length") from None
        if not np.issubdtype(ids.dtype, np.integer):
            raise ConfigError(f"the {what} must be integer token ids, got an array of {ids.dtype}")
        outside = ids[(ids < 0) | (ids >= self.vocab_size)]
        if outside.size:
            raise ConfigError(f"{what} token {outside[0]} is not in the vocabulary 0..{self.vocab_size - 1}")
        return ids.astype(np.int32)

    @staticmethod
    def _rows(what: str, ids: np.ndarray, rows: int, per: str = "sequence decoded") -> np.ndarray:
        """`ids` as [rows, n]: a row per sequence (a prompt of other rows would be read as other
        sequences' tokens)."""
        if ids.ndim != 2 or ids.shape[0] != rows:
            raise ConfigError(f"the {what} must be token ids [{rows}, n], a row per {per}; got shape {ids.shape}")
        return ids

    @staticmethod
    def _count(what: str, n) -> int:
        """`n` as an int where an argument counts (steps, top_k, beam_size): a float or a text was
        a TypeError from deep inside (a range, a slice, a comparison)."""
        try:
            whole = operator.index(n)  # (an int, NumPy's or JAX's; not a float, which would be cut)
        except TypeError:
            whole = None
        if isinstance(n, bool) or whole is None:
            raise ConfigError(f"{what} {n!r} ({type(n).__name__}) must be a whole number: give an int")
        return whole

    @staticmethod
    def _number(what: str, x) -> float:
        """`x` as a float where an argument is a real number (temperature, alpha)."""
        value = None
        if not isinstance(x, str | bytes | bool) and x is not None:  # (float('0.8') would take a text)
            with contextlib.suppress(TypeError, ValueError):
                value = float(x)  # (a Python, NumPy or JAX real number)
        if value is None:
            raise ConfigError(f"{what} {x!r} ({type(x).__name__}) must be a number")
        return value

    def _steps(self, steps: int | None, first: int) -> int:
        """The tokens to decode after `first` (the default: up to the decoder's length)."""
        room = self.length - first + 1  # (the last new token needs no place in the caches)
        if steps is None:
            return room
        steps = self._count("steps", steps)
        if not 1 <= steps <= room:
            raise ConfigError(
                f"steps {steps}: after {first} tokens the decoder's length {self.length} leaves room for 1 to {room}"
            )
        return steps

    @property
    def vocab_size(self) -> int:
        return self.model.vocab.size

    def _advance(self, ids, step: int, caches, encoded) -> tuple[np.ndarray, list]:
        """One step: the tokens `ids` at position `step` -> (the next tokens' logits, the caches)."""
        logits, *caches = self.step_fn(self._feeds(ids, step, caches, encoded))
        return np.asarray(logits, np.float64), caches

    def sample(self, prompt=None, inputs=None, steps: int | None = None, temperature=1.0, top_k=0, seed=0):
        """Tokens [batch, steps] after the prompt (LM: [batch, n] ids; encoder-decoder: BOS by
        default, `inputs` [batch, input_length]): each drawn from softmax(logits / temperature),
        among the `top_k` most likely (0: all); temperature 0: the most likely (greedy)."""
        temperature, top_k = self._number("temperature", temperature), self._count("top_k", top_k)
        if not (temperature >= 0 and math.isfinite(temperature)):
            raise ConfigError(f"temperature {temperature} must be a finite number >= 0 (0: greedy)")
        if not 0 <= top_k <= self.vocab_size:
            raise ConfigError(f"top_k {top_k} must be from 0 (all tokens) to the vocabulary's {self.vocab_size}")
        if top_k and temperature == 0:
            raise ConfigError(
                f"top_k {top_k} samples among the {top_k} most likely tokens, but temperature 0 takes the "
                "most likely one: give a temperature > 0, e.g. 0.8"
            )
        rng = np.random.default_rng(seed)
        tokens, caches, encoded, logits = self._start(prompt, inputs)
        first = tokens.shape[1]
        steps = self._steps(steps, first)
        out = []
        for t in range(first, first + steps):
            nxt = _choose(logits, temperature, top_k, rng)
            out.append(nxt)
            if t >= self.length or len(out) == steps:
                break
            logits, caches = self._advance(nxt, t, caches, encoded)
        return np.stack(out, 1)

    def greedy(self, prompt=None, inputs=None, steps: int | None = None):
        """The most likely token at each step (`sample` at temperature 0)."""
        return self.sample(prompt, inputs, steps, temperature=0.0)

    def beam_search(self, inputs=None, prompt=None, beam_size: int = 4, steps: int | None = None, alpha=0.6):
        """The best of `beam_size` hypotheses per sequence, scored by log-probability / ((5 +
        length) / 6) ** alpha (Mesh-TensorFlow's length penalty). The decoder's batch holds
        sequences x beams (batch = sequences * beam_size). Returns (tokens [sequences, steps],
        their scores)."""
        beam_size, alpha = self._count("beam_size", beam_size), self._number("alpha", alpha)
        if beam_size < 1 or self.batch_size % beam_size:
            raise ConfigError(f"the decoder's batch {self.batch_size} must be sequences x beam_size {beam_size}")
        n = self.batch_size // beam_size

        def rep(what, a):  # (each sequence's row once per beam)
            if a is None:
                return None
            a = self._rows(what, np.asarray(a), n, f"sequence ({self.batch_size} / beam_size {beam_size})")
            return np.repeat(a, beam_size, axis=0)

        tokens, caches, encoded, logits = self._start(rep("prompt", prompt), rep("inputs", inputs))
        first = tokens.shape[1]
        steps = self._steps(steps, first)
        scores = np.zeros((n, beam_size))
        scores[:, 1:] = -np.inf  # (the beams start equal: keep one of them)
        history = np.zeros((n, beam_size, 0), np.int32)
        for t in range(first, first + steps):
            logp = _log_softmax(logits).reshape(n, beam_size, -1)
            total = scores[:, :, None] + logp
            vocab = total.shape[-1]
            best = np.argsort(-total.reshape(n, -1), axis=1, kind="stable")[:, :beam_size]
            beam, token = best // vocab, best % vocab
            scores = np.take_along_axis(total.reshape(n, -1), best, 1)
            history = np.concatenate([np.take_along_axis(history, beam[:, :, None], 1), token[:, :, None]], 2)
            rows = (np.arange(n)[:, None] * beam_size + beam).reshape(-1)
            caches = [np.asarray(c)[rows] for c in caches]
            if t >= self.length or history.shape[2] == steps:
                break
            logits, caches = self._advance(token.reshape(-1), t, caches, encoded)
        penalty = ((5.0 + history.shape[2]) / 6.0) ** alpha
        pick = np.argmax(scores, axis=1)
        return history[np.arange(n), pick], scores[np.arange(n), pick] / penalty


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _choose(logits: np.ndarray, temperature: float, top_k: int, rng) -> np.ndarray:
    if temperature == 0.0:
        return np.argmax(logits, -1).astype(np.int32)
    # (logits - max) / temperature: 0 for the most likely, -inf at most for the rest, where a
    # tiny temperature overflows logits / temperature itself (inf - inf: NaN)
    with np.errstate(over="ignore", divide="ignore", under="ignore"):
        scaled = (logits - logits.max(-1, keepdims=True)) / temperature
    if top_k:  # exactly the top_k most likely (by rank, ties as argmax breaks them: top_k 1 is greedy)
        keep = np.argsort(-logits, -1, kind="stable")[:, :top_k]
        masked = np.full_like(scaled, -np.inf)
        np.put_along_axis(masked, keep, np.take_along_axis(scaled, keep, -1), -1)
        scaled = masked
    p = np.exp(_log_softmax(scaled))
    return np.array([rng.choice(len(row), p=row / row.sum()) for row in p], np.int32)


def sequence_log_probability(decoder: Decoder, inputs, tokens) -> np.ndarray:
    """The log-probability of `tokens` [batch, n] under the model (teacher forcing from BOS, an
    encoder-decoder's): the score beam search maximizes, before its length penalty."""
    tokens = decoder._rows("tokens", decoder._token_ids("tokens", tokens), decoder.batch_size)
    if not 1 <= tokens.shape[1] <= decoder.length:  # (past the length, the steps wrote no cache: wrong, silently)
        raise ConfigError(f"tokens: 1 to the decoder's length {decoder.length} are scored, got {tokens.shape[1]}")
    bos = np.ones((decoder.batch_size, 1), np.int32)
    _, caches, encoded, logits = decoder._start(bos, inputs)
    total = np.zeros(decoder.batch_size)
    for t in range(tokens.shape[1]):
        total += _log_softmax(logits)[np.arange(decoder.batch_size), tokens[:, t]]
        if t + 1 < tokens.shape[1]:
            logits, caches = decoder._advance(tokens[:, t], t + 1, caches, encoded)
    return total


def _decoding_rules(layout, graph: Graph) -> LayoutRules:
    """The training layout's rules for the decoding step: a rule for `length` splits the training
    sequence, which the step has not (it takes one position; its caches' dim is `memory_length`),
    so it is dropped there; every other rule stays (and a
    rule that splits nothing is still said to be a likely typo)."""
    rules = convert_to_layout_rules(layout)
    if any(d.name == "length" for op in graph.operations for t in op.outputs for d in t.shape):
        return rules
    return LayoutRules([(t, m) for t, m in rules.pairs if t != "length"])
