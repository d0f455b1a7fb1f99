"""Speculative decoding's drafts, proposed on the device: n-gram (prompt lookup) proposals from each sequence's
own tokens, or the model's MTP head chained K times.

A verify step (runner.verify_step) feeds every speculating sequence its last token and up to K drafts, and keeps
the longest prefix that sampling accepts (sampling.verify_row) plus one more token. Its drafts come from here,
proposed at the end of the program that produced the last token (prefill's last chunk, a decode or a verify
step), so the next step's drafts are already on the device and steps stay overlapped.

n-gram: the sequence's tokens so far sit in a device array by position (SpecState.history), and the proposal is
what followed the latest earlier occurrence of the sequence's last n tokens (n from NGRAM_MAX down to NGRAM_MIN).
Repetitive text (code edits, quoting, structured output, a summary of the prompt) finds long matches; new prose
finds none and gets zero drafts, which makes its row a plain decode row.

MTP (mtp_chain): the step runs the head on every kept pair (the main model's state at t, the token at t+1), so its
KV pages end where the sequence ends; its guess from the last kept pair is the first draft, and each further
draft runs the head once more on (its previous output state, its previous draft), one position on. A plain decode
step does not run the head: it keeps its pair (HeadLag), and catch_up runs the head over the kept pairs of every
slot at once, so that an engine whose drafts do not pay runs plain steps at a plain engine's cost: when LAG_ROWS
are kept, and before a verify step, whose drafts the head then chains from the last kept pair (runner.catch_up).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from ..config import ModelConfig
from ..model import mtp as mtp_mod
from ..model.base import Array, TokenBatch, pytree_dataclass
from ..model.transformer import LayerState, Params

LAG_ROWS = 16  # the pairs a slot's HeadLag keeps: the most plain steps between two catch-ups, the rows of each
NGRAM_MAX = 3  # the longest suffix looked up
NGRAM_MIN = 2  # the shortest (single tokens match too often to be worth a verify row)


def catch_up_due(lag: int, verifying: bool) -> bool:
    """Whether a head that lags `lag` plain steps catches up before the next step: before a verify step as soon
    as it lags at all (the step needs the head's KV whole and drafts from the last pair), else once its pairs
    fill (LAG_ROWS). The Scheduler's rule, shared with the benchmarks that time plain steps as it runs them."""
    return lag >= (1 if verifying else LAG_ROWS)


@pytree_dataclass
class SpecState:
    """Per-slot drafting state (leading axis = batch slot)."""

    history: Array  # [B, W] int32: the sequence's tokens by position, its last (not yet fed) token included
    # (n-gram drafts; W = 0 for MTP drafts)
    drafts: Array  # [B, K] int32: the next verify step's drafts
    n_draft: Array  # [B] int32: how many of them are real

    @staticmethod
    def empty(batch: int, width: int, k: int) -> SpecState:
        return SpecState(jnp.zeros((batch, width), jnp.int32), jnp.zeros((batch, k), jnp.int32),
                         jnp.zeros(batch, jnp.int32))


@pytree_dataclass
class HeadLag:
    """The pairs an MTP engine's plain decode steps kept for its head instead of running it (leading axis = batch
    slot): the pair of position t (the main model's state at t, the token sampled after it) at row t % LAG_ROWS.
    The head's KV pages hold the pairs of positions below `length`; catch_up runs it over the rest."""

    hidden: Array  # [B, R, W]: the main model's pre-mixer state (the dtype of the step's residual)
    tokens: Array  # [B, R] int32
    length: Array  # [B] int32

    @staticmethod
    def empty(batch: int, width: int, dtype) -> HeadLag:
        return HeadLag(jnp.zeros((batch, LAG_ROWS, width), dtype), jnp.zeros((batch, LAG_ROWS), jnp.int32),
                       jnp.zeros(batch, jnp.int32))


def keep_pairs(lag: HeadLag, hidden: Array, tokens: Array, positions: Array, live: Array) -> HeadLag:
    """A plain step's pairs into slots [0, b) of lag: hidden [b, W] and tokens [b] at positions [b]; slots not
    live keep theirs. The caller makes sure that no slot keeps more than LAG_ROWS pairs (Scheduler)."""
    b, r = hidden.shape[0], lag.tokens.shape[1]
    slots, cols = jnp.arange(b), jnp.where(live, positions % r, r)  # column r: dropped
    return HeadLag(lag.hidden.at[slots, cols].set(hidden.astype(lag.hidden.dtype), mode="drop"),
                   lag.tokens.at[slots, cols].set(tokens.astype(jnp.int32), mode="drop"), lag.length)


def caught_up(lag: HeadLag, lengths: Array, live: Array) -> HeadLag:
    """lag after a step that ran the head over every pair of slots [0, b) up to lengths [b] (where live)."""
    b = lengths.shape[0]
    return dataclasses.replace(lag, length=lag.length.at[:b].set(jnp.where(live, lengths, lag.length[:b])))


def catch_up(params: Params, cfg: ModelConfig, lag: HeadLag, lengths: Array, live: Array, page_table: Array,
             state: LayerState) -> tuple[HeadLag, LayerState, Array]:
    """The head over the kept pairs of slots [0, b) (lengths [b]: where each sequence ends; page_table [b, P]),
    as one chunk of LAG_ROWS rows per slot: each live slot's pairs from lag.length to its length, in order
    (rows past them are padding, which writes nothing). Returns (the lag with nothing kept, the head's state,
    how many pairs each slot had kept [b]).
    Only the head's KV pages are kept, so XLA computes the layer's K and V rows alone, not its MoE."""
    b, r = lengths.shape[0], lag.tokens.shape[1]
    start = lag.length[:b]
    n = jnp.where(live, lengths - start, 0)
    cols = (start[:, None] + jnp.arange(r)) % r  # the pair of position start + i sits at column (start + i) % r
    hidden = jnp.take_along_axis(lag.hidden[:b], cols[:, :, None], axis=1)
    tokens = jnp.take_along_axis(lag.tokens[:b], cols, axis=1)
    _, state, _ = mtp_mod.mtp_layer(params, cfg, hidden, tokens, TokenBatch.after(start, n, r, page_table), state)
    return caught_up(lag, lengths, live), state, n


def draft_after_lag(params: Params, cfg: ModelConfig, lag: HeadLag, lengths: Array, live: Array, limit: Array,
                    page_table: Array, state: LayerState, k: int) -> tuple[SpecState, LayerState]:
    """After catch_up, the drafts of slots [0, b) that had kept pairs (live [b]): the head run once more on each
    one's last pair, the one at position lengths - 1, whose output gives the first draft, then mtp_chain (limit,
    page_table, k as there). That pair's KV row is written again, with the same values up to rounding: running
    the layer on it alone costs one row of its MoE, where catch_up's output at every row of its chunk would cost
    all of them."""
    b, r = lengths.shape[0], lag.tokens.shape[1]
    slots, col = jnp.arange(b), (lengths - 1) % r
    batch = TokenBatch.after(lengths - 1, live.astype(jnp.int32), 1, page_table)
    h, state, _ = mtp_mod.mtp_layer(params, cfg, lag.hidden[slots, col][:, None], lag.tokens[slots, col][:, None],
                                    batch, state)
    hm = h[:, 0]
    spec, state, _ = mtp_chain(params, cfg, hm, greedy(mtp_mod.mtp_logits(params, cfg, hm)), lengths, limit,
                               page_table, state, k, live)
    return spec, state


def history_width(max_seq_len: int, chunk: int, k: int) -> int:
    """Columns of SpecState.history: every position, plus room for the widest write (a prefill chunk or a
    verify step's K+1 tokens) starting at the last one, so that no dynamic update is shifted by clamping."""
    return max_seq_len + max(chunk, k + 1)


def write(history: Array, start: Array, tokens: Array) -> Array:
    """history [W] with tokens [n] at positions start ... start + n - 1."""
    return lax.dynamic_update_slice_in_dim(history, tokens.astype(jnp.int32), start, axis=0)


def propose(history: Array, last: Array, capacity: Array, k: int) -> tuple[Array, Array]:
    """Drafts for one sequence whose tokens are history[0 .. last] (history [W] int32): (drafts [k] int32,
    how many are real). capacity: positions the sequence may write (its KV pages); the verify step writes
    positions last .. last + n, so n <= capacity - last - 1."""
    w = history.shape[0]
    pos = jnp.arange(w)
    best = jnp.int32(-1)
    for n in range(NGRAM_MIN, NGRAM_MAX + 1):  # longer suffixes win: later n overrides where it matches
        match = (pos >= n - 1) & (pos < last)
        for o in range(n):
            tail = lax.dynamic_index_in_dim(history, jnp.maximum(last - o, 0), keepdims=False)
            match &= jnp.roll(history, o) == tail  # history[j - o] == history[last - o]
        j = jnp.max(jnp.where(match, pos, -1)).astype(jnp.int32)
        best = jnp.where(j >= 0, j, best)
    start = jnp.maximum(best + 1, 0)
    drafts = lax.dynamic_slice_in_dim(jnp.concatenate([history, jnp.zeros(k, jnp.int32)]), start, k)
    n = jnp.where(best >= 0, jnp.minimum(k, last - best), 0)  # only tokens up to `last` exist
    n = jnp.clip(jnp.minimum(n, capacity - last - 1), 0, k)
    return drafts, n.astype(jnp.int32)


def propose_rows(spec: SpecState, last: Array, capacity: Array, live: Array) -> SpecState:
    """propose() for every row: last [B] (the position of each row's last token), capacity [B], live [B]
    (rows that decode; the others get zero drafts)."""
    k = spec.drafts.shape[-1]
    drafts, n = jax.vmap(lambda h, l, c: propose(h, l, c, k))(spec.history, last, capacity)
    return SpecState(spec.history, drafts, jnp.where(live, n, 0))


def advance(spec: SpecState, start: Array, tokens: Array, last: Array, capacity: Array, live: Array) -> SpecState:
    """After a decode or verify step: each live row's new tokens [B, n] into its history from position start
    [B] (rows not live keep theirs), then the next drafts (propose_rows)."""
    hist = jax.vmap(write)(spec.history, start, tokens)
    hist = jnp.where(live[:, None], hist, spec.history)
    return propose_rows(SpecState(hist, spec.drafts, spec.n_draft), last, capacity, live)


def greedy(logits: Array) -> Array:
    """The MTP head's draft: its most likely token (drafts are single proposals; sampling.verify_row)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def mtp_chain(params: Params, cfg: ModelConfig, hm: Array, first: Array, last: Array, limit: Array,
              page_table: Array, state: LayerState, k: int, live: Array,
              first_logits: Array | None = None) -> tuple[SpecState, LayerState, Array | None]:
    """MTP drafts for every row: `first` [B] is the head's guess from its output state hm [B, W] at the row's last
    kept pair, i.e. the token after the last token, which sits at position last [B]; drafts 2..k each run the
    head on (its previous output state, its previous draft) at positions last .. last + k - 2 of its own KV
    pages. The next step rewrites those positions from the true pairs before anything reads them (each of its
    rows attends up to its own position, written in that step). limit [B]: the positions the row may write in
    these page_table [B, P] columns (its pages within the step's context bucket); the next verify step writes
    positions last .. last + n, so n <= limit - last - 1. Rows not live get no drafts. Returns (SpecState with
    drafts [B, k] and n_draft, without history, the MTP layer's state, and given the logits [B, V] that `first`
    was chosen from, the logits of every draft [B, k, V], for inspection)."""
    n = jnp.where(live, jnp.clip(limit - last - 1, 0, k), 0).astype(jnp.int32)
    drafts, logits = [first], [first_logits]
    for i in range(1, k):  # draft i + 1 from the pair (hm, draft i), whose position is draft i's minus one
        batch = TokenBatch.after(last + i - 1, (n > i).astype(jnp.int32), 1, page_table)
        h, state, _ = mtp_mod.mtp_layer(params, cfg, hm[:, None], drafts[-1][:, None], batch, state)
        hm = h[:, 0]
        logits.append(mtp_mod.mtp_logits(params, cfg, hm))
        drafts.append(greedy(logits[-1]))
    spec = SpecState(jnp.zeros((hm.shape[0], 0), jnp.int32), jnp.stack(drafts, axis=1), n)
    return spec, state, None if first_logits is None else jnp.stack(logits, axis=1)
