"""Routed experts of a prefill chunk straight from NVFP4 weights: a grouped matmul over tiles of one expert each,
two Pallas kernels (Triton backend on the GPU, interpret mode elsewhere).

A chunk's (token, choice) pairs are sorted by expert and each expert's rows padded to whole tiles of `tile` rows
(jaxflash.model.moe.plan_tiles), so tile t holds rows of expert ids[t] only. For the rows xs [R, H] of all
tiles the pair computes, for every tile whose id is not -1,

    act[rows of t] = bf16( silu(bf16(xs W_gate^T)) * bf16(xs W_up^T) )      W = expert (or cache slot) ids[t]
    y[rows of t]   = bf16( act W_down^T )

and leaves the rows of tiles with id -1 as they were in `y0` (the engine's host residency computes a chunk in
blocks of experts that fit the VRAM cache, one block's tiles per call, into one y).

Why this shape:
  * The weights are read where they live, as NVFP4 bytes: resident expert tensors or cache slot records
    (nvfp4_experts.Placement: the same operands as the decode kernels). Each program dequantises its block of
    4-bit codes in registers (integer bit placement into float16, then the FP8 block scale and the global scale
    in float32, rounded to the token dtype exactly as moe.dequantize does) and multiplies on the tensor cores.
    Nothing is dequantised to memory, so an expert with several tiles costs its 4-bit bytes per tile, not a
    bf16 copy.
  * One program per (tile, block of output rows). Tiles past the chunk's live tiles carry id -1 and exit at
    once: the tile count is a static bound (pairs / tile + experts), the live count is data.
  * The even and odd inputs of each byte come as two arrays (xs[:, 0::2], xs[:, 1::2]), so every load is a
    contiguous block and the low and high nibbles each make one matmul.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import compiler_params, dot, on_gpu, pow2_divisor
from .nvfp4_experts import _TWO14, NVFP4_GROUP, Part, Placement, _global_scale, _unpack, is_nvfp4

Array = jax.Array
_BYTES_PER_GROUP = NVFP4_GROUP // 2


@dataclass(frozen=True)
class GroupTiles:
    """Per program: `rows_gu` / `rows_down` output rows, the inputs walked `bytes_gu` / `bytes_down` packed bytes
    (twice as many inputs) at a time. Powers of two; clamped to the shapes by fit(). The defaults were the
    fastest of a sweep on the H200 at chunks of 256, 2048 and 8192 tokens, though by 2-3% only: the
    dequantisation, not the tile shape, bounds the kernels (benchmarks/RESULTS.md)."""

    rows_gu: int = 128
    bytes_gu: int = 64
    rows_down: int = 128
    bytes_down: int = 64
    warps: int = 4
    stages: int = 2

    def fit(self, place: Placement) -> GroupTiles:
        return GroupTiles(pow2_divisor(place.inter, self.rows_gu), pow2_divisor(place.hidden // 2, self.bytes_gu),
                          pow2_divisor(place.hidden, self.rows_down), pow2_divisor(place.inter // 2, self.bytes_down),
                          self.warps, self.stages)


def takes(x: Array) -> bool:
    """Whether the engine computes tokens x [N, H] with these kernels: bfloat16, compiling for a GPU. (Float32
    models keep the jnp path there: the tensor cores would round their products to TF32.)"""
    return on_gpu() and x.dtype == jnp.bfloat16


# ----- in-kernel pieces ------------------------------------------------------------------------------------------
def _weights(refs, codes: Part, scales: Part, e, s2, row0, rows: int, in_dim: int, byte0, nbytes: int, dt):
    """Rows row0.. of one matrix of expert e, packed bytes byte0.. (nbytes), dequantised as (low nibbles, high
    nibbles) [rows, nbytes] in dt: E2M1 value * FP8 block scale * global scale s2, in float32 and that order
    (moe.dequantize's), then rounded."""
    r = jnp.arange(rows, dtype=jnp.int32)[:, None]
    c = byte0 + jnp.arange(nbytes, dtype=jnp.int32)[None, :]
    packed = refs[codes.arg][e, codes.offset + (row0 + r) * (in_dim // 2) + c]
    raw = refs[scales.arg][e, scales.offset + (row0 + r) * (in_dim // NVFP4_GROUP) + c // _BYTES_PER_GROUP]
    if scales.kind == "f8u8":
        raw = jax.lax.bitcast_convert_type(raw, jnp.float8_e4m3fn)
    sc = raw.astype(jnp.float32)
    lo, hi = _unpack(packed)  # the E2M1 values times 2^-14, exactly
    return (((lo * _TWO14) * sc) * s2).astype(dt), (((hi * _TWO14) * sc) * s2).astype(dt)


def _gate_up_kernel(ids_ref, xe_ref, xo_ref, *refs, place: Placement, tile: int, t: GroupTiles):
    *w, act_ref = refs
    e = ids_ref[pl.program_id(0)]
    row0 = pl.program_id(1) * t.rows_gu
    rows = pl.ds(pl.program_id(0) * tile, tile)
    dt = act_ref.dtype

    @pl.when(e >= 0)
    def _():
        g_s2, u_s2 = _global_scale(w, place.gate_s2, e), _global_scale(w, place.up_s2, e)

        def step(s, acc):
            b0 = s * t.bytes_gu
            xe, xo = xe_ref[rows, pl.ds(b0, t.bytes_gu)], xo_ref[rows, pl.ds(b0, t.bytes_gu)]
            glo, ghi = _weights(w, place.gate, place.gate_scale, e, g_s2, row0, t.rows_gu, place.hidden, b0,
                                t.bytes_gu, dt)
            ulo, uhi = _weights(w, place.up, place.up_scale, e, u_s2, row0, t.rows_gu, place.hidden, b0,
                                t.bytes_gu, dt)
            return (acc[0] + dot(xe, glo, 1) + dot(xo, ghi, 1), acc[1] + dot(xe, ulo, 1) + dot(xo, uhi, 1))

        zero = jnp.zeros((tile, t.rows_gu), jnp.float32)
        g, u = jax.lax.fori_loop(0, place.hidden // 2 // t.bytes_gu, step, (zero, zero))
        g = g.astype(dt).astype(jnp.float32)
        act_ref[rows, pl.ds(row0, t.rows_gu)] = (g * jax.nn.sigmoid(g) * u.astype(dt).astype(jnp.float32)).astype(dt)


def _down_kernel(ids_ref, ae_ref, ao_ref, *refs, place: Placement, tile: int, t: GroupTiles, has_y0: bool):
    if has_y0:  # y0 is aliased to the output: rows of tiles with id -1 keep it
        _, *w, y_ref = refs
    else:  # rows of tiles with id -1 are zeros, written here (see _grouped)
        *w, y_ref = refs
    e = ids_ref[pl.program_id(0)]
    row0 = pl.program_id(1) * t.rows_down
    rows = pl.ds(pl.program_id(0) * tile, tile)
    dt = y_ref.dtype

    if not has_y0:
        @pl.when(e < 0)
        def _():
            y_ref[rows, pl.ds(row0, t.rows_down)] = jnp.zeros((tile, t.rows_down), dt)

    @pl.when(e >= 0)
    def _():
        s2 = _global_scale(w, place.down_s2, e)

        def step(s, acc):
            b0 = s * t.bytes_down
            ae, ao = ae_ref[rows, pl.ds(b0, t.bytes_down)], ao_ref[rows, pl.ds(b0, t.bytes_down)]
            lo, hi = _weights(w, place.down, place.down_scale, e, s2, row0, t.rows_down, place.inter, b0,
                              t.bytes_down, dt)
            return acc + dot(ae, lo, 1) + dot(ao, hi, 1)

        acc = jax.lax.fori_loop(0, place.inter // 2 // t.bytes_down, step,
                                jnp.zeros((tile, t.rows_down), jnp.float32))
        y_ref[rows, pl.ds(row0, t.rows_down)] = acc.astype(dt)


# ----- entry point -----------------------------------------------------------------------------------------------
def split_inputs(xs: Array) -> tuple[Array, Array]:
    """xs [R, H] as the kernels read it: its even and odd columns (two copies of [R, H/2]). A caller that runs the
    kernels several times on the same rows (the host cache's blocks of experts) splits them once."""
    return xs[:, 0::2], xs[:, 1::2]


@partial(jax.jit, static_argnames=("place", "tile", "tiles", "interpret"))
def _grouped(xe, xo, ids, y0, operands, place: Placement, tile: int, tiles: GroupTiles, interpret: bool):
    n_tiles = ids.shape[0]
    t = tiles.fit(place)
    dt = xe.dtype
    params = compiler_params(interpret, t.warps, t.stages)
    act = pl.pallas_call(
        partial(_gate_up_kernel, place=place, tile=tile, t=t),
        out_shape=jax.ShapeDtypeStruct((n_tiles * tile, place.inter), dt),
        grid=(n_tiles, place.inter // t.rows_gu), compiler_params=params, interpret=interpret,
        name="nvfp4_grouped_gate_up",
    )(ids, xe, xo, *operands)
    # Without y0 the kernel writes the zeros of empty tiles itself: a zero-filled y0 would depend on nothing,
    # and XLA builds such buffers for every layer at once in one fused kernel at the start of the program,
    # where they stay (one [rows, H] buffer per layer: most of a prefill chunk's temporaries on the H200).
    y0_arg = () if y0 is None else (y0,)
    return pl.pallas_call(
        partial(_down_kernel, place=place, tile=tile, t=t, has_y0=y0 is not None),
        out_shape=jax.ShapeDtypeStruct((n_tiles * tile, place.hidden), dt),
        grid=(n_tiles, place.hidden // t.rows_down), compiler_params=params, interpret=interpret,
        input_output_aliases={} if y0 is None else {3: 0}, name="nvfp4_grouped_down",
    )(ids, *split_inputs(act), *y0_arg, *operands)


def grouped_experts(place: Placement, operands: tuple[Array, ...], xs: Array | tuple[Array, Array], ids: Array,
                    tile: int, y0: Array | None = None, tiles: GroupTiles = GroupTiles(),
                    interpret: bool | None = None) -> Array:
    """y [R, H] (xs's dtype) for the rows xs [R, H] (or split_inputs(xs)) of R / tile tiles: tile t's rows
    through expert (or slot) ids[t] (int32 [R / tile]); rows of tiles with id -1 are y0's (zeros when None).
    `place`/`operands` from nvfp4_experts.resident_operands or record_operands. interpret: default on anything
    but a GPU."""
    xe, xo = xs if isinstance(xs, tuple) else split_inputs(xs)
    if xe.dtype not in (jnp.bfloat16, jnp.float32):
        raise TypeError(f"the grouped NVFP4 kernel takes bfloat16 or float32 rows, not {xe.dtype}")
    if xe.shape[0] != ids.shape[0] * tile or xo.shape != xe.shape:
        raise ValueError(f"{xe.shape[0]} rows are not {ids.shape[0]} tiles of {tile}")
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"the tile must be a power of two >= 16 (a tensor-core dimension), got {tile}")
    if interpret is None:
        interpret = not on_gpu()
    y0 = None if y0 is None else y0.astype(xe.dtype)
    return _grouped(xe, xo, ids.astype(jnp.int32), y0, tuple(operands), place, tile, tiles, interpret)


__all__ = ["GroupTiles", "grouped_experts", "is_nvfp4", "split_inputs", "takes"]
