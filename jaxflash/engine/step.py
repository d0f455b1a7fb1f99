"""The engine's compiled programs: a prefill chunk for one sequence and a decode step for the whole batch.

Both run `forward_tokens`: the model of jaxflash.model.transformer, but over new tokens of sequences that
already have state (paged KV for attention, conv + recurrent state for GDN, conv state and n-gram context for
PLE), which they update. State lives in one `DecodeState` pytree that every program donates and returns, so
its buffers keep their addresses from token to token (what lets XLA replay one captured CUDA graph).

Routed experts run in one of two residencies:
  * device: the experts are part of the parameters (gather path for a decode step, tiled path for prefill);
  * host: every expert sits in a pinned host pool (jaxflash.ffi.ExpertPool). A decode step resolves the
    routed ids against a per-layer LRU cache of VRAM slots and copies only the misses in (FFI resolve +
    gather); a prefill chunk stages the experts it hits, a block of `staging` slots at a time.
The PLE n-gram rows come from the FFI host step (hashing + lookup in the memory-mapped table).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .. import ffi
from ..config import ModelConfig
from ..model import gated_deltanet as gdn
from ..model import hyper_connection as hc
from ..model import mtp as mtp_mod
from ..model import ple as ple_mod
from ..model.attention import Attention, PagedKV, attention_paged
from ..model.base import Array, pytree_dataclass, up
from ..model.moe import NVFP4, Experts, experts_gather, moe, tiled_with_fetch
from ..model.transformer import Params, embed, lm_logits
from .sampling import SamplingRows, sample


@pytree_dataclass
class SeqState:
    """Per-sequence state, leading axis = batch slot."""

    lengths: Array  # [B] int32: tokens in the cache
    page_table: Array  # [B, max_pages] int32: the KV pages of each slot
    gdn: tuple  # GDNState (conv [B, K-1, C], recurrent [B, Hv, dk, dv]) per GDN layer, in layer order
    ple: ple_mod.PLEState | None  # conv [B, n, W], context [B, 2]
    hidden: Array  # [B, W] float32: pre-mixer state at the last token (the MTP head's input)


@pytree_dataclass
class ExpertCache:
    """One decoder layer's VRAM expert cache (host residency)."""

    lru: Array  # int32 LRU state (jaxflash.ffi.cache)
    slots: Array  # uint8 [S, record_bytes]


@pytree_dataclass
class DecodeState:
    seqs: SeqState
    kv: tuple  # PagedKV per attention layer, shared by all slots through the page table
    cache: tuple | None  # ExpertCache per decoder layer (host residency)
    staging: Array | None  # uint8 [staging, record_bytes]: prefill's expert staging area (host residency)
    sampling: SamplingRows
    active: Array  # [B] bool: decoding
    last_token: Array  # [B] int32: the token the next decode step feeds
    mtp_kv: PagedKV | None = None  # the MTP layer's KV cache (same page table), when the step runs the MTP head


@dataclass(frozen=True, eq=False)
class HostExperts:
    """Static description of host-resident experts (closed over by the compiled programs)."""

    pool: Any  # ffi.ExpertPool, pool layer i = decoder layer i
    layout: Any  # ffi.ExpertLayout
    slots: int
    staging: int
    gather_mode: str = "auto"


@dataclass(frozen=True, eq=False)
class StepContext:
    cfg: ModelConfig
    host: HostExperts | None
    table: Any  # ffi.NgramTable or None (no PLE)
    hash: Any  # ffi.NgramHash
    table_scale: float | None
    max_pages: int
    page_size: int
    mtp: bool = False  # run the MTP head in every step: keeps its KV current and drafts the token after next
    # Benchmark-only ablations ("gather", "routed", "mixers"): leave that part out of the step, so timing the
    # variants splits a step's time by part. The outputs are then wrong; never set outside benchmarks.
    skip: frozenset = frozenset()


