"""The Transformer of the paper (section 9), written once with named dims.

Dims: batch, length (queries), memory_length (keys and values; the encoder's output), d_model,
heads, d_kv, d_ff, vocab. The paper's layouts are one line each:
  data-parallel      "batch:all"
  model-parallel     "vocab:all;d_ff:all;heads:all"
  both, on r x c     "batch:rows;vocab:cols;d_ff:cols;heads:cols"
Every expensive op has exactly one of vocab, d_ff, heads, and no tensor has two, which is why
the model-parallel layout is legal and cheap.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from meshax import initializers
from meshax.core.errors import ConfigError, GraphError, as_flag
from meshax.core.graph import Tensor
from meshax.core.shape import Dimension
from meshax.layers import dense, layer_norm
from meshax.layout import OPEN
from meshax.moe import MoeOutput, moe
from meshax.ops import elementwise as ew
from meshax.ops.attention import fused_attention
from meshax.ops.einsum import einsum
from meshax.ops.indexing import gather
from meshax.ops.inputs import import_tensor
from meshax.ops.inputs import range as mrange
from meshax.ops.layout_ops import mesh_split
from meshax.ops.random import dropout
from meshax.ops.recompute import recompute_grad
from meshax.ops.reduce import softmax
from meshax.ops.shape_ops import rename_dimension
from meshax.ops.variables import get_variable
from meshax.pipeline import pipeline

NEG_INF = -1e9
DTYPES = ("float32", "bfloat16", "float16")  # the computation's (TransformerConfig.dtype)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int = 256
    d_model: int = 64
    d_ff: int = 256
    num_heads: int = 4
    d_kv: int = 16
    num_layers: int = 2  # decoder layers
    num_encoder_layers: int = 0  # 0: a decoder-only language model
    dropout: float = 0.0
    activation: str = "relu"  # or "gelu"
    tie_embeddings: bool = True  # the softmax reuses the (target) embedding table
    positions: str = "sinusoidal"  # or "learned"
    max_length: int = 256  # for learned positions
    layer_norm_epsilon: float = 1e-6
    sharding: str = ""  # "" (the layout rules alone) or one of GSPMD_SHARDINGS: annotations, the rest propagated
    # Pipelining (meshax.pipeline): each stack's layers as `pipeline_stages` stages over a dim
    # "stage" (split it in the layout, e.g. "stage:rows"), the batch in `microbatches`, and with
    # `circular_repeats` > 1 the circular schedule. 0 or 1 stages: no pipeline.
    pipeline_stages: int = 0
    microbatches: int = 1
    circular_repeats: int = 1
    # Mixture of experts (meshax.moe): every other layer's feed-forward block (layers 1, 3, ...)
    # is an MoE layer of `moe_experts` experts of hidden size d_ff, top-2 gated, over groups of
    # `moe_group_size` tokens (0: a whole sequence); its balancing loss, times
    # `moe_loss_coef`, joins the training loss.
    moe_experts: int = 0
    moe_capacity_factor: float = 1.25
    moe_group_size: int = 0
    moe_loss_coef: float = 0.01
    # Mixed precision (Mesh-TensorFlow's variable dtypes): variables and optimizer state stay
    # float32 (the master weights); with dtype "bfloat16" (or "float16") the activations and
    # matmuls are bfloat16 (float16), the weights cast to it where used, while layer-norm
    # statistics, softmax, logits and loss are float32 and every weight gradient is summed in
    # float32. meshax.train trains a float16 model with dynamic loss scaling
    # (optimize.LossScaleOptimizer), as float16's range needs.
    dtype: str = "float32"
    # "einsum": attention as two einsums and a softmax (any layout, dropout on the weights);
    # "fused": one jax.nn.dot_product_attention per device (cuDNN on a GPU, XLA elsewhere),
    # which needs the sequence and d_kv dims whole on each device (batch and heads may be split)
    attention: str = "einsum"
    # Rematerialization (Mesh-TensorFlow's recompute_grad): each layer's activations are
    # recomputed in the backward pass from its input, so only the layers' inputs are kept
    remat: bool = False

    def __post_init__(self):
        for field in ("tie_embeddings", "remat"):  # (frozen: set as the bool it was checked to be)
            object.__setattr__(self, field, as_flag(getattr(self, field), f"TransformerConfig: {field}"))
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r}: use one of {', '.join(map(repr, DTYPES))}")
        if self.attention not in ("einsum", "fused"):
            raise ConfigError(f"attention {self.attention!r}: use 'einsum' or 'fused'")
        if self.attention == "fused" and self.dropout:
            raise ConfigError(
                "fused attention has no dropout on the attention weights: use attention='einsum' "
                "with dropout, or dropout=0"
            )
        for field, least in (("pipeline_stages", 0), ("microbatches", 1), ("circular_repeats", 1), ("moe_experts", 0)):
            # (a negative count turned the pipeline off without a word; 0 repeats divided by zero)
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < least:
                raise ConfigError(f"TransformerConfig: {field}={value!r} must be a whole number of at least {least}")
        for field in ("moe_loss_coef", "layer_norm_epsilon"):  # (nan, or a negative epsilon, made every loss nan)
            value = getattr(self, field)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float | np.floating | np.integer)
                or not (math.isfinite(value) and value >= 0)
            ):
                raise ConfigError(f"TransformerConfig: {field}={value!r} must be a finite number >= 0")
        if self.microbatches > 1 and self.pipeline_stages <= 1:  # (as circular_repeats: it was ignored)
            raise ConfigError("microbatches needs pipeline_stages > 1 (without a pipeline the batch is not cut)")
        stacks = [("num_layers", self.num_layers)]
        if self.num_encoder_layers:
            stacks.append(("num_encoder_layers", self.num_encoder_layers))
        if self.pipeline_stages > 1:
            blocks = self.pipeline_stages * self.circular_repeats
            for field, layers in stacks:
                if layers % blocks:
                    raise ConfigError(
                        f"{self.pipeline_stages} pipeline stages x {self.circular_repeats} circular repeats do not "
                        f"divide the {layers} layers ({field}): each stage runs the same number of layers"
                    )
            if self.moe_experts:
                raise ConfigError("MoE layers inside a pipeline are not supported: use moe_experts or pipeline_stages")
        if self.moe_experts == 1:  # (found when the layer was built, naming the layer's gating)
            raise ConfigError(
                "moe_experts=1: an MoE layer's top-2 gating sends each token to 2 experts: give 2 or more "
                "(or 0: dense feed-forward layers)"
            )
        if self.remat and (self.pipeline_stages > 1 or self.moe_experts):
            raise ConfigError(
                "remat is for plain layer stacks: a pipeline already recomputes each stage in its backward "
                "pass, and MoE layers' balancing losses cannot leave a recomputed layer"
            )
        if self.circular_repeats > 1 and self.pipeline_stages <= 1:
            raise ConfigError("circular_repeats needs pipeline_stages > 1")

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer` of a stack has an MoE feed-forward block (every other layer)."""
        return bool(self.moe_experts) and layer % 2 == 1

    def parameter_count(self) -> int:
        """Parameters, computed from the config (tests check it against the built graph)."""
        d, f, hk = self.d_model, self.d_ff, self.num_heads * self.d_kv
        attention = 4 * d * hk
        norm = 2 * d

        def ffn(layers: int) -> int:  # dense: kernels and biases; MoE: the gate and the experts' kernels
            moe = sum(self.is_moe(i) for i in range(layers))
            return (layers - moe) * (2 * d * f + f + d) + moe * (d * self.moe_experts + self.moe_experts * 2 * d * f)

        enc = (
            self.num_encoder_layers * (attention + 2 * norm) + ffn(self.num_encoder_layers)
            if self.num_encoder_layers
            else 0
        ) + (norm if self.num_encoder_layers else 0)
        dec = (
            self.num_layers
            * (attention * (2 if self.num_encoder_layers else 1) + norm * (3 if self.num_encoder_layers else 2))
            + ffn(self.num_layers)
            + norm
        )
        embeddings = self.vocab_size * d * (2 if self.num_encoder_layers else 1)
        softmax_weights = 0 if self.tie_embeddings else self.vocab_size * d
        positions = self.max_length * d * (2 if self.num_encoder_layers else 1) if self.positions == "learned" else 0
        return enc + dec + embeddings + softmax_weights + positions


