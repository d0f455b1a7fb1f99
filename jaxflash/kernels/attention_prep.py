"""The attention layer's work around the paged attention kernel in a decode or verify step, in two kernels per
layer (Pallas; Triton backend on a GPU) where XLA spent about twenty small ones.

`new_rows`, one program per new token, takes the rows of the stacked q|k|v projection (and of QSA's index
projection) where the GEMV wrote them and does what jaxflash.model.attention does for them before attending:
  * the q/k RMSNorms (zero-centred weights) and the partial NeoX RoPE of the queries and keys, and the same for
    QSA's index queries;
  * the writes of the token's K, V and raw index key into its sequence's pages, in place (the page buffers are
    aliased in and out); a padding token, or one whose page the sequence does not own, writes nothing.
It returns the roped queries and index queries. RoPE's rotate-half is a second load of the same row with the
columns permuted (a register tile has no cheap column shuffle): the norm is per row, so the permuted row normed
with the permuted weight is the normed row permuted.

`block_scores`, programs of (sequence, BLOCKS QSA blocks), scores every complete block of a sequence's pages
as qsa.block_choice does: each block's raw keys pooled (mean), normed and roped at the block's first position,
then sum_h relu(q_h . k_b) / sqrt(dI) for each query of the step. Pooled block keys are not kept anywhere, so
this reads the sequence's raw keys once per step (1 MB of the 4096-key bucket at full size) in one kernel. The
block choice itself (rank, top-k, the visible blocks) stays in XLA: one fusion.

Both round where the model rounds (the norms and RoPE in the compute dtype, as norms.rms_norm and
rope.apply_rope do). Their pure-jnp twins are the model's own code (attention.attention's XLA path,
qsa.block_keys and qsa.block_scores): the CPU path and the tests' oracle (the tests run these kernels in
interpret mode). Triton loads need power-of-two shapes: head counts are padded with masked rows.

Not wired into attention.attention yet: on the H100, new_rows takes 7.4 us per layer, but block_scores 79 us
(16 programs at batch 1 and 4096 keys, each a chain of gathered loads: too few programs), and the layer's QSA
choice differed from XLA's at 4000 tokens in bf16 (benchmarks/RESULTS.md, "Kernels around the attention and a
product kernel, measured").
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ..config import ModelConfig
from . import compiler_params, dot, on_gpu

Array = jax.Array
BLOCKS = 64  # QSA blocks per program of block_scores


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, (n - 1).bit_length()))


def inv_freq(cfg: ModelConfig) -> Array:
    """RoPE's inverse frequencies [rotary_dim / 2], as rope.rope_cos_sin computes them (a constant to XLA)."""
    rd = cfg.rotary_dim
    return 1.0 / (cfg.rope_theta ** (jnp.arange(0, rd, 2, dtype=jnp.float32) / rd))


def _norm_rope(load, weight_ref, freq_ref, position, d: int, rd: int, eps: float, dt):
    """RMSNorm (weight 1 + w) and NeoX RoPE of the first rd of d columns, for the rows load(cols) returns
    ([R, d] from the column indices [1, d]) at `position` (a scalar or [R, 1]); rounded to dt as the model
    rounds. The rotated half comes from a second load with permuted columns (see the module docstring)."""
    f32 = jnp.float32
    half = rd // 2
    cols = jnp.arange(d, dtype=jnp.int32)[None, :]
    src = jnp.where(cols < half, cols + half, jnp.where(cols < rd, cols - half, cols))
    x, xr = load(cols).astype(f32), load(src).astype(f32)
    rs = jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / d + eps)
    y = (x * rs * (1.0 + weight_ref[cols].astype(f32))).astype(dt)
    yr = (xr * rs * (1.0 + weight_ref[src].astype(f32))).astype(dt)
    yr = jnp.where(cols < half, -yr, yr)
    angle = position.astype(f32) * freq_ref[jnp.minimum(cols % half, half - 1)]
    roped = y * jnp.cos(angle).astype(dt) + yr * jnp.sin(angle).astype(dt)
    return jnp.where(cols < rd, roped, y)


