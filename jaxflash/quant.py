"""NVFP4 and FP8 numerics on the host (numpy + ml_dtypes), bit-compatible with NVIDIA ModelOpt's exports.

Three formats appear in qwen4_exp checkpoints (docs/model.md §12):

* NVFP4 (routed experts): two 4-bit E2M1 codes per byte, one FP8-E4M3 scale per 16 consecutive input elements,
  and one float32 per-tensor scale:  W[n, k] = E2M1(code[n, k]) * f32(weight_scale[n, k // 16]) * weight_scale_2.
* FP8 per-tensor (the PLE n-gram table): x = f32(fp8) * scale, one float32 scale for the whole tensor.
* FP8 128x128 blocks (ModelOpt `FP8_PB_WO`, the MTP experts): one float32 scale per 128x128 tile.

Everything here is plain numpy so the checkpoint reader, the synthetic-model writer and the tests share one
definition; the GPU kernels dequantize the same bytes in-kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np

FP4_BLOCK = 16  # NVFP4 elements that share one FP8 scale
FP8_BLOCK = 128  # FP8_PB_WO tile edge
E2M1_MAX = 6.0
FP8_E4M3_MAX = 448.0
FP8_E4M3_MIN_SUBNORMAL = 2.0**-9  # the smallest positive E4M3 value; smaller block scales would become 0

# code -> value. Bit 3 is the sign, bits 0-2 index the magnitudes; code 8 is negative zero.
_E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E2M1_VALUES = np.array(_E2M1_MAGNITUDES + [-m for m in _E2M1_MAGNITUDES], dtype=np.float32)  # [8] is -0.0

# ModelOpt's export assumes this activation amax when nothing was calibrated; see `synthetic_input_scale`.
SYNTHETIC_ACTIVATION_AMAX = 16.0


# ---------------------------------------------------------------------------------------------------------------
# E2M1 codes
# ---------------------------------------------------------------------------------------------------------------
def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., K/2] -> uint8 codes [..., K]; the LOW nibble is the earlier element (ModelOpt/vLLM order)."""
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise TypeError(f"unpack_fp4 expects uint8 bytes, got {packed.dtype}")
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


def pack_fp4(codes: np.ndarray) -> np.ndarray:
    """uint8 codes [..., K] (values 0..15, K even) -> packed bytes [..., K/2], low nibble first."""
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise TypeError(f"pack_fp4 expects uint8 codes, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dimension, got shape {codes.shape}")
    if codes.size and codes.max() > 15:
        raise ValueError("pack_fp4: codes must be 4-bit values (0..15)")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def e2m1_decode(codes: np.ndarray) -> np.ndarray:
    """uint8 codes -> float32 values (code 8 decodes to -0.0)."""
    return E2M1_VALUES[np.asarray(codes, dtype=np.uint8) & 0x0F]


def e2m1_encode(x: np.ndarray) -> np.ndarray:
    """float -> nearest E2M1 code, ties to the even mantissa, saturating at +-6.

    This is ModelOpt's `_cast_fp4` rule: the magnitude is bucketed by the midpoints 0.25, 0.75, 1.25, 1.75, 2.5,
    3.5, 5, a value exactly on a midpoint goes to the neighbour with an even mantissa (0.25->0, 0.75->1, 1.25->1,
    1.75->2, 2.5->2, 3.5->4, 5->4), and the sign bit is set for every x < 0, so a small negative value becomes
    code 8 (-0.0) while +0.0 and -0.0 inputs both give code 0. ml_dtypes' float4_e2m1fn cast implements the same
    round-to-nearest-even with saturation; only its handling of an exact -0.0 input differs, which we patch.
    """
    x = np.asarray(x, dtype=np.float32)
    if np.isnan(x).any():
        raise ValueError("e2m1_encode: input contains NaN")
    codes = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F
    codes[x == 0] = 0  # -0.0 input: ModelOpt tests `x < 0`, which is False for -0.0
    return codes


# ---------------------------------------------------------------------------------------------------------------
# NVFP4
# ---------------------------------------------------------------------------------------------------------------
class NVFP4Weight(NamedTuple):
    """One NVFP4 linear weight as stored: packed codes, per-16 FP8 scales, the float32 per-tensor scale."""

    weight: np.ndarray  # uint8 [N, K/2]
    weight_scale: np.ndarray  # float8_e4m3fn [N, K/16]
    weight_scale_2: np.ndarray  # float32 [] (may be [1] in some exports)

    @property
    def shape(self) -> tuple[int, int]:
        """The logical (dequantized) shape [N, K]."""
        return self.weight.shape[0], self.weight.shape[1] * 2

    def dequantize(self, dtype=np.float32) -> np.ndarray:
        return dequantize_nvfp4(self.weight, self.weight_scale, self.weight_scale_2).astype(dtype, copy=False)


