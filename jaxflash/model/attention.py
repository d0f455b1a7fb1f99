"""Gated full attention with the QSA indexer (docs/model.md §8, §9): GQA, partial RoPE, q/k norms and a
sigmoid output gate per (head, dim), over a paged KV cache.

Decode and verify steps may run in kernels (`attention`'s `kernel`): jaxflash.kernels.attention_prep norms and
ropes their new rows, writes them into the pages and scores QSA's blocks; jaxflash.kernels.attention_decode
attends over the pages. Otherwise steps of at most ATTEND_Q_BLOCK new tokens per sequence (decode, speculative
verify: inside CUDA graphs, which capture no while loops) score all their queries against the whole cache at
once (`attend`). Longer prefill chunks run `attend_blocked`: query blocks against key blocks with an online
softmax, skipping the key blocks past the block's last position, so that the scores never exceed
[n_heads, q_block, k_block]."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from ..config import ModelConfig
from ..kernels import attention_decode, attention_prep
from . import qsa
from .base import (Array, TokenBatch, acc_dtype, linear, linear_rows, linear_split, matmul, pytree_dataclass,
                   stacked_part, up)
from .norms import rms_norm
from .rope import apply_rope, rope_cos_sin


@pytree_dataclass
class Attention:
    """An attention layer's weights. q_proj, k_proj and v_proj are stored stacked (base.stack_rows: one matmul
    reads x for all three); the properties below are the checkpoint's tensors."""

    qkv_proj: Array  # [n_heads * 2 * head_dim + 2 * n_kv * head_dim, H]: q_proj | k_proj | v_proj
    o_proj: Array  # [H, n_heads * head_dim]
    q_norm: Array  # [head_dim]
    k_norm: Array  # [head_dim]
    indexer: qsa.Indexer | None

    def _edges(self) -> tuple[int, int]:
        """Where q_proj's and k_proj's rows of `qkv_proj` end."""
        q = 2 * self.o_proj.shape[-1]
        return q, q + (self.qkv_proj.shape[0] - q) // 2

    q_proj = stacked_part("qkv_proj", 0)  # [n_heads * 2 * head_dim, H]: per head [query | gate]
    k_proj = stacked_part("qkv_proj", 1)  # [n_kv * head_dim, H]
    v_proj = stacked_part("qkv_proj", 2)  # [n_kv * head_dim, H]


