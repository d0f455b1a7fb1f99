"""Norms (docs/model.md §4). All normalise in (at least) float32 and cast back to the input dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .base import Array, up


def rms_norm(x: Array, weight: Array, eps: float, group: int | None = None) -> Array:
    """Zero-centred RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w).

    With `group`, the mean is taken over each group of that many trailing elements (one per residual stream),
    while `weight` spans the whole last axis.
    """
    xf = up(x)
    if group is not None:
        xf = xf.reshape(*x.shape[:-1], -1, group)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if group is not None:
        y = y.reshape(x.shape)
    return (y * (1.0 + weight.astype(y.dtype))).astype(x.dtype)


def rms_norm_gated(x: Array, gate: Array, weight: Array, eps: float, activation: str) -> Array:
    """GDN output norm: w * norm(x) * act(gate). Here w multiplies as is (ones-initialised, no +1)."""
    dtype = x.dtype
    xf = up(x)
    y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(dtype)
    y = weight.astype(dtype) * y
    g = gate.astype(xf.dtype)
    act = jax.nn.sigmoid(g) if activation == "sigmoid" else g * jax.nn.sigmoid(g)
    return (y.astype(xf.dtype) * act).astype(dtype)


def l2norm(x: Array, eps: float = 1e-6) -> Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32 (GDN queries and keys)."""
    xf = up(x)
    return xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)