def _paper(d_ff, heads, d_kv=128):  # (the table's last row, d_kv 64, states 0.21B for what counts 0.24B here)
    """Table 3 of the paper: WMT14 encoder-decoder, d_model 1024, 6 + 6 layers, 32k vocab."""
    return TransformerConfig(
        vocab_size=32768,
        d_model=1024,
        d_ff=d_ff,
        num_heads=heads,
        d_kv=d_kv,
        num_layers=6,
        num_encoder_layers=6,
        max_length=256,
    )


_WEIGHTS = {"d_model": "x", "heads": "y", "d_ff": "y"}  # W_Q, W_K, W_V (MND), W_O (NDM), W_in (MH), W_out (HM)
# Table 1 of the GSPMD paper, by dim name (B batch, S length, M d_model, N heads, D d_kv, H d_ff) on a
# mesh with dims x and y. Each entry annotates one kind of tensor; whatever it does not name is
# replicated, and every tensor the table does not name is left to propagation.
GSPMD_SHARDINGS: dict[str, dict[str, dict[str, str]]] = {
    "gspmd-2d-attempt1": {"weights": _WEIGHTS, "BSM": {"d_model": "x"}, "BSND": {"heads": "y"}, "BSH": {"d_ff": "y"}},
    "gspmd-2d-attempt2": {
        "weights": _WEIGHTS,
        "BSM": {"batch": "x"},
        "BSND": {"batch": "x", "heads": "y"},
        "BSH": {"batch": "x", "d_ff": "y"},
    },
    "gspmd-2d-finalized": {
        "weights": _WEIGHTS,
        "BSM": {"batch": "x", "d_model": "y"},
        "BSND": {"batch": "x", "heads": "y"},
        "BSH": {"batch": "x", "d_ff": "y"},
    },
}


