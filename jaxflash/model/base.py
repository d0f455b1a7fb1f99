"""Small shared pieces of the functional model: pytree dataclasses and the one matmul wrapper."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array


def pytree_dataclass(cls):
    """A frozen dataclass whose fields are all pytree children (weights, or None for absent parts)."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=names, meta_fields=[])


def linear(x: Array, w: Array) -> Array:
    """x @ w.T with w stored [out, in] as in the checkpoint; the result has x's dtype.

    float32 runs at full precision (GPUs would otherwise use TF32); bf16 accumulates in float32.
    """
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    y = jnp.einsum("...k,nk->...n", x, w.astype(x.dtype), precision=precision,
                   preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def silu(x: Array) -> Array:
    return x * jax.nn.sigmoid(x)
