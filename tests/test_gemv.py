"""The few-row product kernel (jaxflash/kernels/gemv.py) against its twin, base.linear, in Pallas interpret mode.

Shapes: N a multiple of the column block and not (the last block overhangs and recomputes column N-1), K of one
and of several loop steps, one row (float32 products and a sum) and several (the tensor-core dot, rows padded to
16), leading axes, bfloat16 and float32. Tolerances, relative to the largest output: float32 1e-6 (the sums'
order differs), bfloat16 8e-3 (both round the float32 sum to bf16 once: within one bf16 ulp, 2^-8 = 3.9e-3).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.kernels import gemv
from jaxflash.model.base import linear

from numerics import rel_err

TOL = {jnp.float32: 1e-6, jnp.bfloat16: 8e-3}


@pytest.mark.parametrize("dt", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 4), (16,)])
@pytest.mark.parametrize("n,k,tiles", [(40, 192, gemv.Tiles(8, 64)), (48, 128, gemv.Tiles(16, 128)),
                                       (100, 256, gemv.Tiles(4, 32))])
def test_kernel_matches_linear(dt, lead, n, k, tiles):
    rng = np.random.default_rng(n + k + len(lead))
    x = jnp.asarray(rng.normal(size=(*lead, k)), dt)
    w = jnp.asarray(rng.normal(size=(n, k)) * 0.1, dt)
    got = gemv.linear(x, w, tiles=tiles)
    ref = linear(x, w)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert rel_err(got, ref) < TOL[dt]


def test_takes_and_bad_input():
    assert gemv.takes((1, 2560), (16480, 2560), jnp.bfloat16)
    assert gemv.takes((2, 4, 6144), (2560, 6144), jnp.float32)
    assert not gemv.takes((17, 2560), (16480, 2560), jnp.bfloat16)  # more rows than a tile
    assert not gemv.takes((1, 96), (64, 96), jnp.bfloat16)  # K's power-of-two factor is 32
    assert not gemv.takes((1, 128), (8, 128), jnp.bfloat16)  # N below 16
    assert not gemv.takes((1, 128), (64, 128), jnp.float16)
    x, w = jnp.ones((1, 128)), jnp.ones((64, 128))
    with pytest.raises(ValueError, match="does not take"):
        gemv.linear(jnp.ones((1, 96)), jnp.ones((64, 96)))
    with pytest.raises(ValueError, match="powers of two"):
        gemv.linear(x, w, tiles=gemv.Tiles(12, 64))


def test_product_takes_the_kernel_for_one_bf16_row_on_a_gpu(monkeypatch):
    """The rule only (the backend is faked, the programs are traced, not run): the kernel for PRODUCT_ROWS bf16
    rows on a GPU; XLA's forms for more rows, for float32, for shapes it does not take, and off a GPU."""
    def uses_kernel(x, w):
        return "gemv" in str(jax.make_jaxpr(lambda a, b: gemv.product(a, b))(x, w))  # a fresh trace each time

    w = jnp.ones((64, 128), jnp.bfloat16)
    one, two = jnp.ones((1, 128), jnp.bfloat16), jnp.ones((2, 128), jnp.bfloat16)
    monkeypatch.setattr(gemv, "on_gpu", lambda: False)
    assert not uses_kernel(one, w)  # off a GPU
    monkeypatch.setattr(gemv, "on_gpu", lambda: True)
    assert gemv.PRODUCT_ROWS == 1
    assert uses_kernel(one, w) and uses_kernel(one[None], w)
    assert not uses_kernel(two, w) and not uses_kernel(one.astype(jnp.float32), w.astype(jnp.float32))
    assert not uses_kernel(jnp.ones((1, 96), jnp.bfloat16), jnp.ones((64, 96), jnp.bfloat16))
