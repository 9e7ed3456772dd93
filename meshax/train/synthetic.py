"""Synthetic tasks with a known answer.

`MarkovSource`: a random order-k Markov chain over a small vocabulary, with a computable
entropy rate: the best any model can do is a cross-entropy equal to it (after the first k
tokens). `reversal_batch` / `sorting_batch`: sequence-to-sequence tasks scored by exact match.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class MarkovSource:
    """Next token ~ P[previous k tokens]; P drawn from a Dirichlet(alpha), so low alpha = low entropy."""

    def __init__(self, vocab: int = 16, order: int = 2, alpha: float = 0.1, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.vocab, self.order = vocab, order
        self.n_contexts = vocab**order
        self.probs = rng.dirichlet(np.full(vocab, alpha), size=self.n_contexts)
        self.cum = np.cumsum(self.probs, axis=1)
        self.cum[:, -1] = 1.0
        self.stationary = self._stationary()

    def _next_context(self, ctx: np.ndarray, token: np.ndarray) -> np.ndarray:
        return (ctx * self.vocab + token) % self.n_contexts

    def _stationary(self) -> np.ndarray:
        """The chain's stationary distribution over contexts, by power iteration. Context c = a *
        vocab^(k-1) + b goes with token t to b * vocab + t: the mass arriving at each context is a
        sum over the leading token a."""
        pi = np.full(self.n_contexts, 1.0 / self.n_contexts)
        for _ in range(2000):
            new = (pi[:, None] * self.probs).reshape(self.vocab, -1).sum(axis=0)
            if np.abs(new - pi).sum() < 1e-12:
                return new
            pi = new
        return pi

    @property
    def entropy_rate(self) -> float:
        """In nats per token: sum over contexts of pi(context) * H(P[context])."""
        h = -(self.probs * np.log(np.maximum(self.probs, 1e-300))).sum(axis=1)
        return float((self.stationary * h).sum())

    def sample(self, rngs: Sequence[np.random.Generator], length: int) -> np.ndarray:
        """[len(rngs), length] int32 sequences from the stationary distribution, row i drawn
        with rngs[i] (so any subset of a batch's rows can be drawn alone)."""
        ctx = np.array([g.choice(self.n_contexts, p=self.stationary) for g in rngs], np.int64)
        u = np.array([g.random(length) for g in rngs]).reshape(len(rngs), length)
        out = np.empty((len(rngs), length), np.int32)
        for t in range(length):
            token = (u[:, t : t + 1] > self.cum[ctx]).sum(axis=1)
            out[:, t] = token
            ctx = self._next_context(ctx, token)
        return out


def _tokens(rngs: Sequence[np.random.Generator], length: int, vocab: int) -> np.ndarray:
    return np.array([g.integers(2, vocab, size=length) for g in rngs], np.int32).reshape(len(rngs), length)


def reversal_batch(rngs: Sequence[np.random.Generator], length: int, vocab: int, bos: int = 1):
    """Inputs of tokens 2..vocab-1 (row i drawn with rngs[i]); targets are the inputs reversed.
    Returns (inputs, targets_in, targets): targets_in is the target shifted right behind a BOS
    token (teacher forcing)."""
    inputs = _tokens(rngs, length, vocab)
    targets = inputs[:, ::-1].copy()
    return inputs, _shift_right(targets, bos), targets


def sorting_batch(rngs: Sequence[np.random.Generator], length: int, vocab: int, bos: int = 1):
    inputs = _tokens(rngs, length, vocab)
    targets = np.sort(inputs, axis=1)
    return inputs, _shift_right(targets, bos), targets


def _shift_right(targets: np.ndarray, bos: int) -> np.ndarray:
    return np.concatenate([np.full((len(targets), 1), bos, np.int32), targets[:, :-1]], axis=1)


def segmentation_batch(rngs: Sequence[np.random.Generator], size: int, spatial: int, noise: float = 0.6):
    """Images of `spatial` (2 or 3) dims of `size`, each with 1-3 balls of radius size/8 to
    size/4 at random centres; the answer is known: label 1 inside a ball, 0 outside. The image
    is the label plus Gaussian noise of std `noise`, so a pixel alone is ambiguous and the model
    must look at its neighbourhood. Image i is drawn with rngs[i]. Returns (images [len(rngs),
    *size, 1] float32, labels int32)."""
    grid = np.stack(np.meshgrid(*[np.arange(size)] * spatial, indexing="ij"), axis=-1)
    labels = np.zeros((len(rngs),) + (size,) * spatial, np.int32)
    images = np.zeros(labels.shape, np.float32)
    for b, rng in enumerate(rngs):
        for _ in range(rng.integers(1, 4)):
            centre = rng.uniform(0, size, spatial)
            radius = rng.uniform(size / 8, size / 4)
            labels[b] |= (np.linalg.norm(grid - centre, axis=-1) <= radius).astype(np.int32)
        images[b] = labels[b] + rng.normal(0, noise, labels.shape[1:])
    return images[..., None], labels
