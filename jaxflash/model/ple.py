"""PLE: the hashed n-gram embedding added to the residual before decoder layer 1 (docs/model.md §6).

Each token's bigram and trigram (raw token ids, cut at EOS) are hashed into 16 heads of a huge table; the
16 rows form a [16 * d] embedding that gates a shared value per residual stream, followed by a dilated
depthwise conv. The hashing runs on the host (int64 arithmetic, `ngram_ids`); the table may live on the host
too, in which case the caller gathers the rows and passes them in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from .base import Array, linear, pytree_dataclass, silu, up
from .norms import rms_norm


@pytree_dataclass
class PLE:
    key_proj: Array  # [W, D]
    value_proj: Array  # [H, D]
    norm_key: Array  # [W]
    norm_query: Array  # [W]
    norm_conv: Array  # [W]
    conv1d: Array  # [W, K] depthwise, dilation ngram_size (checkpoint [W, 1, K])
    table: Array | None  # n-gram table [rows, d] on the device (bf16/f32, or fp8 with table_scale); None: on host
    table_scale: Array | None  # float32 scalar global scale of an FP8 table


@pytree_dataclass
class PLEState:
    conv: Array  # [(K-1)*dilation, W]: the last rows of the normalised gated value
    context: Array  # [ngram_size-1] int32: the last token ids (initially eos)


def init_state(cfg: ModelConfig, dtype) -> PLEState:
    return PLEState(
        conv=jnp.zeros((cfg.ple_conv_state_len, cfg.hc_hidden_size), dtype),
        context=jnp.full((cfg.ngram_size - 1,), cfg.eos_token_id, jnp.int32),
    )


def ngram_ids(cfg: ModelConfig, tokens, context=None, ple_index: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Host-side hashing (numpy, int64). tokens [..., T], context [..., 2] (default eos) ->
    (ids [..., T, 16] int32 global table rows, new context [..., 2]).

    hist = context ++ tokens. The token k places back counts only if no EOS lies between it and the current
    token (exclusive of the current one); otherwise eos stands in. Products stay below 2^63 by construction.
    """
    eos = cfg.eos_token_id
    tokens = np.asarray(tokens, np.int64)
    if context is None:
        context = np.full(tokens.shape[:-1] + (2,), eos, np.int64)
    hist = np.concatenate([np.asarray(context, np.int64), tokens], axis=-1)
    t0, t1, t2 = hist[..., 2:], hist[..., 1:-1], hist[..., :-2]
    t2 = np.where(t1 == eos, eos, t2)  # an EOS at t-1 cuts the trigram (tok1 is then eos already)
    m = cfg.ngram_multipliers(ple_index)
    mix2 = (t0 * m[0]) ^ (t1 * m[1])
    mix3 = mix2 ^ (t2 * m[2])
    sizes = np.asarray(cfg.ngram_head_vocab_sizes(ple_index), np.int64)
    offsets = np.asarray(cfg.ngram_head_offsets(ple_index), np.int64)
    h = cfg.heads_per_ngram
    ids = np.concatenate([mix2[..., None] % sizes[:h] + offsets[:h],
                          mix3[..., None] % sizes[h:] + offsets[h:]], axis=-1)
    return ids.astype(np.int32), hist[..., -2:].astype(np.int32)


def ngram_ids_traced(cfg: ModelConfig, tokens: Array, context: Array) -> Array:
    """ngram_ids inside a traced program (jit/vmap): the hashing runs on the host through a callback."""
    shape = jax.ShapeDtypeStruct(tokens.shape + (cfg.num_ngram_heads,), jnp.int32)
    return jax.pure_callback(lambda t, c: ngram_ids(cfg, t, c)[0], shape, tokens, context,
                             vmap_method="broadcast_all")


def gather_rows(p: PLE, ids: Array) -> Array:
    """Rows of a device-resident table for ids [T, 16] -> [T, 16, d] in float32 (FP8 rows times the scale)."""
    rows = up(p.table[ids])
    return rows * p.table_scale if p.table_scale is not None else rows


def commit(hist: Array, cfg: ModelConfig, n: Array | int) -> Array:
    """The conv state after the first n tokens of a verify step, from its history (`ple(pending=True)`)."""
    return jax.lax.dynamic_slice_in_dim(hist, n, cfg.ple_conv_state_len, axis=0)


def ple(p: PLE, cfg: ModelConfig, h: Array, rows: Array, conv_state: Array,
        n_valid: Array | int | None = None, pending: bool = False) -> tuple[Array, Array]:
    """h [T, W] (float32 residual), rows [T, 16, d] -> (PLE output [T, W] float32, new conv state). pending:
    return the conv history [state; T rows] instead of the state (a verify step: `commit` keeps a prefix)."""
    t = h.shape[0]
    s, hid = cfg.hc_count, cfg.hidden_size
    dt = p.key_proj.dtype
    eps = cfg.rms_norm_eps
    emb = rows.reshape(t, -1).astype(dt)  # head-major [T, 16*d]

    key = rms_norm(linear(emb, p.key_proj), p.norm_key, eps, group=hid).reshape(t, s, hid)
    value = up(linear(emb, p.value_proj))  # one value shared by all streams
    query = rms_norm(h, p.norm_query, eps, group=hid).reshape(t, s, hid)
    g = jnp.sum(up(key) * query, axis=-1) / hid ** 0.5
    g = jnp.sign(g) * jnp.sqrt(jnp.maximum(jnp.abs(g), 1e-6))
    gated = (jax.nn.sigmoid(g)[..., None] * value[:, None, :]).reshape(t, s * hid)
    gated_normed = rms_norm(gated, p.norm_conv, eps, group=hid)

    # causal dilated depthwise conv: tap j reads the row (K-1-j)*dilation steps back
    dil, k = cfg.ple_conv_dilation, cfg.ple_conv_kernel_size
    hist = jnp.concatenate([conv_state.astype(gated_normed.dtype), gated_normed], axis=0)
    w = p.conv1d.astype(hist.dtype)
    conv = sum(hist[j * dil : j * dil + t] * w[:, j] for j in range(k))
    out = gated + silu(conv)

    if pending:
        return out, hist.astype(conv_state.dtype)
    new_state = commit(hist, cfg, t if n_valid is None else n_valid).astype(conv_state.dtype)
    return out, new_state
