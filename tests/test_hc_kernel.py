"""The hyper-connection mix kernels (jaxflash/kernels/hc_mix.py) against their twin, the model's
hyper_connection.mix, and inside the engine's decode steps; and the twin's float32-exact dot with bfloat16
weights.

On the CPU the kernels run in Pallas interpret mode. Inputs: random float32 residual rows at several scales,
norm, bottleneck and injection weights in float32 and bfloat16, with and without injection weights (the final
mixer), 1 to 8 rows, with and without the previous block's combine inside the mix (combine_mix; its block output
whole, or a MoE block's output as parts summed in the kernel). Tolerance,
relative to the largest value: 1e-5 for x and inj, 1e-6 for the combined residual, 2^-8 (one bfloat16 ulp) for x
written in bfloat16. Everything is float32 in
both; the kernels only sum in another order (measured 4e-8 to 8e-7, the full-size shapes included), and may
fuse the combine's multiply-add (1e-7).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import presets
from jaxflash.engine import runner as runner_mod
from jaxflash.engine.runner import Want
from jaxflash.kernels import hc_mix, on_gpu
from jaxflash.model import hyper_connection as hc
from jaxflash.model.moe import MoEOutput

from numerics import rel_err


def random_hc(rng, cfg, dt, inject: bool):
    w, r, s = cfg.hidden_size * cfg.hc_count, cfg.hc_lowrank, cfg.hc_count

    def arr(*shape, scale):
        return jnp.asarray(rng.normal(size=shape) * scale, dt)

    return hc.HyperConnection(norm=arr(w, scale=0.3), down=arr(r, w, scale=0.05), up=arr(w, r, scale=0.2),
                              inject=arr(s, w, scale=0.05) if inject else None)


@pytest.mark.parametrize("dt,inject", [(jnp.float32, True), (jnp.bfloat16, True), (jnp.float32, False)])
def test_mix_matches_twin(dt, inject):  # bfloat16 weights without injection: no path the three cases miss
    cfg = presets.preset("tiny")  # one chunk per stream and of the rank; the full-size test has several
    rng = np.random.default_rng(7)
    p = random_hc(rng, cfg, dt, inject)
    s, eps = cfg.hc_count, cfg.rms_norm_eps
    for shape, scale in (((1, 1), 3.0), ((3, 1), 1e-3), ((2, 4), 50.0)):  # 8 rows: the kernels' most
        assert hc_mix.takes(math.prod(shape), cfg.hidden_size * s, s, cfg.hc_lowrank)  # or the twin met itself
        h = jnp.asarray(rng.normal(size=(*shape, cfg.hidden_size * s)) * scale, jnp.float32)
        x0, i0 = hc.mix(p, h, s, eps)
        x1, i1 = hc.mix(p, h, s, eps, kernel=True)
        assert x1.shape == x0.shape == (*shape, cfg.hidden_size) and x1.dtype == jnp.float32
        assert rel_err(x1, x0) < 1e-5
        if inject:
            assert i1.shape == (*shape, s) and rel_err(i1, i0) < 1e-5
        else:
            assert i1 is None and i0 is None
        # with the block output y of the previous block combined first (injection weights in [0, 2])
        inj = jnp.asarray(rng.uniform(0, 2, size=(*shape, s)), jnp.float32)
        y = jnp.asarray(rng.normal(size=(*shape, cfg.hidden_size)) * scale, dt)
        want = hc.combine_mix(p, h, inj, y, s, eps)
        got = hc.combine_mix(p, h, inj, y, s, eps, kernel=True)
        np.testing.assert_array_equal(np.asarray(want[0]), np.asarray(hc.combine(h, inj, y)))
        assert got[0].shape == h.shape and rel_err(got[0], want[0]) < 1e-6
        assert rel_err(got[1], want[1]) < 1e-5
        assert (got[2] is None) == (not inject) and (not inject or rel_err(got[2], want[2]) < 1e-5)
        # y as a MoE block's parts (summed in the kernel where y is read): as the twin, whose y is their sum
        # rounded to y's dtype, up to one ulp of that rounding where a fused multiply-add straddles it (GPU)
        parts = MoEOutput(jnp.asarray(rng.normal(size=y.shape) * scale, jnp.float32), y,
                          jnp.asarray(rng.uniform(0, 1, size=(*shape, 1)), jnp.float32))
        want = hc.combine_mix(p, h, inj, parts, s, eps)
        got = hc.combine_mix(p, h, inj, parts, s, eps, kernel=True)
        np.testing.assert_array_equal(np.asarray(want[0]), np.asarray(hc.combine(h, inj, parts.total())))
        ulp = 2.0 * float(jnp.max(jnp.abs(parts.total().astype(jnp.float32)))) * (2 ** -8 if dt == jnp.bfloat16 else 0)
        assert float(jnp.max(jnp.abs(got[0] - want[0]))) <= ulp + 1e-6 * float(jnp.max(jnp.abs(want[0])))
        assert rel_err(got[1], want[1]) < 1e-5 + (2 ** -8 if dt == jnp.bfloat16 else 0)
        # x in the block's input dtype, rounded as it is written: the float32 x rounded, up to one bfloat16 ulp
        # where the two float32 sums straddle a rounding boundary
        for fn in (lambda kernel: hc.mix(p, h, s, eps, kernel, jnp.bfloat16)[0],
                   lambda kernel: hc.combine_mix(p, h, inj, y, s, eps, kernel, jnp.bfloat16)[1]):
            xb0, xb1 = fn(False), fn(True)
            assert xb0.dtype == xb1.dtype == jnp.bfloat16 and xb1.shape == xb0.shape
            assert rel_err(xb1, xb0) < 2 ** -8


@pytest.mark.parametrize("tiles", [dict(), dict(block_r=8, block_h=16, splits=5), dict(block_r=2, splits=5),
                                   dict(up_warps=4, r_piece=256), dict(splits=1)])
def test_full_size_mix_matches_twin(tiles):
    """Full-size shapes (several loads per program; a stream's columns split over programs: by default from
    three rows on, row_splits), with and without a pending combine; two rows, and four with the default tiles."""
    cfg = presets.preset("full")
    rng = np.random.default_rng(8)
    p = random_hc(rng, cfg, jnp.bfloat16, True)
    s, eps, w = cfg.hc_count, cfg.rms_norm_eps, cfg.hidden_size * cfg.hc_count
    for rows in (2, 4) if not tiles else (2,):
        h = jnp.asarray(rng.normal(size=(rows, w)), jnp.float32)
        inj = jnp.asarray(rng.uniform(0, 2, size=(rows, s)), jnp.float32)
        y = jnp.asarray(rng.normal(size=(rows, cfg.hidden_size)), jnp.bfloat16)
        x0, i0 = hc.mix(p, h, s, eps)
        x1, i1, h1 = hc_mix.mix(h, p.norm, p.down, p.up, p.inject, s, eps, **tiles)
        assert rel_err(x1, x0) < 1e-5 and rel_err(i1, i0) < 1e-5
        np.testing.assert_array_equal(np.asarray(h1), np.asarray(h))
        hc0, x0, i0 = hc.combine_mix(p, h, inj, y, s, eps)
        x1, i1, hc1 = hc_mix.mix(h, p.norm, p.down, p.up, p.inject, s, eps, pending=(inj, y), **tiles)
        assert rel_err(hc1, hc0) < 1e-6 and rel_err(x1, x0) < 1e-5 and rel_err(i1, i0) < 1e-5


def test_bf16_parts_are_exact():
    """The three bfloat16 parts of float32 values (the twin's bf16-weight dot) sum to them exactly, over
    the float32 range down to 2^-100, signs and zeros included. (Below, a part can be subnormal, and XLA
    flushes subnormals to zero, as in all its float arithmetic: no residual value is that small.)"""
    rng = np.random.default_rng(12)
    x = rng.normal(size=4096) * np.exp2(rng.integers(-100, 120, 4096).astype(np.float64))
    x = np.concatenate([x, [0.0, -0.0, 1.0, -1.0, 3.4e38, 2.0 ** -100]]).astype(np.float32)
    parts = hc._bf16_parts(jnp.asarray(x))
    assert parts.shape == (3, x.size) and parts.dtype == jnp.bfloat16
    p = np.asarray(parts.astype(jnp.float32))
    np.testing.assert_array_equal(p[0] + (p[1] + p[2]), x)
    np.testing.assert_array_equal(p.sum(0), x)


def test_bf16_weight_dot_is_a_float32_dot():
    """With bfloat16 weights and SPLIT_ROWS rows or more the mix's products run as one bf16 dot over the
    parts: equal to the float32 product of the widened weights up to the order of the sums (tolerance 1e-6 of the largest value, against
    float64; float32 itself measures about 5e-7 here)."""
    rng = np.random.default_rng(13)
    w = jnp.asarray(rng.normal(size=(40, 2560)) * 0.02, jnp.bfloat16)
    for rows in (1, hc.SPLIT_ROWS, 8):  # the float32 dot, then the parts
        x = jnp.asarray(rng.normal(size=(rows, 2560)) * 10.0 ** rng.uniform(-3, 3, (rows, 1)), jnp.float32)
        ref = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64).T
        got = hc._f32_linear(x, w)
        assert got.dtype == jnp.float32
        assert np.abs(np.asarray(got) - ref).max() / np.abs(ref).max() < 1e-6


def test_takes_and_fallback(monkeypatch):
    cfg = presets.preset("tiny")
    w, r, s = cfg.hidden_size * cfg.hc_count, cfg.hc_lowrank, cfg.hc_count
    assert hc_mix.takes(8, w, s, r) and not hc_mix.takes(9, w, s, r) and not hc_mix.takes(0, w, s, r)
    assert not hc_mix.takes(1, 3 * 64, 3, r)  # streams not a power of two
    assert not hc_mix.takes(1, w, s, 18)  # a rank the blocks do not tile
    assert not hc_mix.takes(1, w, s, r, splits=2)  # a stream of one chunk cannot be split
    # from SPLIT_FROM_ROWS rows on a stream's columns split over ROWS_SPLITS programs where its chunks allow it
    full = presets.preset("full")
    assert [hc_mix.row_splits(n, full.hidden_size) for n in (1, 2, 3, 8)] == [1, 1, 5, 5]
    assert hc_mix.row_splits(8, cfg.hidden_size) == 1  # the tiny stream is one chunk
    assert hc_mix.takes(1, full.hidden_size * full.hc_count, full.hc_count, full.hc_lowrank)
    with pytest.raises(ValueError, match="hc_mix takes"):
        hc_mix.mix(jnp.zeros((9, w)), jnp.zeros(w), jnp.zeros((r, w)), jnp.zeros((w, r)), None, s, 1e-6)
    with pytest.raises(ValueError, match="r_piece must be a power of two"):
        hc_mix.mix(jnp.zeros((1, w)), jnp.zeros(w), jnp.zeros((r, w)), jnp.zeros((w, r)), None, s, 1e-6, r_piece=12)
    # more rows than the kernels take (a prefill chunk): hc.mix keeps its own code
    monkeypatch.setattr(hc_mix, "mix", lambda *a, **k: pytest.fail("the kernel ran for 16 rows"))
    p = random_hc(np.random.default_rng(9), cfg, jnp.float32, True)
    h = jnp.asarray(np.random.default_rng(10).normal(size=(2, 8, w)), jnp.float32)
    x0, _ = hc.mix(p, h, s, cfg.rms_norm_eps)
    x1, _ = hc.mix(p, h, s, cfg.rms_norm_eps, kernel=True)
    np.testing.assert_array_equal(np.asarray(x1), np.asarray(x0))


@pytest.mark.xdist_group("nvfp4")  # conftest.py's NVFP4 engines, shared with test_engine.py
def test_engine_decode_with_the_kernels_equals_xla(nvfp4_dir, nvfp4_plain, trace_decode, monkeypatch):
    """Decoding with the kernels gives the XLA path's tokens and, every decode step, its logits to float32
    noise (1e-5 of the largest logit); the decode program's mixes (two per layer and the final one) went
    through them. The XLA path is conftest.py's engine of the same model and geometry, loaded with the
    defaults."""
    traced = []
    real = hc_mix.mix
    monkeypatch.setattr(hc_mix, "mix", lambda *a, **k: traced.append(1) or real(*a, **k))
    on = jaxflash.load(nvfp4_dir, expert_residency="device", hc_kernel=True, max_batch=4, max_seq_len=128,
                       prefill_chunk=16, progress=False)
    off = nvfp4_plain
    cfg = on.config
    prompt = [int(t) for t in np.random.default_rng(11).integers(0, cfg.vocab_size, 9)]
    toks_on, logits_on, _ = on.scheduler.step_logits(prompt, 8)
    assert len(traced) >= 2 * cfg.num_hidden_layers + 1
    n = len(traced)
    toks_off, logits_off, _ = off.scheduler.step_logits(prompt, 8)
    trace_decode(off)  # its programs may have been built before the patch: trace its decode step again
    assert len(traced) == n  # the default engine never calls them
    assert toks_on == toks_off
    assert rel_err(logits_on, logits_off) < 1e-5


@pytest.mark.xdist_group("nvfp4")  # conftest.py's NVFP4 engines, shared with test_engine.py
def test_engine_takes_the_kernels_for_steps_of_few_rows(nvfp4_plain, monkeypatch):
    """By default the engine runs the kernels on a GPU for steps of hc_mix.FASTER_ROWS rows (elsewhere never);
    a decode step of more rows than Setup.hc_kernel_rows keeps XLA's mix, one of at most that many takes the
    kernels for every mix (two per layer and the final one). The step is traced, not compiled."""
    r = nvfp4_plain.scheduler.runner
    assert r.setup.hc_kernel_rows == (hc_mix.FASTER_ROWS if on_gpu() else 0)
    calls = []
    real = hc_mix.mix
    monkeypatch.setattr(hc_mix, "mix", lambda *a, **k: calls.append(1) or real(*a, **k))
    rows = r.setup.max_batch  # the state's slots: the decode step's token rows
    state = jax.tree.unflatten(r._state_def, r._state_shapes)
    for limit, want in ((rows - 1, 0), (rows, 2 * nvfp4_plain.config.num_hidden_layers + 1)):
        setup = dataclasses.replace(r.setup, hc_kernel_rows=limit)
        calls.clear()
        jax.eval_shape(lambda p, st: runner_mod.decode_step(p, setup, Want(logits=True), st, None, None),
                       r.params, state)
        assert len(calls) == want, (limit, len(calls))
