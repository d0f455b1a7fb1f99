"""The GDN chunk kernels (jaxflash/kernels/gdn_chunk.py) against their twin, the model's chunked form
(gated_deltanet.chunk_gated_delta_rule on q and k repeated over the value heads), and inside gated_deltanet.

On the CPU the kernels run in Pallas interpret mode, in float32. Inputs: random l2-normed queries and keys,
decays and betas in the model's forms, key heads shared by 1, 2 and 3 value heads, lengths below, at and past a
chunk, value columns split over programs, padding rows (g = beta = 0) that must leave the state as it was.
Tolerances, relative to the largest value: 1e-5 (measured 1e-7 to 4e-7: the kernels invert I + A as a product of
powers of A, the twin by block doubling) and 5e-5 for the `hard` input (no decay, beta 1: the largest entries of
A; measured 5e-6 against float64 where the twin has 5e-7). Compiled on a GPU the matmuls run in TF32x3: 2e-4,
and a bfloat16 model's in TF32: 2e-3 for its state (benchmarks/RESULTS.md has the measured figures).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash import presets
from jaxflash.kernels import gdn_chunk, on_gpu
from jaxflash.model import gated_deltanet as gdn
from jaxflash.model.norms import l2norm

from numerics import rel_err
from test_gdn_kernel import random_layer

TOL = 2e-4 if on_gpu() else 1e-5
HARD_TOL = 2e-4 if on_gpu() else 5e-5


def _inputs(rng, t, hk, hv, dk, dv, hard=False):
    q = l2norm(jnp.asarray(rng.normal(size=(t, hk, dk)), jnp.float32)) * dk ** -0.5
    k = l2norm(jnp.asarray(rng.normal(size=(t, hk, dk)), jnp.float32))
    v = jnp.asarray(rng.normal(size=(t, hv, dv)), jnp.float32)
    if hard:
        g, beta = jnp.zeros((t, hv), jnp.float32), jnp.ones((t, hv), jnp.float32)
    else:
        g = jnp.asarray(-np.exp(rng.uniform(-1, 1, hv)) * np.log1p(np.exp(rng.normal(size=(t, hv)) - 2)), jnp.float32)
        beta = jnp.asarray(1 / (1 + np.exp(-rng.normal(size=(t, hv)))), jnp.float32)
    s = jnp.asarray(rng.normal(size=(hv, dk, dv)) * 0.3, jnp.float32)
    return q, k, v, g, beta, s


def _twin(q, k, v, g, beta, s):
    group = v.shape[1] // k.shape[1]
    return gdn.chunk_gated_delta_rule(jnp.repeat(q, group, axis=1), jnp.repeat(k, group, axis=1), v, g, beta, s)


@pytest.mark.parametrize("t,heads,dims,block_v,hard", [
    (100, (2, 4), (16, 16), 16, False),   # past one chunk, padded; two value heads per key head
    (64, (2, 6), (32, 16), 8, False),     # exactly one chunk; three per key head; two column blocks
    (30, (1, 2), (16, 32), 16, False),    # shorter than a chunk
    (130, (2, 2), (16, 16), 16, True),    # one value head per key head; the hard input
])
def test_chunk_rule_matches_twin(t, heads, dims, block_v, hard):
    rng = np.random.default_rng(t)
    x = _inputs(rng, t, *heads, *dims, hard=hard)
    o0, s0 = _twin(*x)
    o1, s1 = gdn_chunk.chunk_rule(*x, block_v=block_v)
    assert o1.shape == o0.shape and s1.shape == s0.shape and o1.dtype == s1.dtype == jnp.float32
    tol = HARD_TOL if hard else TOL
    assert rel_err(o1, o0) < tol
    assert rel_err(s1, s0) < tol


def test_padding_rows_leave_the_state():
    """Rows with g = beta = 0 (gated_deltanet's rows past n_valid) change nothing: the state after 70 live rows
    and 58 padding rows is the state after the 70 rows alone."""
    rng = np.random.default_rng(3)
    q, k, v, g, beta, s = _inputs(rng, 128, 2, 4, 16, 16)
    live = jnp.arange(128) < 70
    g, beta = jnp.where(live[:, None], g, 0.0), jnp.where(live[:, None], beta, 0.0)
    o_pad, s_pad = gdn_chunk.chunk_rule(q, k, v, g, beta, s)
    o_70, s_70 = gdn_chunk.chunk_rule(q[:70], k[:70], v[:70], g[:70], beta[:70], s)
    assert rel_err(s_pad, s_70) < TOL
    assert rel_err(o_pad[:70], o_70) < TOL


def test_gated_deltanet_with_the_kernels(monkeypatch):
    """A prefill chunk of two sequences (vmapped, as the engine runs them), one of them with padding rows, through
    gated_deltanet_batch with kernel=True against kernel=False, in bfloat16 (the float32 arithmetic is the
    tests above'); 8 tokens (UNROLL) still take the recurrence."""
    dt = jnp.bfloat16
    cfg = presets.preset("tiny").replace(linear_num_key_heads=2, linear_num_value_heads=4)
    rng = np.random.default_rng(11)
    p = random_layer(rng, cfg, dt)
    k = cfg.linear_conv_kernel_dim
    st = gdn.GDNState(conv=jnp.asarray(rng.normal(size=(2, k - 1, cfg.linear_conv_dim)), dt),
                      recurrent=jnp.asarray(rng.normal(size=(2, 4, 16, 16)) * 0.3, jnp.float32))
    calls = []
    real = gdn_chunk.chunk_rule
    for t in (80, 8):
        x = jnp.asarray(rng.normal(size=(2, t, cfg.hidden_size)), dt)
        n = jnp.asarray([t, t - 3])

        def run(kernel):
            return jax.jit(lambda xx, s, nn: gdn.gated_deltanet_batch(p, cfg, xx, s, nn, kernel))(x, st, n)

        monkeypatch.setattr(gdn_chunk, "chunk_rule", lambda *a, t=t, **kw: calls.append(t) or real(*a, **kw))
        y1, s1 = run(True)
        y0, s0 = run(False)
        assert rel_err(y1, y0) < 8e-3  # bf16 y: one ulp either side
        # a bfloat16 model's kernels take TF32 on a GPU (gdn_chunk.precision_for)
        assert rel_err(s1.recurrent, s0.recurrent) < (2e-3 if on_gpu() else TOL)
        np.testing.assert_array_equal(np.asarray(s1.conv, np.float32), np.asarray(s0.conv, np.float32))
    assert calls == [80]  # the chunk of 80 tokens took the kernels, the 8 tokens the recurrence


def test_takes():
    cfg = presets.preset("tiny")
    assert gdn_chunk.takes(cfg, jnp.bfloat16) and gdn_chunk.takes(cfg, jnp.float32)
    assert not gdn_chunk.takes(cfg, jnp.float16)
    assert not gdn_chunk.takes(cfg.replace(linear_key_head_dim=8), jnp.float32)  # below a tensor-core tile
    assert not gdn_chunk.takes(cfg.replace(linear_value_head_dim=24), jnp.float32)
    assert gdn_chunk.takes(presets.preset("full"), jnp.bfloat16)
    with pytest.raises(ValueError, match="block_v"):
        gdn_chunk.chunk_rule(*_inputs(np.random.default_rng(0), 64, 2, 4, 16, 16), block_v=6)
