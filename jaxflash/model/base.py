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


def acc_dtype(dtype) -> jnp.dtype:
    """The dtype for math that must not run in bf16: float32, or float64 when the model runs in float64."""
    return jnp.dtype(jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32)


def up(x: Array) -> Array:
    """x in at least float32."""
    return x.astype(acc_dtype(x.dtype))


def precision_for(dtype):
    """Full precision for float32/64 matmuls (GPUs would otherwise use TF32); the default for bf16."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize >= 4 else None


def linear(x: Array, w: Array) -> Array:
    """x @ w.T with w stored [out, in] as in the checkpoint; the result has x's dtype (bf16 accumulates in
    float32)."""
    y = jnp.einsum("...k,nk->...n", x, w.astype(x.dtype), precision=precision_for(x.dtype),
                   preferred_element_type=acc_dtype(x.dtype))
    return y.astype(x.dtype)


def silu(x: Array) -> Array:
    return x * jax.nn.sigmoid(x)
