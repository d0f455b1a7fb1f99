"""Token sampling inside the compiled step: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Each batch row carries its own parameters. A row's random key is fold_in(key(seed), position): it depends
only on the request's seed and on the position of the token being drawn, never on the batch it shares, so a
seeded request gives the same tokens alone or beside others.

Greedy rows take the argmax and sampled rows add Gumbel noise to their scaled logits in vocabulary order and take
the argmax. Only top-k, top-p and min-p need the vocabulary sorted (85 us for one row on the H200, 606 us for
eight: benchmarks/RESULTS.md), so the sort is built into a program only when asked (`filters`); the scheduler
runs the programs with it only while a request in the batch filters. Both draw the same token for a row that
does not filter, so a seeded request's tokens do not depend on which program ran its step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

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

    @property
    def filtered(self) -> bool:
        """Whether the row needs a program that filters (sample's `filters`): a sampled row with top-k, top-p or
        min-p. Greedy and temperature-only rows draw the same tokens without."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)


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


def kept(scaled: Array, top_k, top_p, min_p) -> Array:
    """Which tokens of the scaled logits [V] top-k, top-p and min-p keep, as a mask in vocabulary order.

    Each filter keeps a prefix of the tokens sorted by probability (ties in vocabulary order): top-k its first
    k; top-p, on the top-k distribution renormalised, the shortest prefix whose mass reaches top_p (the first
    token always); min-p the tokens at least min_p times as likely as the first. So the kept set is the first n
    sorted tokens: those above the n-th one's value t, and the tokens equal to t up to the n-th one's id. This
    needs the full sort, which is why programs built without Want.filters skip it."""
    v = scaled.shape[-1]
    order = jnp.argsort(-scaled)  # stable: equal values keep vocabulary order
    s = scaled[order]
    probs = jax.nn.softmax(s)
    rank = jnp.arange(v)
    keep = (top_k <= 0) | (rank < top_k)
    mass = jnp.where(keep, probs, 0.0)
    mass = mass / jnp.sum(mass)
    keep &= (jnp.cumsum(mass) - mass) < top_p
    keep &= probs >= min_p * probs[0]
    n = jnp.sum(keep)  # >= 1: each filter keeps the first token
    t, last = s[n - 1], order[n - 1]
    return (scaled > t) | ((scaled == t) & (jnp.arange(v) <= last))


def sample_row(logits: Array, temperature, top_k, top_p, min_p, seed, position, filters: bool = True) -> Array:
    """One token id from logits [V] (float32): the argmax at temperature 0, else a draw from the softmax of
    logits / temperature, restricted by top-k, top-p and min-p when `filters` (static; see `kept`). The draw is
    Gumbel noise from fold_in(key(seed), position) added in vocabulary order, so a row whose filters are off
    draws the same token with or without `filters`: a program may leave the sort out when no row needs it."""
    greedy = jnp.argmax(logits).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    if filters:
        scaled = jnp.where(kept(scaled, top_k, top_p, min_p), scaled, -jnp.inf)
    key = jax.random.fold_in(jax.random.key(seed), position)
    drawn = jax.random.categorical(key, scaled).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)


def verify_row(logits: Array, drafts: Array, n_draft, temperature, top_k, top_p, min_p, seed,
               position, filters: bool = True) -> tuple[Array, Array]:
    """Speculative sampling over one sequence's verify step: logits [K+1, V] (float32) after feeding its last
    token and drafts [K] (the first n_draft of them real). Returns (tokens [K+1], accepted): the first
    `accepted` drafts are kept, and tokens[accepted] is the token after them; tokens[i] for i <= accepted
    is what the sequence emits. position: where tokens[0] goes (tokens[i] goes to position + i).

    Drafts are single proposals (a point mass q at d), and a draft is kept exactly when the token that plain
    sampling draws at its position (`sample_row`, the same key) is d. That keeps d with probability p(d)
    under the request's own sampling distribution p (temperature, top-k, top-p, min-p), and at a rejection the
    position emits that draw, which given "not d" follows (p - q)+ renormalised: the speculative-sampling rule,
    with its randomness shared with plain sampling, so a seeded request emits the same tokens with or without
    drafts, whichever were proposed and however many were fed. Greedy (temperature 0): the argmax. filters: as
    in sample_row."""
    k = drafts.shape[0]
    draw = jax.vmap(partial(sample_row, filters=filters), in_axes=(0, None, None, None, None, None, 0))
    tokens = draw(logits, temperature, top_k, top_p, min_p, seed, position + jnp.arange(k + 1))
    ok = (tokens[:k] == drafts) & (jnp.arange(k) < n_draft)
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)))
    return tokens.astype(jnp.int32), accepted.astype(jnp.int32)


def verify(logits: Array, drafts: Array, n_draft: Array, rows: SamplingRows, positions: Array,
           filters: bool = True):
    """verify_row over a batch: logits [B, K+1, V], drafts [B, K], n_draft [B], positions [B]."""
    return jax.vmap(partial(verify_row, filters=filters))(logits.astype(jnp.float32), drafts, n_draft,
                                                          rows.temperature, rows.top_k, rows.top_p, rows.min_p,
                                                          rows.seed, positions)


def sample(logits: Array, rows: SamplingRows, positions: Array, filters: bool = True) -> Array:
    """Token ids [B] from logits [B, V]; positions [B]: the position each drawn token will take. filters
    (static): honour the rows' top-k, top-p and min-p (a sort of the vocabulary per row); without it every row
    draws from its whole distribution at its temperature (greedy rows take the argmax either way)."""
    return jax.vmap(partial(sample_row, filters=filters))(logits.astype(jnp.float32), rows.temperature, rows.top_k,
                                                          rows.top_p, rows.min_p, rows.seed, positions)
