"""The GDN decode kernel (jaxflash/kernels/gdn_decode.py) against its twin, the model's gated_deltanet on one
token, and inside the engine's decode steps.

On the CPU the kernel runs in Pallas interpret mode. Inputs: random weights and states, batches holding a
padding row (whose states must stay exactly as they were), states with more rows than the step has
sequences (the others must stay too), key heads shared by 2 and 3 value heads, both
output gates. Tolerances, relative to the largest value: float32 1e-5 (the kernel sums S^T k and S^T q in
another order than XLA's einsum; measured 2e-7); bfloat16 outputs 8e-3 (two bf16 ulps, should a sum land on
the other side of a rounding; measured 0), the float32 states 1e-5. Compiled on a GPU, XLA keeps the twin's
bfloat16 intermediates (the conv output, SiLU) in float32 where it fuses them (its default
xla_allow_excess_precision) while the kernel rounds them as the model does, so there the bfloat16 case's
states may differ by the effect of one bf16 rounding of q, k, v: 4e-3 (measured 4e-4 on the H200); so may
the batched twin's from the per-sequence code's, which XLA fuses another way (measured 3.5e-4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import presets
from jaxflash.config import FULL_ATTENTION
from jaxflash.kernels import gdn_chunk, gdn_decode, on_gpu
from jaxflash.model import gated_deltanet as gdn

from numerics import rel_err


def random_layer(rng, cfg, dt):
    h, c, k = cfg.hidden_size, cfg.linear_conv_dim, cfg.linear_conv_kernel_dim
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim

    def arr(*shape, scale=0.2):
        return jnp.asarray(rng.normal(size=shape) * scale, dt)

    return gdn.GatedDeltaNet(in_proj=arr(c + hv * dv + 2 * hv, h), conv1d=arr(c, k), dt_bias=arr(hv),
                             A_log=arr(hv), norm=arr(dv, scale=1.0), out_proj=arr(h, hv * dv))


@pytest.mark.parametrize("dt", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("heads,gate,block_v", [((2, 4), "sigmoid", 32), ((2, 6), "sigmoid", 4),
                                                 ((2, 4), "silu", 8)])
def test_decode_step_matches_twin(dt, heads, gate, block_v, monkeypatch):
    """block_v 32 is clipped to the tiny dv of 16 (one program per head); 4 and 8 split a head's columns."""
    real = gdn_decode.recurrent_step
    monkeypatch.setattr(gdn_decode, "recurrent_step", lambda *a, **k: real(*a, **k, block_v=block_v))
    hk, hv = heads
    cfg = presets.preset("tiny").replace(linear_num_key_heads=hk, linear_num_value_heads=hv, output_gate_type=gate)
    rng = np.random.default_rng(hv * 10 + (gate == "silu"))
    p = random_layer(rng, cfg, dt)
    b, k = 3, cfg.linear_conv_kernel_dim
    x = jnp.asarray(rng.normal(size=(b, 1, cfg.hidden_size)), dt)
    # the states hold 2 more rows than the step has sequences (slots outside a decode bucket)
    st = gdn.GDNState(conv=jnp.asarray(rng.normal(size=(b + 2, k - 1, cfg.linear_conv_dim)), dt),
                      recurrent=jnp.asarray(rng.normal(size=(b + 2, hv, cfg.linear_key_head_dim,
                                                             cfg.linear_value_head_dim)) * 0.5, jnp.float32))
    n = jnp.asarray([1, 0, 1])  # row 1 is padding

    def run(kernel):
        return jax.jit(lambda xx, s, nn: gdn.gated_deltanet_batch(p, cfg, xx, s, nn, kernel))(x, st, n)

    (y0, s0), (y1, s1) = run(False), run(True)
    assert y1.shape == y0.shape and y1.dtype == y0.dtype
    assert s1.recurrent.shape == s0.recurrent.shape == st.recurrent.shape and s1.conv.shape == st.conv.shape
    assert rel_err(y1, y0) < (1e-5 if dt == jnp.float32 else 8e-3)
    excess_precision = dt == jnp.bfloat16 and on_gpu()
    assert rel_err(s1.recurrent, s0.recurrent) < (4e-3 if excess_precision else 1e-5)
    # the conv states: the kept rows exactly, the new row (the qkv projection, which XLA may compile differently
    # in the two programs: 1-ulp differences on an AMD EPYC CPU) to float32 rounding, or one bfloat16 ulp
    np.testing.assert_array_equal(np.asarray(s1.conv[:, :-1], np.float32), np.asarray(s0.conv[:, :-1], np.float32))
    assert rel_err(s1.conv, s0.conv) < (1e-6 if dt == jnp.float32 else 8e-3)
    for s in (s0, s1):  # padding row 1 and rows 3, 4 outside the step: unchanged
        for row in (1, 3, 4):
            np.testing.assert_array_equal(np.asarray(s.recurrent[row]), np.asarray(st.recurrent[row]))
            np.testing.assert_array_equal(np.asarray(s.conv[row], np.float32), np.asarray(st.conv[row], np.float32))
    # the batch's rows are the per-sequence model code's
    one = jax.jit(lambda xx, s, nn: gdn.gated_deltanet(p, cfg, xx, s, nn))
    for i in (0, 2):
        yi, si = one(x[i], gdn.GDNState(conv=st.conv[i], recurrent=st.recurrent[i]), n[i])
        assert rel_err(y0[i], yi) < (1e-6 if dt == jnp.float32 else 8e-3)
        assert rel_err(s0.recurrent[i], si.recurrent) < (4e-3 if excess_precision else 1e-6)


