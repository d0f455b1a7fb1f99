#!/usr/bin/env python3
"""Calibrated expert routing for host-residency benchmarks: a seeded generator of per-(token, layer) expert ids
and weights whose cache behaviour matches the published real-text figures of Qwen3.8-Flash-Next, and a record
of the bundled trained model's own routing on its held-out text.

API (pure numpy; put benchmarks/ on sys.path, then `from routing import RoutingModel`):

    rm = RoutingModel(num_layers=48, num_experts=512, top_k=10, seed=0)
    ids, weights = rm.sample(tokens, streams=1, first_stream=0)
        ids      int32   [streams, tokens, num_layers, top_k]  distinct within a row, heaviest first
        weights  float32 [streams, tokens, num_layers, top_k]  positive, each row sums to 1

    Streams are independent sequences (e.g. the sequences of one decode batch). They share the layers'
    popularity, and each has its own drifting context and recency. Stream i is a function of (seed, i) only, and
    layer l of (seed, i, l) only. So `first_stream` picks further streams, and a longer sample extends a
    shorter one. Any (layers, experts, top_k) works: RoutingModel(8, 16, 4) drives CPU tests of the engine.

    lru_hits(trace, slots, num_experts) -> (hits, misses) [steps, rows]: the engine cache's LRU rules
    (jaxflash.ffi.reference.LruModel), vectorised over rows. lfu_hits and pinned_hits are the compared policies.

The model. Layer l of stream s picks the top_k experts of the logits
    u[e] = log_popularity[l, e] + context_weight[l] * c[s, l, e](t) + recency[l] * r[s, l, e](t) + Gumbel noise
which is sampling top_k experts without replacement from softmax(u - noise) (Gumbel-top-k). The three parts:
  - log_popularity = popularity[l] * z[l, e] with z ~ N(0, 1) drawn once per layer (shared by all streams).
    A fraction `dead` of the layer's experts sits DEAD_LOGIT lower: such experts are almost never routed to.
  - c is the stream's context: an AR(1) process per expert with unit variance and per-token correlation
    persistence[l]. A stream's favoured experts change over tens of tokens, as text moves between topics.
  - r is a decaying count of the stream's recent uses: r <- decay[l] * r + [e routed at the previous token].
    Consecutive tokens share experts.
The weights are the softmax of the chosen experts' u: a router's renormalised top-k, noise included.

Per-layer variation: layer 0 has its own fitted parameters (the published figures imply that it touches fewer
experts than the average layer does, see below). Every other layer uses
OTHER_LAYERS, with `popularity` and `context_weight` scaled by exp(LAYER_SPREAD * N(0, 1)) per layer. That
spread is an assumption: no per-layer figures were published beyond layer 0.

What the statistics mean. Each is measured on `runs` independent 300-token streams, each with a cold cache,
as in the published runs:
  - hit rate at S slots: each (run, layer) has its own S-slot LRU cache, starting empty. Cold misses count.
    Hits over expert uses, summed over all layers and runs (every layer has tokens * top_k uses, so this is
    also the mean of the layers' rates).
  - touched experts: distinct experts that layer 0 uses in a run, averaged over runs.
  - top-64 share: the uses of a layer's 64 most used experts over all its uses in a run, averaged over all
    layers and runs. The published sentence does not name a layer. It follows the layer-0 figure, so layer 0's
    own share is fitted to 41% as well, and printed, and tested. Small configs use the top num_experts/8.
  - pinned top-S: each layer keeps a fixed set of S experts, its most used over `runs` other streams (a
    profile of other text), and serves nothing else from the cache. Cold start counts here too (a pinned
    expert misses on its first use), so pinning all 512 equals LRU at 512. Profiling the run itself would be an
    oracle that no engine has.
  - LFU (compared, not published): evict the expert used least often since the run began (ties: LRU's order).
  - reuse distance: tokens between consecutive uses of one expert in one (run, layer); 1 = the next token.
The 85% hit rate at 512 slots means 15% cold misses, i.e. 450 of 3000 uses per layer first-touch an
expert. The average layer therefore touches more experts than layer 0 (384). Layer 0 gets that difference
by its `dead` fraction; the other layers have none.

Fit (`python benchmarks/routing.py --fit`, about 15 minutes on one core): Nelder-Mead (scipy.optimize) on
fixed seeds, so the objective is deterministic. It minimises the sum of squared errors, each scaled by its
tolerance (3 points for rates, 10% for the counts).
  1. OTHER_LAYERS (5 parameters), coarse, from a fixed start: the five hit rates, the top-64 share and pinned
     top-186, on layers 1..FIT_LAYERS of the seed-0 model (what the 48-layer model generates there) over
     FIT_RUNS runs with FIT_RUNS profile runs.
  2. FIRST_LAYER's popularity and dead fraction: layer 0's touched experts and top-64 share, over
     4 * FIT_RUNS runs. Its context and recency are those of OTHER_LAYERS.
  3. OTHER_LAYERS, fine, from stage 1's result: the same targets on exactly what the CLI measures (all 48
     layers, seed 0, 8 runs, 8 profile runs).
  4. Stage 2 again, on stage 3's result.
The CLI then measures the result. Paste the printed constants below.

Usage:
    python benchmarks/routing.py --tokens 300 --slots 93,186,279,372,512     # calibrated vs the targets
    python benchmarks/routing.py --policies --batch 8                         # + LFU, and 8 streams in a batch
    python benchmarks/routing.py --fit                                        # refit the constants
    python benchmarks/routing.py --bundled                                    # the bundled model's routing
--bundled needs jax and the data of scripts/train_tiny.py (`apt-get install bible-kjv python3.11-doc`). It
rebuilds the held-out text with train_tiny's own functions and tokenises it with the model's tokenizer, then
runs the model on 300-token windows spread evenly over it (cold start each).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # jaxflash from this checkout, for --bundled


# ---------------------------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LayerParams:
    popularity: float  # std of the layer's log-popularity: how skewed its experts' use is
    context_weight: float  # weight of the stream's drifting context in the logits
    persistence: float  # per-token correlation of the context (a topic lasts ~1 / (1 - persistence) tokens)
    recency: float  # logit bonus per recent use
    decay: float  # per-token decay of that bonus
    dead: float = 0.0  # fraction of experts text almost never routes to


DEAD_LOGIT = 8.0  # a dead expert's logit offset: e^-8, so about one use in 10^5 tokens
LAYER_SPREAD = 0.15  # log-std of the per-layer scaling of popularity and context_weight (layers 1..L-1)

# Fitted by `--fit` (see the module docstring); the figures they give are in benchmarks/RESULTS.md.
FIRST_LAYER = LayerParams(popularity=0.4883, context_weight=0.6111, persistence=0.967, recency=1.6921, decay=0.2185,
                          dead=0.2435)
OTHER_LAYERS = LayerParams(popularity=0.647, context_weight=0.6111, persistence=0.967, recency=1.6921, decay=0.2185)

# The published figures (Qwen3.8-Flash-Next, LRU cache, 300-token real-text runs, cold start included).
PUBLISHED = {
    "tokens": 300, "num_layers": 48, "num_experts": 512, "top_k": 10,
    "hit_rate": {93: 0.435, 186: 0.620, 279: 0.720, 372: 0.789, 512: 0.850},
    "touched_layer0": 384.0, "top64_share": 0.41, "pinned": {186: 0.594},
}
RATE_TOL, COUNT_TOL = 0.03, 0.10  # absolute for rates; relative for touched experts and the top-64 share
FIT_RUNS, FIT_LAYERS = 4, 16
BLOCK = 16  # tokens of noise drawn at once per (stream, layer): fixed, so a longer sample extends a shorter one


# ---------------------------------------------------------------------------------------------------------------
# The routing model
# ---------------------------------------------------------------------------------------------------------------
class RoutingModel:
    """Seeded routing of a (num_layers, num_experts, top_k) MoE model; see the module docstring."""

    def __init__(self, num_layers: int = 48, num_experts: int = 512, top_k: int = 10, seed: int = 0,
                 first: LayerParams = FIRST_LAYER, others: LayerParams = OTHER_LAYERS,
                 spread: float = LAYER_SPREAD):
        if not 0 < top_k <= num_experts or num_layers < 1:
            raise ValueError(f"need num_layers >= 1 and 0 < top_k <= num_experts, got {num_layers}, "
                             f"{num_experts}, {top_k}")
        self.num_layers, self.num_experts, self.top_k, self.seed = num_layers, num_experts, top_k, seed
        self.layer_params: list[LayerParams] = []
        log_pop = np.empty((num_layers, num_experts))
        for layer in range(num_layers):
            rng = np.random.default_rng([seed, 0, layer])  # layer l's structure depends on (seed, l) only
            z = rng.standard_normal(num_experts)
            dead = rng.random(num_experts)
            scale = np.exp(spread * rng.standard_normal(2))
            p = first if layer == 0 else dataclasses.replace(
                others, popularity=others.popularity * scale[0], context_weight=others.context_weight * scale[1])
            self.layer_params.append(p)
            log_pop[layer] = p.popularity * z - DEAD_LOGIT * (dead < p.dead)
        self.log_popularity = log_pop
        col = lambda name: np.array([getattr(p, name) for p in self.layer_params])[:, None]  # noqa: E731
        self._context, self._persist = col("context_weight"), col("persistence")
        self._innov = np.sqrt(1.0 - self._persist ** 2)  # keeps the context's variance at 1
        self._recency, self._decay = col("recency"), col("decay")

    def _noise(self, stream: int, layer: int):
        """One (stream, layer)'s noise: its initial context, then (uniform, normal) for BLOCK tokens at a time."""
        rng = np.random.default_rng([self.seed, 1, stream, layer])
        yield rng.standard_normal(self.num_experts, dtype=np.float32)
        while True:
            yield (rng.random((BLOCK, self.num_experts), dtype=np.float32),
                   rng.standard_normal((BLOCK, self.num_experts), dtype=np.float32))

    def sample(self, tokens: int, streams: int = 1, first_stream: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32, weights float32), both [streams, tokens, num_layers, top_k]; streams first_stream..."""
        S, L, E, k = streams, self.num_layers, self.num_experts, self.top_k
        noise = [[self._noise(first_stream + s, layer) for layer in range(L)] for s in range(S)]
        context = np.stack([np.stack([next(g) for g in row]) for row in noise]).astype(np.float64)  # [S, L, E]
        recent = np.zeros((S, L, E))
        ids = np.empty((S, tokens, L, k), np.int32)
        weights = np.empty((S, tokens, L, k), np.float32)
        for t in range(tokens):
            if t % BLOCK == 0:
                blocks = [[next(g) for g in row] for row in noise]
                uniform = np.array([[b[0] for b in row] for row in blocks]).transpose(2, 0, 1, 3)  # [BLOCK,S,L,E]
                normal = np.array([[b[1] for b in row] for row in blocks]).transpose(2, 0, 1, 3)
            with np.errstate(divide="ignore"):  # a uniform of exactly 0 gives -inf: that expert is not picked
                gumbel = -np.log(-np.log(uniform[t % BLOCK]))
            u = self.log_popularity + self._context * context + self._recency * recent + gumbel
            top = np.argpartition(-u, k - 1, axis=-1)[..., :k] if k < E else np.broadcast_to(np.arange(E), u.shape)
            top_u = np.take_along_axis(u, top, -1)
            order = np.argsort(-top_u, axis=-1)
            top, top_u = np.take_along_axis(top, order, -1), np.take_along_axis(top_u, order, -1)
            w = np.exp(top_u - top_u[..., :1])
            ids[:, t], weights[:, t] = top, w / w.sum(-1, keepdims=True)
            recent *= self._decay
            np.put_along_axis(recent, top, np.take_along_axis(recent, top, -1) + 1.0, -1)
            context = self._persist * context + self._innov * normal[t % BLOCK]
        return ids, weights


# ---------------------------------------------------------------------------------------------------------------
# Cache policies, vectorised over independent caches (rows)
# ---------------------------------------------------------------------------------------------------------------
def _distinct(step_ids: np.ndarray) -> np.ndarray:
    """Sorted ids [rows, n] with repeats and negative padding replaced by -1 (each expert counted once)."""
    ids = np.sort(step_ids, axis=1)
    dup = np.zeros_like(ids, bool)
    dup[:, 1:] = ids[:, 1:] == ids[:, :-1]
    return np.where(dup | (ids < 0), -1, ids)


def _simulate(trace, slots: int, num_experts: int, policy: str):
    """Shared body of lru_hits and lfu_hits: slot-level replay of the engine cache's resolve.

    Per step, a row's wanted experts (distinct, ascending) that hold a slot are hits and keep it. The others take
    the free or evicted slots in ascending order of the eviction key, the smallest key first. For LRU the key is
    (stamp of last use, slot): LruModel's rule. LFU puts the expert's use count so far before that. Stamps count
    steps from 1; empty slots have stamp -1. LruModel's rebase at 2^30 steps never happens in these runs."""
    trace = np.asarray(trace)
    T, B, n = trace.shape
    rows = np.arange(B)
    where = np.full((B, num_experts), -1, np.int64)  # expert -> slot
    holder = np.full((B, slots), -1, np.int64)  # slot -> expert
    stamp = np.full((B, slots), -1, np.int64)
    uses = np.zeros((B, num_experts + 1), np.int64)  # LFU's counts; the extra last column is an empty slot's
    uses[:, -1] = -1  # (holder -1), so LFU fills empty slots first as LRU does
    hits, misses = np.zeros((T, B), np.int64), np.zeros((T, B), np.int64)
    never = np.iinfo(np.int64).max
    for t in range(T):
        ids = _distinct(trace[t])
        valid = ids >= 0
        if (valid.sum(1) > slots).any():
            raise ValueError(f"step {t} wants {valid.sum(1).max()} distinct experts, more than {slots} slots")
        slot_of = np.where(valid, where[rows[:, None], np.maximum(ids, 0)], -1)
        kept, new = slot_of >= 0, valid & (slot_of < 0)
        hits[t], misses[t] = kept.sum(1), new.sum(1)
        key = (stamp + 1) * slots + np.arange(slots)
        if policy == "lfu":
            key = key + uses[rows[:, None], holder] * ((T + 1) * slots)
        kr, kj = np.nonzero(kept)
        key[kr, slot_of[kr, kj]] = never
        m = min(n, slots)
        cand = np.argpartition(key, m - 1, axis=1)[:, :m] if m < slots else np.argsort(key, axis=1)[:, :m]
        victims = np.take_along_axis(cand, np.argsort(np.take_along_axis(key, cand, 1), axis=1), 1)
        new_ids = np.take_along_axis(ids, np.argsort(~new, axis=1, kind="stable"), 1)  # new ones first, ascending
        r, j = np.nonzero(np.arange(m)[None, :] < misses[t][:, None])
        v, e = victims[r, j], new_ids[r, j]
        old = holder[r, v]
        where[r[old >= 0], old[old >= 0]] = -1
        holder[r, v], where[r, e] = e, v
        stamp[r, v] = t + 1
        stamp[kr, slot_of[kr, kj]] = t + 1
        vr, vj = np.nonzero(valid)
        uses[vr, ids[vr, vj]] += 1
    return hits, misses