def _rows_kernel(proj_ref, iproj_ref, pos_ref, live_ref, table_ref, q_norm_ref, k_norm_ref, iq_norm_ref, freq_ref,
                 k_ref, v_ref, ik_ref, q_out_ref, iq_out_ref, k_out_ref, v_out_ref, ik_out_ref, *, nh: int, nkv: int,
                 d: int, ni: int, di: int, rd: int, eps: float, t_new: int, page: int, n_pages: int,
                 max_pages: int, indexer: bool):
    del k_ref, v_ref, ik_ref  # aliased to k_out_ref, v_out_ref, ik_out_ref: written in place
    dt = q_out_ref.dtype
    n = pl.program_id(0)  # token row b T + t
    b = n // t_new
    pos = pos_ref[n]
    width = nh * 2 * d + 2 * nkv * d  # the projection row: per head [query | gate], then k, then v
    cols = jnp.arange(d, dtype=jnp.int32)[None, :]

    # where the token's K, V and index key go: write_pages's rule (dropped when not live or the page not owned)
    col = pos // page
    slot = table_ref[b * max_pages + jnp.clip(col, 0, max_pages - 1)]
    keep = (live_ref[n] != 0) & (col < max_pages) & (slot >= 0) & (slot < n_pages)
    cache_row = jnp.clip(slot, 0, n_pages - 1) * page + pos % page

    hq = jnp.arange(_pow2(nh), dtype=jnp.int32)[:, None]
    q = _norm_rope(lambda c: proj_ref[n * width + jnp.minimum(hq, nh - 1) * 2 * d + c], q_norm_ref, freq_ref, pos,
                   d, rd, eps, dt)
    plt.store(q_out_ref.at[n * nh * d + hq * d + cols], q, mask=(hq < nh) & (cols < d))

    hk = jnp.arange(_pow2(nkv), dtype=jnp.int32)[:, None]
    at_k = n * width + nh * 2 * d + jnp.minimum(hk, nkv - 1) * d
    k = _norm_rope(lambda c: proj_ref[at_k + c], k_norm_ref, freq_ref, pos, d, rd, eps, dt)
    in_cache = (cache_row * nkv + hk) * d + cols
    write = keep & (hk < nkv) & (cols < d)
    plt.store(k_out_ref.at[in_cache], k.astype(k_out_ref.dtype), mask=write)
    v = proj_ref[at_k + nkv * d + cols]
    plt.store(v_out_ref.at[in_cache], v.astype(v_out_ref.dtype), mask=write)

    if indexer:
        iwidth = (ni + 1) * di
        ci = jnp.arange(di, dtype=jnp.int32)[None, :]
        hi = jnp.arange(_pow2(ni), dtype=jnp.int32)[:, None]
        iq = _norm_rope(lambda c: iproj_ref[n * iwidth + jnp.minimum(hi, ni - 1) * di + c], iq_norm_ref, freq_ref,
                        pos, di, rd, eps, dt)
        plt.store(iq_out_ref.at[n * ni * di + hi * di + ci], iq, mask=(hi < ni) & (ci < di))
        raw = iproj_ref[n * iwidth + ni * di + ci]
        plt.store(ik_out_ref.at[cache_row * di + ci], raw.astype(ik_out_ref.dtype), mask=keep & (ci < di))


