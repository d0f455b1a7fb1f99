"""Gated full attention with the QSA indexer (docs/model.md §8, §9): GQA, partial RoPE, q/k norms and a
sigmoid output gate per (head, dim), over a paged KV cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..config import ModelConfig
from . import qsa
from .base import Array, TokenBatch, linear, pytree_dataclass, up
from .norms import rms_norm
from .rope import apply_rope, rope_cos_sin


@pytree_dataclass
class Attention:
    q_proj: Array  # [n_heads * 2 * head_dim, H]: per head [query | gate]
    k_proj: Array  # [n_kv * head_dim, H]
    v_proj: Array  # [n_kv * head_dim, H]
    o_proj: Array  # [H, n_heads * head_dim]
    q_norm: Array  # [head_dim]
    k_norm: Array  # [head_dim]
    indexer: qsa.Indexer | None


def attend(q: Array, k: Array, v: Array, mask: Array) -> Array:
    """softmax(q k^T / sqrt(d) | mask) v in float32. q [T, nh, d]; k, v [S, nkv, d]; mask [T, S] bool."""
    t, nh, d = q.shape
    nkv = k.shape[1]
    qg = up(q).reshape(t, nkv, nh // nkv, d)
    s = jnp.einsum("tkgd,skd->kgts", qg, k.astype(qg.dtype), precision=lax.Precision.HIGHEST) * d ** -0.5
    s = jnp.where(mask, s, -jnp.inf)
    w = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("kgts,skd->tkgd", w, v.astype(w.dtype), precision=lax.Precision.HIGHEST)
    return o.reshape(t, nh, d).astype(q.dtype)


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


def attention(p: Attention, cfg: ModelConfig, x: Array, batch: TokenBatch, kv: PagedKV) -> tuple[Array, PagedKV]:
    """Attention for the new tokens x [B, T, H] of `batch`, after their keys and values join each sequence's
    pages. Returns ([B, T, H], updated cache). Each query sees every cached key at or before its position,
    narrowed by QSA's block selection (blocks pooled from the cached raw indexer keys)."""
    b, t = x.shape[:2]
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    positions, valid, page_table = batch.positions, batch.valid, batch.page_table
    cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)  # [B, T, rd]

    qg = linear(x, p.q_proj).reshape(b, t, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    q = apply_rope(rms_norm(q, p.q_norm, cfg.rms_norm_eps), cos, sin)
    k = apply_rope(rms_norm(linear(x, p.k_proj).reshape(b, t, nkv, hd), p.k_norm, cfg.rms_norm_eps), cos, sin)
    v = linear(x, p.v_proj).reshape(b, t, nkv, hd)
    kv = PagedKV(k=write_pages(kv.k, page_table, positions, valid, k),
                 v=write_pages(kv.v, page_table, positions, valid, v), index_keys=kv.index_keys)
    q_index = None
    if p.indexer is not None:
        q_index, raw = jax.vmap(lambda xx, c, s: qsa.queries_and_raw_keys(p.indexer, cfg, xx, c, s))(x, cos, sin)
        kv = PagedKV(kv.k, kv.v, write_pages(kv.index_keys, page_table, positions, valid, raw))

    def one(q_b, pos_b, row, qi_b):
        keys, values = read_pages(kv.k, row), read_pages(kv.v, row)
        n_keys = keys.shape[0]
        mask = pos_b[:, None] >= jnp.arange(n_keys)[None, :]
        if qi_b is not None:
            kb = qsa.block_keys(p.indexer, cfg, read_pages(kv.index_keys, row), n_keys // cfg.indexer_compress_ratio)
            mask &= qsa.selection_mask(cfg, qi_b, kb, pos_b, n_keys)
        return attend(q_b, keys, values, mask)

    o = jax.vmap(one)(q, positions, page_table, q_index).reshape(b, t, nh * hd)
    o = o * jax.nn.sigmoid(up(gate.reshape(b, t, nh * hd))).astype(o.dtype)
    return linear(o, p.o_proj), kv
