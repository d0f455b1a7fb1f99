"""The MoE block's input kernel (jaxflash/kernels/moe_inputs.py: the router's softmax, top-k and renormalisation,
the shared expert's gate and activation) against its twin, the model's own code (moe.route, moe_parts' XLA
path), and the MoE block with it.

On the CPU the kernel runs in Pallas interpret mode. Inputs: random product rows in bfloat16 and float32, expert
counts that are and are not powers of two, shared widths that take one and several programs with a partial last
one, k from 1 to every expert, renormalised or not, 1 to 5 rows; and rows with exact ties on purpose. Expected:
expert ids equal (ties in index order, as top_k); weights within float32 rounding of the renormalising sum
(1e-6 relative in float32; one bfloat16 ulp where the two sums round to either side); the gate within 1e-6;
the activation within one ulp of its dtype (the same roundings; the GPU's exp may differ in the last bit).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash import presets
from jaxflash.kernels import moe_inputs
from jaxflash.model import moe as moe_mod
from jaxflash.model.base import silu, up

from numerics import rel_err


def twin(proj, experts, shared, k, norm):
    """moe_parts' XLA path from the same product rows."""
    cfg = dataclasses.replace(presets.preset("tiny"), num_experts=experts, num_experts_per_tok=k,
                              norm_topk_prob=norm)
    logits, g, u, gl = jnp.split(proj, [experts, experts + shared, experts + 2 * shared], axis=-1)
    probs = jax.nn.softmax(up(logits), axis=-1)
    w, ids = moe_mod.route(None, cfg, proj, probs)
    return ids, w, jax.nn.sigmoid(up(gl)), silu(up(g)).astype(proj.dtype) * u


def check(proj, experts, shared, k, norm, **kw):
    got = moe_inputs.moe_inputs(proj, experts, shared, k, norm, **kw)  # compiled on a GPU
    want = twin(proj, experts, shared, k, norm)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    ulp = 2.0 ** -8 if proj.dtype == jnp.bfloat16 else 1e-6
    np.testing.assert_allclose(np.asarray(got[1], np.float32), np.asarray(want[1], np.float32), rtol=ulp, atol=0)
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-6, atol=0)
    np.testing.assert_allclose(np.asarray(got[3], np.float32), np.asarray(want[3], np.float32), rtol=ulp,
                               atol=1e-30)
    return got


@pytest.mark.parametrize("dt", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("experts,shared,k,norm,rows,piece", [
    (16, 32, 4, True, 1, 128),     # the tiny preset's sizes: one activation program
    (12, 20, 3, False, 3, 8),      # neither a power of two; three activation programs, the last partial
    (64, 128, 8, True, 5, 32),     # the small preset's
    (7, 5, 7, True, 2, 4),         # every expert chosen
    (9, 4, 1, True, 1, 128),       # k = 1 (weight 1 when renormalised)
])
def test_matches_twin(dt, experts, shared, k, norm, rows, piece):
    rng = np.random.default_rng(experts * 100 + k)
    proj = jnp.asarray(rng.normal(size=(rows, experts + 2 * shared + 1)) * 3.0, dt)
    check(proj, experts, shared, k, norm, piece=piece)


def test_ties_in_index_order():
    """Equal logits give equal probabilities in both; the kernel takes them lowest index first, as top_k."""
    experts, shared, k = 16, 8, 5
    rows = np.zeros((4, experts + 2 * shared + 1), np.float32)
    rows[1, :experts] = [1, 2, 2, 0, 2, 1, 2, 0, 0, 1, 2, 1, 0, 0, 0, 0]  # five at the top: the first five
    rows[2, :experts] = np.repeat([0.5, 3.0], 8)  # ties across the cut: the first five of the 3.0s
    rows[3, :experts] = -1e4  # all equal, exponents underflow nowhere (softmax subtracts the max)
    rows[:, experts:] = np.linspace(-2, 2, 2 * shared + 1)
    ids = check(jnp.asarray(rows, jnp.bfloat16), experts, shared, k, True)[0]
    np.testing.assert_array_equal(np.asarray(ids), [[0, 1, 2, 3, 4], [1, 2, 4, 6, 10], [8, 9, 10, 11, 12],
                                                    [0, 1, 2, 3, 4]])


def test_rejects_bad_rows():
    with pytest.raises(ValueError, match="product row"):
        moe_inputs.moe_inputs(jnp.zeros((1, 20), jnp.bfloat16), 8, 4, 2, True)
    with pytest.raises(ValueError, match="rows"):
        moe_inputs.moe_inputs(jnp.zeros((moe_inputs.MAX_ROWS + 1, 17), jnp.bfloat16), 8, 4, 2, True)
    with pytest.raises(ValueError, match="k <= experts"):
        moe_inputs.moe_inputs(jnp.zeros((1, 17), jnp.bfloat16), 8, 4, 9, True)


@pytest.mark.parametrize("dt", [jnp.bfloat16, jnp.float32])
def test_moe_block_with_kernel(dt):
    """The tiny model's MoE block with the kernel against its XLA path, with the router's and with given ids."""
    cfg = presets.preset("tiny")
    e, h, i, si = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    rng = np.random.default_rng(3)

    def arr(*shape):
        return jnp.asarray(rng.normal(size=shape) * shape[-1] ** -0.5, dt)

    p = moe_mod.MoE(inputs=arr(e + 2 * si + 1, h), experts=moe_mod.Experts(arr(e, i, h), arr(e, i, h), arr(e, h, i)),
                    shared_down_proj=arr(h, si))
    x = jax.random.normal(jax.random.PRNGKey(4), (3, cfg.hidden_size), dt)
    src = moe_mod.ResidentExperts("gather")
    for ids in (None, jnp.asarray(np.random.default_rng(5).integers(0, cfg.num_experts, (3, cfg.num_experts_per_tok)),
                                  jnp.int32)):
        y0, _, r0 = moe_mod.moe(p, cfg, x, src, ids=ids, router_kernel=False)
        y1, _, r1 = moe_mod.moe(p, cfg, x, src, ids=ids, router_kernel=True)
        np.testing.assert_array_equal(np.asarray(r1.ids), np.asarray(r0.ids))
        assert y1.dtype == y0.dtype == dt and rel_err(y1, y0) < (2 ** -7 if dt == jnp.bfloat16 else 1e-5)