class NVFP4Quantized(NamedTuple):
    """What `quantize_nvfp4` returns: the stored triple plus the activation scale ModelOpt exports beside it."""

    weight: np.ndarray
    weight_scale: np.ndarray
    weight_scale_2: np.ndarray
    input_scale: np.ndarray  # float32 []

    def as_weight(self) -> NVFP4Weight:
        return NVFP4Weight(self.weight, self.weight_scale, self.weight_scale_2)


def _scalar_f32(x, what: str) -> np.float32:
    a = np.asarray(x, dtype=np.float32)
    if a.size != 1:
        raise ValueError(f"{what} must be a single value, got shape {a.shape}")
    return a.reshape(())[()]


def dequantize_nvfp4(weight: np.ndarray, weight_scale: np.ndarray, weight_scale_2, block: int = FP4_BLOCK
                     ) -> np.ndarray:
    """uint8 [N, K/2], float8_e4m3fn [N, K/block], float32 scalar -> float32 [N, K].

    W[n, k] = E2M1(nibble[n, k]) * f32(weight_scale[n, k // block]) * weight_scale_2; the product of the two
    scales is formed first (in float32), as ModelOpt's reference dequantizer does.
    """
    weight = np.asarray(weight)
    scale = np.asarray(weight_scale)
    n, half_k = weight.shape[-2:]
    k = 2 * half_k
    if scale.shape[-2:] != (n, k // block) or k % block:
        raise ValueError(f"NVFP4 weight_scale shape {scale.shape} does not match weight {weight.shape} "
                         f"(expected [..., {n}, {k // block}] for block {block})")
    if scale.dtype != ml_dtypes.float8_e4m3fn:
        raise TypeError(f"NVFP4 weight_scale must be float8_e4m3fn, got {scale.dtype}")
    values = e2m1_decode(unpack_fp4(weight))  # [..., N, K]
    block_scale = scale.astype(np.float32) * _scalar_f32(weight_scale_2, "weight_scale_2")
    values = values.reshape(values.shape[:-1] + (k // block, block)) * block_scale[..., None]
    return values.reshape(values.shape[:-2] + (k,))


def nvfp4_global_scale(w: np.ndarray) -> np.float32:
    """ModelOpt's per-tensor `weight_scale_2` = amax(|w|) / (6 * 448): the largest block scale becomes 448."""
    amax = np.float32(np.max(np.abs(w))) if w.size else np.float32(0)
    return np.float32(amax / np.float32(E2M1_MAX * FP8_E4M3_MAX))


def synthetic_input_scale(activation_amax: float = SYNTHETIC_ACTIVATION_AMAX) -> np.float32:
    """The activation global scale ModelOpt would export for a calibrated input amax: amax / (6 * 448).

    Only W4A4 kernels use it; jaxflash runs W4A16 and ignores it. For synthetic checkpoints we assume an input
    amax of 16: expert inputs are RMS-normalised hyper-connection mixes (per-element RMS ~0.5) whose
    calibrated max over a calibration set is typically tens of RMS, so 16 is a plausible order of magnitude.
    """
    return np.float32(np.float32(activation_amax) / np.float32(E2M1_MAX * FP8_E4M3_MAX))


def quantize_nvfp4(w: np.ndarray, block: int = FP4_BLOCK, weight_scale_2=None,
                   input_scale=None) -> NVFP4Quantized:
    """float [N, K] -> (uint8 [N, K/2], float8_e4m3fn [N, K/block], float32 [], float32 []) as ModelOpt does it.

    1. weight_scale_2 = amax(|w|) / (6 * 448)                                (unless given)
    2. per block of 16 along K: s = block_amax / (6 * weight_scale_2); an all-zero block gets s = 1; s is clamped
       to [2^-9, 448] (the E4M3 range: tiny blocks must not underflow to a zero scale) and rounded to E4M3
       (round to nearest even)
    3. codes = E2M1-round( w / (f32(s) * weight_scale_2) )                    (ties to even, saturating)
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize_nvfp4 expects a 2-D weight, got shape {w.shape}")
    n, k = w.shape
    if k % block or k % 2:
        raise ValueError(f"quantize_nvfp4: K={k} must be a multiple of the block size {block}")
    if not np.isfinite(w).all():
        raise ValueError("quantize_nvfp4: weight contains NaN or inf")
    gscale = nvfp4_global_scale(w) if weight_scale_2 is None else _scalar_f32(weight_scale_2, "weight_scale_2")
    blocks = w.reshape(n, k // block, block)
    block_amax = np.abs(blocks).max(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = block_amax / np.float32(np.float32(E2M1_MAX) * gscale)
    s = np.where(block_amax == 0, np.float32(1.0), s)
    s = np.clip(s, FP8_E4M3_MIN_SUBNORMAL, FP8_E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    denom = s.astype(np.float32) * gscale
    if gscale == 0:
        denom = np.ones_like(denom)  # an all-zero tensor: every code is 0 whatever the scale
    codes = e2m1_encode((blocks / denom[..., None]).reshape(n, k))
    iscale = synthetic_input_scale() if input_scale is None else _scalar_f32(input_scale, "input_scale")
    return NVFP4Quantized(pack_fp4(codes), s, np.asarray(gscale, np.float32), np.asarray(iscale, np.float32))


# ---------------------------------------------------------------------------------------------------------------
# FP8 E4M3, per tensor
# ---------------------------------------------------------------------------------------------------------------
def _to_fp8(x: np.ndarray) -> np.ndarray:
    # E4M3 has no infinity and ml_dtypes turns anything past 464 into NaN; the scale makes |x| <= 448 up to one
    # float32 rounding, so clipping only guards that last ulp.
    return np.clip(x, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)


def quantize_fp8_per_tensor(x: np.ndarray, scale=None) -> tuple[np.ndarray, np.float32]:
    """float -> (float8_e4m3fn, float32 scale) with scale = amax / 448 (ModelOpt FP8); x ~= f32(fp8) * scale."""
    x = np.asarray(x, dtype=np.float32)
    if scale is None:
        amax = np.float32(np.max(np.abs(x))) if x.size else np.float32(0)
        scale = np.float32(amax / np.float32(FP8_E4M3_MAX))
    scale = _scalar_f32(scale, "scale")
    return _to_fp8(x / (scale if scale != 0 else np.float32(1))), scale


def dequantize_fp8_per_tensor(q: np.ndarray, scale) -> np.ndarray:
    return np.asarray(q).astype(np.float32) * _scalar_f32(scale, "scale")


# ---------------------------------------------------------------------------------------------------------------
# FP8 E4M3, 128x128 blocks (ModelOpt FP8_PB_WO)
# ---------------------------------------------------------------------------------------------------------------
def fp8_block_scale_shape(shape: tuple[int, int], block: int = FP8_BLOCK) -> tuple[int, int]:
    """Scales of a [N, K] weight: one per (partial) block, i.e. [ceil(N/block), ceil(K/block)]."""
    n, k = shape
    return -(-n // block), -(-k // block)


def quantize_fp8_block(w: np.ndarray, block: int = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """float [N, K] -> (float8_e4m3fn [N, K], float32 [ceil(N/b), ceil(K/b)]), scale = block amax / 448.

    Edge blocks are partial (ModelOpt pads with zeros, which does not change the amax). An all-zero block keeps
    scale 0 on disk and divides by one, as ModelOpt's FP8QTensor does, so it dequantizes to zeros.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize_fp8_block expects a 2-D weight, got shape {w.shape}")
    n, k = w.shape
    nb, kb = fp8_block_scale_shape(w.shape, block)
    padded = np.zeros((nb * block, kb * block), np.float32)
    padded[:n, :k] = w
    tiles = padded.reshape(nb, block, kb, block)
    scale = (np.abs(tiles).max(axis=(1, 3)) / np.float32(FP8_E4M3_MAX)).astype(np.float32)
    safe = np.where(scale == 0, np.float32(1), scale)
    q = _to_fp8(tiles / safe[:, None, :, None]).reshape(nb * block, kb * block)[:n, :k]
    return np.ascontiguousarray(q), scale


def dequantize_fp8_block(q: np.ndarray, scale: np.ndarray, block: int = FP8_BLOCK) -> np.ndarray:
    """float8_e4m3fn [N, K] * per-tile float32 scale [ceil(N/b), ceil(K/b)] -> float32 [N, K]."""
    q = np.asarray(q)
    scale = np.asarray(scale, dtype=np.float32)
    n, k = q.shape
    if scale.shape != fp8_block_scale_shape((n, k), block):
        raise ValueError(f"FP8 block scale shape {scale.shape} does not match weight {q.shape} with block {block} "
                         f"(expected {fp8_block_scale_shape((n, k), block)})")
    full = np.repeat(np.repeat(scale, block, axis=0), block, axis=1)[:n, :k]
    return q.astype(np.float32) * full


class FP8BlockWeight(NamedTuple):
    """A 128x128-block FP8 weight: `weight` [N, K] float8_e4m3fn and `scale` [ceil(N/b), ceil(K/b)] float32.

    `scale` is always the dequantization multiplier (see jaxflash.checkpoint for the `weight_scale_inv` name)."""

    weight: np.ndarray
    scale: np.ndarray
    block: int = FP8_BLOCK

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    def dequantize(self, dtype=np.float32) -> np.ndarray:
        return dequantize_fp8_block(self.weight, self.scale, self.block).astype(dtype, copy=False)


class FP8Weight(NamedTuple):
    """A per-tensor FP8 weight (ModelOpt `FP8`): float8_e4m3fn data and one float32 multiplier."""

    weight: np.ndarray
    scale: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return self.weight.shape

    def dequantize(self, dtype=np.float32) -> np.ndarray:
        return dequantize_fp8_per_tensor(self.weight, self.scale).astype(dtype, copy=False)
