"""Partial rotary position embedding (docs/model.md §8): NeoX rotate-half on the first `rotary_dim` dims.

Text-only input has equal MRoPE rows, so it reduces to plain 1-D RoPE. Angles are float32, as in the reference.
"""

from __future__ import annotations

import jax.numpy as jnp

from .base import Array


def inv_freq(rotary_dim: int, theta: float) -> Array:
    """The inverse frequencies [rotary_dim / 2] of the rotated pairs (float32)."""
    return 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))


def rope_cos_sin(positions: Array, rotary_dim: int, theta: float) -> tuple[Array, Array]:
    """cos, sin of shape [..., rotary_dim] for integer `positions` [...]."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq(rotary_dim, theta)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate the first cos.shape[-1] dims of x [..., heads, dim]; cos/sin are [..., rotary_dim] (no head axis)."""
    rd = cos.shape[-1]
    cos = cos[..., None, :].astype(x.dtype)
    sin = sin[..., None, :].astype(x.dtype)
    xr, xp = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    return jnp.concatenate([xr * cos + rotated * sin, xp], axis=-1)