def lru_hits(trace, slots: int, num_experts: int):
    """LRU hits and misses [steps, rows] of trace [steps, rows, n] (expert ids; -1 pads; a repeat within a step
    counts once), each row its own cache of `slots` slots starting empty. The rules of LruModel, exactly."""
    return _simulate(trace, slots, num_experts, "lru")


def lfu_hits(trace, slots: int, num_experts: int):
    """As lru_hits, evicting the expert used least often since the start (ties: least recently, lower slot)."""
    return _simulate(trace, slots, num_experts, "lfu")


def pinned_hits(trace, pinned: np.ndarray):
    """Hits and misses [steps, rows] when each row's cache holds only its pinned experts (pinned [rows, E]
    bool). A pinned expert misses on its first use (cold start); an unpinned one always misses."""
    trace = np.asarray(trace)
    T, B, _ = trace.shape
    rows = np.arange(B)[:, None]
    seen = np.zeros_like(pinned, bool)
    hits, misses = np.zeros((T, B), np.int64), np.zeros((T, B), np.int64)
    for t in range(T):
        ids = _distinct(trace[t])
        valid = ids >= 0
        safe = np.maximum(ids, 0)
        hit = valid & pinned[rows, safe] & seen[rows, safe]
        hits[t], misses[t] = hit.sum(1), (valid & ~hit).sum(1)
        r, j = np.nonzero(valid)
        seen[r, ids[r, j]] = True
    return hits, misses