def records_as_experts(layout, records: Array) -> Experts:
    """Expert records (uint8 [..., R], the pool/cache layout) as an Experts pytree with the records' leading axes."""
    i = layout.intermediate_size
    if layout.kind == "bf16":
        gu, dn = layout.view(records, "gate_up_weight"), layout.view(records, "down_weight")
        return Experts(gate=gu[..., :i, :], up=gu[..., i:, :], down=dn)
    gu, gs = layout.view(records, "gate_up_weight"), layout.view(records, "gate_up_scale")
    s2 = layout.view(records, "scale_2")
    return Experts(gate=NVFP4(gu[..., :i, :], gs[..., :i, :], s2[..., 0]),
                   up=NVFP4(gu[..., i:, :], gs[..., i:, :], s2[..., 1]),
                   down=NVFP4(layout.view(records, "down_weight"), layout.view(records, "down_scale"), s2[..., 2]))


def _stand_in_ids(idx: Array, valid: Array) -> Array:
    """Padding tokens route like the first real token, so they bring no extra experts into the cache."""
    first = jnp.argmax(valid)
    return jnp.where(valid[:, None], idx, idx[first][None, :])


def forward_tokens(params: Params, ctx: StepContext, seqs: SeqState, kv: tuple, cache, staging, tokens: Array,
                   n_new: Array, *, prefill: bool, all_logits: bool = False):
    """Run tokens [b, T] (the first n_new[i] of row i are real) through the model on top of each sequence's state.

    Returns (seqs, kv, cache, staging, logits [b, V] of each row's last real token (all_logits: [b, T, V] of
    every token), info, hidden [b, T, W]) where info holds the FFI steps' status words (checked on the host
    after the step) and hidden is the pre-mixer state of every new token (the MTP head's input)."""
    cfg = ctx.cfg
    b, t = tokens.shape
    positions = seqs.lengths[:, None] + jnp.arange(t)[None, :]
    valid = jnp.arange(t)[None, :] < n_new[:, None]
    valid_flat = valid.reshape(-1)
    s, eps = cfg.hc_count, cfg.rms_norm_eps
    h = embed(params, cfg, tokens)
    info = {}

    rows, ple_state = None, seqs.ple
    if ctx.table is not None:
        step = ffi.ple_step(tokens, ple_state.context, ctx.table, ctx.hash, lengths=n_new)
        rows = up(step.rows)
        if ctx.table_scale is not None:
            rows = rows * ctx.table_scale
        ple_state = ple_mod.PLEState(conv=ple_state.conv, context=step.context)
        info["ple"] = step.info

    new_gdn, new_kv = list(seqs.gdn), list(kv)
    new_cache = list(cache) if cache is not None else None
    resolve_info = []
    gi = ai = 0
    for i, layer in enumerate(params.layers):
        dt = layer.moe.router.dtype
        if layer.ple is not None:
            out, conv = jax.vmap(lambda hh, rr, cs, n: ple_mod.ple(layer.ple, cfg, hh, rr, cs, n))(
                h, rows, ple_state.conv, n_new)
            h = h + out
            ple_state = ple_mod.PLEState(conv=conv, context=ple_state.context)

        x, inj = hc.mix(layer.attn_hc, h, s, eps)
        x = x.astype(dt)
        if "mixers" in ctx.skip:
            y = jnp.zeros_like(x)
            ai, gi = ai + isinstance(layer.mixer, Attention), gi + (not isinstance(layer.mixer, Attention))
        elif isinstance(layer.mixer, Attention):
            y, new_kv[ai] = attention_paged(layer.mixer, cfg, x, positions, valid, kv[ai], seqs.page_table)
            ai += 1
        else:
            y, new_gdn[gi] = jax.vmap(lambda xx, st, n: gdn.gated_deltanet(layer.mixer, cfg, xx, st, n))(
                x, seqs.gdn[gi], n_new)
            gi += 1
        h = hc.combine(h, inj, y)

        x, inj = hc.mix(layer.mlp_hc, h, s, eps)
        x = x.astype(dt).reshape(b * t, -1)
        routed = None
        if "routed" in ctx.skip:
            routed = _Routed(lambda self, x, idx, w: jnp.zeros(x.shape, jnp.float32), staging)
        elif ctx.host is not None:
            routed = _host_routed(ctx, i, new_cache, staging, valid_flat, resolve_info, prefill)
        y = moe(layer.moe, cfg, x, routed=routed).reshape(b, t, -1)
        if routed is not None:
            staging = routed.staging
        h = hc.combine(h, inj, y)

    last = jnp.maximum(n_new - 1, 0)
    h_last = h[jnp.arange(b), last]  # [b, W]
    hidden = jnp.where((n_new > 0)[:, None], h_last, seqs.hidden)
    x, _ = hc.mix(params.mixer, h if all_logits else h_last, s, eps)
    logits = lm_logits(params, x)
    if resolve_info:
        info["resolve"] = jnp.stack(resolve_info)
    seqs = SeqState(lengths=seqs.lengths + n_new, page_table=seqs.page_table, gdn=tuple(new_gdn), ple=ple_state,
                    hidden=hidden)
    return seqs, tuple(new_kv), None if new_cache is None else tuple(new_cache), staging, logits, info, h


