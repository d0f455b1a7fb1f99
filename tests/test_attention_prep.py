"""The attention layer's kernels around the paged attention (jaxflash/kernels/attention_prep.py) against their
twins, the model's own code: new_rows against rms_norm, apply_rope and write_pages; block_scores against
qsa.block_keys of the sequence's pages and qsa.block_scores.

On the CPU the kernels run in Pallas interpret mode. Inputs: random projection rows of three sequences over
scattered pages, one token and three per sequence; padding rows (which write nothing) and a token whose page
its sequence does not own; head counts that are and are not powers of two (Triton pads them); pages whose
size is and is not a multiple of QSA's block, and more blocks than one program scores. Tolerances, relative to
the largest value: float32 1e-6 (only summation orders differ), bfloat16 2e-2 (the kernels and XLA may round
the products of the norm and RoPE differently: a few bf16 ulps).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash import presets
from jaxflash.kernels import attention_prep as ap
from jaxflash.model import attention as attn
from jaxflash.model import qsa
from jaxflash.model.norms import rms_norm
from jaxflash.model.rope import apply_rope, rope_cos_sin

from numerics import rel_err

TOL = {jnp.float32: 1e-6, jnp.bfloat16: 2e-2}


def config(heads: int, index_heads: int):
    """The tiny preset with `heads` query heads (over its 2 KV heads) and `index_heads` QSA heads."""
    return dataclasses.replace(presets.preset("tiny"), num_attention_heads=heads, indexer_n_heads=index_heads)


def pages_case(rng, cfg, dt, t, n_pages=30, page=8, max_pages=9):
    """Three sequences over scattered pages holding random earlier rows; their last tokens at 20, 70 and 44. The
    second owns 6 pages only (positions 64 on are on its 9th: not owned, so those tokens write nothing); the
    third's last row is padding when the step has several."""
    nkv, d, di = cfg.num_key_value_heads, cfg.head_dim, cfg.indexer_head_dim
    k = jnp.asarray(rng.normal(size=(n_pages, page, nkv, d)), dt)
    v = jnp.asarray(rng.normal(size=(n_pages, page, nkv, d)), dt)
    ik = jnp.asarray(rng.normal(size=(n_pages, page, di)), dt)
    table = rng.permutation(n_pages)[: 3 * max_pages].reshape(3, max_pages).astype(np.int32)
    table[1, 6:] = np.where(np.arange(max_pages - 6) % 2, n_pages, -1)
    positions = np.asarray([20, 70, 44])[:, None] - np.arange(t)[::-1][None, :]
    valid = np.ones((3, t), bool)
    valid[2, -1] = t == 1  # a padding row only where the step has several
    return k, v, ik, jnp.asarray(table), jnp.asarray(positions, jnp.int32), jnp.asarray(valid)


def twin_rows(cfg, proj, index_proj, positions, valid, table, q_norm, k_norm, iq_norm, k, v, ik):
    """attention.attention's XLA path for the same rows."""
    b, t = proj.shape[:2]
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ni, di, eps = cfg.indexer_n_heads, cfg.indexer_head_dim, cfg.rms_norm_eps
    cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
    q = proj[..., : nh * 2 * d].reshape(b, t, nh, 2 * d)[..., :d]
    kk = proj[..., nh * 2 * d: (nh * 2 + nkv) * d].reshape(b, t, nkv, d)
    vv = proj[..., (nh * 2 + nkv) * d:].reshape(b, t, nkv, d)
    q = apply_rope(rms_norm(q, q_norm, eps), cos, sin)
    kk = apply_rope(rms_norm(kk, k_norm, eps), cos, sin)
    iq = apply_rope(rms_norm(index_proj[..., : ni * di].reshape(b, t, ni, di), iq_norm, eps), cos, sin)
    return (q, iq, attn.write_pages(k, table, positions, valid, kk), attn.write_pages(v, table, positions, valid, vv),
            attn.write_pages(ik, table, positions, valid, index_proj[..., ni * di:]))


