"""The paged attention kernel of decode and verify steps (jaxflash/kernels/attention_decode.py) against its twin,
the model's path (the pages gathered in position order, the causal and QSA masks, attention.attend), and inside
the engine's decode steps.

On the CPU the kernel runs in Pallas interpret mode. Inputs: random queries and caches whose pages are scattered
and partly not owned (ids out of range, or rows past a sequence's length that hold stale values the masks must
hide); one and several query tokens per sequence at different positions; QSA's block choice random and absent;
key blocks and splits smaller than, equal to and larger than the context, and blocks that overhang it.
Tolerances, relative to the largest value: float32 1e-5 (only the summation order differs; measured ~2e-7);
bfloat16 2e-2 (the kernel rounds the softmax weights to bfloat16 for the second product, as flash attention
does, and both round the output: a few bf16 ulps; measured 5.3e-3).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import presets
from jaxflash.config import FULL_ATTENTION
from jaxflash.kernels import attention_decode as ad
from jaxflash.kernels import on_gpu
from jaxflash.model import attention as attn
from jaxflash.model import qsa
from jaxflash.model.base import TokenBatch

from numerics import rel_err
from test_attention_blocks import random_attention, write_random_cache

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def twin(q, k_pages, v_pages, table, positions, chosen, r):
    """The model's own path, per sequence: pages gathered, causal AND (QSA block kept OR tail), attend."""
    n_keys = table.shape[1] * k_pages.shape[1]
    s = jnp.arange(n_keys)
    out = []
    for b in range(q.shape[0]):
        pos = positions[b]
        mask = pos[:, None] >= s[None, :]
        if chosen is not None:
            mask &= qsa.choice_mask(r, chosen[b], pos, n_keys)
        out.append(attn.attend(q[b], attn.read_pages(k_pages, table[b]), attn.read_pages(v_pages, table[b]), mask))
    return jnp.stack(out)


def paged_case(rng, dt, t, nh=6, nkv=2, d=32, n_pages=24, page=4, max_pages=7):
    """Three sequences over 24 scattered pages of 4 rows (28 keys each at most): lengths such that their queries
    end at 5, 27 and 13; the third owns 4 pages only (the rest of its row: -1 and 24, out of range)."""
    q = jnp.asarray(rng.normal(size=(3, t, nh, d)), dt)
    k = jnp.asarray(rng.normal(size=(n_pages, page, nkv, d)), dt)
    v = jnp.asarray(rng.normal(size=(n_pages, page, nkv, d)), dt)
    table = rng.permutation(n_pages)[: 3 * max_pages].reshape(3, max_pages).astype(np.int32)
    table[2, 4:] = [-1, n_pages, -1]
    last = np.asarray([5, 27, 13])
    positions = jnp.asarray(last[:, None] - np.arange(t)[::-1][None, :], jnp.int32)
    return q, k, v, jnp.asarray(table), positions


TILINGS = [ad.Tiles(16, 16), ad.Tiles(16, 48), ad.Tiles(64, 512), ad.Tiles(16)]
CASES = ([(jnp.float32, t, q, tl) for t in (1, 3) for q in (False, True) for tl in TILINGS]
         + [(jnp.bfloat16, t, True, ad.Tiles(16, 48)) for t in (1, 3)])