def test_takes():
    cfg = presets.preset("tiny")
    assert gdn_decode.takes(cfg, jnp.bfloat16) and gdn_decode.takes(cfg, jnp.float32)
    assert not gdn_decode.takes(cfg, jnp.float16)
    assert not gdn_decode.takes(cfg.replace(linear_key_head_dim=24), jnp.float32)
    c = cfg.linear_conv_dim
    w = c + cfg.linear_num_value_heads * (cfg.linear_value_head_dim + 2)  # qkv | z | b | a
    with pytest.raises(ValueError, match="block_v"):
        gdn_decode.recurrent_step(cfg, jnp.zeros((1, w)), jnp.ones(1, jnp.int32), jnp.zeros((c, 4)),
                                  jnp.zeros(4), jnp.zeros(4), jnp.zeros((1, 3, c)), jnp.zeros((1, 4, 16, 16)),
                                  block_v=6)
    with pytest.raises(ValueError, match="for 2 sequences"):
        gdn_decode.recurrent_step(cfg, jnp.zeros((2, w)), jnp.ones(2, jnp.int32), jnp.zeros((c, 4)),
                                  jnp.zeros(4), jnp.zeros(4), jnp.zeros((2, 3, c)), jnp.zeros((1, 4, 16, 16)))
    with pytest.raises(ValueError, match="for 2 sequences"):
        gdn_decode.recurrent_step(cfg, jnp.zeros((2, w)), jnp.ones(2, jnp.int32), jnp.zeros((c, 4)),
                                  jnp.zeros(4), jnp.zeros(4), jnp.zeros((1, 3, c)), jnp.zeros((2, 4, 16, 16)))
    with pytest.raises(ValueError, match="stacked in_proj"):
        gdn_decode.recurrent_step(cfg, jnp.zeros((1, c)), jnp.ones(1, jnp.int32), jnp.zeros((c, 4)),
                                  jnp.zeros(4), jnp.zeros(4), jnp.zeros((1, 3, c)), jnp.zeros((1, 4, 16, 16)))
    assert gdn_decode.takes(presets.preset("full"), jnp.bfloat16)


@pytest.mark.xdist_group("nvfp4")  # conftest.py's NVFP4 engines, shared with test_engine.py
def test_default_is_the_kernel_on_a_gpu_only(nvfp4_plain):
    assert nvfp4_plain.gdn_kernel == on_gpu()  # conftest.py's engine, loaded with the defaults


@pytest.mark.xdist_group("nvfp4")  # conftest.py's NVFP4 engines, shared with test_engine.py
def test_engine_decode_with_the_kernel_equals_xla(nvfp4_dir, nvfp4_plain, trace_decode, monkeypatch):
    """Decoding with the kernels (the decode kernel, and the chunk kernels for the prompt's chunk of 11 tokens)
    gives the XLA path's tokens and, every decode step, its logits to float32 noise (1e-5 of the largest logit).
    The XLA path is conftest.py's engine of the same model and geometry where that is its default (not on a
    GPU)."""
    traced, chunked = [], []
    real, real_chunk = gdn_decode.recurrent_step, gdn_chunk.chunk_rule
    monkeypatch.setattr(gdn_decode, "recurrent_step", lambda *a, **k: traced.append(1) or real(*a, **k))
    monkeypatch.setattr(gdn_chunk, "chunk_rule", lambda *a, **k: chunked.append(1) or real_chunk(*a, **k))
    kw = dict(expert_residency="device", max_batch=4, max_seq_len=128, prefill_chunk=16, progress=False)
    on = jaxflash.load(nvfp4_dir, gdn_kernel=True, **kw)
    off = nvfp4_plain if not nvfp4_plain.gdn_kernel else jaxflash.load(nvfp4_dir, gdn_kernel=False, **kw)
    cfg = on.config
    prompt = [int(t) for t in np.random.default_rng(6).integers(0, cfg.vocab_size, 11)]
    toks_on, logits_on, _ = on.scheduler.step_logits(prompt, 8)
    gdn_layers = sum(t != FULL_ATTENTION for t in cfg.layer_types)
    assert len(traced) >= gdn_layers  # the decode program's GDN layers went through the kernel
    assert len(chunked) >= gdn_layers  # and the prefill program's through the chunk kernels
    n, n_chunked = len(traced), len(chunked)
    toks_off, logits_off, _ = off.scheduler.step_logits(prompt, 8)
    trace_decode(off)  # its programs may have been built before the patch: trace its decode step again
    assert len(traced) == n  # and gdn_kernel=False never calls them
    assert len(chunked) == n_chunked
    assert toks_on == toks_off
    assert rel_err(logits_on, logits_off) < 1e-5
