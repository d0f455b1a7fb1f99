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
from .norms import rms_norm


@pytree_dataclass
class HyperConnection:
    norm: Array  # hc_norm.weight [W]
    down: Array  # input_mix_weight_down.weight [R, W]
    up: Array  # input_mix_weight_up.weight [W, R]
    inject: Array | None  # block_inject_weight.weight [S, W]; None for the final mixer


def _f32_linear(x: Array, w: Array) -> Array:
    return jnp.einsum("...k,nk->...n", x, w.astype(x.dtype), precision=lax.Precision.HIGHEST)


def mix(p: HyperConnection, h: Array, streams: int, eps: float, kernel: bool = False) -> tuple[Array, Array | None]:
    """Block input x [..., H] (float32) and injection weights [..., S] (None for the final mixer) of h [..., W].
    kernel: a few rows (a decode step) run in jaxflash.kernels.hc_mix (compiled on a GPU, interpreted
    elsewhere); this function's own code is that kernel's twin."""
    lead, rows = h.shape[:-1], math.prod(h.shape[:-1])
    if kernel and h.dtype == jnp.float32 and hc_mix.takes(rows, h.shape[-1], streams, p.down.shape[0]):
        x, inj = hc_mix.mix(h.reshape(rows, -1), p.norm, p.down, p.up, p.inject, streams, eps)
        return x.reshape(*lead, -1), None if inj is None else inj.reshape(*lead, streams)
    hidden = h.shape[-1] // streams
    xn = rms_norm(up(h), p.norm, eps, group=hidden)
    a = silu(_f32_linear(xn, p.down) / streams)
    gates = jax.nn.sigmoid(_f32_linear(a, p.up))
    x = jnp.mean((gates * xn).reshape(*h.shape[:-1], streams, hidden), axis=-2)
    if p.inject is None:
        return x, None
    inj = 2.0 * jax.nn.sigmoid(_f32_linear(xn, p.inject) / streams)
    return x, inj


def combine(h: Array, inj: Array, y: Array) -> Array:
    """h + per-stream injection of the block output y [T, H]: stream s gets inj[:, s] * y."""
    streams = inj.shape[-1]
    hidden = y.shape[-1]
    add = inj[..., :, None] * y.astype(inj.dtype)[..., None, :]
    return h + add.reshape(*h.shape[:-1], streams * hidden)
