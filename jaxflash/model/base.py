"""Small shared pieces of the functional model: pytree dataclasses and the one matmul wrapper."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array


def pytree_dataclass(cls):
    """A frozen dataclass registered as a pytree. Its fields are children (arrays, or None for absent parts),
    except those declared with `static()`: those are part of the tree's structure (Python values a compiled
    program is specialised on, such as a layer count or a handle to a host-side pool)."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    meta = [f.name for f in fields if f.metadata.get("static")]
    data = [f.name for f in fields if not f.metadata.get("static")]
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)


def static(default=dataclasses.MISSING):
    """A pytree_dataclass field that is structure, not data (hashable; fixed for a compiled program)."""
    return dataclasses.field(default=default, metadata={"static": True})


def acc_dtype(dtype) -> jnp.dtype:
    """The dtype for math that must not run in bf16: float32, or float64 when the model runs in float64."""
    return jnp.dtype(jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32)


def up(x: Array) -> Array:
    """x in at least float32."""
    return x.astype(acc_dtype(x.dtype))


def precision_for(dtype):
    """Full precision for float32/64 matmuls (GPUs would otherwise use TF32); the default for bf16."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize >= 4 else None


def matmul(spec: str, a: Array, b: Array) -> Array:
    """einsum of two operands of one dtype, in their own precision (precision_for) and summed in acc_dtype:
    bf16 operands multiply on the tensor cores with exact products and float32 sums, float32/64 ones in full
    precision. The result is in acc_dtype."""
    return jnp.einsum(spec, a, b, precision=precision_for(a.dtype), preferred_element_type=acc_dtype(a.dtype))


def linear(x: Array, w: Array) -> Array:
    """x @ w.T with w stored [out, in] as in the checkpoint; the result has x's dtype (bf16 accumulates in
    float32)."""
    y = jnp.einsum("...k,nk->...n", x, w.astype(x.dtype), precision=precision_for(x.dtype),
                   preferred_element_type=acc_dtype(x.dtype))
    return y.astype(x.dtype)


# Token rows up to which a bfloat16 product on a GPU is written as products and a sum over the inputs
# (linear_by_sum): XLA emits one row reduction reading w at about 3 TB/s, where its GEMV or split-K GEMM for
# the decode step's shapes reads at 2.3-2.7 (H100: GDN's out_proj 14.0 -> 10.7 us, its stacked in_proj 31.6 ->
# 26.8, attention's q|k|v 28.9 -> 21.7; a GDN layer 60.0 -> 56.1 us with out_proj alone by sum). With 8 rows the
# reduction reads w once per row, 6x slower than the GEMM (benchmarks/gemv_forms.py, RESULTS.md).
SUM_ROWS = 1


def linear_rows(x: Array, w: Array) -> Array:
    """linear where x holds every row of the product (a decode step's projections): linear_by_sum for up to
    SUM_ROWS bf16 rows on a GPU, else linear. (Under an outer vmap, which hides the batch's rows from the rule,
    the products are the same, only slower for a large batch.)"""
    if x.dtype == jnp.bfloat16 and math.prod(x.shape[:-1]) <= SUM_ROWS and jax.default_backend() == "gpu":
        return linear_by_sum(x, w)
    return linear(x, w)


def linear_by_sum(x: Array, w: Array) -> Array:
    """linear's product as float32 products (exact for bf16 operands) summed over the inputs: the same arithmetic
    as the tensor cores' bf16 dot with float32 sums, in another order."""
    y = jnp.sum(x.astype(jnp.float32)[..., None, :] * w.astype(x.dtype).astype(jnp.float32), axis=-1)
    return y.astype(x.dtype)


def stack_rows(*ws) -> np.ndarray:
    """Matrices [n_i, K] that multiply the same input, stored as one [sum n_i, K] so that a single matmul reads
    the input for all of them (at decode one GEMV where there were several small ones). On the host, as the
    weights load."""
    return np.concatenate(ws, axis=0)


def stacked_part(field: str, i: int) -> property:
    """A property: the i-th matrix of the stacked weight `field`, whose row edges the class's `_edges()` gives."""
    def get(self):
        edges = (0, *self._edges(), getattr(self, field).shape[0])
        return getattr(self, field)[edges[i]:edges[i + 1]]
    return property(get)


def linear_split(x: Array, w: Array, edges) -> tuple[Array, ...]:
    """linear(x, w) of a stacked w, split back into the parts' outputs at the row edges."""
    return tuple(jnp.split(linear(x, w), list(edges), axis=-1))


# top_k and top_k_mask rank by comparisons while rows x n x n stays below this (decode and verify steps): one
# compare-and-count fusion per call, where XLA:GPU sorts every row (at decode on the H200 a 5.5 us sort per
# router and 7.8 us per QSA block selection, 0.36 ms per step); larger inputs (prefill chunks, long contexts)
# sort
RANK_COMPARES = 1 << 24


def _ranks(x: Array) -> Array | None:
    """Each entry's place in its row's descending order (equal values in index order), int32; None when the
    row is too long to rank by comparisons (RANK_COMPARES)."""
    n = x.shape[-1]
    if x.size * n > RANK_COMPARES:
        return None
    i = jnp.arange(n, dtype=jnp.int32)
    a, b = x[..., :, None], x[..., None, :]  # entry i against entry j
    before = (b > a) | ((b == a) & (i[None, :] < i[:, None]))  # j comes before i
    return jnp.sum(before, axis=-1, dtype=jnp.int32)  # a permutation of 0..n-1 per row


# Rows at least this long (a vocabulary: the logprobs' top alternatives) select top_k in two stages
# (_top_k_by_groups): on the H200 lax.top_k sorts every row, 63 us for one row of 248,320 and 511 us for eight
GROUPED_ROWS = 1 << 16
_GROUP = 128  # entries per group of the two-stage selection


def _top_k_by_groups(x: Array, k: int, group: int | None = None) -> tuple[Array, Array]:
    """top_k of long rows: first the k groups (of `group` consecutive entries, default _GROUP) with the largest
    maxima, then the k largest entries of those groups. Exact, ties included: an entry of a group outside those
    k has, in each of them, an entry before it (larger, or equal and at a lower index since groups are index
    ranges)."""
    *lead, n = x.shape
    group = group or _GROUP
    g = -(-n // group)
    if g <= k:  # every group is a candidate
        return lax.top_k(x, k)
    xp = jnp.pad(x, [(0, 0)] * len(lead) + [(0, g * group - n)], constant_values=-jnp.inf)
    groups = xp.reshape(*lead, g, group)
    _, gid = top_k(jnp.max(groups, axis=-1), k)
    gid = jnp.sort(gid, axis=-1)  # candidates in index order, so that equal values keep it
    cand = jnp.take_along_axis(groups, gid[..., None], axis=-2).reshape(*lead, k * group)
    val, at = top_k(cand, k)
    idx = (gid[..., None] * group + jnp.arange(group, dtype=jnp.int32)).reshape(*lead, k * group)
    return val, jnp.take_along_axis(idx, at, axis=-1).astype(jnp.int32)


def top_k(x: Array, k: int) -> tuple[Array, Array]:
    """lax.top_k over the last axis of a floating x: the k largest values, descending, and their indices
    (int32); equal values come in index order."""
    n = x.shape[-1]
    if n >= GROUPED_ROWS and n > 4 * k * _GROUP:
        return _top_k_by_groups(x, k)
    rank = _ranks(x)
    if rank is None:
        return lax.top_k(x, k)
    pick = rank[..., None, :] == jnp.arange(k, dtype=jnp.int32)[:, None]  # [..., k, n]: one True per row
    idx = jnp.sum(jnp.where(pick, jnp.arange(x.shape[-1], dtype=jnp.int32), 0), axis=-1, dtype=jnp.int32)
    # the value by the same pick (a max over one entry and -infs is that entry, exactly), so that XLA reads
    # both from one reduction instead of a gather after it
    return jnp.max(jnp.where(pick, x[..., None, :], -jnp.inf), axis=-1), idx


def top_k_mask(x: Array, k: int) -> Array:
    """Whether each entry is among its row's k largest (equal values in index order): top_k's indices as a
    mask, without their order."""
    rank = _ranks(x)
    if rank is not None:
        return rank < k
    _, idx = lax.top_k(x, k)
    return jnp.put_along_axis(jnp.zeros(x.shape, bool), idx, True, axis=-1, inplace=False)


def silu(x: Array) -> Array:
    return x * jax.nn.sigmoid(x)


@pytree_dataclass
class TokenBatch:
    """Where the new tokens [B, T] of B sequences go: a sequence that already holds `lengths[b]` tokens of
    state (KV, recurrent, conv) takes the first n_new[b] entries of its row as its next tokens; the rest of the
    row is padding. A fresh full-sequence forward is the case lengths = 0, n_new = T."""

    positions: Array  # [B, T] int32: absolute position of each entry (lengths[b] + column)
    valid: Array  # [B, T] bool: real tokens (a prefix of each row)
    page_table: Array  # [B, max_pages] int32: the KV pages of each sequence (see attention.PagedKV)

    @staticmethod
    def after(lengths: Array, n_new: Array, width: int, page_table: Array) -> TokenBatch:
        cols = jnp.arange(width, dtype=jnp.int32)[None, :]
        return TokenBatch(positions=lengths[:, None].astype(jnp.int32) + cols, valid=cols < n_new[:, None],
                          page_table=page_table)

    @property
    def n_new(self) -> Array:
        """[B] int32: real tokens per row."""
        return jnp.sum(self.valid, axis=1, dtype=jnp.int32)
