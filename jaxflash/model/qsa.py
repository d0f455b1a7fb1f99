"""QSA block indexer (docs/model.md §9): which earlier tokens each query of a full-attention layer may see.

Keys are mean-pooled over blocks of `r` (=indexer_compress_ratio) consecutive tokens, aligned to the sequence's
first token. Each query scores every complete block it can see, keeps the top `block_topk` blocks, and always
keeps the incomplete tail block. With at most `block_topk` complete blocks visible, QSA equals dense attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from .base import Array, linear, matmul, pytree_dataclass, top_k_mask, up
from .norms import rms_norm
from .rope import apply_rope, rope_cos_sin


@pytree_dataclass
class Indexer:
    index_qk_proj: Array  # [(n_heads + 1) * dI, H]: the query heads, then one raw key
    q_norm: Array  # q_layernorm.weight [dI]
    k_norm: Array  # k_layernorm.weight [dI]


def queries_and_raw_keys(p: Indexer, cfg: ModelConfig, x: Array, cos: Array, sin: Array) -> tuple[Array, Array]:
    """Index queries [T, n_heads, dI] (normed, RoPE'd) and the raw keys [T, dI] that the cache keeps."""
    n, d = cfg.indexer_n_heads, cfg.indexer_head_dim
    qk = linear(x, p.index_qk_proj)
    q = qk[:, : n * d].reshape(-1, n, d)
    q = apply_rope(rms_norm(q, p.q_norm, cfg.rms_norm_eps), cos, sin)
    return q, qk[:, n * d :]


def block_keys(p: Indexer, cfg: ModelConfig, raw_keys: Array, n_blocks: int) -> Array:
    """Keys of the first `n_blocks` complete blocks [n_blocks, dI]: mean (float32), k-norm, RoPE at the
    position of each block's first token."""
    r = cfg.indexer_compress_ratio
    kb = up(raw_keys[: n_blocks * r]).reshape(n_blocks, r, -1).mean(axis=1).astype(raw_keys.dtype)
    kb = rms_norm(kb, p.k_norm, cfg.rms_norm_eps)
    cos, sin = rope_cos_sin(jnp.arange(n_blocks) * r, cfg.rotary_dim, cfg.rope_theta)
    return apply_rope(kb[:, None, :], cos, sin)[:, 0, :]


def block_scores(cfg: ModelConfig, q_index: Array, kb: Array) -> Array:
    """Float32 [T, n_blocks]: each query's score of each block, sum_h relu(q_h . k_b) / sqrt(dI)."""
    scores = matmul("thd,bd->thb", q_index, kb.astype(q_index.dtype))  # bf16: exact products, float32 sums
    return jnp.sum(jax.nn.relu(scores), axis=1) / (cfg.indexer_head_dim ** 0.5)


def choose_blocks(cfg: ModelConfig, scores: Array, q_pos: Array) -> Array:
    """Bool [T, n_blocks] from the scores [T, n_blocks] (block_scores): the complete blocks the query at position
    q_pos[t] keeps.

    A query at position p sees nb = (p + 1) // r complete blocks and keeps the top min(block_topk, nb) of them.
    Equal scores (common: a block whose every head product is negative scores exactly 0) go to the earlier
    block; the reference's torch.topk breaks such ties in no documented order."""
    n_blocks = scores.shape[-1]
    visible = (q_pos + 1) // cfg.indexer_compress_ratio  # complete blocks visible to each query
    valid = jnp.arange(n_blocks)[None, :] < visible[:, None]
    k = min(cfg.block_topk, n_blocks)
    return top_k_mask(jnp.where(valid, scores, -jnp.inf), k) & valid


def block_choice(cfg: ModelConfig, q_index: Array, kb: Array, q_pos: Array) -> Array:
    """Bool [T, n_blocks]: the complete blocks the query at position q_pos[t] keeps (choose_blocks of
    block_scores)."""
    return choose_blocks(cfg, block_scores(cfg, q_index, kb), q_pos)


def selection_mask(cfg: ModelConfig, q_index: Array, kb: Array, q_pos: Array, n_keys: int) -> Array:
    """Bool [T, n_keys]: key position s is selected for the query at position q_pos[t] (choice_mask of
    block_choice). Causality is not applied here."""
    t = q_pos.shape[0]
    chosen = jnp.zeros((t, 0), bool) if kb.shape[0] == 0 else block_choice(cfg, q_index, kb, q_pos)
    return choice_mask(cfg.indexer_compress_ratio, chosen, q_pos, n_keys)


def choice_mask(r: int, chosen: Array, q_pos: Array, n_keys: int) -> Array:
    """Bool [T, n_keys] from a choice of complete blocks of r keys ([T, n_blocks]): key s lies in a kept block,
    or in the query's incomplete tail block (s >= r ((p + 1) // r))."""
    n_blocks = chosen.shape[-1]
    s = jnp.arange(n_keys)
    tail = s[None, :] >= ((q_pos + 1) // r * r)[:, None]
    if n_blocks == 0:
        return tail
    block_of_key = jnp.minimum(s // r, n_blocks - 1)
    in_chosen = jnp.where(s[None, :] < n_blocks * r, chosen[:, block_of_key], False)
    return in_chosen | tail