def new_rows(cfg: ModelConfig, proj: Array, index_proj: Array | None, positions: Array, valid: Array,
             page_table: Array, q_norm: Array, k_norm: Array, index_q_norm: Array | None, k_pages: Array,
             v_pages: Array, index_pages: Array | None, *, interpret: bool | None = None, warps: int = 4):
    """The new tokens of B sequences, T each: proj [B, T, n_heads 2 d + 2 n_kv d] the stacked q|k|v projection
    (attention.Attention.qkv_proj), index_proj [B, T, (nI + 1) dI] QSA's (or None without the indexer), at
    positions [B, T] (valid [B, T]: padding rows write nothing) over page_table [B, max_pages].
    Returns (q [B, T, n_heads, d] normed and roped, the index queries [B, T, nI, dI] or None, and k_pages,
    v_pages, index_pages with the tokens' rows written, as attention.write_pages writes them)."""
    if k_pages.size >= 2 ** 31:
        raise ValueError(f"a KV cache of {k_pages.size} entries: the kernel indexes it in int32")
    interpret = not on_gpu() if interpret is None else interpret
    return _new_rows(cfg, proj, index_proj, positions, valid, page_table, q_norm, k_norm, index_q_norm, k_pages,
                     v_pages, index_pages, interpret=interpret, warps=warps)


@partial(jax.jit, static_argnames=("cfg", "interpret", "warps"))
def _new_rows(cfg: ModelConfig, proj, index_proj, positions, valid, page_table, q_norm, k_norm, index_q_norm,
              k_pages, v_pages, index_pages, *, interpret: bool, warps: int):
    b, t_new, width = proj.shape
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ni, di = cfg.indexer_n_heads, cfg.indexer_head_dim
    if width != nh * 2 * d + 2 * nkv * d:
        raise ValueError(f"a projection row of {width} columns; q|k|v of this model gives {nh * 2 * d + 2 * nkv * d}")
    indexer = index_proj is not None
    if not indexer:  # stand-ins, never read
        index_proj, index_q_norm, index_pages = proj, q_norm, jnp.zeros((1,), k_pages.dtype)
    n_pages, page = k_pages.shape[:2]
    rows = b * t_new
    kernel = partial(_rows_kernel, nh=nh, nkv=nkv, d=d, ni=ni, di=di, rd=cfg.rotary_dim, eps=cfg.rms_norm_eps,
                     t_new=t_new, page=page, n_pages=n_pages, max_pages=page_table.shape[1], indexer=indexer)
    args = (proj.reshape(-1), index_proj.reshape(-1), positions.astype(jnp.int32).reshape(-1),
            valid.astype(jnp.int32).reshape(-1), page_table.astype(jnp.int32).reshape(-1), q_norm, k_norm,
            index_q_norm, inv_freq(cfg), k_pages.reshape(-1), v_pages.reshape(-1), index_pages.reshape(-1))

    def whole(a):
        return pl.BlockSpec(a.shape, lambda i: (0,) * a.ndim)

    outs = (jax.ShapeDtypeStruct((rows * nh * d,), proj.dtype), jax.ShapeDtypeStruct((rows * ni * di,), proj.dtype),
            *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args[-3:]))
    q, iq, k_pages_new, v_pages_new, index_new = pl.pallas_call(
        kernel, out_shape=outs, grid=(rows,), in_specs=[whole(a) for a in args],
        out_specs=tuple(pl.BlockSpec(o.shape, lambda i: (0,)) for o in outs),
        input_output_aliases={9: 2, 10: 3, 11: 4},
        compiler_params=compiler_params(interpret, warps),
        interpret=interpret, name="attention_new_rows",
    )(*args)
    iq = iq.reshape(b, t_new, ni, di) if indexer else None
    index_new = index_new.reshape(index_pages.shape) if indexer else None
    return (q.reshape(b, t_new, nh, d), iq, k_pages_new.reshape(k_pages.shape), v_pages_new.reshape(v_pages.shape),
            index_new)


