"""Token sampling inside the compiled step: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Each batch row carries its own parameters. A row's random key is fold_in(key(seed), position): it depends
only on the request's seed and on the position of the token being drawn, never on the batch it shares, so a
seeded request gives the same tokens alone or beside others.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ..model.base import Array, pytree_dataclass


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings. temperature 0 is greedy; top_k 0 and top_p 1 and min_p 0 are off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if not (self.temperature >= 0 and self.temperature == self.temperature):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if int(self.top_k) != self.top_k or not 0 <= self.top_k < 2**31:
            raise ValueError(f"top_k must be an integer in [0, 2^31) (0: off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if int(self.seed) != self.seed or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be an integer in [0, 2^32), got {self.seed}")


@pytree_dataclass
class SamplingRows:
    """SamplingParams of every batch row, as device arrays [B]."""

    temperature: Array  # float32
    top_k: Array  # int32
    top_p: Array  # float32
    min_p: Array  # float32
    seed: Array  # uint32

    @staticmethod
    def init(batch: int) -> SamplingRows:
        return SamplingRows(jnp.zeros(batch, jnp.float32), jnp.zeros(batch, jnp.int32), jnp.ones(batch, jnp.float32),
                            jnp.zeros(batch, jnp.float32), jnp.zeros(batch, jnp.uint32))

    @staticmethod
    def of(p: SamplingParams) -> SamplingRows:
        """A single row (scalars) to write into a slot."""
        return SamplingRows(jnp.float32(p.temperature), jnp.int32(p.top_k), jnp.float32(p.top_p),
                            jnp.float32(p.min_p), jnp.uint32(p.seed))


def sample_row(logits: Array, temperature, top_k, top_p, min_p, seed, position) -> Array:
    """One token id from logits [V] (float32)."""
    greedy = jnp.argmax(logits).astype(jnp.int32)
    v = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled)  # descending
    s = scaled[order]
    probs = jax.nn.softmax(s)
    rank = jnp.arange(v)
    keep = (top_k <= 0) | (rank < top_k)
    kept = jnp.where(keep, probs, 0.0)
    kept = kept / jnp.sum(kept)  # top-p acts on the top-k distribution, renormalised
    keep &= (jnp.cumsum(kept) - kept) < top_p  # the smallest prefix reaching top_p (the first token always)
    keep &= probs >= min_p * probs[0]  # min-p: relative to the most likely token
    key = jax.random.fold_in(jax.random.key(seed), position)
    choice = jax.random.categorical(key, jnp.where(keep, s, -jnp.inf))
    return jnp.where(temperature > 0, order[choice].astype(jnp.int32), greedy)


def sample(logits: Array, rows: SamplingRows, positions: Array) -> Array:
    """Token ids [B] from logits [B, V]; positions [B]: the position each drawn token will take."""
    return jax.vmap(sample_row)(logits.astype(jnp.float32), rows.temperature, rows.top_k, rows.top_p, rows.min_p,
                                rows.seed, positions)