def _gspmd(layers: int, d_model: int, d_ff: int, heads: int = 128, d_kv: int = 256) -> TransformerConfig:
    """Table 2 of the GSPMD paper: D 256, vocab 32000; each layer holds 4MND + 2MH weights (2^31
    for M 8192, H 65536, N 128; the 1T model's 2^33 needs N 256 beside its M and H)."""
    return TransformerConfig(
        vocab_size=32000, d_model=d_model, d_ff=d_ff, num_heads=heads, d_kv=d_kv, num_layers=layers, max_length=1024
    )


PRESETS: dict[str, TransformerConfig] = {
    "tiny": TransformerConfig(vocab_size=256, d_model=64, d_ff=256, num_heads=4, d_kv=16, num_layers=2),
    "small": TransformerConfig(vocab_size=256, d_model=128, d_ff=512, num_heads=8, d_kv=16, num_layers=4),
    "paper-ff2048": _paper(2048, 4),
    "paper-ff4096": _paper(4096, 8),
    "paper-ff8192": _paper(8192, 16),
    "paper-ff16384": _paper(16384, 32),
    "paper-ff32768": _paper(32768, 64),
    "paper-ff65536": _paper(65536, 128),
    "gspmd-64b": _gspmd(32, 8192, 65536),
    "gspmd-128b": _gspmd(64, 8192, 65536),
    "gspmd-256b": _gspmd(128, 8192, 65536),
    "gspmd-512b": _gspmd(256, 8192, 65536),
    "gspmd-1t": _gspmd(128, 16384, 131072, heads=256),
    # Section 5.1's "8x narrower" model (Table 3), pipelined in Table 4: M 4096, H 16384, N 64, D 128,
    # 64 layers of 4MND + 2MH = 2^28 weights each, "16 billion" (2^34) in all
    "gspmd-16b-narrow": _gspmd(64, 4096, 16384, heads=64, d_kv=128),
}
# Parameters (billions) of Table 3, next to each paper preset.
PAPER_PARAMETERS = {
    "paper-ff2048": 0.15,
    "paper-ff4096": 0.24,
    "paper-ff8192": 0.42,
    "paper-ff16384": 0.77,
    "paper-ff32768": 1.48,
    "paper-ff65536": 2.89,
}