def attend(q: Array, k: Array, v: Array, mask: Array) -> Array:
    """softmax(q k^T / sqrt(d) | mask) v, the softmax in float32. q [T, nh, d]; k, v [S, nkv, d]; mask [T, S]
    bool. Both products in q's dtype (base.matmul): in a bf16 model the scores are exact products summed in
    float32, and the weights meet v rounded to bf16, below the output's own rounding."""
    t, nh, d = q.shape
    nkv = k.shape[1]
    qg = q.reshape(t, nkv, nh // nkv, d)
    s = matmul("tkgd,skd->kgts", qg, k.astype(q.dtype)) * d ** -0.5
    s = jnp.where(mask, s, -jnp.inf)
    w = jax.nn.softmax(s, axis=-1)
    o = matmul("kgts,skd->tkgd", w.astype(q.dtype), v.astype(q.dtype))
    return o.reshape(t, nh, d).astype(q.dtype)


# The blocked form's sizes (attention() picks it when T > the query block): on the GPU each key block is two
# batched matmuls of [n_kv, g * q_block, d] x [d, k_block]; at 24 heads the scores are 100 MB per sequence.
# On the H200 (full preset, QSA, bf16 cache of 65536 rows) a chunk of 8192 tokens at the end of the context takes
# 438 ms in 0.8 GiB of temporaries (512 x 1024: 464 ms; 1024 x 2048: 369 ms, but T up to 1024 would then keep
# the unblocked [T, S] scores, 12 GiB); 32 unblocked chunks of 256 take 400 ms in 3 GiB at any context length.
ATTEND_Q_BLOCK = 512
ATTEND_K_BLOCK = 2048


def attend_blocked(q: Array, k: Array, v: Array, pos: Array, valid: Array | None = None, select=None,
                   select_args: tuple = (), *, q_block: int = ATTEND_Q_BLOCK, k_block: int = ATTEND_K_BLOCK) -> Array:
    """`attend` with the mask (pos[t] >= s) & select(...) for queries at positions pos [T] (int32), computed over
    blocks of q_block queries and min(k_block, S) keys with an online softmax (running max and sum per row).

    select(pos_block [q_block], *args_block) -> [q_block, S] bool narrows the causal mask for one query block;
    select_args are per-query arrays [T, ...] that it receives sliced to the block (rows past T are zeros at
    position -1). Key blocks past the block's last valid position (valid [T], default all) are not computed.
    A row that sees no key returns 0; invalid rows may see fewer keys than their position allows.

    Memory per call (outside the output): the scores and weights, 2 * n_heads * q_block * k_block floats, the
    accumulator n_heads * q_block * (d + 2) floats, and what `select` makes for one query block; never [T, S]."""
    t, nh, d = q.shape
    n_keys, nkv = k.shape[:2]
    g = nh // nkv
    qb, kblk = q_block, min(k_block, n_keys)
    n_qb, n_kb = -(-t // qb), -(-n_keys // kblk)
    pad = n_qb * qb - t
    valid = jnp.ones(t, bool) if valid is None else valid

    def blocks(a, fill):  # [T, ...] -> [n_qb, q_block, ...], padding rows filled
        a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1), constant_values=fill)
        return a.reshape(n_qb, qb, *a.shape[1:])

    def query_block(xs):
        q_b, pos_b, valid_b, args_b = xs
        qg = q_b.reshape(qb, nkv, g, d)
        sel = None if select is None else select(pos_b, *args_b)
        # keys after the block's last real query are causal-masked for all its real rows: skip their blocks
        last = jnp.max(jnp.where(valid_b, pos_b, -1))
        trips = jnp.clip((last + kblk) // kblk, 0, n_kb).astype(jnp.int32)

        def key_block(j, carry):
            m, l, acc = carry  # running max [nkv, g, qb], sum [nkv, g, qb], weighted values [nkv, g, qb, d]
            # the last block, when kblk does not divide S, starts early; its keys before j * kblk are masked
            s0 = jnp.minimum(j * kblk, n_keys - kblk)
            keys = s0 + jnp.arange(kblk)
            k_j = lax.dynamic_slice_in_dim(k, s0, kblk).astype(q.dtype)
            v_j = lax.dynamic_slice_in_dim(v, s0, kblk).astype(q.dtype)
            s = matmul("tkgd,skd->kgts", qg, k_j) * d ** -0.5
            see = (pos_b[:, None] >= keys[None, :]) & (keys >= j * kblk)[None, :]
            if sel is not None:
                see &= lax.dynamic_slice_in_dim(sel, s0, kblk, axis=1)
            s = jnp.where(see, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that saw no key yet: no -inf - -inf
            scale = jnp.exp(m - m_use)
            w = jnp.exp(s - m_use[..., None])
            acc = acc * scale[..., None] + matmul("kgts,skd->kgtd", w.astype(q.dtype), v_j)
            return m_new, l * scale + jnp.sum(w, axis=-1), acc

        f = acc_dtype(q.dtype)
        init = (jnp.full((nkv, g, qb), -jnp.inf, f), jnp.zeros((nkv, g, qb), f), jnp.zeros((nkv, g, qb, d), f))
        _, l, acc = lax.fori_loop(jnp.int32(0), trips, key_block, init)
        o = acc / jnp.where(l > 0, l, 1.0)[..., None]
        return o.transpose(2, 0, 1, 3).reshape(qb, nh, d)

    xs = (blocks(q, 0), blocks(pos, -1), blocks(valid, False), tuple(blocks(a, 0) for a in select_args))
    o = lax.map(query_block, xs)
    return o.reshape(n_qb * qb, nh, d)[:t].astype(q.dtype)


@pytree_dataclass
class PagedKV:
    """One attention layer's KV cache, shared by all sequences: P pages of `page` token rows. A sequence owns
    the pages its row of the page table [max_pages] names; token position s lives in page table[s // page] at
    row s % page. QSA's raw indexer keys are cached beside K and V (block keys are pooled from them).
    Page ids outside [0, P) in a page table mark pages a sequence does not own: writes there are dropped.
    A fresh full-sequence forward uses one page of T rows per sequence (`fresh`)."""

    k: Array  # [P, page, n_kv, head_dim]
    v: Array  # [P, page, n_kv, head_dim]
    index_keys: Array | None  # [P, page, dI]

    @staticmethod
    def empty(cfg: ModelConfig, num_pages: int, page_size: int, dtype, indexer: bool) -> PagedKV:
        shape = (num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
        ik = jnp.zeros((num_pages, page_size, cfg.indexer_head_dim), dtype) if indexer else None
        return PagedKV(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), index_keys=ik)


def write_pages(pages: Array, page_table: Array, positions: Array, valid: Array, values: Array) -> Array:
    """Store values [B, T, ...] at token positions [B, T] of each sequence; invalid rows, and rows past the
    pages a sequence owns, are dropped."""
    n_pages, size = pages.shape[:2]
    col = positions // size
    slot = jnp.take_along_axis(page_table, jnp.clip(col, 0, page_table.shape[1] - 1), axis=1)
    keep = valid & (col < page_table.shape[1]) & (slot >= 0) & (slot < n_pages)
    slot = jnp.where(keep, slot, n_pages)  # out of range: dropped by the scatter
    return pages.at[slot, positions % size].set(values.astype(pages.dtype), mode="drop")


def read_pages(pages: Array, table_row: Array) -> Array:
    """A sequence's whole cache [max_pages * page, ...] in position order (rows past its length are stale, and
    pages it does not own read as some other page: the causal mask hides both)."""
    got = pages[jnp.clip(table_row, 0, pages.shape[0] - 1)]
    return got.reshape(-1, *pages.shape[2:])


def attention(p: Attention, cfg: ModelConfig, x: Array, batch: TokenBatch, kv: PagedKV, kernel: bool = False, *,
              q_block: int | None = None, k_block: int | None = None) -> tuple[Array, PagedKV]:
    """Attention for the new tokens x [B, T, H] of `batch`, after their keys and values join each sequence's
    pages. Returns ([B, T, H], updated cache). Each query sees every cached key at or before its position,
    narrowed by QSA's block selection (blocks pooled from the cached raw indexer keys).

    T <= q_block (default ATTEND_Q_BLOCK): `attend`, with [T, S] scores per head (S = the sequence's cache rows).
    Longer: `attend_blocked` over q_block x k_block (default ATTEND_K_BLOCK) blocks, with QSA's selection made
    per query block: per sequence, besides its gathered cache rows, 2 * n_heads * q_block * k_block score floats
    and QSA's q_block * (indexer_n_heads * S / r floats + S bools), never [T, S].
    kernel: steps of few tokens (attention_decode.takes) run `_attention_kernels`: the new rows and QSA's block
    scores in jaxflash.kernels.attention_prep, the attention in jaxflash.kernels.attention_decode, which reads K
    and V in their pages (compiled on a GPU, interpreted elsewhere); QSA's ranking of the blocks stays in XLA."""
    q_block = ATTEND_Q_BLOCK if q_block is None else q_block
    k_block = ATTEND_K_BLOCK if k_block is None else k_block
    b, t = x.shape[:2]
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    if kernel and attention_decode.takes(nh, nkv, hd, t, kv.k.dtype) and attention_prep.takes(kv.k):
        return _attention_kernels(p, cfg, x, batch, kv)
    positions, valid, page_table = batch.positions, batch.valid, batch.page_table
    cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)  # [B, T, rd]

    qg, k, v = linear_split(x, p.qkv_proj, p._edges())
    qg = qg.reshape(b, t, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    q = apply_rope(rms_norm(q, p.q_norm, cfg.rms_norm_eps), cos, sin)
    k = apply_rope(rms_norm(k.reshape(b, t, nkv, hd), p.k_norm, cfg.rms_norm_eps), cos, sin)
    v = v.reshape(b, t, nkv, hd)
    kv = PagedKV(k=write_pages(kv.k, page_table, positions, valid, k),
                 v=write_pages(kv.v, page_table, positions, valid, v), index_keys=kv.index_keys)
    q_index = None
    if p.indexer is not None:
        q_index, raw = jax.vmap(lambda xx, c, s: qsa.queries_and_raw_keys(p.indexer, cfg, xx, c, s))(x, cos, sin)
        kv = PagedKV(kv.k, kv.v, write_pages(kv.index_keys, page_table, positions, valid, raw))
    o = jax.vmap(partial(_attend_sequence, p, cfg, kv, t, q_block, k_block))(q, positions, valid, page_table,
                                                                             q_index)
    return _output(p, o, gate), kv


def _output(p: Attention, o: Array, gate: Array) -> Array:
    """o_proj of the attended values o [B, T, nh, d] times the sigmoid of the output gate [B, T, nh, d]."""
    b, t = o.shape[:2]
    o = o.reshape(b, t, -1)
    o = o * jax.nn.sigmoid(up(gate.reshape(b, t, -1))).astype(o.dtype)
    return linear_rows(o, p.o_proj)


# Whether the kernel path scores QSA's blocks in attention_prep.block_scores (one kernel) rather than in XLA
# (pooling the raw keys into block keys, norm, RoPE and the product: three more kernels per layer). H200, one
# layer at 112 tokens: 59.1 against 62.2 us (benchmarks/RESULTS.md).
QSA_SCORES_KERNEL = True


def _attention_kernels(p: Attention, cfg: ModelConfig, x: Array, batch: TokenBatch,
                       kv: PagedKV) -> tuple[Array, PagedKV]:
    """attention() for a decode or verify step in kernels: attention_prep.new_rows norms and ropes the new rows
    where the projection wrote them and writes their K, V and index keys into the pages; QSA's blocks are scored
    in attention_prep.block_scores (QSA_SCORES_KERNEL) or XLA, and chosen in XLA (qsa.choose_blocks);
    attention_decode attends over the pages and applies the output gate."""
    b, t = x.shape[:2]
    nh, hd = cfg.num_attention_heads, cfg.head_dim
    positions, page_table = batch.positions, batch.page_table
    proj = linear_rows(x, p.qkv_proj)
    ix = p.indexer
    q, q_index, k_pages, v_pages, index_pages = attention_prep.new_rows(
        cfg, proj, None if ix is None else linear_rows(x, ix.index_qk_proj), positions, batch.valid, page_table,
        p.q_norm, p.k_norm, None if ix is None else ix.q_norm, kv.k, kv.v, kv.index_keys)
    kv = PagedKV(k_pages, v_pages, index_pages)
    chosen = None
    n_keys = page_table.shape[1] * kv.k.shape[1]
    if q_index is not None and n_keys >= cfg.indexer_compress_ratio:  # else every key is in the tail
        if QSA_SCORES_KERNEL:
            scores = attention_prep.block_scores(cfg, q_index, kv.index_keys, page_table, ix.k_norm)
            chosen = jax.vmap(partial(qsa.choose_blocks, cfg))(scores, positions)
        else:
            chosen = jax.vmap(lambda qi_b, pos_b, row: qsa.block_choice(cfg, qi_b, _block_keys(p, cfg, kv, row),
                                                                        pos_b))(q_index, positions, page_table)
    # the output gate is applied as the kernel combines its splits, from the gate columns of proj
    o = attention_decode.paged_attention(q, kv.k, kv.v, page_table, positions, chosen,
                                         r=cfg.indexer_compress_ratio, gate_rows=proj)
    return linear_rows(o.reshape(b, t, nh * hd), p.o_proj), kv


def _attend_sequence(p: Attention, cfg: ModelConfig, kv: PagedKV, t: int, q_block: int, k_block: int, q_b: Array,
                     pos_b: Array, valid_b: Array, row: Array, qi_b: Array | None) -> Array:
    """One sequence's attention (attention's path without the kernel) over its pages gathered in position
    order: `attend` for at most q_block queries, `attend_blocked` beyond."""
    keys, values = read_pages(kv.k, row), read_pages(kv.v, row)
    n_keys = keys.shape[0]
    kb = None if qi_b is None else _block_keys(p, cfg, kv, row)
    if t > q_block:
        select = None if kb is None else (lambda pos, qi: qsa.selection_mask(cfg, qi, kb, pos, n_keys))
        return attend_blocked(q_b, keys, values, pos_b, valid_b, select, () if kb is None else (qi_b,),
                              q_block=q_block, k_block=k_block)
    mask = pos_b[:, None] >= jnp.arange(n_keys)[None, :]
    if kb is not None:
        mask &= qsa.selection_mask(cfg, qi_b, kb, pos_b, n_keys)
    return attend(q_b, keys, values, mask)


def _block_keys(p: Attention, cfg: ModelConfig, kv: PagedKV, row: Array) -> Array:
    """QSA's keys of every complete block of a sequence's pages (page-table row `row`)."""
    raw = read_pages(kv.index_keys, row)
    return qsa.block_keys(p.indexer, cfg, raw, raw.shape[0] // cfg.indexer_compress_ratio)
