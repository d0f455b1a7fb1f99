"""Gated full attention with the QSA indexer (SPEC.md section 8): GQA, partial RoPE, q/k norms and a sigmoid
output gate per (head, dim)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..config import ModelConfig
from . import qsa
from .base import Array, linear, pytree_dataclass, up
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


def attention(p: Attention, cfg: ModelConfig, x: Array, positions: Array) -> Array:
    """Full-sequence attention over x [T, H] at `positions` [T] (0-based, the sequence's own tokens)."""
    t = x.shape[0]
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)

    qg = linear(x, p.q_proj).reshape(t, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    q = apply_rope(rms_norm(q, p.q_norm, cfg.rms_norm_eps), cos, sin)
    k = apply_rope(rms_norm(linear(x, p.k_proj).reshape(t, nkv, hd), p.k_norm, cfg.rms_norm_eps), cos, sin)
    v = linear(x, p.v_proj).reshape(t, nkv, hd)

    mask = positions[:, None] >= positions[None, :]
    if p.indexer is not None:
        q_index, raw_keys = qsa.queries_and_raw_keys(p.indexer, cfg, x, cos, sin)
        kb = qsa.block_keys(p.indexer, cfg, raw_keys, t // cfg.indexer_compress_ratio)
        mask &= qsa.selection_mask(cfg, q_index, kb, positions, t)

    o = attend(q, k, v, mask).reshape(t, nh * hd)
    o = o * jax.nn.sigmoid(up(gate.reshape(t, nh * hd))).astype(o.dtype)
    return linear(o, p.o_proj)
