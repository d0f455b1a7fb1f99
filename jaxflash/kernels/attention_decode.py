"""Attention of a decode or verify step over the paged KV cache in one kernel per layer (Pallas; Triton backend
on a GPU), split over the keys.

For each sequence b and KV head h, the queries of the step (T rows x the G = n_heads / n_kv query heads that
share h) form one [M, d] block, M = T G rounded up to a power of two >= 16 (a tensor-core dimension). Program
(b, h, c) of the grid sequences x KV heads x splits walks split c's keys, `block` at a time: it reads the page
ids of those keys from the sequence's page-table row, loads their K and V rows where they lie in the cache
(nothing is gathered to memory first), and keeps an online softmax (running max m, sum l and weighted values
acc) of the scores q k^T / sqrt(d) under the mask

    key s is seen by the query at position p  iff  s <= p  and  (no QSA, or s is in a block QSA kept, or s is
    in p's incomplete tail block: s >= r ((p + 1) // r)),

the mask of jaxflash.model.attention / qsa (QSA's block choice, [T, blocks] per sequence, comes in as data).
It writes its split's (m, l, acc); a second kernel combines the splits (program per query row and block of
COMBINE_COLS columns), and multiplies in the output gate where the layer passes its rows, where XLA spent
four kernels on the combine and one on the gate.

Why this shape: a decode step has one query row per sequence, so the work is reading K and V once, at the
bandwidth of the memory. Splitting the keys gives the GPU programs for a single sequence; a program skips the
key blocks after its sequence's last query position, so a short sequence in a long context bucket reads its
own keys only (the XLA path reads the whole bucket and converts it to float32). Scores take the cache dtype's
products with float32 sums (bfloat16 products are exact in float32), the softmax is float32, and the weights
are rounded to V's dtype for the second product, as flash attention does (one bf16 rounding per weight, below
the output's own bf16 rounding). Float32 models keep float32 products throughout.

The pure-jnp twin is the model's own path (read_pages, the mask, attention.attend); tests run this kernel in
interpret mode against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import compiler_params, dot, on_gpu, pow2_ceil

Array = jax.Array
DTYPES = (jnp.bfloat16, jnp.float32)  # cache dtypes the kernel takes
MAX_ROWS = 64  # T G per (sequence, KV head): one [M, d] query block in registers


# Programs a call aims for when it picks its split: about two per SM of an H200 (132). A program's key blocks
# run one after another, each waiting on its page ids before its K and V loads, so a long split is a chain of
# latencies; more, shorter splits run side by side (their combine costs M d floats each).
TARGET_PROGRAMS = 256


@dataclass(frozen=True)
class Tiles:
    """block: keys per loop step; split: keys per program (a multiple of block; 0: as many splits as give
    about TARGET_PROGRAMS programs); warps, stages: Triton's."""

    block: int = 64
    split: int = 0
    warps: int = 4
    stages: int = 2

    def fit(self, n_keys: int, rows: int, parallel: int) -> Tiles:
        """For n_keys keys per sequence, `rows` query rows per (sequence, KV head) and `parallel` (sequence, KV
        head) pairs. Blocks of 64 keys with 64 query rows ask for more shared memory than an H200 has (320 KB
        at head dim 256): 32 from 64 rows on."""
        block = min(self.block, pow2_ceil(n_keys, 16), 32 if rows >= 64 else self.block)
        split = self.split or -(-n_keys // max(1, TARGET_PROGRAMS // parallel))
        split = max(block, min(split, -(-n_keys // block) * block))
        return Tiles(block, -(-split // block) * block, self.warps, self.stages)


def takes(n_heads: int, n_kv: int, head_dim: int, rows: int, dtype) -> bool:
    """Whether the kernel runs this attention: T = rows query tokens per sequence, G heads per KV head with
    T G <= MAX_ROWS, a power-of-two head dim >= 16 and a supported cache dtype."""
    g = n_heads // n_kv
    pow2 = head_dim >= 16 and head_dim & (head_dim - 1) == 0
    return jnp.dtype(dtype) in DTYPES and pow2 and n_heads % n_kv == 0 and rows * g <= MAX_ROWS


def _kernel(table_ref, pos_ref, chosen_ref, q_ref, k_ref, v_ref, m_ref, l_ref, acc_ref, *, page: int,
            n_pages: int, n_kv: int, d: int, t: Tiles, g: int, t_new: int, m_rows: int, r: int, n_blocks: int,
            qsa: bool):
    f32 = jnp.float32
    h, c = pl.program_id(1), pl.program_id(2)
    # the query rows of KV head h, token-major then its G heads, read where they lie in q [T, n_heads, d];
    # padding rows (from T G up to M) repeat a real row and sit at position -1
    m_idx = jnp.arange(m_rows, dtype=jnp.int32)
    t_row = jnp.minimum(m_idx // g, t_new - 1)  # each row's query token
    head = h * g + m_idx % g
    cols = jnp.arange(d, dtype=jnp.int32)[None, :]
    q = q_ref[(t_row * (n_kv * g) + head)[:, None] * d + cols]  # [M, d]
    pos = jnp.where(m_idx < t_new * g, pos_ref[t_row], -1)  # [M]: each row's query position
    scale = d ** -0.5
    # key blocks holding a key at or before the last query; this program's share of them
    last = jnp.max(pos)
    needed = (last + t.block) // t.block
    lo = c * (t.split // t.block)
    hi = jnp.minimum(lo + t.split // t.block, needed)
    if qsa:
        visible = (pos + 1) // r  # complete QSA blocks each row sees; blocks from there on are its tail

    def step(j, carry):
        m, l, acc = carry
        s_idx = j * t.block + jnp.arange(t.block, dtype=jnp.int32)  # the block's key positions
        # keys past the table (a block that overhangs the context) are masked: any page will do
        page_id = jnp.clip(table_ref[jnp.minimum(s_idx // page, table_ref.shape[0] - 1)], 0, n_pages - 1)
        row = (page_id * page + s_idx - s_idx // page * page) * n_kv + h  # its row in the cache as [P page n_kv, d]
        at = row[:, None] * d + cols
        k, v = k_ref[at], v_ref[at]  # [block, d]
        # rows past the last query are stale or another page's: masked below, but a weight of 0 times a NaN
        # there would still be NaN
        v = jnp.where((s_idx <= last)[:, None], v, jnp.zeros_like(v))
        s = dot(q, k, 1) * scale  # [M, block]
        see = s_idx[None, :] <= pos[:, None]
        if qsa:
            blk = s_idx // r
            kept = chosen_ref[t_row[:, None] * n_blocks + jnp.minimum(blk, n_blocks - 1)[None, :]] != 0
            see &= (blk[None, :] >= visible[:, None]) | kept
        s = jnp.where(see, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that saw no key yet: no -inf - -inf
        alpha = jnp.exp(m - m_use)
        p = jnp.exp(s - m_use[:, None])
        pv = dot(p.astype(v.dtype), v, 0)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    init = (jnp.full((m_rows,), -jnp.inf, f32), jnp.zeros((m_rows,), f32), jnp.zeros((m_rows, d), f32))
    m, l, acc = jax.lax.fori_loop(lo, jnp.maximum(hi, lo), step, init)
    m_ref[...] = m
    l_ref[...] = l
    acc_ref[...] = acc


@partial(jax.jit, static_argnames=("r", "tiles", "interpret"))
def _paged_attention(q, k_pages, v_pages, page_table, positions, chosen, gate_rows, *, r: int, tiles: Tiles,
                     interpret: bool):
    b, t_new, nh, d = q.shape
    n_pages, page, n_kv = k_pages.shape[:3]
    g = nh // n_kv
    n_keys = page_table.shape[1] * page
    m_rows = pow2_ceil(t_new * g, 16)
    t = tiles.fit(n_keys, m_rows, b * n_kv)
    n_splits = -(-n_keys // t.split)
    qsa = chosen is not None
    n_blocks = chosen.shape[-1] if qsa else 1
    chosen = (chosen.astype(jnp.int32).reshape(b, -1) if qsa else jnp.zeros((b, 1), jnp.int32))
    kernel = partial(_kernel, page=page, n_pages=n_pages, n_kv=n_kv, d=d, t=t, g=g, t_new=t_new, m_rows=m_rows, r=r,
                     n_blocks=n_blocks, qsa=qsa)

    def seq(shape):  # sequence b's block
        return pl.BlockSpec((None,) + shape, lambda i, h, c: (i,) + (0,) * len(shape))

    def whole(shape):
        return pl.BlockSpec(shape, lambda i, h, c: (0,) * len(shape))

    def out(shape):  # program (b, h, c)'s block of an output [B, n_kv, splits, ...]
        return pl.BlockSpec((None, None, None) + shape, lambda i, h, c: (i, h, c) + (0,) * len(shape))

    flat = (n_pages * page * n_kv * d,)
    f32 = jnp.float32
    m, l, acc = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((b, n_kv, n_splits, m_rows), f32),
                   jax.ShapeDtypeStruct((b, n_kv, n_splits, m_rows), f32),
                   jax.ShapeDtypeStruct((b, n_kv, n_splits, m_rows, d), f32)),
        grid=(b, n_kv, n_splits),
        in_specs=[seq(page_table.shape[1:]), seq((t_new,)), seq(chosen.shape[1:]), seq((t_new * nh * d,)),
                  whole(flat), whole(flat)],
        out_specs=(out((m_rows,)), out((m_rows,)), out((m_rows, d))),
        compiler_params=compiler_params(interpret, t.warps, t.stages),
        interpret=interpret, name="attention_decode",
    )(page_table.astype(jnp.int32), positions.astype(jnp.int32), chosen, q.astype(k_pages.dtype).reshape(b, -1),
      k_pages.reshape(flat), v_pages.reshape(flat))
    return _combine(m, l, acc, gate_rows, t_new=t_new, nh=nh, g=g, dtype=q.dtype, interpret=interpret)


# Output columns per program of the combine (a program reads [splits, COMBINE_COLS] of one row's acc)
COMBINE_COLS = 64


def _combine_kernel(m_ref, l_ref, acc_ref, gate_ref, o_ref, *, n_kv: int, n_splits: int, m_rows: int, d: int,
                    g: int, t_new: int, nh: int, cols: int, width: int, gated: bool):
    f32 = jnp.float32
    i, h, row, cb = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)

    @pl.when(row < t_new * g)  # padding rows of the query block are not outputs
    def _():
        split = jnp.arange(pow2_ceil(n_splits), dtype=jnp.int32)  # Triton blocks: a power of two, masked
        real = split < n_splits
        at = ((i * n_kv + h) * n_splits + jnp.minimum(split, n_splits - 1)) * m_rows + row  # the row's, per split
        m, l = jnp.where(real, m_ref[at], -jnp.inf), jnp.where(real, l_ref[at], 0.0)
        top = jnp.max(m)
        w = jnp.exp(m - jnp.where(top == -jnp.inf, 0.0, top))  # a split that saw no key weighs 0
        den = jnp.sum(w * l)
        col = cb * cols + jnp.arange(cols, dtype=jnp.int32)
        acc = jnp.where(real[:, None], acc_ref[at[:, None] * d + col[None, :]], 0.0)  # [S, cols]
        o = (jnp.sum(w[:, None] * acc, axis=0) / jnp.where(den > 0, den, 1.0)).astype(o_ref.dtype)
        t, head = row // g, h * g + row % g
        if gated:  # attention._output's gate: o * sigmoid(gate), each rounded to o's dtype
            gate = gate_ref[(i * t_new + t) * width + head * 2 * d + d + col]
            o = o * jax.nn.sigmoid(gate.astype(f32)).astype(o.dtype)
        o_ref[((i * t_new + t) * nh + head) * d + col] = o


def _combine(m, l, acc, gate_rows, *, t_new: int, nh: int, g: int, dtype, interpret: bool):
    """The splits' softmaxes (m, l, acc: [B, n_kv, splits, M(, d)]) as one: weights exp(m_c - max_c m_c), a row
    that saw no key gives 0; times the output gate when gate_rows is given. [B, T, n_heads, d] in dtype."""
    b, n_kv, n_splits, m_rows, d = acc.shape
    cols = min(COMBINE_COLS, d)
    gated = gate_rows is not None
    gate = gate_rows.reshape(-1) if gated else jnp.zeros((1,), dtype)
    kernel = partial(_combine_kernel, n_kv=n_kv, n_splits=n_splits, m_rows=m_rows, d=d, g=g, t_new=t_new, nh=nh,
                     cols=cols, width=gate_rows.shape[-1] if gated else 0, gated=gated)
    args = (m.reshape(-1), l.reshape(-1), acc.reshape(-1), gate)
    whole = [pl.BlockSpec(a.shape, lambda *_: (0,)) for a in args]
    out = jax.ShapeDtypeStruct((b * t_new * nh * d,), dtype)
    o = pl.pallas_call(kernel, out_shape=out, grid=(b, n_kv, m_rows, d // cols), in_specs=whole,
                       out_specs=pl.BlockSpec(out.shape, lambda *_: (0,)),
                       compiler_params=compiler_params(interpret, 2), interpret=interpret,
                       name="attention_combine")(*args)
    return o.reshape(b, t_new, nh, d)


def paged_attention(q: Array, k_pages: Array, v_pages: Array, page_table: Array, positions: Array,
                    chosen: Array | None = None, *, r: int = 1, gate_rows: Array | None = None,
                    tiles: Tiles = Tiles(), interpret: bool | None = None) -> Array:
    """softmax(q k^T / sqrt(d) | mask) v for the queries q [B, T, n_heads, d] at positions [B, T] of B
    sequences over their pages (k_pages, v_pages [P, page, n_kv, d]; page_table [B, max_pages], ids outside
    [0, P) read as some page, which the mask hides when the sequence never wrote there: attention.PagedKV).

    chosen [B, T, n_keys / r] bool: QSA's kept complete blocks of r keys per query (qsa.block_choice), or None
    for causal attention over every earlier key. gate_rows [B, T, width]: rows whose columns [2 d h + d,
    2 d h + 2 d) hold head h's output gate (attention's q|k|v projection, read in place), which then multiplies
    the output as attention._output does. Returns [B, T, n_heads, d] in q's dtype; a query at position -1 sees
    nothing and gives 0. interpret: default on anything but a GPU; tiles: see Tiles."""
    b, t_new, nh, d = q.shape
    n_kv = k_pages.shape[2]
    if not takes(nh, n_kv, d, t_new, k_pages.dtype):
        raise ValueError(f"the attention kernel does not take {t_new} tokens x {nh} heads over {n_kv} KV heads of "
                         f"dim {d} in {k_pages.dtype} (at most {MAX_ROWS} rows per KV head, a power-of-two dim)")
    n_keys = page_table.shape[1] * k_pages.shape[1]
    if k_pages.size >= 2 ** 31:
        raise ValueError(f"a KV cache of {k_pages.size} entries: the kernel indexes it in int32")
    if chosen is not None and chosen.shape != (b, t_new, n_keys // r):
        raise ValueError(f"QSA's choice {chosen.shape} is not [{b}, {t_new}, {n_keys // r}] (blocks of {r} keys)")
    if tiles.block < 16 or tiles.block & (tiles.block - 1) or tiles.split < 0:
        raise ValueError(f"tiles {tiles}: block must be a power of two >= 16, split >= 0")
    if gate_rows is not None and (gate_rows.shape[:2] != (b, t_new) or gate_rows.shape[2] < 2 * nh * d):
        raise ValueError(f"gate rows {gate_rows.shape} do not hold {nh} heads' gates for [{b}, {t_new}] queries")
    return _paged_attention(q, k_pages, v_pages, page_table, positions, chosen, gate_rows, r=r, tiles=tiles,
                            interpret=not on_gpu() if interpret is None else interpret)


__all__ = ["MAX_ROWS", "Tiles", "paged_attention", "takes"]
