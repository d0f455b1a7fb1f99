"""Routed experts of a decode step straight from NVFP4 weights: two Pallas kernels (Triton backend on the GPU).

For N tokens with top-k expert ids `ids` [N, k] (expert ids into resident weights, or VRAM cache slot ids) the
pair computes, for every (token n, choice j),

    act[n, j] = bf16( silu(bf16(gate_e x_n)) * bf16(up_e x_n) )          e = ids[n, j]   (gate_up kernel)
    y[n, j]   = bf16( down_e act[n, j] )                                                  (down kernel)

and `routed_experts` returns sum_j w[n, j] * y[n, j] in float32: the function of
`jaxflash.model.moe.experts_gather`, its pure-jnp twin, which is the CPU path and the tests' oracle (the
float32 path below does its arithmetic; the float16x2 path rounds each product to float16).

Why this shape:
  * The weights are read where they live, as NVFP4 bytes: the resident expert tensors, or a cache slot's record
    (one uint8 row per slot, sections at the offsets of jaxflash.ffi.ExpertLayout). Ids arrive as device data;
    each program loads its expert's rows by address. Nothing is dequantised to memory.
  * One program per (pair, block of output rows). A program whose expert already appeared at an earlier pair of
    the step does nothing; the first one computes the rows of every token that chose that expert, so an expert
    shared by several tokens of a batch (or by the K+1 rows of a speculative verify) is read once.
  * E2M1 is unpacked with integer bit operations (Hopper has no FP4 conversion). Two product paths:
      - float16x2 (the default for bfloat16 tokens): the nibbles are placed into E4M3 bit patterns, which the
        hardware's E4M3x2 -> f16x2 conversion turns into halves (the value times 2^-6, exactly); the products
        lo * x[2c] + hi * x[2c+1] of a byte run in f16x2 arithmetic (inline PTX, 4 bytes at a time), summed in
        float32 per scale group. Each chunk of inputs is scaled by a power of two into [-1, 1] first, so
        float16 cannot overflow (Tiles.x_scale "row": one power of two per token row instead, an untimed
        variant); the products are rounded to float16 (2^-11, below the bfloat16 inputs' own 2^-9). About 4
        instructions per byte where the float32 path spends about 12: 1.3-1.6x faster on the H200
        (RESULTS.md).
      - float32 (float32 tokens, or Tiles(math="f32")): a code's magnitude bits and sign are placed into a
        float16 bit pattern (the value times 2^-14, exactly, the 0.5 included as a subnormal), converted to
        float32, multiplied and summed in float32.
    The 2^-6 or 2^-14 is folded into the FP8 block scale.
  * The sum over the top-k is left to XLA (one small fusion with the shared expert's add): a per-pair output
    keeps the result deterministic, where an in-kernel atomic sum would not be.

jax 0.11 warns that the Pallas Triton backend is deprecated; the routes after it are Mosaic GPU (no FP4
conversion on Hopper, but the integer unpacking here needs none) or Triton through jax-triton.

A second route computes the same pairs in CUDA behind an FFI call (jaxflash.ffi.nvfp4_moe, ffi/nvfp4_moe.cu):
`routed_experts(route=)` picks "pallas" (these kernels) or "cuda"; "auto" takes these kernels, measured faster
(see choose_route).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import compiler_params, count_done, count_wait, item_loop, on_gpu, pow2_ceil, pow2_divisor, sm_count

Array = jax.Array
NVFP4_GROUP = 16  # codes per FP8 block scale (as jaxflash.model.moe)

_BYTES_PER_GROUP = NVFP4_GROUP // 2  # one FP8 scale per 8 packed bytes (16 codes)
_TWO14 = float(2**14)
MAX_TOKENS = 16  # the kernels unroll a branch per token: decode batches and verify rows, not prefill chunks
DTYPES = (jnp.bfloat16, jnp.float32)  # token dtypes the kernels take
ROUTES = ("auto", "pallas", "cuda")


# ----- where the weights are -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Part:
    """One tensor of an expert inside operand `arg` (2-D: [experts or slots, elements per expert]): it starts
    at element `offset` of its expert's row. kind: "u8" packed codes, "f8" FP8 scales (typed), "f8u8" FP8 scales
    stored as raw bytes, "f32" a float32 scalar, "f32u8" a float32 scalar stored as 4 raw bytes."""

    arg: int
    offset: int
    kind: str


@dataclass(frozen=True)
class Placement:
    """Where gate, up and down (codes, block scales, global scale) of every expert sit among the operands."""

    hidden: int  # H: gate/up inputs, down outputs
    inter: int  # I: gate/up outputs, down inputs
    gate: Part
    up: Part
    down: Part
    gate_scale: Part
    up_scale: Part
    down_scale: Part
    gate_s2: Part
    up_s2: Part
    down_s2: Part


def is_nvfp4(m) -> bool:
    return all(hasattr(m, f) for f in ("packed", "scale", "scale2"))


def resident_operands(e) -> tuple[Placement, tuple[Array, ...]]:
    """Resident NVFP4 experts (jaxflash.model.moe.Experts of NVFP4 stacks) as kernel operands: each tensor
    reshaped to [E, elements] (a free view)."""
    for m in (e.gate, e.up, e.down):
        if not is_nvfp4(m):
            raise TypeError("the NVFP4 expert kernel needs NVFP4 experts")
    n_exp, inter, half_h = e.gate.packed.shape
    hidden = 2 * half_h
    ops, parts = [], []
    for a, kind in ((e.gate.packed, "u8"), (e.up.packed, "u8"), (e.down.packed, "u8"),
                    (e.gate.scale, "f8"), (e.up.scale, "f8"), (e.down.scale, "f8"),
                    (e.gate.scale2, "f32"), (e.up.scale2, "f32"), (e.down.scale2, "f32")):
        parts.append(Part(len(ops), 0, kind))
        ops.append(a.reshape(n_exp, -1))
    return Placement(hidden, inter, *parts), tuple(ops)


def record_operands(layout, slots: Array) -> tuple[Placement, tuple[Array, ...]]:
    """VRAM cache slots (uint8 [S, record_bytes], jaxflash.ffi.ExpertLayout "nvfp4") as the kernel's one
    operand: every tensor is read at its byte offset inside the slot's record."""
    if layout.kind != "nvfp4":
        raise ValueError(f"the NVFP4 expert kernel reads NVFP4 records, not {layout.kind!r}")
    h, i, s = layout.hidden_size, layout.intermediate_size, layout.sections
    gw, dw, gs, ds, s2 = (s[k].offset for k in
                          ("gate_up_weight", "down_weight", "gate_up_scale", "down_scale", "scale_2"))
    place = Placement(h, i, Part(0, gw, "u8"), Part(0, gw + i * h // 2, "u8"), Part(0, dw, "u8"),
                      Part(0, gs, "f8u8"), Part(0, gs + i * h // 16, "f8u8"), Part(0, ds, "f8u8"),
                      Part(0, s2, "f32u8"), Part(0, s2 + 4, "f32u8"), Part(0, s2 + 8, "f32u8"))
    return place, (slots,)


# ----- tuning ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tiles:
    """Per-program work: `rows_gu` gate/up output rows and `rows_down` down output rows; the inputs are walked
    `chunk_gu` / `chunk_down` packed bytes at a time (powers of two dividing H/2 and I/2, multiples of 8).
    The defaults come from a sweep on the H200 (benchmarks/expert_kernel.py, RESULTS.md): within 3% of the
    fastest at batch 1, and the fastest at batch 8."""

    rows_gu: int = 32
    rows_down: int = 8
    chunk_gu: int = 256
    chunk_down: int = 64
    warps_gu: int = 8
    warps_down: int = 1
    stages: int = 2
    unroll: int = 0  # walks of up to this many chunks are unrolled (see _walk); on the H200 unrolling was slower
    math: str = "auto"  # "f32", "f16x2" (see _f16x2_products), "auto": f16x2 for bfloat16 tokens
    x_scale: str = "chunk"  # f16x2: the inputs' power of two per "chunk" of a walk, or per "row" (one pre-pass)
    launch: str = "pair"  # "pair": a gate_up and a down kernel; "one": both in one launch (see the kernels)
    per_sm: int = 2  # "one": programs per SM (each with warps_gu warps; all must be resident at once)
    programs: int = 0  # "one": the number of programs, if not 0 (else per_sm per SM; 1 in interpret mode)


def fit_tiles(place: Placement, t: Tiles) -> Tiles:
    """The tiles clamped to the shapes (tiny test models have H, I far under the defaults)."""
    h, i = place.hidden, place.inter
    if t.launch not in LAUNCHES:
        raise ValueError(f"Tiles.launch must be one of {LAUNCHES}, got {t.launch!r}")
    if t.per_sm < 1:
        raise ValueError(f"Tiles.per_sm must be at least 1, got {t.per_sm}")
    return dataclasses.replace(t, rows_gu=pow2_divisor(i, t.rows_gu), rows_down=pow2_divisor(h, t.rows_down),
                               chunk_gu=max(_BYTES_PER_GROUP, pow2_divisor(h // 2, t.chunk_gu)),
                               chunk_down=max(_BYTES_PER_GROUP, pow2_divisor(i // 2, t.chunk_down)))


LAUNCHES = ("pair", "one")


MATHS = ("auto", "f32", "f16x2")


def resolve_math(t: Tiles, dtype) -> str:
    if t.math not in MATHS:
        raise ValueError(f"Tiles.math must be one of {MATHS}, got {t.math!r}")
    if t.x_scale not in ("chunk", "row"):
        raise ValueError(f"Tiles.x_scale must be 'chunk' or 'row', got {t.x_scale!r}")
    if t.math == "auto":
        return "f16x2" if jnp.dtype(dtype) == jnp.bfloat16 else "f32"
    return t.math


# ----- in-kernel pieces ------------------------------------------------------------------------------------------
def _i32(v):
    return jnp.asarray(v, jnp.int32)


def _group(ids_ref, p, n_tok: int, k: int):
    """For the expert e of pair p: (e, whether p is its first pair, and per token n (Python lists of scalars):
    whether n chose e, and the pair n*k + j where it did). Triton has no element access into a block, so
    every per-token value is its own reduction."""
    npad, kpad = pow2_ceil(n_tok), pow2_ceil(k)
    tok = jnp.arange(npad, dtype=jnp.int32)[:, None]
    col = jnp.arange(kpad, dtype=jnp.int32)[None, :]
    inside = (tok < n_tok) & (col < k)
    flat = jnp.where(inside, tok * k + col, 0)
    e = ids_ref[p]
    eq = (ids_ref[flat] == e) & inside  # [npad, kpad]
    first = jnp.min(jnp.where(eq, flat, n_tok * k)) == p
    cols = jnp.arange(kpad, dtype=jnp.int32)
    hits, pairs = [], []
    for n in range(n_tok):
        row = (ids_ref[n * k + jnp.minimum(cols, k - 1)] == e) & (cols < k)
        choice = jnp.min(jnp.where(row, cols, k))  # k: not chosen (the pair is clamped, and unused)
        hits.append(jnp.max(row.astype(jnp.int32)) > 0)
        pairs.append(jnp.minimum(n * k + choice, n_tok * k - 1))
    return e, first, hits, pairs


def _block_offsets(row0, rows: int, stride: int, col0, groups: int):
    """Element offsets [rows, groups, 8] of a tile: rows row0.., each `stride` long, bytes col0.. of each row."""
    r = jnp.arange(rows, dtype=jnp.int32)[:, None, None]
    g = jnp.arange(groups, dtype=jnp.int32)[None, :, None]
    b = jnp.arange(_BYTES_PER_GROUP, dtype=jnp.int32)[None, None, :]
    return (row0 + r) * stride + col0 + g * _BYTES_PER_GROUP + b


def _scale_offsets(row0, rows: int, stride: int, col0, groups: int):
    r = jnp.arange(rows, dtype=jnp.int32)[:, None]
    g = jnp.arange(groups, dtype=jnp.int32)[None, :]
    return (row0 + r) * stride + col0 + g


def _codes(refs, part: Part, e, offs):
    return refs[part.arg][e, part.offset + offs]


def _scales(refs, part: Part, e, offs, fold: float):
    """FP8 block scales as float32, times `fold`: the factor the product path's decoded codes lack (2^14 for
    _unpack's, 2^6 for _f16x2_products')."""
    raw = refs[part.arg][e, part.offset + offs]
    if part.kind == "f8u8":
        raw = jax.lax.bitcast_convert_type(raw, jnp.float8_e4m3fn)
    return raw.astype(jnp.float32) * fold


def _global_scale(refs, part: Part, e):
    if part.kind == "f32":
        return refs[part.arg][e, part.offset].astype(jnp.float32)
    b = refs[part.arg][e, part.offset + jnp.arange(4, dtype=jnp.int32)].astype(jnp.int32)
    word = jnp.sum(b << (8 * jnp.arange(4, dtype=jnp.int32)))  # little-endian bytes; the shifts do not overlap
    return jax.lax.bitcast_convert_type(word, jnp.float32)


def _f16_bits_to_f32(h):
    return jax.lax.bitcast_convert_type(h.astype(jnp.int16), jnp.float16).astype(jnp.float32)


def _unpack(packed):
    """uint8 bytes -> (low-nibble values, high-nibble values) as float32, each E2M1 value * 2^-14: a code's three
    magnitude bits go to float16 bits 9..11 and its sign to bit 15 (code 8, negative zero, gives -0.0)."""
    b = packed.astype(jnp.int32)
    lo = ((b & 0x07) << 9) | ((b & 0x08) << 12)
    hi = ((b & 0x70) << 5) | ((b & 0x80) << 8)
    return _f16_bits_to_f32(lo), _f16_bits_to_f32(hi)


def _inputs(ref, row, col0, groups: int):
    """The inputs paired with a tile's low and high nibbles: elements 2c and 2c+1 of row `row` for the bytes
    c = col0 + [groups, 8], as float32."""
    c = col0 + (jnp.arange(groups, dtype=jnp.int32)[:, None] * _BYTES_PER_GROUP
                + jnp.arange(_BYTES_PER_GROUP, dtype=jnp.int32)[None, :])
    return ref[row, 2 * c].astype(jnp.float32), ref[row, 2 * c + 1].astype(jnp.float32)


# Per byte of codes, lo * xe + hi * xo in float16x2 arithmetic, 4 bytes per instance: the nibbles are placed into
# E4M3 bit patterns (magnitude bits to bits 2..4, sign to bit 7: the E2M1 value times 2^-6, exactly), which
# Hopper's E4M3x2 -> f16x2 conversion turns into two halves; one multiply and one fused multiply-add per two
# bytes follow. About 4 instructions per byte, where the float32 path spends about 12.
_F16X2_PTX = """{
.reg .b32 lo, hi, t, f, p, q;
.reg .b16 lo0, lo1, hi0, hi1;
and.b32 lo, $2, 0x07070707;
shl.b32 lo, lo, 2;
and.b32 t, $2, 0x08080808;
shl.b32 t, t, 4;
or.b32 lo, lo, t;
shr.b32 hi, $2, 2;
and.b32 hi, hi, 0x1C1C1C1C;
and.b32 t, $2, 0x80808080;
or.b32 hi, hi, t;
mov.b32 {lo0, lo1}, lo;
mov.b32 {hi0, hi1}, hi;
cvt.rn.f16x2.e4m3x2 f, lo0;
mul.rn.f16x2 p, f, $3;
cvt.rn.f16x2.e4m3x2 f, hi0;
fma.rn.f16x2 p, f, $5, p;
cvt.rn.f16x2.e4m3x2 f, lo1;
mul.rn.f16x2 q, f, $4;
cvt.rn.f16x2.e4m3x2 f, hi1;
fma.rn.f16x2 q, f, $6, q;
mov.b32 $0, p;
mov.b32 $1, q;
}"""
_TWO6 = float(2**6)  # the E4M3 placement's factor, folded into the block scale (see _fold)


def _f16x2_products(codes, xe, xo, interpret: bool):
    """float16 [same shape as codes]: lo * xe + hi * xo per byte, lo/hi its E2M1 values times 2^-6; xe/xo
    float16 of the same shape. Interpret mode emulates the instruction sequence (same roundings, up to a rare
    double rounding in the fused multiply-add)."""
    if interpret:
        lo, hi = _unpack(codes)  # the values times 2^-14: times 2^8 gives the E4M3 placement's 2^-6, exactly
        lo, hi = lo * 256.0, hi * 256.0
        t = (lo * xe.astype(jnp.float32)).astype(jnp.float16).astype(jnp.float32)
        return (hi * xo.astype(jnp.float32) + t).astype(jnp.float16)
    from jax.experimental.pallas import triton as plgpu

    [p] = plgpu.elementwise_inline_asm(_F16X2_PTX, args=[codes, xe, xo], constraints="=r,=r,r,r,r,r,r", pack=4,
                                      result_shape_dtypes=[jax.ShapeDtypeStruct(codes.shape, jnp.float16)])
    return p


def _pow2_above(m):
    """(s, 1/s) for the least power of two s >= m (m >= 0 float32 scalar; 2^-126 for a subnormal m; s = 0 and
    1/s = 2^127 for m = 0), exact: from the bits, since a reciprocal or log2 on the GPU is approximate."""
    bits = jax.lax.bitcast_convert_type(m, jnp.int32)
    s_bits = (bits + 0x007FFFFF) & 0x7F800000
    return (jax.lax.bitcast_convert_type(s_bits, jnp.float32),
            jax.lax.bitcast_convert_type(0x7F000000 - s_bits, jnp.float32))


def _row_scale(ref, row, steps: int, chunk: int, groups: int):
    """_pow2_above of the largest |input| of a whole row (Tiles.x_scale "row"): an elementwise max over the
    walk's chunks, then a single reduction, where "chunk" reduces across the program at every step."""
    def body(step, m):
        xe, xo = _inputs(ref, row, step * chunk, groups)
        return jnp.maximum(m, jnp.maximum(jnp.abs(xe), jnp.abs(xo)))

    m = jax.lax.fori_loop(0, steps, body, jnp.zeros((groups, _BYTES_PER_GROUP), jnp.float32))
    return _pow2_above(jnp.max(m))


def _dot_tile_f16x2(codes, sc, xe, xo, interpret: bool, scale=None):
    """_dot_tile in float16x2 arithmetic: the inputs scaled by a power of two into [-1, 1] (so that float16
    cannot overflow, whatever the bfloat16 tokens hold; scale: the row's (s, 1/s), else the chunk's own), the
    per-byte products summed in float32 per group and scaled back with the block scale."""
    s, inv = scale if scale is not None else _pow2_above(jnp.maximum(jnp.max(jnp.abs(xe)), jnp.max(jnp.abs(xo))))
    shape = codes.shape
    xe16 = jnp.broadcast_to((xe * inv).astype(jnp.float16)[None], shape)
    xo16 = jnp.broadcast_to((xo * inv).astype(jnp.float16)[None], shape)
    p = _f16x2_products(codes, xe16, xo16, interpret)
    return jnp.sum(p.astype(jnp.float32), axis=-1) * (sc * s)


def _dot_tile(lo, hi, sc, xe, xo):
    """sum over each group of (lo * xe + hi * xo), times the group's scale: [rows, groups]."""
    return jnp.sum(lo * xe[None] + hi * xo[None], axis=-1) * sc


def _walk(steps: int, unroll: int, load, compute, acc):
    """acc = compute(load(s), s, acc) for s < steps. Up to `unroll` steps are unrolled with every load issued
    before the first compute, so a program has all its weight bytes in flight at once (a decode program reads
    only a few KB: latency, not bandwidth, bounds it otherwise); longer walks run as a loop."""
    if steps <= unroll:
        tiles = [load(s) for s in range(steps)]
        for s in range(steps):
            acc = compute(tiles[s], s, acc)
        return acc
    return jax.lax.fori_loop(0, steps, lambda s, a: compute(load(s), s, a), acc)


def _fold(t: Tiles) -> float:
    """The power of two the block scales carry for the tile's product path (t.math resolved)."""
    return _TWO6 if t.math == "f16x2" else _TWO14


def _tile_loader(w, e, row0, rows: int, in_dim: int, chunk: int, codes: tuple[Part, ...],
                 scales: tuple[Part, ...], fold: float):
    """load(step): the codes (uint8 [rows, groups, 8]) and block scales (float32 [rows, groups], times `fold`)
    of chunk `step` of rows row0.. of each matrix, for matrices with `in_dim` inputs."""
    groups = chunk // _BYTES_PER_GROUP

    def load(step):
        offs = _block_offsets(row0, rows, in_dim // 2, step * chunk, groups)
        soffs = _scale_offsets(row0, rows, in_dim // NVFP4_GROUP, step * groups, groups)
        return (tuple(_codes(w, c, e, offs) for c in codes),
                tuple(_scales(w, c, e, soffs, fold) for c in scales))

    return load


# ----- the kernels -----------------------------------------------------------------------------------------------
# Work comes in items of (pair, block of output rows). Only the first pair of each distinct expert works; it runs
# once per token that chose the expert (a branch per token: a batch's tokens rarely share an expert, and a repeat
# reads the expert's few KB per program again from L1/L2, not from HBM). Two launch forms (Tiles.launch):
#   * "pair": a gate_up kernel (one program per gate_up item) and a down kernel (one per down item);
#   * "one": a single launch of a few programs per SM, each working through items in a fixed order, every gate_up
#     item before every down item. A down item needs its expert's activations: it loads its weights first, then
#     waits until the count of its pair's finished gate_up items (an int32 per pair, added atomically) is
#     complete. Every program is resident at once (a few per SM), and a program reaches its down items only after
#     its own gate_up items, so every wait ends.
def _products(t: Tiles, interpret: bool):
    """dot(codes, scales, xe, xo, row scale or None) -> [rows, groups] float32 for the tile's arithmetic
    (t.math resolved)."""
    if t.math == "f16x2":
        return lambda codes, sc, xe, xo, xs: _dot_tile_f16x2(codes, sc, xe, xo, interpret, xs)
    return lambda codes, sc, xe, xo, xs: _dot_tile(*_unpack(codes), sc, xe, xo)


def _input_scale(t: Tiles, ref, row, steps: int, chunk: int, groups: int):
    return _row_scale(ref, row, steps, chunk, groups) if t.math == "f16x2" and t.x_scale == "row" else None


def _gate_up_rows(ids_ref, x_ref, w, act_ref, p, row0, *, place: Placement, n_tok: int, k: int, t: Tiles,
                  interpret: bool, done=None):
    """Rows row0.. of act for every token whose choice is pair p's expert, if p is that expert's first pair;
    then done(p) there (the one-launch form's count)."""
    e, first, hit, pair = _group(ids_ref, p, n_tok, k)
    rows, chunk = t.rows_gu, t.chunk_gu
    groups = chunk // _BYTES_PER_GROUP
    half_h = place.hidden // 2
    dt = act_ref.dtype
    load = _tile_loader(w, e, row0, rows, place.hidden, chunk, (place.gate, place.up),
                        (place.gate_scale, place.up_scale), _fold(t))
    dot = _products(t, interpret)

    @pl.when(first)
    def _():
        for r in range(n_tok):
            @pl.when(hit[r])
            def _():
                xs = _input_scale(t, x_ref, _i32(r), half_h // chunk, chunk, groups)

                def compute(tile, step, acc):
                    (gw, uw), (g_sc, u_sc) = tile
                    xe, xo = _inputs(x_ref, _i32(r), step * chunk, groups)
                    return acc[0] + dot(gw, g_sc, xe, xo, xs), acc[1] + dot(uw, u_sc, xe, xo, xs)

                zero = jnp.zeros((rows, groups), jnp.float32)
                acc = _walk(half_h // chunk, t.unroll, load, compute, (zero, zero))
                g_s2, u_s2 = _global_scale(w, place.gate_s2, e), _global_scale(w, place.up_s2, e)
                g = (jnp.sum(acc[0], axis=1) * g_s2).astype(dt).astype(jnp.float32)
                u = (jnp.sum(acc[1], axis=1) * u_s2).astype(dt).astype(jnp.float32)
                a = (g * jax.nn.sigmoid(g) * u).astype(dt)
                act_ref[pair[r], row0 + jnp.arange(rows, dtype=jnp.int32)] = a

        if done is not None:
            done(p)


def _down_rows(ids_ref, act_ref, w, y_ref, p, row0, *, place: Placement, n_tok: int, k: int, t: Tiles,
               interpret: bool, wait=None):
    """Rows row0.. of y for every token whose choice is pair p's expert, if p is that expert's first pair.
    wait(p) (the one-launch form): blocks until p's activations are complete and returns an int32 zero added to
    their row index (a data dependence, so their loads cannot start earlier); the weights are loaded before it
    (up to _PREFETCH_STEPS chunks a row: all of down's at full size), so the wait overlaps their reads."""
    e, first, hit, pair = _group(ids_ref, p, n_tok, k)
    rows, chunk = t.rows_down, t.chunk_down
    groups = chunk // _BYTES_PER_GROUP
    half_i = place.inter // 2
    steps = half_i // chunk
    load = _tile_loader(w, e, row0, rows, place.inter, chunk, (place.down,), (place.down_scale,), _fold(t))
    dot = _products(t, interpret)

    @pl.when(first)
    def _():
        tiles = [load(s) for s in range(steps)] if wait is not None and steps <= _PREFETCH_STEPS else None
        tie = wait(p) if wait is not None else 0
        for r in range(n_tok):
            @pl.when(hit[r])
            def _():
                row = pair[r] + tie
                xs = _input_scale(t, act_ref, row, steps, chunk, groups)

                def compute(tile, step, acc):
                    (dw,), (sc,) = tile
                    ae, ao = _inputs(act_ref, row, step * chunk, groups)
                    return acc + dot(dw, sc, ae, ao, xs)

                zero = jnp.zeros((rows, groups), jnp.float32)
                if tiles is not None:
                    acc = zero
                    for s in range(steps):
                        acc = compute(tiles[s], s, acc)
                else:
                    acc = _walk(steps, t.unroll, load, compute, zero)
                y = (jnp.sum(acc, axis=1) * _global_scale(w, place.down_s2, e)).astype(y_ref.dtype)
                y_ref[pair[r], row0 + jnp.arange(rows, dtype=jnp.int32)] = y


def _gate_up_kernel(ids_ref, x_ref, *refs, **kw):
    *w, act_ref = refs
    _gate_up_rows(ids_ref, x_ref, w, act_ref, pl.program_id(0), pl.program_id(1) * kw["t"].rows_gu, **kw)


def _down_kernel(ids_ref, act_ref, *refs, **kw):
    *w, y_ref = refs
    _down_rows(ids_ref, act_ref, w, y_ref, pl.program_id(0), pl.program_id(1) * kw["t"].rows_down, **kw)


_PREFETCH_STEPS = 8  # the one-launch form's down items load up to this many chunks of their rows before waiting


def _one_launch_kernel(ids_ref, x_ref, *refs, place: Placement, n_tok: int, k: int, t: Tiles, n_prog: int,
                       interpret: bool):
    *w, _, sem_ref, act_ref, y_ref = refs  # the count buffer comes in aliased to sem_ref
    pairs = n_tok * k
    nb_gu, nb_down = place.inter // t.rows_gu, place.hidden // t.rows_down
    t_gu = pairs * nb_gu
    total = t_gu + pairs * nb_down
    kw = dict(place=place, n_tok=n_tok, k=k, t=t, interpret=interpret)
    done = lambda p: count_done(sem_ref, p, interpret)  # noqa: E731
    wait = lambda p: count_wait(sem_ref, p, nb_gu, pairs)  # noqa: E731

    def item(it):
        @pl.when(it < t_gu)
        def _():
            _gate_up_rows(ids_ref, x_ref, w, act_ref, it // nb_gu, (it % nb_gu) * t.rows_gu, done=done, **kw)

        @pl.when((it >= t_gu) & (it < total))
        def _():
            d = it - t_gu
            _down_rows(ids_ref, act_ref, w, y_ref, d // nb_down, (d % nb_down) * t.rows_down, wait=wait, **kw)

    item_loop(total, n_prog, item)


# ----- entry point -----------------------------------------------------------------------------------------------
def _one_launch(x, ids, operands, place: Placement, t: Tiles, interpret: bool):
    """y [pairs, H] and the count of down items that gave up waiting (0 unless programs were not all resident)."""
    n_tok, k = ids.shape
    pairs = n_tok * k
    total = pairs * (place.inter // t.rows_gu + place.hidden // t.rows_down)
    # interpret mode runs programs one after another: one program does every item, in order, and never waits
    n_prog = min(total, t.programs or (1 if interpret else t.per_sm * sm_count()))
    dt = x.dtype
    sem = jnp.zeros((pairs + 1,), jnp.int32)  # a count per pair, then the give-up flag
    sem, _, y = pl.pallas_call(
        partial(_one_launch_kernel, place=place, n_tok=n_tok, k=k, t=t, n_prog=n_prog, interpret=interpret),
        out_shape=(jax.ShapeDtypeStruct(sem.shape, jnp.int32), jax.ShapeDtypeStruct((pairs, place.inter), dt),
                   jax.ShapeDtypeStruct((pairs, place.hidden), dt)),
        grid=(n_prog,), input_output_aliases={2 + len(operands): 0},
        compiler_params=compiler_params(interpret, t.warps_gu, t.stages),
        interpret=interpret, name="nvfp4_experts",
    )(ids.reshape(-1).astype(jnp.int32), x, *operands, sem)
    return y, sem[pairs]


@partial(jax.jit, static_argnames=("place", "tiles", "interpret"))
def _pairs(x, ids, operands, place: Placement, tiles: Tiles, interpret: bool):
    """y [N, k, H] and the count of down items that gave up waiting (always 0 for the pair form)."""
    n_tok, k = ids.shape
    pairs = n_tok * k
    t = fit_tiles(place, tiles)
    dt = x.dtype
    t = dataclasses.replace(t, math=resolve_math(t, dt))
    if t.launch == "one":
        y, gave_up = _one_launch(x, ids, operands, place, t, interpret)
        return y.reshape(n_tok, k, place.hidden), gave_up
    flat = ids.reshape(-1).astype(jnp.int32)
    kw = dict(place=place, n_tok=n_tok, k=k, t=t, interpret=interpret)
    act = pl.pallas_call(
        partial(_gate_up_kernel, **kw),
        out_shape=jax.ShapeDtypeStruct((pairs, place.inter), dt),
        grid=(pairs, place.inter // t.rows_gu),
        compiler_params=compiler_params(interpret, t.warps_gu, t.stages),
        interpret=interpret, name="nvfp4_gate_up",
    )(flat, x, *operands)
    y = pl.pallas_call(
        partial(_down_kernel, **kw),
        out_shape=jax.ShapeDtypeStruct((pairs, place.hidden), dt),
        grid=(pairs, place.hidden // t.rows_down),
        compiler_params=compiler_params(interpret, t.warps_down, t.stages),
        interpret=interpret, name="nvfp4_down",
    )(flat, act, *operands)
    return y.reshape(n_tok, k, place.hidden), jnp.int32(0)


def choose_route(route: str) -> str:
    """The route a call takes: `route` itself; "auto" takes these Pallas kernels, which beat the CUDA route on the
    H200 at 1, 4 and 8 rows and at 4 verify rows (benchmarks/RESULTS.md, "The CUDA route of the expert
    kernels"). The CUDA route is there by name: it takes up to jaxflash.ffi.nvfp4_moe.MAX_TOKENS rows where
    these take MAX_TOKENS."""
    if route not in ROUTES:
        raise ValueError(f"the expert kernel route must be one of {ROUTES}, got {route!r}")
    return "pallas" if route == "auto" else route


def takes(x: Array, route: str = "auto") -> bool:
    """Whether the engine's "auto" choice sends these tokens [N, H] to the kernels of `route`: compiling for a
    GPU, a dtype the route takes, decode-sized (up to MAX_TOKENS for Pallas, jaxflash.ffi.nvfp4_moe.MAX_TOKENS
    bfloat16 tokens for CUDA, where the native module has the CUDA kernels)."""
    if not (on_gpu() and x.dtype in DTYPES):
        return False
    if choose_route(route) == "cuda":
        from ..ffi import nvfp4_moe

        return x.dtype == jnp.bfloat16 and x.shape[0] <= nvfp4_moe.MAX_TOKENS and nvfp4_moe.available()
    return x.shape[0] <= MAX_TOKENS


def expert_kernel_choice(value) -> tuple[bool | None, str]:
    """An engine's `expert_kernel` setting as (use the kernels: True/False/None for where they apply, route):
    None, True, False, "pallas" or "cuda"."""
    if value is None or isinstance(value, bool):
        return value, "auto"
    if value in ("pallas", "cuda"):
        return True, value
    raise ValueError(f"expert_kernel must be None, True, False, 'pallas' or 'cuda', got {value!r}")


def cuda_parts(place: Placement, operands: tuple[Array, ...]) -> tuple[list[int], list[int]]:
    """The nine parts as (operand indices, byte offsets) for jaxflash.ffi.nvfp4_moe."""
    parts = (place.gate, place.up, place.down, place.gate_scale, place.up_scale, place.down_scale, place.gate_s2,
             place.up_s2, place.down_s2)
    return [p.arg for p in parts], [p.offset * jnp.dtype(operands[p.arg].dtype).itemsize for p in parts]


def choice_outputs(place: Placement, operands: tuple[Array, ...], x: Array, ids: Array, tiles: Tiles = Tiles(),
                   interpret: bool | None = None) -> tuple[Array, Array]:
    """The Pallas kernels' outputs before the weighted sum: (y [N, k, H] in x's dtype, the count of down items
    of the one-launch form that gave up waiting for their activations, an int32 that is 0 unless its programs
    were not all resident at once; their rows are then wrong)."""
    if ids.shape[0] > MAX_TOKENS:
        raise ValueError(f"the NVFP4 expert kernel takes up to {MAX_TOKENS} tokens, got {ids.shape[0]}")
    return _pairs(x, ids, tuple(operands), place, tiles, not on_gpu() if interpret is None else interpret)


def routed_experts(place: Placement, operands: tuple[Array, ...], x: Array, ids: Array, w: Array,
                   tiles: Tiles = Tiles(), interpret: bool | None = None, route: str = "auto",
                   cuda_tiles=None) -> Array:
    """sum_j w[n, j] * expert_{ids[n, j]}(x[n]) for x [N, H] (bfloat16 or float32), ids/w [N, k]: float32
    [N, H]. `place`/`operands` from resident_operands or record_operands. route: "pallas" (these kernels),
    "cuda" (jaxflash.ffi.nvfp4_moe: CUDA on a GPU, its C++ handler on the CPU; bfloat16 tokens) or "auto"
    (choose_route). interpret: run the Pallas kernels in interpret mode (default: on anything but a GPU).
    tiles / cuda_tiles: the block shapes of either route."""
    if x.dtype not in DTYPES:
        raise TypeError(f"the NVFP4 expert kernel takes bfloat16 or float32 inputs, not {x.dtype}")
    if choose_route(route) == "cuda":
        from ..ffi import nvfp4_moe

        arg, offset = cuda_parts(place, operands)
        y = nvfp4_moe.expert_pairs(x, ids, tuple(operands), arg, offset, place.inter,
                                   cuda_tiles or nvfp4_moe.CudaTiles())
    else:
        y, _ = choice_outputs(place, operands, x, ids, tiles, interpret)
    return jnp.einsum("nkh,nk->nh", y.astype(jnp.float32), w.astype(jnp.float32))


def kernel_bytes(place: Placement, distinct: int) -> int:
    """NVFP4 bytes the kernels must read for `distinct` experts (codes, block scales, global scales)."""
    h, i = place.hidden, place.inter
    return distinct * (3 * h * i // 2 + 3 * h * i // NVFP4_GROUP + 12)
