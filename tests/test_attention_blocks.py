"""The blocked attention of long prefill chunks (attention.attend_blocked) against the unblocked `attend`.

`attend_blocked` on random queries, keys and masks (whole key blocks and whole rows masked, T and S not
multiples of the blocks); then the attention layer (random weights of the tiny preset, QSA past its 32-token
budget) over a chunk that follows earlier context in a paged cache filled with random rows, run with small
forced blocks against the unblocked path; and that steps of at most ATTEND_Q_BLOCK tokens (decode, verify: CUDA
graphs) keep the unblocked path, which has no loops. Tolerances, relative to the largest value: float64 1e-12
(measured ~1e-15: only the summation order differs), float32 1e-5 (measured ~1e-7).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash import presets
from jaxflash.model import attention as attn
from jaxflash.model import qsa
from jaxflash.model.base import TokenBatch

from numerics import rel_err

TOL = {jnp.float64: 1e-12, jnp.float32: 1e-5}


def random_attention(rng, cfg, dt) -> attn.Attention:
    h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ni, di = cfg.indexer_n_heads, cfg.indexer_head_dim

    def arr(*shape, scale=0.3):
        return jnp.asarray(rng.normal(size=shape) * scale, dt)

    indexer = qsa.Indexer(index_qk_proj=arr((ni + 1) * di, h), q_norm=arr(di, scale=1.0), k_norm=arr(di, scale=1.0))
    return attn.Attention(qkv_proj=arr(nh * 2 * hd + 2 * nkv * hd, h),
                          o_proj=arr(h, nh * hd), q_norm=arr(hd, scale=1.0), k_norm=arr(hd, scale=1.0),
                          indexer=indexer)


def random_inputs(rng, t, s, nh=4, nkv=2, d=8, dt=jnp.float64):
    q = jnp.asarray(rng.normal(size=(t, nh, d)), dt)
    k = jnp.asarray(rng.normal(size=(s, nkv, d)), dt)
    v = jnp.asarray(rng.normal(size=(s, nkv, d)), dt)
    return q, k, v


@pytest.mark.parametrize("dt", [jnp.float64, jnp.float32])
@pytest.mark.parametrize("q_block,k_block", [(8, 16), (5, 7), (1, 1), (64, 64), (37, 50)])
def test_attend_blocked_equals_attend(dt, q_block, k_block):
    """37 queries at positions 13..49 against 50 keys; a random mask with keys 16..31 hidden from the first 20
    rows (whole key blocks of 16) and rows 3 and 30 seeing nothing. A row that sees no key is NaN in `attend`
    (softmax over nothing) and 0 in the blocked form; every other row agrees."""
    with jax.enable_x64(dt == jnp.float64):
        rng = np.random.default_rng(q_block * 100 + k_block)
        t, s = 37, 50
        q, k, v = random_inputs(rng, t, s, dt=dt)
        pos = jnp.arange(t, dtype=jnp.int32) + 13
        sel = rng.random((t, s)) > 0.3
        sel[:20, 16:32] = False
        sel[[3, 30]] = False
        sel = jnp.asarray(sel)
        mask = sel & (pos[:, None] >= jnp.arange(s)[None, :])
        sees = np.asarray(mask.any(axis=1))
        assert not sees[3] and not sees[30] and sees.sum() == t - 2
        ref = np.asarray(attn.attend(q, k, v, mask))
        got = jax.jit(lambda *a: attn.attend_blocked(*a, None, lambda p, m: m, (sel,), q_block=q_block,
                                                     k_block=k_block))(q, k, v, pos)
        assert got.shape == q.shape and got.dtype == q.dtype
        got = np.asarray(got)
        assert np.isfinite(got).all()
        np.testing.assert_array_equal(got[~sees], 0)
        assert rel_err(got[sees], ref[sees]) < TOL[dt]


def test_bf16_attention_within_its_rounding():
    """bf16 queries, keys and values: `attend` and `attend_blocked` take their products on bf16 operands (the
    weights rounded to bf16 before they meet v) with float32 sums. Against float64 on the same bf16 values, the
    error relative to the largest output stays within a few bf16 roundings: tolerance 1e-2 (measured 2.3e-3, about one rounding of the output)."""
    rng = np.random.default_rng(7)
    t, s = 37, 50
    q, k, v = random_inputs(rng, t, s, dt=jnp.bfloat16)
    pos = jnp.arange(t, dtype=jnp.int32) + 13
    mask = pos[:, None] >= jnp.arange(s)[None, :]
    with jax.enable_x64(True):
        ref = np.asarray(attn.attend(*(a.astype(jnp.float64) for a in (q, k, v)), mask))
    got = attn.attend(q, k, v, mask)
    blocked = jax.jit(lambda *a: attn.attend_blocked(*a, q_block=8, k_block=16))(q, k, v, pos)
    assert got.dtype == blocked.dtype == jnp.bfloat16
    assert rel_err(got, ref) < 1e-2
    assert rel_err(blocked, ref) < 1e-2


def test_attend_blocked_skips_key_blocks_past_the_last_position():
    """Queries at positions 0..29 (29 the last valid one; the invalid rows 25..29 do not count, so the last is 24)
    with key blocks of 8: keys 32.. are NaN and must never be read (0 * NaN would reach the output), and keys
    25..31 share a block with visible keys, so they are read and masked."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(3)
        t, s = 30, 64
        q, k, v = random_inputs(rng, t, s)
        pos = jnp.arange(t, dtype=jnp.int32)
        valid = jnp.arange(t) < 25
        mask = pos[:, None] >= jnp.arange(s)[None, :]
        ref = np.asarray(attn.attend(q, k, v, mask))
        k_nan, v_nan = k.at[32:].set(jnp.nan), v.at[32:].set(jnp.nan)
        for q_block in (8, 30):
            got = np.asarray(attn.attend_blocked(q, k_nan, v_nan, pos, valid, q_block=q_block, k_block=8))
            assert rel_err(got[:25], ref[:25]) < 1e-12
            assert np.isfinite(got).all()  # the invalid rows saw fewer keys than their position allows