@functools.lru_cache(maxsize=8)
def _sinusoids(length: int, d_model: int) -> np.ndarray:
    """The sinusoidal position table [length, d_model], read-only: a model is built many times over
    (a layout search builds it once per candidate depth), and at the papers' sizes (1024 x 8192)
    the table takes a third of a second to compute."""
    pos = np.arange(length)[:, None]
    i = np.arange(d_model // 2)[None, :]
    angles = pos / np.power(10000.0, 2 * i / d_model)
    table = np.concatenate([np.sin(angles), np.cos(angles)], axis=1).astype(np.float32)
    table.setflags(write=False)
    return table


class Transformer:
    """Builds the model's graph. Variables are created on first use, under `name/`."""

    def __init__(self, config: TransformerConfig, mesh, name: str = "transformer"):
        self.config = config
        self.mesh = mesh
        self.name = name
        c = config
        self.d_model = Dimension("d_model", c.d_model)
        self.heads = Dimension("heads", c.num_heads)
        self.d_kv = Dimension("d_kv", c.d_kv)
        self.d_ff = Dimension("d_ff", c.d_ff)
        self.vocab = Dimension("vocab", c.vocab_size)
        self.dtype = np.dtype(c.dtype)  # (one of DTYPES: NumPy knows "bfloat16" once JAX is imported)
        self._vars: dict[str, Tensor] = {}
        if c.sharding and c.sharding not in GSPMD_SHARDINGS:
            raise ConfigError(
                f"unknown sharding {c.sharding!r}; choose one of {sorted(GSPMD_SHARDINGS)} or '' "
                "(the layout rules alone)"
            )
        self._sharding = GSPMD_SHARDINGS.get(c.sharding, {})
        self.moe_outputs: list[MoeOutput] = []  # the MoE layers' losses and dropped fractions

    def annotate(self, x: Tensor, kind: str) -> Tensor:
        """x annotated as the configured GSPMD sharding says for `kind` (weights, BSM, BSND, BSH);
        x itself without one. A pipeline's stage and repeat dims are left to the layout rules."""
        spec = self._sharding.get(kind)
        if spec is None:
            return x
        return mesh_split(x, [OPEN if d.name in ("stage", "repeat") else spec.get(d.name) for d in x.shape])

    # ---- pieces -------------------------------------------------------------------------------
    def _var(self, name, shape, init):
        """The model's variable `name`, created on first use and shared after (tied embeddings)."""
        if name not in self._vars:
            self._vars[name] = get_variable(self.mesh, f"{self.name}/{name}", shape, initializer=init)
        return self._vars[name]

    def _compute(self, x: Tensor) -> Tensor:
        """x in the computation's dtype (a float32 weight cast to bfloat16 where it is used)."""
        return ew.cast(x, self.dtype)

    def _wide(self) -> np.dtype | None:
        """The dtype of the sums that stay float32 (logits) in mixed precision; None in float32."""
        return np.dtype(np.float32) if self.dtype != np.float32 else None

    def _drop(self, x: Tensor) -> Tensor:
        return dropout(x, self.config.dropout) if self.config.dropout else x

    def _table(self, name: str) -> Tensor:
        """An embedding table, N(0, 1/d_model): times sqrt(d_model) on input it has unit scale,
        like the positional signal added to it; as the tied softmax weights, unit-scale logits."""
        return self._var(name, [self.vocab, self.d_model], initializers.normal(1.0 / math.sqrt(self.config.d_model)))

    def embed(self, ids: Tensor, table_name: str, length: Dimension) -> Tensor:
        """ids [batch, length] -> embeddings [batch, length, d_model]: scaled by sqrt(d_model),
        plus positions, then dropout."""
        x = gather(self._compute(self._table(table_name)), ids, self.vocab) * math.sqrt(self.config.d_model)
        return self._drop(x + self._compute(self.positions(length, table_name)))

    def positions(self, length: Dimension, prefix: str) -> Tensor:
        """The position encodings [length, d_model]: learned (a table per prefix) or sinusoidal, per the config."""
        if self.config.positions == "learned":
            if length.size > self.config.max_length:
                raise GraphError(f"sequence length {length.size} exceeds max_length {self.config.max_length}")
            table = self._var(
                f"{prefix}_positions",
                [Dimension("max_length", self.config.max_length), self.d_model],
                initializers.normal(0.02),
            )
            from meshax.ops.slicing import slice as mslice

            return rename_dimension(mslice(table, 0, length.size, "max_length"), "max_length", length.name)
        table = _sinusoids(length.size, self.config.d_model)
        return import_tensor(self.mesh, table, [length, self.d_model], name="sinusoid")

    def attention(self, x: Tensor, memory: Tensor, bias: Tensor | None, name: str, causal: bool = False) -> Tensor:
        """Multi-head attention of x [.., length, d_model] over memory [.., memory_length, d_model].

        `bias`: einsum attention's float bias (0 or -inf; the causal one included) or, fused, a
        bool mask of the keys seen; `causal`: fused attention's own causal mask."""
        dims = [self.d_model, self.heads, self.d_kv]
        std = 1.0 / math.sqrt(self.config.d_model)
        weight = lambda *a: self._compute(self.annotate(self._var(*a), "weights"))  # noqa: E731
        wq = weight(f"{name}/q", dims, initializers.normal(std / math.sqrt(self.config.d_kv)))
        wk = weight(f"{name}/k", dims, initializers.normal(std))
        wv = weight(f"{name}/v", dims, initializers.normal(std))
        wo = weight(
            f"{name}/o",
            [self.heads, self.d_kv, self.d_model],
            initializers.normal(1.0 / math.sqrt(self.config.num_heads * self.config.d_kv)),
        )
        q = self.annotate(einsum(x, wq, reduced_dims=[self.d_model]), "BSND")
        k = self.annotate(einsum(memory, wk, reduced_dims=[self.d_model]), "BSND")
        v = self.annotate(einsum(memory, wv, reduced_dims=[self.d_model]), "BSND")
        memory_length = memory.shape.get_dim_by_name("memory_length")
        if self.config.attention == "fused":
            out = fused_attention(q, k, v, self.d_kv, self.heads, mask=bias, causal=causal, scale=1.0)
        else:
            # [..., heads, length, memory_length]: the order the batched matmul produces (and XLA's
            # own partitioner keeps), so no transpose of the largest activation; float32 in mixed precision
            length = q.shape.get_dim_by_name("length")
            order = [d for d in q.shape if d not in (length, self.heads, self.d_kv)] + [
                self.heads,
                length,
                memory_length,
            ]
            logits = einsum(q, k, output_shape=order, dtype=self._wide())
            if bias is not None:
                logits = logits + bias
            weights = self._compute(self._drop(softmax(logits, memory_length)))
            out = einsum(weights, v, reduced_dims=[memory_length])
        return einsum(out, wo, reduced_dims=[self.heads, self.d_kv])

    def feed_forward(self, x: Tensor, name: str) -> Tensor:
        """The feed-forward block: dense to d_ff with the activation, then back to d_model."""
        act = ew.relu if self.config.activation == "relu" else ew.gelu
        weights = lambda w: self.annotate(w, "weights")  # noqa: E731
        h = dense(
            x,
            self.d_ff,
            reduced_dims=[self.d_model],
            activation=act,
            name=f"{self.name}/{name}/wi",
            kernel_annotation=weights,
        )
        h = self._drop(self.annotate(h, "BSH"))
        return dense(
            h, self.d_model, reduced_dims=[self.d_ff], name=f"{self.name}/{name}/wo", kernel_annotation=weights
        )

    def norm(self, x: Tensor, name: str) -> Tensor:
        """Layer norm over d_model, with its scale and bias named after `name`."""
        return layer_norm(x, self.d_model, self.config.layer_norm_epsilon, name=f"{self.name}/{name}")

    @staticmethod
    def as_memory(x: Tensor) -> Tensor:
        """x with its `length` dim renamed `memory_length`: the keys and values of attention."""
        return rename_dimension(x, "length", "memory_length")

    def self_bias(self, length: Dimension) -> Tensor | None:
        """The decoder's self-attention bias: the causal one (einsum attention); none where
        fused attention applies its own causal mask."""
        return None if self.config.attention == "fused" else self.causal_bias(length)

    def causal_bias(self, length: Dimension) -> Tensor:
        """[memory_length, length]: -inf where a key is in a query's future, else 0."""
        memory_length = Dimension("memory_length", length.size)
        future = ew.greater(mrange(self.mesh, memory_length), mrange(self.mesh, length))
        return ew.where(future, NEG_INF, 0.0)

    def padding_bias(self, ids: Tensor, pad_id: int = 0) -> Tensor:
        """[batch, memory_length]: -inf on keys that are padding (fused attention: a bool mask,
        True on the keys that are not)."""
        pad = ew.equal(self.as_memory(ids), pad_id)
        return ew.logical_not(pad) if self.config.attention == "fused" else ew.where(pad, NEG_INF, 0.0)

    def moe(self, x: Tensor, name: str, group_size: int | None = None, capacity_factor: float | None = None) -> Tensor:
        """The MoE feed-forward block (meshax.moe), over groups of `group_size` tokens at
        `capacity_factor` (default: the config's); its loss and dropped fraction are kept in
        `moe_outputs` for the task."""
        c = self.config
        out = moe(
            x,
            self.d_ff.size,
            c.moe_experts,
            group_size=group_size or c.moe_group_size or None,
            capacity_factor=capacity_factor or c.moe_capacity_factor,
            model_dim="d_model",
            activation=ew.relu if c.activation == "relu" else ew.gelu,
            name=f"{self.name}/{name}",
        )
        self.moe_outputs.append(out)
        return out.output

    def layers(self, x: Tensor, count: int, prefix: str, self_bias, memory=None, memory_bias=None) -> Tensor:
        """`count` Transformer layers: self-attention (with `self_bias`), cross-attention to
        `memory` if given, and feed-forward (MoE on odd layers, if configured), each pre-normed
        and with a residual."""
        causal = prefix == "decoder"  # (the encoder's self-attention sees the whole input)

        def layer(x: Tensor, i: int) -> Tensor:
            y = self.norm(x, f"{prefix}/{i}/self_attention_norm")
            x = x + self._drop(self.attention(y, self.as_memory(y), self_bias, f"{prefix}/{i}/self_attention", causal))
            if memory is not None:
                y = self.norm(x, f"{prefix}/{i}/cross_attention_norm")
                x = x + self._drop(self.attention(y, memory, memory_bias, f"{prefix}/{i}/cross_attention"))
            y = self.norm(x, f"{prefix}/{i}/ffn_norm")
            block = self.moe if self.config.is_moe(i) else self.feed_forward
            return x + self._compute(self._drop(block(y, f"{prefix}/{i}/ffn")))

        for i in range(count):
            x = self.annotate(x, "BSM")
            if self.config.remat:  # (recomputed in the backward pass: only x is kept)
                x = recompute_grad(lambda x, i=i: layer(x, i), [x], name=f"{prefix}/{i}/remat")
            else:
                x = layer(x, i)
        return x

    def stack(self, x: Tensor, layers: int, prefix: str, self_bias, memory=None, memory_bias=None) -> Tensor:
        """`layers` Transformer layers (`layers`) and the final norm; with pipeline stages in the
        config, as a pipeline (meshax.pipeline) over a dim "stage": stage s runs layers s*k ..
        s*k + k - 1 (k = layers / stages; circular: the blocks s, s + S, ...), each with its own
        weights [stage, ...]; the inputs that have the batch dim go in by microbatch."""
        c = self.config
        if c.pipeline_stages <= 1:
            return self.norm(self.layers(x, layers, prefix, self_bias, memory, memory_bias), f"{prefix}/final_norm")
        batch = x.shape[0].name
        extras = [self_bias, memory, memory_bias]
        sides = [i for i, t in enumerate(extras) if t is not None and batch in t.shape]

        def stage_fn(h: Tensor, *per_stage: Tensor) -> Tensor:
            args = list(extras)
            for i, t in zip(sides, per_stage):
                args[i] = t
            return self.layers(h, layers // (c.pipeline_stages * c.circular_repeats), prefix, *args)

        schedule = "circular" if c.circular_repeats > 1 else "gpipe"
        x = pipeline(
            stage_fn,
            [x, *[extras[i] for i in sides]],
            Dimension("stage", c.pipeline_stages),
            c.microbatches,
            schedule,
            c.circular_repeats,
            name=f"{prefix}_pipeline",
        )
        return self.norm(x, f"{prefix}/final_norm")

    def logits(self, x: Tensor, table_name: str) -> Tensor:
        """x [..., d_model] -> logits [..., vocab]: the embedding table (tied) or a softmax weight."""
        if self.config.tie_embeddings:
            w = self._table(table_name)
        else:
            w = self._var(
                "softmax", [self.d_model, self.vocab], initializers.normal(1.0 / math.sqrt(self.config.d_model))
            )
        return einsum(x, self._compute(w), reduced_dims=[self.d_model], dtype=self._wide())

    # ---- models -------------------------------------------------------------------------------
    def language_model(self, ids: Tensor) -> Tensor:
        """Decoder-only LM: ids [batch, length] -> logits [batch, length, vocab] (causal)."""
        length = ids.shape.get_dim_by_name("length")
        x = self.embed(ids, "embedding", length)
        x = self.stack(x, self.config.num_layers, "decoder", self.self_bias(length))
        return self.logits(x, "embedding")

    def encoder_decoder(self, inputs: Tensor, targets_in: Tensor, pad_id: int | None = 0) -> Tensor:
        """inputs [batch, length_in] and shifted targets [batch, length] -> logits [batch, length, vocab].

        The encoder's sequence dim must be named "length" too (its own size); its output becomes
        the decoder's memory over "memory_length"."""
        if not self.config.num_encoder_layers:
            raise ConfigError("encoder_decoder needs num_encoder_layers > 0 in the config")
        enc_len = inputs.shape.get_dim_by_name("length")
        pad = self.padding_bias(inputs, pad_id) if pad_id is not None else None
        x = self.embed(inputs, "input_embedding", enc_len)
        memory = self.as_memory(self.stack(x, self.config.num_encoder_layers, "encoder", pad))
        length = targets_in.shape.get_dim_by_name("length")
        y = self.embed(targets_in, "target_embedding", length)
        y = self.stack(y, self.config.num_layers, "decoder", self.self_bias(length), memory, pad)
        return self.logits(y, "target_embedding")


__all__ = ["GSPMD_SHARDINGS", "PAPER_PARAMETERS", "PRESETS", "Transformer", "TransformerConfig"]