def _scores_kernel(iq_ref, ik_ref, table_ref, k_norm_ref, freq_ref, out_ref, *, r: int, ni: int, di: int,
                   rd: int, eps: float, t_new: int, rows: int, page: int, n_pages: int, max_pages: int):
    f32 = jnp.float32
    dt = iq_ref.dtype
    b, c = pl.program_id(0), pl.program_id(1)
    blk = c * BLOCKS + jnp.arange(BLOCKS, dtype=jnp.int32)[:, None]  # [BLOCKS, 1]: this program's blocks

    def pooled(cols):
        """The mean of each block's r raw keys (float32) at the columns `cols`, rounded as qsa.block_keys rounds.
        Blocks past the page table read some page: their scores are garbage that the block choice never keeps."""
        acc = jnp.zeros((BLOCKS, di), f32)
        for i in range(r):
            s = blk * r + i
            slot = jnp.clip(table_ref[b * max_pages + jnp.minimum(s // page, max_pages - 1)], 0, n_pages - 1)
            acc = acc + ik_ref[(slot * page + s % page) * di + cols].astype(f32)
        return (acc / r).astype(dt)

    kb = _norm_rope(pooled, k_norm_ref, freq_ref, blk * r, di, rd, eps, dt)  # [BLOCKS, dI]
    t = jnp.arange(rows, dtype=jnp.int32)[:, None]
    ci = jnp.arange(di, dtype=jnp.int32)[None, :]
    s = jnp.zeros((rows, BLOCKS), f32)
    for h in range(ni):
        q = iq_ref[((b * t_new + jnp.minimum(t, t_new - 1)) * ni + h) * di + ci]  # [rows, dI]; rows >= T repeat
        s = s + jnp.maximum(dot(q, kb, 1), 0.0)
    out_ref[...] = s * (di ** -0.5)


def block_scores(cfg: ModelConfig, index_q: Array, index_pages: Array, page_table: Array, k_norm: Array, *,
                 interpret: bool | None = None, warps: int = 4) -> Array:
    """QSA's score of every complete block of r keys of each sequence's pages for each of its queries:
    index_q [B, T, nI, dI] (normed, roped: new_rows), index_pages [P, page, dI] the raw keys, page_table
    [B, max_pages], k_norm the indexer's key norm. Returns float32 [B, T, max_pages page / r], what
    qsa.block_scores gives for qsa.block_keys of the sequence's pages (blocks past a sequence's length score
    its stale keys; the choice masks them)."""
    interpret = not on_gpu() if interpret is None else interpret
    return _block_scores(cfg, index_q, index_pages, page_table, k_norm, interpret=interpret, warps=warps)


@partial(jax.jit, static_argnames=("cfg", "interpret", "warps"))
def _block_scores(cfg: ModelConfig, index_q, index_pages, page_table, k_norm, *, interpret: bool, warps: int):
    b, t_new, ni, di = index_q.shape
    n_pages, page = index_pages.shape[:2]
    r = cfg.indexer_compress_ratio
    n_blocks = page_table.shape[1] * page // r
    programs = -(-n_blocks // BLOCKS)
    rows = _pow2(t_new, 16)  # a tensor-core tile's least height
    kernel = partial(_scores_kernel, r=r, ni=ni, di=di, rd=cfg.rotary_dim, eps=cfg.rms_norm_eps, t_new=t_new,
                     rows=rows, page=page, n_pages=n_pages, max_pages=page_table.shape[1])
    args = (index_q.reshape(-1), index_pages.reshape(-1), page_table.astype(jnp.int32).reshape(-1), k_norm,
            inv_freq(cfg))
    scores = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((b, rows, programs * BLOCKS), jnp.float32), grid=(b, programs),
        in_specs=[pl.BlockSpec(a.shape, lambda i, c: (0,)) for a in args],
        out_specs=pl.BlockSpec((None, rows, BLOCKS), lambda i, c: (i, 0, c)),
        compiler_params=compiler_params(interpret, warps),
        interpret=interpret, name="qsa_block_scores",
    )(*args)
    return scores[:, :t_new, :n_blocks]


__all__ = ["BLOCKS", "block_scores", "inv_freq", "new_rows"]
