"""The attention layer's work around the paged attention kernel in a decode or verify step, in two kernels per
layer (Pallas; Triton backend on a GPU) where XLA spent about twenty small ones.

`new_rows`, with programs of (new token, Q_HEADS of its query heads | its K and V | its index queries), takes
the rows of the stacked q|k|v projection (and of QSA's index projection) where the GEMV wrote them and does
what jaxflash.model.attention does for them before attending:
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
this reads the sequence's raw keys once per step (1 MB of the 4096-key bucket at full size) in one kernel. A
key is loaded once, as three column tiles (RoPE's two halves and the rest), so the rotate-half pairs tiles
instead of loading the row again. Few blocks per program give many programs (each a short chain of dependent
loads: page id, then keys). The block choice itself (rank, top-k, the visible blocks) stays in XLA: one fusion.

Both round where the model rounds (the norms and RoPE in the compute dtype, as norms.rms_norm and
rope.apply_rope do). Their pure-jnp twins are the model's own code (attention.attention's XLA path,
qsa.block_keys and qsa.block_scores): the CPU path and the tests' oracle (the tests run these kernels in
interpret mode). Triton loads need power-of-two shapes: head counts are padded with masked rows.

attention.attention's kernel path (decode and verify steps on a GPU) runs both (block_scores while
attention.QSA_SCORES_KERNEL). On the H200, per attention layer: new_rows 3.4 us, block_scores 4.1 us at batch 1
over a 4096-key bucket (11.3 at batch 8). In bf16, block_scores chooses what XLA's scores choose from the same
queries; near a tie both differ from a float32 computation in a few of 512 blocks (benchmarks/RESULTS.md, "The
attention layer's new rows and QSA scores in kernels").
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ..config import ModelConfig
from ..model.rope import inv_freq
from . import compiler_params, on_gpu, pow2_ceil

Array = jax.Array
Q_HEADS = 4  # query heads per program of new_rows (a token's heads are spread over programs)
BLOCKS = 4  # QSA blocks per program of block_scores (256 programs at batch 1 over a 4096-key bucket; H100: 3.6 us
# per layer there, 4.2 at 8 blocks, 6.2 at 16)


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
                 max_pages: int, indexer: bool, q_heads: int):
    del k_ref, v_ref, ik_ref  # aliased to k_out_ref, v_out_ref, ik_out_ref: written in place
    dt = q_out_ref.dtype
    n, part = pl.program_id(0), pl.program_id(1)  # token row b T + t; which heads
    b = n // t_new
    pos = pos_ref[n]
    width = nh * 2 * d + 2 * nkv * d  # the projection row: per head [query | gate], then k, then v
    cols = jnp.arange(d, dtype=jnp.int32)[None, :]

    # where the token's K, V and index key go: write_pages's rule (dropped when not live or the page not owned)
    col = pos // page
    slot = table_ref[b * max_pages + jnp.clip(col, 0, max_pages - 1)]
    keep = (live_ref[n] != 0) & (col < max_pages) & (slot >= 0) & (slot < n_pages)
    cache_row = jnp.clip(slot, 0, n_pages - 1) * page + pos % page

    n_qb = -(-nh // q_heads)  # programs of q_heads query heads each; then one for K and V, one for QSA's queries

    @pl.when(part < n_qb)
    def _queries():
        hq = part * q_heads + jnp.arange(q_heads, dtype=jnp.int32)[:, None]
        q = _norm_rope(lambda c: proj_ref[n * width + jnp.minimum(hq, nh - 1) * 2 * d + c], q_norm_ref, freq_ref,
                       pos, d, rd, eps, dt)
        plt.store(q_out_ref.at[n * nh * d + hq * d + cols], q, mask=(hq < nh) & (cols < d))

    @pl.when(part == n_qb)
    def _keys_values():
        hk = jnp.arange(pow2_ceil(nkv), dtype=jnp.int32)[:, None]
        at_k = n * width + nh * 2 * d + jnp.minimum(hk, nkv - 1) * d
        k = _norm_rope(lambda c: proj_ref[at_k + c], k_norm_ref, freq_ref, pos, d, rd, eps, dt)
        in_cache = (cache_row * nkv + hk) * d + cols
        write = keep & (hk < nkv) & (cols < d)
        plt.store(k_out_ref.at[in_cache], k.astype(k_out_ref.dtype), mask=write)
        v = proj_ref[at_k + nkv * d + cols]
        plt.store(v_out_ref.at[in_cache], v.astype(v_out_ref.dtype), mask=write)
        if indexer:
            ci = jnp.arange(di, dtype=jnp.int32)[None, :]
            raw = iproj_ref[n * (ni + 1) * di + ni * di + ci]
            plt.store(ik_out_ref.at[cache_row * di + ci], raw.astype(ik_out_ref.dtype), mask=keep & (ci < di))

    if indexer:
        @pl.when(part == n_qb + 1)
        def _index_queries():
            ci = jnp.arange(di, dtype=jnp.int32)[None, :]
            hi = jnp.arange(pow2_ceil(ni), dtype=jnp.int32)[:, None]
            iq = _norm_rope(lambda c: iproj_ref[n * (ni + 1) * di + jnp.minimum(hi, ni - 1) * di + c], iq_norm_ref,
                            freq_ref, pos, di, rd, eps, dt)
            plt.store(iq_out_ref.at[n * ni * di + hi * di + ci], iq, mask=(hi < ni) & (ci < di))


def takes(k_pages: Array) -> bool:
    """Whether new_rows takes a KV cache of this size (it indexes the pages in int32)."""
    return k_pages.size < 2 ** 31


def new_rows(cfg: ModelConfig, proj: Array, index_proj: Array | None, positions: Array, valid: Array,
             page_table: Array, q_norm: Array, k_norm: Array, index_q_norm: Array | None, k_pages: Array,
             v_pages: Array, index_pages: Array | None, *, interpret: bool | None = None, warps: int = 4):
    """The new tokens of B sequences, T each: proj [B, T, n_heads 2 d + 2 n_kv d] the stacked q|k|v projection
    (attention.Attention.qkv_proj), index_proj [B, T, (nI + 1) dI] QSA's (or None without the indexer), at
    positions [B, T] (valid [B, T]: padding rows write nothing) over page_table [B, max_pages].
    Returns (q [B, T, n_heads, d] normed and roped, the index queries [B, T, nI, dI] or None, and k_pages,
    v_pages, index_pages with the tokens' rows written, as attention.write_pages writes them)."""
    if not takes(k_pages):
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
    q_heads = min(Q_HEADS, pow2_ceil(nh))
    kernel = partial(_rows_kernel, nh=nh, nkv=nkv, d=d, ni=ni, di=di, rd=cfg.rotary_dim, eps=cfg.rms_norm_eps,
                     t_new=t_new, page=page, n_pages=n_pages, max_pages=page_table.shape[1], indexer=indexer,
                     q_heads=q_heads)
    parts = -(-nh // q_heads) + 1 + indexer
    args = (proj.reshape(-1), index_proj.reshape(-1), positions.astype(jnp.int32).reshape(-1),
            valid.astype(jnp.int32).reshape(-1), page_table.astype(jnp.int32).reshape(-1), q_norm, k_norm,
            index_q_norm, inv_freq(cfg.rotary_dim, cfg.rope_theta), k_pages.reshape(-1), v_pages.reshape(-1),
            index_pages.reshape(-1))

    def whole(a):
        return pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)

    outs = (jax.ShapeDtypeStruct((rows * nh * d,), proj.dtype), jax.ShapeDtypeStruct((rows * ni * di,), proj.dtype),
            *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args[-3:]))
    q, iq, k_pages_new, v_pages_new, index_new = pl.pallas_call(
        kernel, out_shape=outs, grid=(rows, parts), in_specs=[whole(a) for a in args],
        out_specs=tuple(whole(o) for o in outs),
        input_output_aliases={9: 2, 10: 3, 11: 4},
        compiler_params=compiler_params(interpret, warps),
        interpret=interpret, name="attention_new_rows",
    )(*args)
    iq = iq.reshape(b, t_new, ni, di) if indexer else None
    index_new = index_new.reshape(index_pages.shape) if indexer else None
    return (q.reshape(b, t_new, nh, d), iq, k_pages_new.reshape(k_pages.shape), v_pages_new.reshape(v_pages.shape),
            index_new)


