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


def _filtered(logits: Array, temperature, top_k, top_p, min_p):
    """The sampling distribution of logits [V]: (order, the sorted scaled logits, which of them are kept)."""
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
    return order, s, keep


def _draw(order, s, keep, greedy, temperature, seed, position) -> Array:
    """The token at `position` from a filtered distribution (_filtered), or `greedy` at temperature 0."""
    key = jax.random.fold_in(jax.random.key(seed), position)
    choice = jax.random.categorical(key, jnp.where(keep, s, -jnp.inf))
    return jnp.where(temperature > 0, order[choice].astype(jnp.int32), greedy)


def sample_row(logits: Array, temperature, top_k, top_p, min_p, seed, position) -> Array:
    """One token id from logits [V] (float32)."""
    greedy = jnp.argmax(logits).astype(jnp.int32)
    return _draw(*_filtered(logits, temperature, top_k, top_p, min_p), greedy, temperature, seed, position)


def verify_row(logits: Array, drafts: Array, n_draft, temperature, top_k, top_p, min_p, seed,
               position) -> tuple[Array, Array]:
    """Speculative sampling over one sequence's verify step: logits [K+1, V] (float32) after feeding its last
    token and drafts [K] (the first n_draft of them real). Returns (tokens [K+1], accepted): the first
    `accepted` drafts are kept, and tokens[accepted] is the token after them; tokens[i] for i <= accepted
    is what the sequence emits. position: where tokens[0] goes (tokens[i] goes to position + i).

    Drafts are single proposals (a point mass q at d), and a draft is kept exactly when the token that plain
    sampling draws at its position (`sample_row`, the same key) is d. That keeps d with probability p(d)
    under the request's own sampling distribution p (temperature, top-k, top-p, min-p), and at a rejection the
    position emits that draw, which given "not d" follows (p - q)+ renormalised: the speculative-sampling rule,
    with its randomness shared with plain sampling, so a seeded request emits the same tokens with or without
    drafts, whichever were proposed and however many were fed. Greedy (temperature 0): the argmax."""
    k = drafts.shape[0]
    draw = jax.vmap(sample_row, in_axes=(0, None, None, None, None, None, 0))
    tokens = draw(logits, temperature, top_k, top_p, min_p, seed, position + jnp.arange(k + 1))
    ok = (tokens[:k] == drafts) & (jnp.arange(k) < n_draft)
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)))
    return tokens.astype(jnp.int32), accepted.astype(jnp.int32)


def verify(logits: Array, drafts: Array, n_draft: Array, rows: SamplingRows, positions: Array):
    """verify_row over a batch: logits [B, K+1, V], drafts [B, K], n_draft [B], positions [B]."""
    return jax.vmap(verify_row)(logits.astype(jnp.float32), drafts, n_draft, rows.temperature, rows.top_k,
                                rows.top_p, rows.min_p, rows.seed, positions)


def sample(logits: Array, rows: SamplingRows, positions: Array) -> Array:
    """Token ids [B] from logits [B, V]; positions [B]: the position each drawn token will take."""
    return jax.vmap(sample_row)(logits.astype(jnp.float32), rows.temperature, rows.top_k, rows.top_p, rows.min_p,
                                rows.seed, positions)