class _Routed:
    """The routed-expert function handed to moe() under host residency; it records the new cache/staging."""

    def __init__(self, fn, staging):
        self.fn, self.staging = fn, staging

    def __call__(self, x, idx, w):
        return self.fn(self, x, idx, w)


def _host_routed(ctx: StepContext, layer: int, cache: list, staging, valid_flat, infos: list, prefill: bool):
    host, cfg = ctx.host, ctx.cfg
    E = cfg.num_experts

    def decode(self, x, idx, w):  # LRU cache: resolve, copy the misses in, compute from the slots
        idx = _stand_in_ids(idx, valid_flat)
        c = cache[layer]
        r = ffi.resolve(idx, c.lru, num_slots=host.slots, num_experts=E)
        slots = c.slots if "gather" in ctx.skip else ffi.gather(r.misses, r.info, c.slots, pool=host.pool,
                                                                   layer=layer, mode=host.gather_mode)
        cache[layer] = ExpertCache(lru=r.state, slots=slots)
        infos.append(r.info)
        return experts_gather(records_as_experts(host.layout, slots), x, r.slots, w)

    def chunk(self, x, idx, w):  # stage the experts this chunk hits, `staging` at a time
        idx = _stand_in_ids(idx, valid_flat)
        n = host.staging
        lane = jnp.arange(n)

        def fetch(area, ex, n_live):
            misses = jnp.where((lane < n_live)[:, None], jnp.stack([ex, lane], axis=1), -1).astype(jnp.int32)
            note = jnp.stack([n_live, n_live, 0, 0]).astype(jnp.int32)
            area = ffi.gather(misses, note, area, pool=host.pool, layer=layer, mode=host.gather_mode)
            return area, records_as_experts(host.layout, area)

        out, self.staging = tiled_with_fetch(fetch, self.staging, x, idx, w, E, tiles_per_step=n)
        return out

    return _Routed(chunk if prefill else decode, staging)


# ----- the programs ----------------------------------------------------------------------------------------------
TOP_LOGPROBS = 20  # alternatives returned per token when logprobs are asked for (OpenAI's maximum)


