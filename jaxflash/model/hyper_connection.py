"""The 4-stream gated residual (docs/model.md §5).

The residual `h` [T, W=S*H] holds S streams side by side. Before each block, every stream is RMS-normalised,
elementwise sigmoid gates from a rank-R bottleneck weight the normalised streams, and their mean is the block
input. After the block, stream s gets the block output scaled by its own injection weight 2*sigmoid(.).
The residual itself is never mixed across streams. This math, and the residual, stay in float32 (the vLLM
kernels do the same).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from ..kernels import hc_mix
from .base import Array, pytree_dataclass, silu, up
from .moe import MoEOutput
from .norms import rms_norm


@pytree_dataclass
class HyperConnection:
    norm: Array  # hc_norm.weight [W]
    down: Array  # input_mix_weight_down.weight [R, W]
    up: Array  # input_mix_weight_up.weight [W, R]
    inject: Array | None  # block_inject_weight.weight [S, W]; None for the final mixer


def _bf16_parts(x: Array) -> Array:
    """float32 x as three bfloat16 terms [3, ...] (largest first) whose sum is x exactly: each keeps the top
    8 significant bits of what is left (float32 has 24; bfloat16 has float32's exponent range). The bits
    are cut with an integer mask, which no compiler may treat as a rounding it can skip."""
    parts = []
    for _ in range(3):
        top = lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000),
                                       jnp.float32)
        parts.append(top.astype(jnp.bfloat16))  # exact: top has bfloat16's precision
        x = x - top  # exact: the low bits of x
    return jnp.stack(parts)


# Rows from which a bfloat16 weight multiplies the parts of x in one bf16 dot rather than as float32. H200,
# full size, one mix with its combine (benchmarks/hc_kernel.py): 1 row 14.2 us as float32, 21.8 us by the parts
# (cuBLAS picks a split-K GEMM for 3 rows); 8 rows 39.4 us as float32, 21.3 us by the parts.
SPLIT_ROWS = 2


def _f32_linear(x: Array, w: Array) -> Array:
    """x [..., K] float32 @ w [N, K]^T in float32. From SPLIT_ROWS rows on, a bfloat16 w multiplies the three
    bfloat16 parts of x in one bf16 x bf16 -> f32 dot: each product is exact in float32, so this is the float32
    product up to the order of the sums, reading w once as bf16 on the tensor cores, where a float32 dot
    widens w and runs as a reduction whose time grows with the rows."""
    if x.dtype == jnp.float32 and w.dtype == jnp.bfloat16 and math.prod(x.shape[:-1]) >= SPLIT_ROWS:
        y = jnp.einsum("p...k,nk->p...n", _bf16_parts(x), w, preferred_element_type=jnp.float32)
        return y[0] + (y[1] + y[2])
    return jnp.einsum("...k,nk->...n", x, w.astype(x.dtype), precision=lax.Precision.HIGHEST)


def _kernels_take(p: HyperConnection, h: Array, streams: int) -> bool:
    """Whether jaxflash.kernels.hc_mix takes the mix of h [..., W] (float32, few rows)."""
    return h.dtype == jnp.float32 and hc_mix.takes(math.prod(h.shape[:-1]), h.shape[-1], streams, p.down.shape[0])


def _in_kernels(p: HyperConnection, h: Array, streams: int, eps: float, dtype, pending=None):
    """(h, x, inj) of the mix of h [..., W] in jaxflash.kernels.hc_mix, after the pending combine (inj0, y) if
    any (then h is the combined residual, else h itself); x in dtype."""
    lead, rows = h.shape[:-1], math.prod(h.shape[:-1])
    if pending is not None:  # (inj0, y), with y as its parts when it is a MoE block's output
        inj0, y = pending
        parts = (y.routed, y.shared, y.gate) if isinstance(y, MoEOutput) else (y,)
        pending = (inj0.reshape(rows, streams), *(a.reshape(rows, -1) for a in parts))
    x, inj, hk = hc_mix.mix(h.reshape(rows, -1), p.norm, p.down, p.up, p.inject, streams, eps, pending=pending,
                            x_dtype=dtype)
    return hk.reshape(h.shape), x.reshape(*lead, -1), None if inj is None else inj.reshape(*lead, streams)


def mix(p: HyperConnection, h: Array, streams: int, eps: float, kernel: bool = False,
        dtype=None) -> tuple[Array, Array | None]:
    """Block input x [..., H] and injection weights [..., S] (None for the final mixer) of h [..., W], in h's
    dtype (float32, float64 for a float64 model); x is rounded to `dtype` at the end if given (the block's
    input dtype: a kernel writes it so, saving a conversion kernel).
    kernel: a few rows (a decode step) run in jaxflash.kernels.hc_mix (compiled on a GPU, interpreted
    elsewhere); this function's own code is that kernel's twin."""
    if kernel and _kernels_take(p, h, streams):
        return _in_kernels(p, h, streams, eps, dtype or h.dtype)[1:]
    hidden = h.shape[-1] // streams
    xn = rms_norm(up(h), p.norm, eps, group=hidden)
    a = silu(_f32_linear(xn, p.down) / streams)
    gates = jax.nn.sigmoid(_f32_linear(a, p.up))
    x = jnp.mean((gates * xn).reshape(*h.shape[:-1], streams, hidden), axis=-2)
    x = x if dtype is None else x.astype(dtype)
    if p.inject is None:
        return x, None
    inj = 2.0 * jax.nn.sigmoid(_f32_linear(xn, p.inject) / streams)
    return x, inj


def combine_mix(p: HyperConnection, h: Array, inj: Array, y: Array | MoEOutput, streams: int, eps: float,
                kernel: bool = False, dtype=None) -> tuple[Array, Array, Array | None]:
    """combine(h, inj, y), then mix(p, ..., dtype) of the result: (h, x, inj) of the next block. kernel: a few
    rows run both in jaxflash.kernels.hc_mix's two kernels (the combine inside the first, a MoE output's parts
    summed there too), which saves XLA's combine kernel; this function's own code is their twin."""
    if kernel and _kernels_take(p, h, streams):
        return _in_kernels(p, h, streams, eps, dtype or h.dtype, (inj, y))
    h = combine(h, inj, y)
    return (h, *mix(p, h, streams, eps, dtype=dtype))


def combine(h: Array, inj: Array, y: Array | MoEOutput) -> Array:
    """h + per-stream injection of the block output y [T, H] (or a MoE block's output, summed first): stream s
    gets inj[:, s] * y."""
    y = y.total() if isinstance(y, MoEOutput) else y
    streams = inj.shape[-1]
    hidden = y.shape[-1]
    add = inj[..., :, None] * y.astype(inj.dtype)[..., None, :]
    return h + add.reshape(*h.shape[:-1], streams * hidden)