def layer_rows(ids: np.ndarray) -> np.ndarray:
    """ids [runs, tokens, layers, k] -> trace [tokens, runs * layers, k]: one cache per (run, layer)."""
    R, T, L, k = ids.shape
    return ids.transpose(1, 0, 2, 3).reshape(T, R * L, k)


def batch_rows(ids: np.ndarray) -> np.ndarray:
    """ids [streams, tokens, layers, k] -> trace [tokens, layers, streams * k]: the streams decode as one batch,
    so each layer has one cache that resolves the union of their ids."""
    S, T, L, k = ids.shape
    return ids.transpose(1, 2, 0, 3).reshape(T, L, S * k)


def hottest(ids: np.ndarray, num_experts: int, count: int) -> np.ndarray:
    """Per layer, the `count` experts most used over ids [runs, tokens, layers, k]: bool [layers, E]."""
    L = ids.shape[2]
    uses = np.stack([np.bincount(ids[:, :, layer].ravel(), minlength=num_experts) for layer in range(L)])
    order = np.argsort(-uses, axis=1, kind="stable")[:, :count]
    out = np.zeros((L, num_experts), bool)
    out[np.arange(L)[:, None], order] = True
    return out


# ---------------------------------------------------------------------------------------------------------------
# Statistics of a trace
# ---------------------------------------------------------------------------------------------------------------
def usage_counts(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Uses per (run, layer, expert) of ids [runs, tokens, layers, k]."""
    R, T, L, k = ids.shape
    flat = ids.transpose(0, 2, 1, 3).reshape(R * L, T * k) + num_experts * np.arange(R * L)[:, None]
    return np.bincount(flat.ravel(), minlength=R * L * num_experts).reshape(R, L, num_experts)


def top_share(counts: np.ndarray, m: int) -> np.ndarray:
    """Share of each (run, layer)'s uses carried by its m most used experts: [runs, layers]."""
    return np.sort(counts, axis=-1)[..., ::-1][..., :m].sum(-1) / counts.sum(-1)


def reuse_gaps(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Tokens between consecutive uses of the same expert in the same (run, layer), all pooled."""
    R, T, L, k = ids.shape
    used = np.zeros((R, L, num_experts, T), bool)
    r, t, layer, _ = np.indices(ids.shape).reshape(4, -1)
    used[r, layer, ids.ravel(), t] = True
    flat = np.flatnonzero(used)  # ascending: grouped by (run, layer, expert), then by token
    group, tok = np.divmod(flat, T)
    same = group[1:] == group[:-1]
    return (tok[1:] - tok[:-1])[same]


GAP_BINS = [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, 128), (129, 256), (257, None)]


def gap_summary(gaps: np.ndarray, uses: int) -> str:
    """Reuse distances: quantiles, then the share of all uses per distance bin (first uses are the rest)."""
    q = np.percentile(gaps, [25, 50, 75, 90, 99]).round(1) if len(gaps) else [np.nan] * 5
    parts = [f"reuse distance (tokens) p25/50/75/90/99: {'/'.join(f'{x:g}' for x in q)}"]
    cells = []
    for lo, hi in GAP_BINS:
        sel = (gaps >= lo) & (gaps <= (hi if hi is not None else np.inf))
        cells.append(f"{lo if hi == lo else f'{lo}-{hi}' if hi else f'{lo}+'}: {100 * sel.sum() / uses:.1f}")
    parts.append("share of uses by reuse distance (%): " + ", ".join(cells)
                 + f"; first uses: {100 * (1 - len(gaps) / uses):.1f}")
    return "\n  ".join(parts)


def measure(ids: np.ndarray, profile: np.ndarray | None, num_experts: int, slots, policies=("lru",),
            first_layer: bool = True) -> dict:
    """The statistics of the module docstring for ids [runs, tokens, layers, k]; profile: other runs, for
    pinning (None: no pinned figures). policies: any of "lru", "lfu", "pinned". first_layer: layer 0 of ids
    is the model's layer 0 (for the layer-0 figures)."""
    R, T, L, k = ids.shape
    trace = layer_rows(ids)
    counts = usage_counts(ids, num_experts)
    m = max(1, num_experts // 8)
    out = {"uses": T * k, "top_m": m, "touched_all": counts.astype(bool).sum(-1).mean(),
           "top_share": top_share(counts, m).mean(), "gaps": reuse_gaps(ids, num_experts), "all_uses": ids.size}
    if first_layer:
        out["touched_layer0"] = counts[:, 0].astype(bool).sum(-1).mean()
        out["top_share_layer0"] = top_share(counts[:, :1], m).mean()
    for policy in policies:
        rates = {}
        for s in slots:
            if policy == "pinned":
                if profile is None:
                    continue
                pin = np.tile(hottest(profile, num_experts, s), (R, 1))
                h, mi = pinned_hits(trace, pin)
            else:
                h, mi = (lru_hits if policy == "lru" else lfu_hits)(trace, s, num_experts)
            rates[s] = h.sum() / (h.sum() + mi.sum())
        out[policy] = rates
    return out


# ---------------------------------------------------------------------------------------------------------------
# Calibration against the published figures
# ---------------------------------------------------------------------------------------------------------------
def calibrated(seed: int = 0, tokens: int = 300, runs: int = 8, slots=(93, 186, 279, 372, 512),
               policies=("lru", "pinned"), model: RoutingModel | None = None) -> dict:
    """Statistics of the full-size calibrated model: `runs` streams, profiled on `runs` further streams."""
    model = model or RoutingModel(seed=seed)
    ids, _ = model.sample(tokens, runs)
    profile, _ = model.sample(tokens, runs, first_stream=runs) if "pinned" in policies else (None, None)
    return measure(ids, profile, model.num_experts, slots, policies)


def pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def print_calibrated(stats: dict, args, out=sys.stdout) -> None:
    hit, P = stats["lru"], PUBLISHED
    print(f"calibrated routing: RoutingModel(48 layers, 512 experts, top-10, seed {args.seed}), {args.runs} runs "
          f"of {args.tokens} tokens, each layer of each run its own cold LRU cache", file=out)
    print("slots/layer  LRU hit rate  target", file=out)
    for s, r in hit.items():
        target = P["hit_rate"].get(s)
        print(f"{s:11d}  {pct(r):>12}  {pct(target) if target is not None else '    -'}", file=out)
    print(f"touched experts, layer 0: {stats['touched_layer0']:.1f} of 512 (target {P['touched_layer0']:.0f}); "
          f"average layer: {stats['touched_all']:.1f}", file=out)
    print(f"top-{stats['top_m']} share, averaged over layers: {pct(stats['top_share']).strip()} "
          f"(target {pct(P['top64_share']).strip()}); layer 0: {pct(stats['top_share_layer0']).strip()}", file=out)
    pinned = stats.get("pinned", {})
    for s, r in pinned.items():
        target = P["pinned"].get(s)
        note = (f" (target {pct(target).strip()} vs {pct(P['hit_rate'][s]).strip()})" if target is not None
                else "")
        print(f"pinned top-{s} (profiled on {args.runs} other runs): {pct(r).strip()} vs LRU "
              f"{pct(hit[s]).strip()}{note}", file=out)
    print(f"  {gap_summary(stats['gaps'], stats['all_uses'])}", file=out)


def check(stats: dict) -> list[str]:
    """The published figures that stats misses by more than the tolerances (empty: all reproduced)."""
    P, bad = PUBLISHED, []
    for s, target in P["hit_rate"].items():
        if abs(stats["lru"][s] - target) > RATE_TOL:
            bad.append(f"hit rate at {s}: {stats['lru'][s]:.3f} vs {target}")
    for s, target in P["pinned"].items():
        if abs(stats["pinned"][s] - target) > RATE_TOL:
            bad.append(f"pinned at {s}: {stats['pinned'][s]:.3f} vs {target}")
    for name, key, target in (("touched (layer 0)", "touched_layer0", P["touched_layer0"]),
                              ("top-64 share", "top_share", P["top64_share"]),
                              ("top-64 share (layer 0)", "top_share_layer0", P["top64_share"])):
        if abs(stats[key] / target - 1) > COUNT_TOL:
            bad.append(f"{name}: {stats[key]:.3f} vs {target}")
    for s, r in stats.get("pinned", {}).items():
        if s < P["num_experts"] and r >= stats["lru"][s]:
            bad.append(f"pinned top-{s} does not lose to LRU ({r:.3f} vs {stats['lru'][s]:.3f})")
    return bad


# ---------------------------------------------------------------------------------------------------------------
# Fitting
# ---------------------------------------------------------------------------------------------------------------
OTHER_FIELDS = ("popularity", "context_weight", "persistence", "recency", "decay")
FIRST_FIELDS = ("popularity", "dead")
FRACTIONS = ("persistence", "decay", "dead")  # fitted through a logistic, the rest through exp


def _to_params(x, fields, base: LayerParams) -> LayerParams:
    vals = {f: 1 / (1 + np.exp(-v)) if f in FRACTIONS else np.exp(v) for f, v in zip(fields, x)}
    return dataclasses.replace(base, **{f: round(float(v), 4) for f, v in vals.items()})


def _to_x(p: LayerParams, fields) -> np.ndarray:
    vals = [getattr(p, f) for f in fields]
    return np.array([np.log(v / (1 - v)) if f in FRACTIONS else np.log(v) for f, v in zip(fields, vals)])


def _errors(stats: dict) -> list[float]:
    """Misfits of the hit rates, pinned top-186 and the all-layer top-64 share, in units of their tolerances."""
    P = PUBLISHED
    err = [(stats["lru"][n] - t) / RATE_TOL for n, t in P["hit_rate"].items()]
    err += [(stats["pinned"][n] - t) / RATE_TOL for n, t in P["pinned"].items()]
    return err + [(stats["top_share"] / P["top64_share"] - 1) / COUNT_TOL]


def fit(log=print) -> tuple[LayerParams, LayerParams]:
    """The fit of the module docstring; returns (FIRST_LAYER, OTHER_LAYERS)."""
    from scipy.optimize import minimize

    P = PUBLISHED
    slots = tuple(P["hit_rate"])

    def run(name, loss, fields, base, maxiter):
        evals = [0]

        def logged(x):
            value = loss(_to_params(x, fields, base))
            evals[0] += 1
            if evals[0] % 20 == 0:
                log(f"  {name}, evaluation {evals[0]}: loss {value:.3f}")
            return value

        r = minimize(logged, _to_x(base, fields), method="Nelder-Mead",
                     options={"maxiter": maxiter, "xatol": 1e-3, "fatol": 1e-3})
        best = _to_params(r.x, fields, base)
        log(f"  {name} -> {best} (loss {r.fun:.4f}, {r.nfev} evaluations)")
        return best

    def coarse(others):  # layers 1..FIT_LAYERS, FIT_RUNS runs: the same layers the full model generates there
        model = RoutingModel(num_layers=1 + FIT_LAYERS, seed=0, others=others)
        ids, _ = model.sample(P["tokens"], FIT_RUNS)
        profile, _ = model.sample(P["tokens"], FIT_RUNS, first_stream=FIT_RUNS)
        return float(np.sum(np.square(_errors(
            measure(ids[:, :, 1:], profile[:, :, 1:], 512, slots, ("lru", "pinned"), first_layer=False)))))

    def layer0(first):
        ids, _ = RoutingModel(num_layers=1, seed=0, first=first).sample(P["tokens"], 4 * FIT_RUNS)
        counts = usage_counts(ids, 512)[:, 0]
        return float(np.square((counts.astype(bool).sum(-1).mean() / P["touched_layer0"] - 1) / COUNT_TOL)
                     + np.square((top_share(counts, 64).mean() / P["top64_share"] - 1) / COUNT_TOL))

    def with_first(first, others):  # layer 0: its own popularity and dead fraction, the rest as the others
        return dataclasses.replace(others, **{f: getattr(first, f) for f in FIRST_FIELDS})

    start = LayerParams(popularity=0.6, context_weight=0.6, persistence=0.97, recency=1.5, decay=0.2)
    log(f"1. OTHER_LAYERS, coarse: layers 1..{FIT_LAYERS}, {FIT_RUNS} runs")
    others = run("coarse", coarse, OTHER_FIELDS, start, 300)
    log("2. FIRST_LAYER's popularity and dead fraction: layer 0's touched experts and top-64 share")
    first = run("layer 0", layer0, FIRST_FIELDS, dataclasses.replace(others, dead=0.2), 200)

    def fine(candidate):  # the figures the CLI prints at seed 0, all 48 layers
        model = RoutingModel(seed=0, first=with_first(first, candidate), others=candidate)
        return float(np.sum(np.square(_errors(calibrated(model=model)))))

    log("3. OTHER_LAYERS, fine: the full model as the CLI measures it (8 runs, 8 profile runs)")
    others = run("fine", fine, OTHER_FIELDS, others, 80)
    log("4. layer 0 again, on the fine result")
    first = run("layer 0", layer0, FIRST_FIELDS, with_first(first, others), 200)
    return first, others


# ---------------------------------------------------------------------------------------------------------------
# The bundled model's routing on its held-out text
# ---------------------------------------------------------------------------------------------------------------
def model_routing(params, cfg, tokens: np.ndarray) -> np.ndarray:
    """Routed expert ids [windows, T, layers, k] of the functional model on token windows [windows, T].
    The one place that knows how the model reports its routing (forward_hidden's return_routing)."""
    import jax
    import jax.numpy as jnp

    from jaxflash.model import ple, transformer

    def ids_of(params, toks, ngram):
        _, routing = transformer.forward_hidden(params, cfg, toks, ngram_ids=ngram, return_routing=True)
        return jnp.stack([r.ids for r in routing], axis=1)  # [windows * T, layers, k]

    ngram = ple.ngram_ids(cfg, tokens)[0]
    out = jax.jit(ids_of)(params, jnp.asarray(tokens), jnp.asarray(ngram))
    return np.asarray(out, np.int32).reshape(*tokens.shape, cfg.num_hidden_layers, -1)


def heldout_tokens(model_dir: str) -> np.ndarray:
    """The held-out token stream of scripts/train_tiny.py (its documents, split and EOS joins; the model's
    tokenizer)."""
    import importlib.util

    from tokenizers import Tokenizer

    spec = importlib.util.spec_from_file_location("train_tiny", os.path.join(ROOT, "scripts", "train_tiny.py"))
    train_tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_tiny)
    _, held = train_tiny.split_documents(train_tiny.kjv_documents() | train_tiny.python_doc_documents())
    return train_tiny.token_stream(Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")), held)


def bundled(args, out=sys.stdout) -> None:
    import jaxflash

    model_dir = args.model or jaxflash.DEFAULT_MODEL
    stream = heldout_tokens(model_dir)
    engine = jaxflash.load(model_dir, dtype="float32", progress=False)
    cfg = engine.config
    L, E, k, W, T = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok, args.windows, args.tokens
    starts = np.linspace(0, len(stream) - T, W).astype(int)  # evenly over the stream: KJV, then Python docs
    ids = model_routing(engine.params, cfg, np.stack([stream[s : s + T] for s in starts]))
    slots = [int(s) for s in args.bundled_slots.split(",")]
    stats = measure(ids, None, E, slots, ("lru", "lfu"))
    pinned = {}
    for s in slots:  # each window pinned by the other windows' counts (its own would be an oracle)
        h = m = 0
        for w in range(W):
            pin = hottest(np.delete(ids, w, axis=0), E, s)
            hw, mw = pinned_hits(layer_rows(ids[w : w + 1]), pin)
            h, m = h + hw.sum(), m + mw.sum()
        pinned[s] = h / (h + m)
    stats["pinned"] = pinned
    synth = RoutingModel(L, E, k, seed=args.seed)
    synth_ids, _ = synth.sample(T, W)
    synth_profile, _ = synth.sample(T, W, first_stream=W)
    synth_stats = measure(synth_ids, synth_profile, E, slots, ("lru", "lfu", "pinned"))
    rng = np.random.default_rng(args.seed)
    uniform = np.argsort(rng.random((W, T, L, E)), axis=-1)[..., :k].astype(np.int32)
    uniform_stats = measure(uniform, None, E, slots, ("lru",))

    print(f"bundled model ({L} layers, {E} experts, top-{k}) on its held-out text ({len(stream):,} tokens): "
          f"{W} windows of {T} tokens evenly spaced over it ({W * T:,} tokens), each a fresh sequence and a cold "
          f"cache per layer; float32 forward on the CPU", file=out)
    print("slots/layer  LRU hit rate | RoutingModel(same config, seed "
          f"{args.seed})  uniform random routing", file=out)
    for s in slots:
        print(f"{s:11d}  {pct(stats['lru'][s]):>12} | {pct(synth_stats['lru'][s]):>12}  "
              f"{pct(uniform_stats['lru'][s]):>12}", file=out)
    m = stats["top_m"]
    print(f"touched experts per layer in {T} tokens: layer 0 {stats['touched_layer0']:.1f}, average layer "
          f"{stats['touched_all']:.1f} of {E} (RoutingModel: {synth_stats['touched_all']:.1f})", file=out)
    print(f"top-{m} share (top {m}/{E} = the 64/512 fraction), averaged over layers: "
          f"{pct(stats['top_share']).strip()}; layer 0: {pct(stats['top_share_layer0']).strip()} "
          f"(RoutingModel: {pct(synth_stats['top_share']).strip()}, uniform: "
          f"{pct(uniform_stats['top_share']).strip()})", file=out)
    for name, s in (("bundled model", stats), ("RoutingModel, same config", synth_stats),
                    ("uniform random", uniform_stats)):
        print(f"{name}:\n  {gap_summary(s['gaps'], s['all_uses'])}", file=out)
    print_policies({"bundled model (pinned: profiled on the other windows)": stats,
                    f"RoutingModel, same config (pinned: profiled on {W} other runs)": synth_stats}, out)


def print_policies(tables: dict[str, dict], out=sys.stdout) -> None:
    print("cache policies (hit rate; cold start counts for all):", file=out)
    for name, stats in tables.items():
        pols = [p for p in ("lru", "lfu", "pinned") if p in stats]
        print(f"  {name}", file=out)
        print("  slots/layer" + "".join(f"{p.upper():>9}" for p in pols), file=out)
        for s in stats["lru"]:
            print(f"  {s:11d}" + "".join(f"{pct(stats[p][s]):>9}" for p in pols), file=out)


# ---------------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=300, help="tokens per run (window)")
    ap.add_argument("--slots", default="93,186,279,372,512", help="LRU slots per layer (calibrated)")
    ap.add_argument("--runs", type=int, default=8, help="independent runs (streams), each its own cold cache")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", action="store_true", help="also compare LRU, LFU and pinning (calibrated)")
    ap.add_argument("--batch", type=int, default=0,
                    help="also the LRU hit rate when this many streams decode as one batch (one cache per layer)")
    ap.add_argument("--fit", action="store_true", help="refit the constants, then measure them")
    ap.add_argument("--bundled", action="store_true", help="the bundled model's routing on its held-out text")
    ap.add_argument("--model", help="checkpoint directory for --bundled (default: the bundled model)")
    ap.add_argument("--windows", type=int, default=20, help="--bundled: held-out windows of --tokens tokens")
    ap.add_argument("--bundled-slots", default="4,6,8,12,16", help="--bundled: slots per layer")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.bundled:
        bundled(args)
        print(f"({time.perf_counter() - t0:.1f} s)")
        return 0
    first, others = FIRST_LAYER, OTHER_LAYERS
    if args.fit:
        first, others = fit()
        print(f"FIRST_LAYER = {first!r}\nOTHER_LAYERS = {others!r}")
    slots = [int(s) for s in args.slots.split(",")]
    policies = ("lru", "pinned", "lfu") if args.policies else ("lru", "pinned")
    model = RoutingModel(seed=args.seed, first=first, others=others)
    stats = calibrated(args.seed, args.tokens, args.runs, slots, policies, model)
    print_calibrated(stats, args)
    if args.policies:
        print_policies({f"calibrated (pinned: profiled on {args.runs} other runs)": stats})
    if args.batch:
        ids, _ = model.sample(args.tokens, args.batch)
        trace = batch_rows(ids)
        rates = []
        for s in slots:
            h, m = lru_hits(trace, s, model.num_experts)
            rates.append(f"{s}: {pct(h.sum() / (h.sum() + m.sum())).strip()} ({m.sum() / args.tokens:.0f})")
        print(f"{args.batch} streams decoding as one batch, one LRU cache per layer, hit rate (misses per step, "
              "all layers) by slots: " + ", ".join(rates))
    if args.tokens == PUBLISHED["tokens"] and set(PUBLISHED["hit_rate"]) <= set(slots):
        bad = check(stats)
        print("all published figures reproduced within tolerance" if not bad else "NOT reproduced: " + "; ".join(bad))
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