def write_random_cache(rng, kv: attn.PagedKV, dt) -> attn.PagedKV:
    """Every row of every page random: the earlier context, and stale rows that the masks must hide."""
    return attn.PagedKV(k=jnp.asarray(rng.normal(size=kv.k.shape), dt), v=jnp.asarray(rng.normal(size=kv.v.shape), dt),
                        index_keys=jnp.asarray(rng.normal(size=kv.index_keys.shape), dt))


def chunk_case(dt, qsa_on=True):
    """Two sequences of a 13-page cache (page 8, S = 104 rows): the first holds 50 tokens and takes 30 new ones,
    the second holds 9 and takes 37; the chunk is 37 wide (the first row has 7 padding entries). Their pages are
    scattered over 30; pages past what a sequence needs are not owned (ids out of range)."""
    cfg = presets.preset("tiny")
    rng = np.random.default_rng(11)
    p = random_attention(rng, cfg, dt)
    if not qsa_on:
        p = dataclasses.replace(p, indexer=None)
    kv = write_random_cache(rng, attn.PagedKV.empty(cfg, 30, 8, dt, indexer=True), dt)
    ids = rng.permutation(30)
    table = np.full((2, 13), 30, np.int32)
    table[0, :10], table[1, :6] = ids[:10], ids[10:16]  # 80 and 46 tokens
    t = 37
    batch = TokenBatch.after(jnp.asarray([50, 9]), jnp.asarray([30, 37]), t, jnp.asarray(table))
    x = jnp.asarray(rng.normal(size=(2, t, cfg.hidden_size)), dt)
    return p, cfg, x, batch, kv


@pytest.mark.parametrize("dt", [jnp.float64, jnp.float32])
@pytest.mark.parametrize("q_block,k_block", [(8, 16), (5, 7), (16, 256)])
def test_attention_layer_blocked_equals_unblocked(dt, q_block, k_block):
    """The layer with small forced blocks (T = 37 > q_block) against its unblocked path (the default blocks):
    same outputs on the real tokens, same cache. QSA past its budget: the queries see up to 21 complete blocks
    of 4 and keep 8, so the selection really drops keys (checked against dense attention). k_block 7 leaves a
    ragged last key block (104 = 14 * 7 + 6); 256 is clipped to the 104 rows."""
    with jax.enable_x64(dt == jnp.float64):
        p, cfg, x, batch, kv = chunk_case(dt)
        assert cfg.block_topk == 8 and cfg.indexer_compress_ratio == 4
        run = jax.jit(lambda xx, b, c, **kw: attn.attention(p, cfg, xx, b, c, **kw),
                      static_argnames=("q_block", "k_block"))
        y_ref, kv_ref = run(x, batch, kv)
        y, kv_out = run(x, batch, kv, q_block=q_block, k_block=k_block)
        valid = np.asarray(batch.valid)
        assert valid.sum() == 67 and not valid.all()
        assert np.isfinite(np.asarray(y)).all()  # padding rows too: they go on through the layer
        assert rel_err(np.asarray(y)[valid], np.asarray(y_ref)[valid]) < TOL[dt]
        for a, b in zip(jax.tree.leaves(kv_out), jax.tree.leaves(kv_ref)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        # the selection matters here: without QSA (dense causal attention) the outputs differ
        dense = dataclasses.replace(p, indexer=None)
        y_dense, _ = attn.attention(dense, cfg, x, batch, kv)
        assert rel_err(np.asarray(y_dense)[valid], np.asarray(y_ref)[valid]) > 1e-3


@pytest.mark.parametrize("dt", [jnp.float64, jnp.float32])
def test_attention_layer_blocked_without_qsa(dt):
    """A layer without an indexer: causal masking alone, blocked against unblocked."""
    with jax.enable_x64(dt == jnp.float64):
        p, cfg, x, batch, kv = chunk_case(dt, qsa_on=False)
        y_ref, _ = attn.attention(p, cfg, x, batch, kv)
        y, _ = attn.attention(p, cfg, x, batch, kv, q_block=8, k_block=16)
        valid = np.asarray(batch.valid)
        assert rel_err(np.asarray(y)[valid], np.asarray(y_ref)[valid]) < TOL[dt]


def jaxpr_text(p, cfg, x, batch, kv, **kw) -> str:
    return str(jax.make_jaxpr(lambda xx, b, c: attn.attention(p, cfg, xx, b, c, **kw))(x, batch, kv))


def test_short_steps_keep_the_unblocked_path():
    """Decode (T = 1) and verify steps (T <= 4) run in CUDA graphs, which capture no while loops: no loop in their
    program at the default blocks; a chunk of ATTEND_Q_BLOCK tokens has none either, one token more has both the
    query-block scan and the key-block while loop."""
    p, cfg, x, batch, kv = chunk_case(jnp.float32)
    for t in (1, 4):
        text = jaxpr_text(p, cfg, x[:, :t], TokenBatch.after(jnp.asarray([50, 9]), jnp.asarray([1, t]), t,
                                                             batch.page_table), kv)
        assert "while" not in text and "scan" not in text
    for q_block, loops in ((37, False), (36, True)):
        text = jaxpr_text(p, cfg, x, batch, kv, q_block=q_block)
        assert ("while" in text and "scan" in text) == loops, q_block