def apply_mask(logits: Array, bits: Array) -> Array:
    """Keep the tokens allowed by a packed bitmask bits [..., ceil(V/32)] int32 (token v: bit v%32 of word
    v//32, llguidance's layout); the rest get -inf."""
    v = jnp.arange(logits.shape[-1])
    allowed = (jnp.take(bits, v // 32, axis=-1) >> (v % 32)) & 1
    return jnp.where(allowed != 0, logits, -jnp.inf)


def logprobs_of(logits: Array, tokens: Array):
    """(log-probability of tokens [...], top ids [..., 20], top log-probabilities [..., 20]) under the model's
    own distribution (before temperature or masks)."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0]
    top_lp, top_id = lax.top_k(lp, TOP_LOGPROBS)
    return chosen, top_id.astype(jnp.int32), top_lp


def mtp_step(params: Params, ctx: StepContext, kv: PagedKV, hidden: Array, next_tokens: Array, positions: Array,
             valid: Array, page_table: Array) -> tuple[PagedKV, Array]:
    """The MTP head over new tokens: pairs (main state at t, token t+1) -> its KV at t, and the draft logits for
    token t+2 at each row's last real token. hidden [b, T, W], next_tokens [b, T]."""
    cfg, layer = ctx.cfg, params.mtp.layer
    s, eps, dt = cfg.hc_count, cfg.rms_norm_eps, layer.moe.router.dtype
    b, t, _ = hidden.shape
    h = mtp_mod.mtp_input(params, cfg, hidden, next_tokens)
    x, inj = hc.mix(layer.attn_hc, h, s, eps)
    y, kv = attention_paged(layer.mixer, cfg, x.astype(dt), positions, valid, kv, page_table)
    h = hc.combine(h, inj, y)
    x, inj = hc.mix(layer.mlp_hc, h, s, eps)
    h = hc.combine(h, inj, moe(layer.moe, cfg, x.astype(dt).reshape(b * t, -1)).reshape(b, t, -1))
    last = jnp.maximum(jnp.sum(valid, axis=1) - 1, 0)
    return kv, mtp_mod.mtp_logits(params, cfg, h[jnp.arange(b), last])


def decode_step(params: Params, ctx: StepContext, st: DecodeState, want_logits: bool = False, masks=None,
                want_logprobs: bool = False):
    """One token for every active slot: feeds last_token, samples the next. Returns (state, tokens [B], info
    [, logits [B, V]]). With masks [B, ceil(V/32)] (grammar constraints) sampling keeps to the allowed tokens;
    want_logprobs returns (state, tokens, info, logprobs_of(...)). With ctx.mtp, info["draft"] [B] holds the
    MTP head's greedy draft of the token after the sampled one."""
    n_new = st.active.astype(jnp.int32)
    positions = st.seqs.lengths[:, None]
    seqs, kv, cache, staging, logits, info, hidden = forward_tokens(
        params, ctx, st.seqs, st.kv, st.cache, st.staging, st.last_token[:, None], n_new, prefill=False)
    tokens = sample(logits if masks is None else apply_mask(logits, masks), st.sampling, seqs.lengths)
    last = jnp.where(st.active, tokens, st.last_token)
    mtp_kv = st.mtp_kv
    if ctx.mtp:
        mtp_kv, draft_logits = mtp_step(params, ctx, mtp_kv, hidden, tokens[:, None], positions,
                                        st.active[:, None], seqs.page_table)
        info["draft"] = jnp.argmax(draft_logits, axis=-1).astype(jnp.int32)
        if want_logits:
            info["draft_logits"] = draft_logits
    out = dataclasses.replace(st, seqs=seqs, kv=kv, cache=cache, staging=staging, last_token=last,
                              mtp_kv=mtp_kv), tokens, info
    if want_logprobs:
        out = out + (logprobs_of(logits, tokens),)
    return out + (logits,) if want_logits else out


def _row(tree, slot):
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, slot, axis=0, keepdims=True), tree)


def _set_row(tree, slot, row):
    return jax.tree.map(lambda a, r: lax.dynamic_update_index_in_dim(a, r.astype(a.dtype), slot, axis=0), tree, row)


def prefill_step(params: Params, ctx: StepContext, st: DecodeState, slot: Array, tokens: Array, n: Array,
                 last: Array, mask: Array, follow: Array, want_logits: bool = False, score: Array | None = None):
    """The next n (<= C) prompt tokens of slot `slot` (tokens [C], padded); `follow` is the prompt token after
    them (for the MTP head; unused when `last`). With `last`, the slot samples its first generated token (within
    `mask`, a packed [ceil(V/32)] bitmask) and starts decoding.
    Returns (state, token, info, logprobs_of(token)[, logits [V]]). With `score` [C] (the token after each
    prompt token), returns instead (state, info, logprobs_of(score) per position): prompt scoring."""
    seq = _row(st.seqs, slot)
    positions = seq.lengths[:, None] + jnp.arange(tokens.shape[0])[None, :]
    seq, kv, cache, staging, logits, info, hidden = forward_tokens(
        params, ctx, seq, st.kv, st.cache, st.staging, tokens[None, :], n[None], prefill=True,
        all_logits=score is not None)
    seqs = _set_row(st.seqs, slot, seq)
    token = None
    if score is None:
        token = sample(apply_mask(logits, mask[None]), _row(st.sampling, slot), seq.lengths)[0]
    mtp_kv = st.mtp_kv
    if ctx.mtp:  # pairs (state at t, token t+1): the prompt's own next tokens, then what follows the chunk
        after = follow if score is not None else jnp.where(last, token, follow)
        nxt = jnp.concatenate([tokens[1:], tokens[:1]]).at[n - 1].set(after)
        valid = jnp.arange(tokens.shape[0]) < n
        mtp_kv, draft_logits = mtp_step(params, ctx, mtp_kv, hidden, nxt[None], positions, valid[None],
                                        seqs.page_table[slot][None])
        info["draft"] = jnp.argmax(draft_logits[0]).astype(jnp.int32)
        if want_logits:
            info["draft_logits"] = draft_logits[0]
    if score is not None:
        return dataclasses.replace(st, seqs=seqs, kv=kv, cache=cache, staging=staging, mtp_kv=mtp_kv), info, \
            logprobs_of(logits[0], score)
    active = st.active.at[slot].set(last | st.active[slot])
    last_token = st.last_token.at[slot].set(jnp.where(last, token, st.last_token[slot]))
    out = dataclasses.replace(st, seqs=seqs, kv=kv, cache=cache, staging=staging, active=active,
                              last_token=last_token, mtp_kv=mtp_kv), token, info, \
        jax.tree.map(lambda a: a[0], logprobs_of(logits, token[None]))
    return out + (logits[0],) if want_logits else out


