"""Products of a few token rows with a large weight, y = x w^T (base.linear's), in one Pallas kernel that
reads the weight at the bandwidth of the memory (Triton backend on a GPU).

A decode step multiplies one row (or a batch's few rows) by each projection: the weight's bytes are the whole
cost. XLA runs these products as GEMMs or as row reductions that read the step's mid-sized weights (30 to 90 MB)
at 2.3 to 3.1 TB/s on the H200, short of its ~4.2. Here program j of a grid over blocks of `block_n` output
columns walks the inputs `block_k` at a time, so that each program streams a [block_n, K] slab of the weight
through a software pipeline of `stages` loads in flight; many programs per SM keep enough bytes in flight.
One row multiplies as float32 products summed over the inputs (no tensor-core tile is one row high); several
rows (up to MAX_ROWS, padded to 16) as a tensor-core dot. Both are exact products of bf16 operands with float32
sums, as XLA's dot, in another order.

`product` would be the call sites' entry. Not wired into the model yet: on the H100 these tilings read at 1.2 to
2.7 TB/s, behind XLA's reduction form (3.0-3.2 TB/s) for one row (benchmarks/RESULTS.md, "Kernels around the
attention and a product kernel, measured").
Its pure-jnp twin is base.linear: the CPU path and the tests' oracle (the tests run this kernel in interpret
mode).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..model import base
from . import compiler_params, dot, on_gpu

Array = jax.Array
MAX_ROWS = 16  # rows of x one call takes (a tensor-core tile's height)
# Rows up to which `product` takes the kernel on a GPU (bf16): one row, a batch-1 decode step's products
PRODUCT_ROWS = 1


@dataclass(frozen=True)
class Tiles:
    """block_n output columns per program, block_k inputs per loop step (both powers of two); warps, stages:
    Triton's (stages: loads in flight per program)."""

    block_n: int = 8
    block_k: int = 1024
    warps: int = 4
    stages: int = 4

    def fit(self, n: int, k: int, rows: int) -> Tiles:
        """Clipped to the product: block_k to a power of two dividing K, block_n to at least 16 for several rows
        (a tensor-core tile)."""
        bk = min(self.block_k, k & -k)  # the largest power of two dividing K
        bn = max(self.block_n, 16) if rows > 1 else self.block_n
        return Tiles(min(bn, _pow2_floor(n)), bk, self.warps, self.stages)


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def takes(x_shape: tuple[int, ...], w_shape: tuple[int, ...], dtype) -> bool:
    """Whether the kernel computes this product: up to MAX_ROWS rows, K with a power-of-two factor of at least
    64 (the inner loop's step), N at least 16, bf16 or float32."""
    rows = math.prod(x_shape[:-1])
    k, n = x_shape[-1], w_shape[0]
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)) and 0 < rows <= MAX_ROWS
            and w_shape[1] == k and (k & -k) >= 64 and n >= 16)


def _kernel(x_ref, w_ref, y_ref, *, t: Tiles, n: int, k: int, rows: int):
    f32 = jnp.float32
    j = pl.program_id(0)
    # the last block may overhang N: it recomputes column N-1
    out_cols = jnp.minimum(j * t.block_n + jnp.arange(t.block_n, dtype=jnp.int32), n - 1)
    cols = out_cols[:, None]
    kk = jnp.arange(t.block_k, dtype=jnp.int32)[None, :]

    if rows == 1:
        def step(i, acc):
            w = w_ref[cols * k + i * t.block_k + kk].astype(f32)  # [block_n, block_k]
            x = x_ref[i * t.block_k + kk].astype(f32)  # [1, block_k]
            return acc + jnp.sum(w * x, axis=1)
        acc = jax.lax.fori_loop(0, k // t.block_k, step, jnp.zeros((t.block_n,), f32))
        y_ref[out_cols] = acc.astype(y_ref.dtype)
    else:
        r = jnp.arange(MAX_ROWS, dtype=jnp.int32)[:, None]

        def step(i, acc):
            w = w_ref[cols * k + i * t.block_k + kk]  # [block_n, block_k]
            x = x_ref[jnp.minimum(r, rows - 1) * k + i * t.block_k + kk].astype(w.dtype)  # [16, block_k]
            return acc + dot(x, w, 1)
        acc = jax.lax.fori_loop(0, k // t.block_k, step, jnp.zeros((MAX_ROWS, t.block_n), f32))
        y_ref[jnp.minimum(r, rows - 1) * n + out_cols[None, :]] = acc.astype(y_ref.dtype)


def linear(x: Array, w: Array, *, tiles: Tiles = Tiles(), interpret: bool | None = None) -> Array:
    """x [..., K] (at most MAX_ROWS rows) times w [N, K] transposed, in x's dtype (float32 sums): base.linear's
    product. interpret: default on anything but a GPU."""
    if not takes(x.shape, w.shape, x.dtype):
        raise ValueError(f"the product kernel does not take x {x.shape} {x.dtype} with w {w.shape} (at most "
                         f"{MAX_ROWS} rows, K with a power-of-two factor >= 64, N >= 16, bf16 or float32)")
    if tiles.block_n & (tiles.block_n - 1) or tiles.block_k & (tiles.block_k - 1):
        raise ValueError(f"tiles {tiles}: block_n and block_k must be powers of two")
    return _linear(x, w, tiles=tiles, interpret=not on_gpu() if interpret is None else interpret)


@partial(jax.jit, static_argnames=("tiles", "interpret"))
def _linear(x, w, *, tiles: Tiles, interpret: bool):
    *lead, k = x.shape
    n = w.shape[0]
    rows = x.size // k
    t = tiles.fit(n, k, rows)
    kernel = partial(_kernel, t=t, n=n, k=k, rows=rows)
    y = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((rows * n,), x.dtype), grid=(-(-n // t.block_n),),
        in_specs=[pl.BlockSpec((rows * k,), lambda j: (0,)), pl.BlockSpec((n * k,), lambda j: (0,))],
        out_specs=pl.BlockSpec((rows * n,), lambda j: (0,)),
        compiler_params=compiler_params(interpret, t.warps, t.stages),
        interpret=interpret, name="gemv",
    )(x.reshape(-1), w.astype(x.dtype).reshape(-1))
    return y.reshape(*lead, n)


def product(x: Array, w: Array, fallback=base.linear) -> Array:
    """base.linear(x, w) for an x that holds every row of the product (not under a vmap that hides the batch's
    rows, which would read w once per row): the kernel for up to PRODUCT_ROWS bf16 rows on a GPU, where it
    takes the shapes; elsewhere `fallback` (XLA's forms: base.linear, or base.linear_rows)."""
    rows = x.size // x.shape[-1]
    if on_gpu() and x.dtype == jnp.bfloat16 and rows <= PRODUCT_ROWS and takes(x.shape, w.shape, x.dtype):
        return linear(x, w)
    return fallback(x, w)


__all__ = ["MAX_ROWS", "PRODUCT_ROWS", "Tiles", "linear", "product", "takes"]