@pytest.mark.parametrize("dt,t,with_qsa,tiles", CASES)
def test_kernel_matches_twin(dt, t, with_qsa, tiles):
    """Tiles(16, 16): two splits per sequence at 28 keys, the second partly past the context; (16, 48): one split
    of two blocks; (64, 512): clipped to one block of 32 keys (overhanging 28); (16): the kernel's own split
    (here one block each). G = 3 heads per KV head, so a (sequence, KV head) holds 3 or 9 rows of a 16-row
    block. bfloat16 with one tiling (the arithmetic is the same)."""
    rng = np.random.default_rng(t * 10 + with_qsa)
    q, k, v, table, positions = paged_case(rng, dt, t)
    r = 2
    chosen = None
    if with_qsa:  # QSA keeps at least one block when any is complete (else a row could see no key: NaN)
        chosen = jnp.asarray(rng.random((3, t, table.shape[1] * k.shape[1] // r)) < 0.4).at[:, :, 0].set(True)
    got = ad.paged_attention(q, k, v, table, positions, chosen, r=r if with_qsa else 1, tiles=tiles)
    ref = twin(q, k, v, table, positions, chosen, r)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert np.isfinite(np.asarray(got, np.float32)).all()
    assert rel_err(got, ref) < TOL[dt]
    if with_qsa:  # the choice matters: causal attention alone gives other outputs
        assert rel_err(twin(q, k, v, table, positions, None, r), ref) > 1e-2
    # with the output gate applied as the splits combine, read from rows laid out as the q|k|v projection's
    nh, d = q.shape[2:]
    rows = jnp.asarray(rng.normal(size=(3, t, 2 * nh * d + 40)), dt)
    gated = ad.paged_attention(q, k, v, table, positions, chosen, r=r if with_qsa else 1, tiles=tiles,
                               gate_rows=rows)
    gate = rows[..., : 2 * nh * d].reshape(3, t, nh, 2 * d)[..., d:]
    want = ref * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(dt)
    assert gated.shape == q.shape and gated.dtype == q.dtype and rel_err(gated, want) < TOL[dt]
    # the same splits' output, gated: equal on the CPU; on a GPU the sigmoid's last bit may round the other way
    assert rel_err(gated, got * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(dt)) <= (
        2 ** -7 if dt == jnp.bfloat16 else 1e-6)


def test_stale_rows_and_unowned_pages_are_never_seen():
    """Rows past a sequence's last position and pages it does not own hold NaN: nothing of them may reach the
    output (a NaN key gives a NaN score, a NaN value 0 * NaN)."""
    rng = np.random.default_rng(4)
    q, k, v, table, positions = paged_case(rng, jnp.float32, 1)
    owned = np.zeros(k.shape[:2], bool)
    for b in range(3):
        for s in range(int(positions[b, -1]) + 1):
            owned[int(table[b, s // 4]), s % 4] = True
    k_nan = jnp.where(jnp.asarray(owned)[:, :, None, None], k, jnp.nan)
    v_nan = jnp.where(jnp.asarray(owned)[:, :, None, None], v, jnp.nan)
    got = ad.paged_attention(q, k_nan, v_nan, table, positions, tiles=ad.Tiles(16, 16))
    assert np.isfinite(np.asarray(got)).all()
    assert rel_err(got, twin(q, k, v, table, positions, None, 1)) < 1e-5


def test_a_query_that_sees_nothing_gives_zero():
    """Position -1 (no key at or before it) gives 0, where softmax over nothing would be NaN."""
    rng = np.random.default_rng(5)
    q, k, v, table, positions = paged_case(rng, jnp.float32, 2)
    positions = positions.at[1, 0].set(-1)
    got = np.asarray(ad.paged_attention(q, k, v, table, positions))
    np.testing.assert_array_equal(got[1, 0], 0)
    ref = twin(q, k, v, table, positions.at[1, 0].set(0), None, 1)
    assert rel_err(got[:, 1], ref[:, 1]) < 1e-5 and rel_err(got[0], ref[0]) < 1e-5


def test_takes_and_bad_input():
    assert ad.takes(24, 2, 256, 1, jnp.bfloat16) and ad.takes(24, 2, 256, 5, jnp.float32)
    assert not ad.takes(24, 2, 256, 6, jnp.bfloat16)  # 72 rows per KV head
    assert not ad.takes(24, 2, 96, 1, jnp.bfloat16)  # not a power of two
    assert not ad.takes(4, 2, 32, 1, jnp.float16)
    rng = np.random.default_rng(6)
    q, k, v, table, positions = paged_case(rng, jnp.float32, 1)
    with pytest.raises(ValueError, match="QSA's choice"):
        ad.paged_attention(q, k, v, table, positions, jnp.zeros((3, 1, 5), bool), r=2)
    with pytest.raises(ValueError, match="power of two"):
        ad.paged_attention(q, k, v, table, positions, tiles=ad.Tiles(24, 48))
    with pytest.raises(ValueError, match="gate rows"):
        ad.paged_attention(q, k, v, table, positions, gate_rows=jnp.zeros((3, 1, 8)))
    with pytest.raises(ValueError, match="does not take"):
        ad.paged_attention(q.astype(jnp.float16), k.astype(jnp.float16), v.astype(jnp.float16), table, positions)


@pytest.mark.parametrize("scores_kernel", [True, False])
@pytest.mark.parametrize("t", [1, 3])
def test_attention_layer_with_the_kernel_equals_xla(t, scores_kernel, monkeypatch):
    """The tiny preset's layer (QSA past its 32-token budget: queries near 60 and 80 keep 8 of up to 20 blocks)
    over a cache of scattered pages holding random earlier context, for T = 1 (decode) and 3 (a verify step):
    the kernel path's outputs and cache equal the XLA path's (keys to float32 noise), and QSA's selection matters
    (dense attention differs). QSA's blocks scored in attention_prep.block_scores and in XLA."""
    monkeypatch.setattr(attn, "QSA_SCORES_KERNEL", scores_kernel)
    cfg = presets.preset("tiny")
    dt = jnp.float32
    rng = np.random.default_rng(12 + t)
    p = random_attention(rng, cfg, dt)
    kv = write_random_cache(rng, attn.PagedKV.empty(cfg, 30, 8, dt, indexer=True), dt)
    table = np.full((2, 13), 30, np.int32)
    ids = rng.permutation(30)
    table[0, :10], table[1, :12] = ids[:10], ids[10:22]
    batch = TokenBatch.after(jnp.asarray([58, 80]), jnp.asarray([t, t - 1 if t > 1 else 1]), t, jnp.asarray(table))
    x = jnp.asarray(rng.normal(size=(2, t, cfg.hidden_size)), dt)
    run = jax.jit(lambda xx, b, c, kernel: attn.attention(p, cfg, xx, b, c, kernel), static_argnums=3)
    (y0, kv0), (y1, kv1) = run(x, batch, kv, False), run(x, batch, kv, True)
    valid = np.asarray(batch.valid)
    assert rel_err(np.asarray(y1)[valid], np.asarray(y0)[valid]) < 1e-5
    assert rel_err(kv1.k, kv0.k) < 1e-6  # normed and roped in attention_prep: float32 noise
    np.testing.assert_array_equal(np.asarray(kv1.v), np.asarray(kv0.v))  # copies
    np.testing.assert_array_equal(np.asarray(kv1.index_keys), np.asarray(kv0.index_keys))
    dense = dataclasses.replace(p, indexer=None)
    y_dense, _ = attn.attention(dense, cfg, x, batch, kv)
    assert rel_err(np.asarray(y_dense)[valid], np.asarray(y0)[valid]) > 1e-3
    y_dense_kernel, _ = attn.attention(dense, cfg, x, batch, kv, True)
    assert rel_err(np.asarray(y_dense_kernel)[valid], np.asarray(y_dense)[valid]) < 1e-5


def test_prefill_chunks_keep_the_xla_path():
    """Steps with more rows than the kernel takes (prefill chunks) attend as before, kernel or not."""
    cfg = presets.preset("tiny")
    rng = np.random.default_rng(2)
    p = random_attention(rng, cfg, jnp.float32)
    kv = attn.PagedKV.empty(cfg, 4, 16, jnp.float32, indexer=True)
    batch = TokenBatch.after(jnp.asarray([0]), jnp.asarray([40]), 40, jnp.asarray([[0, 1, 2, 3]]))
    x = jnp.asarray(rng.normal(size=(1, 40, cfg.hidden_size)), jnp.float32)
    text = str(jax.make_jaxpr(lambda xx: attn.attention(p, cfg, xx, batch, kv, True))(x))
    assert "attention_decode" not in text
    one = TokenBatch.after(jnp.asarray([40]), jnp.asarray([1]), 1, jnp.asarray([[0, 1, 2, 3]]))
    assert "attention_decode" in str(jax.make_jaxpr(lambda xx: attn.attention(p, cfg, xx[:, :1], one, kv, True))(x))


@pytest.mark.xdist_group("nvfp4")  # conftest.py's NVFP4 engines, shared with test_engine.py
def test_default_is_the_kernel_on_a_gpu_only(nvfp4_plain):
    assert nvfp4_plain.attention_kernel == on_gpu()  # conftest.py's engine, loaded with the defaults


@pytest.mark.xdist_group("nvfp4")  # conftest.py's NVFP4 engines, shared with test_engine.py
def test_engine_decode_with_the_kernel_equals_xla(nvfp4_dir, nvfp4_plain, trace_decode, monkeypatch):
    """Decoding past QSA's budget (a 40-token prompt, 8 tokens: the tiny preset keeps 8 blocks of 4) with the
    kernel gives the XLA path's tokens and, every decode step, its logits to float32 noise (1e-5 of the
    largest logit). The XLA path is conftest.py's engine where that is its default (not on a GPU)."""
    traced = []
    real = ad.paged_attention
    monkeypatch.setattr(ad, "paged_attention", lambda *a, **k: traced.append(1) or real(*a, **k))
    kw = dict(expert_residency="device", max_batch=4, max_seq_len=128, prefill_chunk=16, progress=False)
    on = jaxflash.load(nvfp4_dir, attention_kernel=True, **kw)
    off = (nvfp4_plain if not nvfp4_plain.attention_kernel
           else jaxflash.load(nvfp4_dir, attention_kernel=False, **kw))
    cfg = on.config
    prompt = [int(x) for x in np.random.default_rng(7).integers(0, cfg.vocab_size, 40)]
    toks_on, logits_on, _ = on.scheduler.step_logits(prompt, 8)
    assert len(traced) >= sum(lt == FULL_ATTENTION for lt in cfg.layer_types)
    n = len(traced)
    toks_off, logits_off, _ = off.scheduler.step_logits(prompt, 8)
    trace_decode(off)
    assert len(traced) == n  # attention_kernel=False never calls it
    assert toks_on == toks_off
    assert rel_err(logits_on, logits_off) < 1e-5