def admit(ctx: StepContext, st: DecodeState, slot: Array, pages: Array, sampling: SamplingRows) -> DecodeState:
    """Start a fresh sequence in `slot`: its KV pages [max_pages], empty state, its sampling settings."""
    cfg = ctx.cfg
    fresh = jax.tree.map(lambda a: jnp.zeros(a.shape[1:], a.dtype), st.seqs)
    ple = fresh.ple
    if ple is not None:
        ple = ple_mod.PLEState(conv=ple.conv, context=jnp.full_like(ple.context, cfg.eos_token_id))
    fresh = SeqState(lengths=fresh.lengths, page_table=pages.astype(jnp.int32), gdn=fresh.gdn, ple=ple,
                     hidden=fresh.hidden)
    seqs = jax.tree.map(lambda a, r: a.at[slot].set(r), st.seqs, fresh)
    sampling = jax.tree.map(lambda a, r: a.at[slot].set(r), st.sampling, sampling)
    return dataclasses.replace(st, seqs=seqs, sampling=sampling, active=st.active.at[slot].set(False),
                               last_token=st.last_token.at[slot].set(0))


def release(st: DecodeState, slot: Array) -> DecodeState:
    return dataclasses.replace(st, active=st.active.at[slot].set(False))


def init_state(params: Params, ctx: StepContext, max_batch: int, num_pages: int, dtype) -> DecodeState:
    """An empty state: no sequence active, all pages free, an empty expert cache."""
    cfg = ctx.cfg
    B = max_batch
    gdn_states, kv = [], []

    def pages(attn: Attention) -> PagedKV:
        ik = None
        if attn.indexer is not None:
            ik = jnp.zeros((num_pages, ctx.page_size, cfg.indexer_head_dim), dtype)
        shape = (num_pages, ctx.page_size, cfg.num_key_value_heads, cfg.head_dim)
        return PagedKV(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), index_keys=ik)

    for layer in params.layers:
        if isinstance(layer.mixer, Attention):
            kv.append(pages(layer.mixer))
        else:
            g = gdn.init_state(cfg, dtype)
            gdn_states.append(jax.tree.map(lambda a: jnp.zeros((B,) + a.shape, a.dtype), g))
    ple = None
    if ctx.table is not None:
        p = ple_mod.init_state(cfg, jnp.float32)
        ple = ple_mod.PLEState(conv=jnp.zeros((B,) + p.conv.shape, jnp.float32),
                               context=jnp.full((B, 2), cfg.eos_token_id, jnp.int32))
    seqs = SeqState(lengths=jnp.zeros(B, jnp.int32), page_table=jnp.zeros((B, ctx.max_pages), jnp.int32),
                    gdn=tuple(gdn_states), ple=ple, hidden=jnp.zeros((B, cfg.hc_hidden_size), jnp.float32))
    cache = staging = None
    if ctx.host is not None:
        h = ctx.host
        R = h.layout.record_bytes
        cache = tuple(ExpertCache(lru=jnp.asarray(ffi.lru_state_init(h.slots, cfg.num_experts)),
                                  slots=jnp.zeros((h.slots, R), jnp.uint8)) for _ in params.layers)
        staging = jnp.zeros((h.staging, R), jnp.uint8)
    mtp_kv = pages(params.mtp.layer.mixer) if ctx.mtp else None
    return DecodeState(seqs, tuple(kv), cache, staging, SamplingRows.init(B), jnp.zeros(B, bool),
                       jnp.zeros(B, jnp.int32), mtp_kv)