def _column_groups(di: int, rd: int) -> tuple[tuple[int, int], ...]:
    """A key's columns as (start, width): RoPE's first half, its second half, and the columns it leaves alone.
    Loaded as three tiles, the rotate-half pairs the first two without a second load."""
    return (0, rd // 2), (rd // 2, rd // 2), (rd, di - rd)


def _scores_kernel(iq_ref, ik_ref, table_ref, k_norm_ref, freq_ref, out_ref, *, r: int, ni: int, di: int,
                   rd: int, eps: float, t_new: int, rows: int, blocks: int, page: int, n_pages: int,
                   max_pages: int):
    f32 = jnp.float32
    dt = iq_ref.dtype
    b, c = pl.program_id(0), pl.program_id(1)
    blk = c * blocks + jnp.arange(blocks, dtype=jnp.int32)[:, None]  # [blocks, 1]: this program's blocks
    groups = []  # per column group: the clamped column indices [1, w] (w a power of two) and which are real
    for start, width in _column_groups(di, rd):
        lane = jnp.arange(pow2_ceil(max(width, 1)), dtype=jnp.int32)[None, :]
        groups.append((start + jnp.minimum(lane, max(width, 1) - 1), lane < width))

    # each block's r raw keys, one load per key and column group; blocks past the page table read some page:
    # their scores are garbage that the block choice never keeps
    acc = [jnp.zeros((blocks, cols.shape[1]), f32) for cols, _ in groups]
    for i in range(r):
        s = blk * r + i
        slot = jnp.clip(table_ref[b * max_pages + jnp.minimum(s // page, max_pages - 1)], 0, n_pages - 1)
        at = (slot * page + s % page) * di
        acc = [a + ik_ref[at + cols].astype(f32) for a, (cols, _) in zip(acc, groups)]
    # mean (rounded as qsa.block_keys rounds), RMSNorm over the real columns, RoPE at the block's first position
    pooled = [jnp.where(real, (a / r).astype(dt).astype(f32), 0.0) for a, (_, real) in zip(acc, groups)]
    rs = jax.lax.rsqrt(sum(jnp.sum(x * x, axis=1, keepdims=True) for x in pooled) / di + eps)
    lo, hi, rest = [(x * rs * (1.0 + k_norm_ref[cols].astype(f32))).astype(dt) for x, (cols, _) in zip(pooled, groups)]
    angle = (blk * r).astype(f32) * freq_ref[groups[0][0]]  # [blocks, rd / 2]
    cos, sin = jnp.cos(angle).astype(dt), jnp.sin(angle).astype(dt)
    keys = [lo * cos + -hi * sin, hi * cos + lo * sin, rest]

    # sum_h relu(q_h . k_b) / sqrt(dI) for each query row (bf16 products are exact in float32)
    t_row = jnp.arange(rows, dtype=jnp.int32)[:, None]
    out = jnp.zeros((rows, blocks), f32)
    for t in range(t_new):
        st = jnp.zeros((blocks,), f32)
        for h in range(ni):
            at = ((b * t_new + t) * ni + h) * di
            dots = [jnp.sum(iq_ref[at + cols].astype(f32) * jnp.where(real, k.astype(f32), 0.0), axis=1)
                    for k, (cols, real) in zip(keys, groups)]
            st = st + jnp.maximum(dots[0] + dots[1] + dots[2], 0.0)
        out = jnp.where(t_row == t, st[None, :], out)
    out_ref[...] = out / (di ** 0.5)


def block_scores(cfg: ModelConfig, index_q: Array, index_pages: Array, page_table: Array, k_norm: Array, *,
                 interpret: bool | None = None, warps: int = 4, blocks: int = BLOCKS) -> Array:
    """QSA's score of every complete block of r keys of each sequence's pages for each of its queries:
    index_q [B, T, nI, dI] (normed, roped: new_rows), index_pages [P, page, dI] the raw keys, page_table
    [B, max_pages], k_norm the indexer's key norm. Returns float32 [B, T, max_pages page / r], what
    qsa.block_scores gives for qsa.block_keys of the sequence's pages (blocks past a sequence's length score
    its stale keys; the choice masks them). blocks: QSA blocks per program (a power of two)."""
    if blocks < 1 or blocks & (blocks - 1):
        raise ValueError(f"blocks={blocks}: a power of two (a Triton tile)")
    interpret = not on_gpu() if interpret is None else interpret
    return _block_scores(cfg, index_q, index_pages, page_table, k_norm, interpret=interpret, warps=warps,
                         blocks=blocks)


@partial(jax.jit, static_argnames=("cfg", "interpret", "warps", "blocks"))
def _block_scores(cfg: ModelConfig, index_q, index_pages, page_table, k_norm, *, interpret: bool, warps: int,
                  blocks: int):
    b, t_new, ni, di = index_q.shape
    n_pages, page = index_pages.shape[:2]
    r = cfg.indexer_compress_ratio
    n_blocks = page_table.shape[1] * page // r
    programs = -(-n_blocks // blocks)
    rows = pow2_ceil(t_new)
    kernel = partial(_scores_kernel, r=r, ni=ni, di=di, rd=cfg.rotary_dim, eps=cfg.rms_norm_eps, t_new=t_new,
                     rows=rows, blocks=blocks, page=page, n_pages=n_pages, max_pages=page_table.shape[1])
    args = (index_q.reshape(-1), index_pages.reshape(-1), page_table.astype(jnp.int32).reshape(-1), k_norm,
            inv_freq(cfg.rotary_dim, cfg.rope_theta))
    scores = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((b, rows, programs * blocks), jnp.float32), grid=(b, programs),
        in_specs=[pl.BlockSpec(a.shape, lambda i, c: (0,)) for a in args],
        out_specs=pl.BlockSpec((None, rows, blocks), lambda i, c: (i, 0, c)),
        compiler_params=compiler_params(interpret, warps),
        interpret=interpret, name="qsa_block_scores",
    )(*args)
    return scores[:, :t_new, :n_blocks]


__all__ = ["BLOCKS", "Q_HEADS", "block_scores", "new_rows", "takes"]