@pytest.mark.parametrize("dt", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("heads,index_heads", [(4, 2), (6, 3)])
def test_new_rows_match_twin(dt, t, heads, index_heads):
    cfg = config(heads, index_heads)
    rng = np.random.default_rng(t * 7 + heads)
    nh, nkv, d, ni, di = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.indexer_n_heads,
                          cfg.indexer_head_dim)
    k, v, ik, table, positions, valid = pages_case(rng, cfg, dt, t)
    proj = jnp.asarray(rng.normal(size=(3, t, nh * 2 * d + 2 * nkv * d)), dt)
    index_proj = jnp.asarray(rng.normal(size=(3, t, (ni + 1) * di)), dt)
    norms = [jnp.asarray(rng.normal(size=n) * 0.5, dt) for n in (d, d, di)]
    got = ap.new_rows(cfg, proj, index_proj, positions, valid, table, *norms, k, v, ik)
    ref = twin_rows(cfg, proj, index_proj, positions, valid, table, *norms, k, v, ik)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype
        assert rel_err(g, r) < TOL[dt]
    np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(ref[3]))  # V and raw keys are copies
    np.testing.assert_array_equal(np.asarray(got[4]), np.asarray(ref[4]))
    slots = np.take_along_axis(np.asarray(table), np.asarray(positions) // k.shape[1], axis=1)
    owned = np.asarray(valid) & (slots >= 0) & (slots < k.shape[0])
    assert owned.sum() < np.asarray(valid).sum()  # the second sequence's tokens are on a page it does not own
    assert np.asarray(got[2] != k).any(axis=(2, 3)).sum() == owned.sum()  # rows written: the owned live tokens
    assert rel_err(got[0], apply_rope(ref[0], *rope_cos_sin(positions + 1, cfg.rotary_dim, cfg.rope_theta))) > 1e-2


def test_new_rows_without_indexer():
    cfg = config(4, 2)
    rng = np.random.default_rng(3)
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    k, v, _, table, positions, valid = pages_case(rng, cfg, jnp.float32, 1)
    proj = jnp.asarray(rng.normal(size=(3, 1, nh * 2 * d + 2 * nkv * d)), jnp.float32)
    q, iq, k2, v2, ik2 = ap.new_rows(cfg, proj, None, positions, valid, table, jnp.zeros(d), jnp.zeros(d), None,
                                     k, v, None)
    assert iq is None and ik2 is None and q.shape == (3, 1, nh, d)
    ref = twin_rows(cfg, proj, jnp.zeros((3, 1, (cfg.indexer_n_heads + 1) * cfg.indexer_head_dim)), positions,
                    valid, table, jnp.zeros(d), jnp.zeros(d), jnp.zeros(cfg.indexer_head_dim), k, v,
                    jnp.zeros((30, 8, cfg.indexer_head_dim)))
    assert rel_err(q, ref[0]) < 1e-6 and rel_err(k2, ref[2]) < 1e-6
    np.testing.assert_array_equal(np.asarray(v2), np.asarray(ref[3]))
    with pytest.raises(ValueError, match="projection row"):
        ap.new_rows(cfg, proj[..., 1:], None, positions, valid, table, jnp.zeros(d), jnp.zeros(d), None, k, v, None)


def twin_scores(cfg, indexer, iq, ik, table):
    out = []
    for b in range(iq.shape[0]):
        raw = attn.read_pages(ik, table[b])
        kb = qsa.block_keys(indexer, cfg, raw, raw.shape[0] // cfg.indexer_compress_ratio)
        out.append(qsa.block_scores(cfg, iq[b], kb))
    return jnp.stack(out)


@pytest.mark.parametrize("dt", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("t,page,max_pages,blocks", [(1, 8, 9, ap.BLOCKS), (3, 6, 11, ap.BLOCKS), (1, 8, 40, 32),
                                                     (4, 8, 9, 1)])
def test_block_scores_match_twin(dt, t, page, max_pages, blocks):
    """Pages of 8 (whole blocks of 4) and 6 (blocks across pages); 18, 16 and 80 blocks, in programs of BLOCKS,
    32 (80 blocks: the third program partly past the table) and 1. Every block is compared, stale ones
    included: both read the same rows."""
    cfg = config(4, 3)
    rng = np.random.default_rng(t * 100 + page + max_pages)
    ni, di = cfg.indexer_n_heads, cfg.indexer_head_dim
    n_pages = max(30, 3 * max_pages)
    _, _, ik, _, _, _ = pages_case(rng, cfg, dt, t, n_pages=n_pages, page=page, max_pages=max_pages)
    table = rng.permutation(n_pages)[: 3 * max_pages].reshape(3, max_pages).astype(np.int32)
    table[1, -2:] = [-1, n_pages]  # not owned: read as some page, as read_pages does
    table = jnp.asarray(table)
    iq = jnp.asarray(rng.normal(size=(3, t, ni, di)), dt)
    indexer = qsa.Indexer(index_qk_proj=jnp.zeros(((ni + 1) * di, cfg.hidden_size), dt),
                          q_norm=jnp.zeros(di, dt), k_norm=jnp.asarray(rng.normal(size=di) * 0.5, dt))
    got = ap.block_scores(cfg, iq, ik, table, indexer.k_norm, blocks=blocks)
    ref = twin_scores(cfg, indexer, iq, ik, table)
    assert got.shape == ref.shape == (3, t, max_pages * page // cfg.indexer_compress_ratio)
    assert got.dtype == jnp.float32
    assert rel_err(got, ref) < TOL[dt]
    assert np.asarray(ref > 0).mean() > 0.5  # relu keeps most scores: the comparison is not of zeros


def test_block_scores_take_power_of_two_programs():
    cfg = config(4, 2)
    iq = jnp.zeros((1, 1, 2, cfg.indexer_head_dim))
    with pytest.raises(ValueError, match="power of two"):
        ap.block_scores(cfg, iq, jnp.zeros((4, 8, cfg.indexer_head_dim)), jnp.zeros((1, 4), jnp.int32),
                        jnp.zeros(cfg.indexer_head_dim), blocks=6)
