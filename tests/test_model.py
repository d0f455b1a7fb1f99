"""jaxflash's model against the reference (transformers' qwen4_exp, float64) on tiny random configs.

Every parameter is random (norm weights too). The main config has 8 layers: 6 GDN and 2 attention layers with
QSA, PLE at layer 1, shared + routed experts. QSA's budget is 8 tokens (2 blocks), so every sequence past 11
tokens exercises block selection, and the long case runs far past it. Sequences contain EOS tokens, which cut
PLE's n-grams into segments.

Measured on the CPU (float32 mode vs the float64 reference, max |diff| / max |ref logit|): 3e-6 to 8e-6.
Tolerance: 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp
from jax import lax

import jaxflash
from jaxflash.config import ModelConfig
from jaxflash.engine import Engine
from jaxflash.model import transformer
from jaxflash.model.weights import DictSource, load_params

from hf_reference import (build_hf_model, checkpoint_tensors, hf_logits, mtp_reference, pre_mixer_hidden,
                          near_ties, random_mtp, round_to, save_checkpoint, tiny_hf_config)
from numerics import rel_err

TOL = 1e-4


def with_eos(rng, n, vocab, eos, at):
    s = rng.integers(0, vocab, n)
    s[s == eos] = (eos + 1) % vocab
    s[[i for i in at if i < n]] = eos
    return s


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    # 8 indexer heads make exact zero scores (all heads negative after relu) rare, so top-k ties are rare
    hcfg = tiny_hf_config(num_hidden_layers=8, indexer_n_heads=8)
    model = build_hf_model(hcfg, seed=0)
    path = tmp_path_factory.mktemp("ckpt_f32")
    save_checkpoint(model, path)  # transformers' own text-only layout
    return hcfg, model, path


@pytest.fixture(scope="module")
def engine(ref):
    return jaxflash.load(ref[2], dtype="float32", progress=False)


def test_config_read_from_text_layout(ref, engine):
    hcfg = ref[0]
    assert engine.checkpoint.layout == "text"
    assert engine.config.layer_types.count("full_attention") == 2
    assert engine.config.eos_token_id == hcfg.eos_token_id
    assert engine.config.block_topk == 2


def test_sequence_with_eos_segments(ref, engine):
    hcfg, model, _ = ref
    rng = np.random.default_rng(1)
    # EOS at the start, in the middle, twice in a row and at the end; 120 tokens: the padded length (128) of
    # test_ragged_batch's longest sequence alone, so that the forward compiles once for both
    s = with_eos(rng, 120, hcfg.vocab_size, hcfg.eos_token_id, at=[0, 9, 40, 41, 77, 119])
    assert near_ties(model, s) == 0
    err = rel_err(engine.logits(s), hf_logits(model, s))
    assert err < TOL, err


def test_qsa_far_past_budget(ref, engine):
    """600 tokens = 150 complete blocks against a budget of 2 blocks per query."""
    hcfg, model, _ = ref
    s = with_eos(np.random.default_rng(20), 600, hcfg.vocab_size, hcfg.eos_token_id, at=[300])
    assert near_ties(model, s) == 0
    out = engine.logits(s)
    ref_logits = hf_logits(model, s)
    assert rel_err(out, ref_logits) < TOL
    # QSA really changed the result: with a budget covering everything the logits differ
    dense = jaxflash.Engine(engine.config.replace(indexer_budget=1024), engine.params)
    assert rel_err(dense.logits(s), ref_logits) > 100 * TOL


def test_ragged_batch(ref, engine):
    hcfg, model, _ = ref
    rng = np.random.default_rng(3)
    seqs = [with_eos(rng, n, hcfg.vocab_size, hcfg.eos_token_id, at=[n // 2]) for n in (97, 31, 64, 5)]
    outs = engine.logits(seqs)
    assert [o.shape for o in outs] == [(len(s), hcfg.vocab_size) for s in seqs]
    for s, o in zip(seqs, outs):
        assert near_ties(model, s) == 0
        assert rel_err(o, hf_logits(model, s)) < TOL
        # the same sequence alone gives the same logits as inside the batch (up to float32 reassociation:
        # the padded lengths differ)
        assert rel_err(engine.logits(s), o.astype(np.float64)) < TOL


def test_host_table_equals_device_table(ref, engine):
    host = jaxflash.load(ref[2], dtype="float32", ple_table="host", progress=False)
    assert host.host_table is not None and engine.host_table is None
    s = np.arange(40) % ref[0].vocab_size
    np.testing.assert_allclose(host.logits(s), engine.logits(s), rtol=0, atol=1e-6)


def test_top_k_ranks_like_lax_top_k(monkeypatch):
    """base.top_k ranks short inputs by comparisons (decode's routers and QSA block selection) and sorts long
    ones; both give lax.top_k's values and indices exactly, and top_k_mask its index set, equal values in
    index order: small integers make many ties, -inf entries tie too (QSA's invisible blocks), float32 and
    bfloat16, k from 1 to the whole row, 1-D and batched."""
    from jaxflash.model import base

    rng = np.random.default_rng(7)
    for compares in (base.RANK_COMPARES, 0):  # ranked, then sorted
        monkeypatch.setattr(base, "RANK_COMPARES", compares)
        for dtype in (jnp.float32, jnp.bfloat16):
            for shape in ((16,), (3, 16), (5, 2, 33)):
                x = jnp.asarray(rng.integers(-3, 4, shape), dtype)
                if shape[0] == 3:
                    x = jnp.asarray(rng.standard_normal(shape), dtype)  # no ties
                x = jnp.where(jnp.asarray(rng.random(shape) < 0.2), -jnp.inf, x)
                for k in (1, 4, shape[-1]):
                    v, i = base.top_k(x, k)
                    v0, i0 = lax.top_k(x, k)
                    assert i.dtype == jnp.int32 and v.dtype == x.dtype
                    np.testing.assert_array_equal(np.asarray(i), np.asarray(i0))
                    np.testing.assert_array_equal(np.asarray(v), np.asarray(v0))
                    mask = np.zeros(shape, bool)
                    np.put_along_axis(mask, np.asarray(i0), True, axis=-1)
                    np.testing.assert_array_equal(np.asarray(base.top_k_mask(x, k)), mask)
    x = jnp.asarray([0.5, 2.0, 0.5, 2.0, 1.0])
    assert base.top_k(x, 3)[1].tolist() == [1, 3, 4] and base.top_k(x, 5)[1].tolist() == [1, 3, 4, 0, 2]


def test_top_k_of_long_rows_in_two_stages(monkeypatch):
    """Rows of GROUPED_ROWS entries or more (a vocabulary: the logprobs' top alternatives) select in two stages,
    the k groups with the largest maxima, then their entries: lax.top_k's values and indices exactly, ties and
    -inf entries included, a row whose length is not a multiple of the group, batched."""
    from jaxflash.model import base

    rng = np.random.default_rng(11)
    monkeypatch.setattr(base, "GROUPED_ROWS", 64)
    called = []
    real = base._top_k_by_groups
    monkeypatch.setattr(base, "_top_k_by_groups", lambda *a, **kw: called.append(1) or real(*a, **kw))
    for shape, group in (((2, 3000), 16), ((4, 1001), 8), ((777,), 4), ((3, 2048), 128)):
        for scale in (0.3, 5.0):  # few distinct values: long runs of ties; many
            x = np.round(rng.normal(size=shape) * scale).astype(np.float32)
            x[..., rng.integers(0, shape[-1], 9)] = -np.inf
            for k in (1, 3, 20):
                v, i = real(jnp.asarray(x), k, group)
                v0, i0 = lax.top_k(jnp.asarray(x), k)
                assert i.dtype == jnp.int32
                np.testing.assert_array_equal(np.asarray(i), np.asarray(i0))
                np.testing.assert_array_equal(np.asarray(v), np.asarray(v0))
    monkeypatch.setattr(base, "_GROUP", 8)
    x = jnp.asarray(rng.normal(size=(2, 1000)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(base.top_k(x, 5)[1]), np.asarray(lax.top_k(x, 5)[1]))
    assert called  # top_k took the two stages


def test_linear_by_sum(monkeypatch):
    """base.linear_by_sum (one bf16 row: the GPU's form for a batch-1 decode step's projections) against
    float64: it and linear are both within one bfloat16 rounding of the output (2^-8 of the largest); and
    linear_rows takes it exactly where SUM_ROWS says, on a GPU (the backend is faked: only the rule is checked)."""
    from jaxflash.model import base

    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.normal(size=(48, 160)), jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(1, 160)), jnp.bfloat16)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    for y in (base.linear_by_sum(x, w), base.linear(x, w), base.linear_rows(x, w)):
        assert y.dtype == jnp.bfloat16 and y.shape == (1, 48)
        assert np.abs(np.asarray(y, np.float64) - want).max() <= 2.0**-8 * np.abs(want).max()
    calls = []
    real = base.linear_by_sum
    monkeypatch.setattr(base, "linear_by_sum", lambda *a: calls.append(a[0].shape) or real(*a))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    wide = jnp.asarray(rng.normal(size=(200, 160)), jnp.bfloat16)
    for xx, ww in ((x, w), (x[None], w), (jnp.concatenate([x, x]), w), (x, wide), (x.astype(jnp.float32), w)):
        base.linear_rows(xx, ww)
        base.linear(xx, ww)  # linear itself never does
    assert calls == [(1, 160), (1, 1, 160), (1, 160)]  # one bf16 row (of any rank, any width); not 2 rows or f32
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    base.linear_rows(x, w)
    assert len(calls) == 3  # not on a CPU


def test_moe_paths_agree(ref, engine):
    """gather, tiled (several tiles per expert, partial tiles, steps of tiles) and ragged compute one sum."""
    from jaxflash.model import moe as moe_mod

    p = engine.params.layers[0].moe
    x = jnp.asarray(np.random.default_rng(4).standard_normal((37, ref[0].hidden_size)), jnp.float32)
    w, idx = moe_mod.route(p, engine.config, x)
    want = np.asarray(moe_mod.experts_gather(p.experts, x, idx, w), np.float64)
    for got in (moe_mod.experts_ragged(p.experts, x, idx, w),
                moe_mod.experts_tiled(p.experts, x, idx, w, tile=4, tiles_per_step=3),
                moe_mod.experts_tiled(p.experts, x, idx, w)):
        assert rel_err(got, want) < 1e-5
    toks = jnp.asarray(np.random.default_rng(4).integers(0, ref[0].vocab_size, (2, 48)))
    f = jax.jit(lambda p, t, impl: transformer.forward(p, engine.config, t, moe_impl=impl), static_argnums=2)
    a = np.asarray(f(engine.params, toks, "gather"))
    for impl in ("tiled", "ragged"):
        assert rel_err(f(engine.params, toks, impl), a.astype(np.float64)) < 1e-5


def test_bfloat16_within_bf16_rounding(ref, tmp_path):
    """bf16 mode against the float64 reference on the same bf16 weights. Discrete choices (expert routing, QSA
    blocks) can flip under bf16 rounding, so the criterion is the error distribution of the reference's own
    bf16 run: measured median 0.005 / p90 0.016 / max 0.14 for jaxflash vs 0.007 / 0.022 / 0.16 for the
    reference in bf16."""
    hcfg, model, _ = ref
    model16 = build_hf_model(hcfg, seed=0)
    round_to(model16, torch.bfloat16)
    save_checkpoint(model16, tmp_path, torch.bfloat16)
    eng = jaxflash.load(tmp_path, dtype="bfloat16", progress=False)
    assert eng.dtype == jnp.bfloat16
    ref_bf16 = build_hf_model(hcfg, seed=0).to(torch.bfloat16)
    rng = np.random.default_rng(5)
    ours, theirs = [], []
    for _ in range(4):
        s = with_eos(rng, 64, hcfg.vocab_size, hcfg.eos_token_id, at=[20])
        r = hf_logits(model16, s)
        scale = np.abs(r).max()
        ours.append(np.abs(eng.logits(s) - r).max(-1) / scale)
        theirs.append(np.abs(hf_logits(ref_bf16, s).astype(np.float64) - r).max(-1) / scale)
    ours, theirs = np.concatenate(ours), np.concatenate(theirs)
    assert np.median(ours) < 0.02 and np.median(ours) <= 1.5 * np.median(theirs)
    assert np.percentile(ours, 90) <= 1.5 * np.percentile(theirs, 90)


def test_nvfp4_experts(ref):
    """Routed experts in NVFP4 (ModelOpt layout) against the reference run on the dequantised weights."""
    from jaxflash.quant import dequantize_nvfp4, quantize_nvfp4

    hcfg, _, _ = ref
    model = build_hf_model(hcfg, seed=0)
    tensors = checkpoint_tensors(model)
    for name in [n for n in tensors if ".experts." in n]:
        q = quantize_nvfp4(tensors[name].astype(np.float32))
        base = name.removesuffix(".weight")
        tensors[name] = q.weight
        tensors[f"{base}.weight_scale"] = q.weight_scale
        tensors[f"{base}.weight_scale_2"] = q.weight_scale_2
        deq = dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2)
        layer, e, proj = int(base.split(".")[1]), int(base.split(".")[4]), base.split(".")[5]
        experts = model.model.layers[layer].mlp.experts
        inter = hcfg.moe_intermediate_size
        if proj == "down_proj":
            experts.down_proj[e].copy_(torch.as_tensor(deq, dtype=torch.float64))
        else:
            rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
            experts.gate_up_proj[e, rows].copy_(torch.as_tensor(deq, dtype=torch.float64))
    cfg = ModelConfig.from_dict(hcfg.to_dict())
    table = np.concatenate([tensors.pop(f"layers.1.ple.ple_embedding.ngram_embedding.shard_{i}.weight")
                            for i in range(hcfg.split_ngram_parts)])
    params = load_params(DictSource(tensors), cfg, "float32", ple_table=(table, None))
    assert type(params.layers[0].moe.experts.gate).__name__ == "NVFP4"
    eng = Engine(cfg, params)
    s = with_eos(np.random.default_rng(6), 80, hcfg.vocab_size, hcfg.eos_token_id, at=[30])
    assert near_ties(model, s) == 0
    ref_logits = hf_logits(model, s)
    assert rel_err(eng.logits(s), ref_logits) < TOL
    # every expert path dequantises correctly (80 tokens pick "tiled" by default)
    for impl in ("gather", "ragged"):
        out = jax.jit(lambda p, t: transformer.forward(p, cfg, t, moe_impl=impl))(params, jnp.asarray(s))
        assert rel_err(out, ref_logits) < TOL


def test_mtp_head(ref, engine):
    """The MTP head against an independent float64 implementation of docs/model.md §11."""
    hcfg, model, _ = ref
    layer, mtp_tensors = random_mtp(model, seed=7)
    tensors = checkpoint_tensors(model) | mtp_tensors
    cfg = engine.config.replace(mtp_num_hidden_layers=1)
    table = np.concatenate([tensors[f"layers.1.ple.ple_embedding.ngram_embedding.shard_{i}.weight"]
                            for i in range(hcfg.split_ngram_parts)])
    eng = Engine(cfg, load_params(DictSource(tensors), cfg, "float32", ple_table=(table, None)))
    s = with_eos(np.random.default_rng(8), 60, hcfg.vocab_size, hcfg.eos_token_id, at=[25])
    hidden = pre_mixer_hidden(model, s)
    assert rel_err(eng.hidden(s), hidden) < TOL
    want = mtp_reference(model, layer, mtp_tensors, hidden[:-1], s[1:])
    assert rel_err(eng.mtp_logits(s), want) < TOL


def test_jit_and_vmap(engine):
    """The functional core under jax.jit and jax.vmap: vmap over sequences equals the batched call."""
    cfg, params = engine.config, engine.params
    toks = jnp.asarray(np.random.default_rng(9).integers(0, cfg.vocab_size, (3, 24)))
    fwd = lambda p, t: transformer.forward(p, cfg, t, moe_impl="gather")  # noqa: E731
    batched = jax.jit(fwd)(params, toks)
    mapped = jax.jit(jax.vmap(fwd, in_axes=(None, 0)))(params, toks)
    np.testing.assert_allclose(mapped, batched, rtol=0, atol=1e-5)


def test_grad_matches_finite_differences(engine):
    """jax.grad of a next-token loss against central finite differences along random directions, one per
    parameter group. Run in float64 (the model computes in float64 when its weights are float64), so the
    differences are accurate at steps far too small to flip a routing or QSA choice."""
    cfg = engine.config
    toks = jnp.asarray(np.random.default_rng(10).integers(0, cfg.vocab_size, (2, 20)))
    with jax.enable_x64(True):
        params = jax.tree.map(lambda x: x.astype(jnp.float64) if x.dtype == jnp.float32 else x, engine.params)

        def loss(p):
            logits = transformer.forward(p, cfg, toks[:, :-1])
            logp = jax.nn.log_softmax(logits, axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp, toks[:, 1:, None], axis=-1))

        loss_jit = jax.jit(loss)
        grads = jax.jit(jax.grad(loss))(params)
        leaves, tree = jax.tree.flatten(params)
        gleaves = jax.tree.leaves(grads)
        assert len(gleaves) == len(leaves)
        rng = np.random.default_rng(0)
        checked = 0
        for i, (x, g) in enumerate(zip(leaves, gleaves)):
            if x.dtype != jnp.float64:
                continue
            d = jnp.asarray(rng.standard_normal(x.shape))
            eps = 1e-6

            def moved(sign, i=i, d=d):
                out = list(leaves)
                out[i] = leaves[i] + sign * eps * d
                return jax.tree.unflatten(tree, out)

            numeric = float(loss_jit(moved(1)) - loss_jit(moved(-1))) / (2 * eps)
            analytic = float(jnp.vdot(g, d))
            assert abs(analytic - numeric) <= 1e-5 * max(abs(numeric), 1e-3), (i, x.shape, analytic, numeric)
            checked += 1
        assert checked > 100  # every weight of every block, including the n-gram table
