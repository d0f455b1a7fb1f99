"""Plain-Python references of the FFI steps: the documented rules written directly, for tests, benchmarks and
cache simulations (e.g. hit rates of a routing trace at a given slot count). Slow, obvious, independent of
the C++ code."""

from __future__ import annotations

import numpy as np

HEADER = 4
REBASE_AT, REBASE_BY = 1 << 30, 1 << 29


class TooManyExperts(Exception):
    """A step needs more distinct experts than the layer has slots."""


class LruModel:
    """The expert cache's documented rules, written directly: dicts and a sort, no cleverness."""

    def __init__(self, num_slots: int, num_experts: int):
        self.S, self.E = num_slots, num_experts
        self.step = 0
        self.where = {}  # expert -> slot
        self.holder = [None] * num_slots  # slot -> expert
        self.stamp = [-1] * num_slots
        self.hits = self.misses = 0

    @classmethod
    def from_state(cls, state) -> LruModel:
        st = [int(x) for x in np.asarray(state)]
        S, E = st[1], st[2]
        m = cls(S, E)
        m.step = st[0]
        for v in range(S):
            e = st[HEADER + v]
            if e >= 0:
                m.holder[v] = e
                m.where[e] = v
            m.stamp[v] = st[HEADER + S + v]
        return m

    def resolve(self, ids):
        ids = [int(x) for x in np.asarray(ids).reshape(-1)]
        for e in ids:
            if not 0 <= e < self.E:
                raise ValueError(f"expert id {e}")
        wanted = sorted(set(ids))
        if len(wanted) > self.S:
            raise TooManyExperts(len(wanted))
        self.step += 1
        if self.step >= REBASE_AT:
            self.stamp = [s if s < 0 else max(s - REBASE_BY, 0) for s in self.stamp]
            self.step -= REBASE_BY
        kept = {self.where[e] for e in wanted if e in self.where}
        new = [e for e in wanted if e not in self.where]
        victims = sorted((self.stamp[v], v) for v in range(self.S) if v not in kept)
        misses = []
        for e, (_, v) in zip(new, victims):
            if self.holder[v] is not None:
                del self.where[self.holder[v]]
            self.holder[v] = e
            self.where[e] = v
            self.stamp[v] = self.step
            misses.append((e, v))
        for v in kept:
            self.stamp[v] = self.step
        self.hits += len(kept)
        self.misses += len(new)
        return [self.where[e] for e in ids], misses, len(wanted)

    def state(self) -> np.ndarray:
        expert_slot = [-1] * self.E
        for e, v in self.where.items():
            expert_slot[e] = v
        holder = [-1 if h is None else h for h in self.holder]
        return np.array([self.step, self.S, self.E, 0, *holder, *self.stamp, *expert_slot], np.int32)

    def padded_misses(self, misses, max_misses: int) -> np.ndarray:
        out = np.full((max_misses, 2), -1, np.int32)
        if misses:
            out[: len(misses)] = misses
        return out




def ngram_ids_reference(tokens, context, *, eos: int, multipliers, head_sizes, head_offsets, lengths=None,
                        reset=None):
    """docs/model.md §6.2 for tokens [B, T] and context [B, 2]: returns (ids [B, T, heads] int64, new context
    [B, 2])."""
    tokens = np.asarray(tokens, np.int64)
    B, T = tokens.shape
    lengths = [T] * B if lengths is None else [int(x) for x in lengths]
    reset = [0] * B if reset is None else [int(x) for x in reset]
    heads = len(head_sizes)
    ids = np.zeros((B, T, heads), np.int64)
    new_ctx = np.zeros((B, 2), np.int64)
    for b in range(B):
        ctx = [eos, eos] if reset[b] else [int(x) for x in context[b]]
        hist = ctx + [int(tokens[b, t]) if t < lengths[b] else eos for t in range(T)]
        for t in range(T):
            p = t + 2
            shifted = []
            for k in range(3):
                ok = all(hist[q] != eos for q in range(p - k, p))  # no EOS in [p-k, p-1]
                shifted.append(hist[p - k] if ok else eos)
            mix2 = (shifted[0] * multipliers[0]) ^ (shifted[1] * multipliers[1])
            mix3 = mix2 ^ (shifted[2] * multipliers[2])
            for j in range(heads):
                mix = mix2 if j < heads // 2 else mix3
                ids[b, t, j] = mix % head_sizes[j] + head_offsets[j]
        new_ctx[b] = hist[lengths[b] : lengths[b] + 2]
    return ids, new_ctx
