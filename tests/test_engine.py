"""The engine (prefill chunks, decode steps, paged KV, expert cache, sampling) against the reference and against
jaxflash's own full-sequence forward, on tiny models.

Reference model (conftest.py's ref4, shared with test_speculative.py): transformers' qwen4_exp, float64, 4 layers
(3 GDN + 1 attention with QSA budget 8 tokens), PLE, 8 experts top-2; test_model.py checks the full forward on 8
layers. Prompts hold EOS tokens (PLE n-gram segments) and generation runs far past the QSA budget. The decode
steps of a model with 2 attention layers (the bundled model, 8 layers) are checked against the full forward by
test_bundled_decode_step_logits_equal_full_forward, and the synthetic NVFP4 model's (4 layers) by
test_mtp_drafts_equal_the_teacher_forced_head: every draft reads the main model's state.
Tolerances: decode-step logits vs the full forward, both float32: 1e-4 of the largest logit (measured 1e-6).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxflash
import jaxflash.presets  # not imported by jaxflash itself
from jaxflash.engine import PlanError, planner, sampling
from jaxflash.engine.sampling import SamplingParams, SamplingRows, sample
from jaxflash.engine.scheduler import Stats

from hf_reference import hf_logits, near_ties
from numerics import rel_err

TOL = 1e-4
SMALL = dict(max_batch=4, max_seq_len=128, prefill_chunk=16, progress=False)
# conftest.py's engines, shared with other files: the reference model's and the NVFP4 model's
REF4, NVFP4 = pytest.mark.xdist_group("ref4"), pytest.mark.xdist_group("nvfp4")


def prompt(rng, n, vocab, eos, eos_at=()):
    p = rng.integers(0, vocab, n)
    p[p == eos] = (eos + 1) % vocab
    p[list(eos_at)] = eos
    return [int(x) for x in p]


@pytest.fixture
def ref(ref4):
    return ref4


@pytest.fixture
def engine(ref4_engine):
    return ref4_engine


@pytest.fixture
def on_device(nvfp4_mtp):
    """conftest.py's synthetic NVFP4 model (nvfp4_dir: 16 experts, top-4, the layout the host pool holds) with every
    expert on the device and the MTP head drafting; shared with test_speculative.py."""
    return nvfp4_mtp


@REF4
def test_greedy_equals_reference_generate(ref, engine):
    hcfg, model, _ = ref
    # a prompt whose greedy continuation never picks EOS (which generate(min_new_tokens=n) suppresses) and has
    # no pick near a tie (checked below)
    rng = np.random.default_rng(9)
    p = prompt(rng, 21, hcfg.vocab_size, hcfg.eos_token_id, eos_at=[7])
    n = 40  # prompt + generation reach 61 tokens: far past the QSA budget of 8
    theirs = model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(p):]
    theirs = [int(x) for x in theirs]
    full = p + theirs
    assert near_ties(model, full) == 0
    top2 = np.sort(hf_logits(model, full)[len(p) - 1 : -1], axis=-1)[:, -2:]
    assert np.min(top2[:, 1] - top2[:, 0]) > 1e-3  # no greedy pick within float32 noise of flipping
    ours = engine.generate([p], max_new_tokens=n, ignore_eos=True)[0]
    assert ours == theirs


@REF4
def test_decode_step_logits_equal_full_forward(ref, engine):
    hcfg, model, _ = ref
    rng = np.random.default_rng(1)
    p = prompt(rng, 37, hcfg.vocab_size, hcfg.eos_token_id, eos_at=[3, 20])  # 37: 2 full chunks + 5
    toks, logits, _ = engine.scheduler.step_logits(p, steps=30)
    seq = p + toks[:-1]
    full = engine.logits(seq)[len(p) - 1 :]
    assert rel_err(logits, full) < TOL
    assert rel_err(logits, hf_logits(model, seq)[len(p) - 1 :]) < TOL


@pytest.mark.xdist_group("bundled")
def test_bundled_decode_step_logits_equal_full_forward(bundled):
    """The trained bundled model (conftest.py's engine, shared with test_scheduler.py) has 2 attention layers, so
    the decode steps' paged KV of more than one attention layer is checked here against the full forward."""
    cfg = bundled.config
    assert len(cfg.attention_layers) >= 2
    n = cfg.indexer_budget + 8  # past QSA's budget, which then selects blocks
    p = prompt(np.random.default_rng(3), n - 30, cfg.vocab_size, cfg.eos_token_id, eos_at=[9])
    toks, logits, _ = bundled.scheduler.step_logits(p, steps=30)
    assert rel_err(logits, bundled.logits(p + toks[:-1])[len(p) - 1 :]) < TOL


@REF4
def test_ragged_batch_equals_alone(ref, engine):
    hcfg = ref[0]
    rng = np.random.default_rng(2)
    prompts = [prompt(rng, n, hcfg.vocab_size, hcfg.eos_token_id, eos_at=[1]) for n in (5, 33, 17, 2, 9)]
    # 5 prompts on 4 slots: the fifth waits for a free slot; seeds make sampled rows reproducible
    kw = dict(max_new_tokens=[12, 7, 20, 15, 3], temperature=[0.0, 0.9, 1.3, 0.0, 0.7], top_k=[0, 0, 20, 0, 5],
              top_p=[1.0, 0.9, 1.0, 1.0, 1.0], seed=[1, 2, 3, 4, 5], ignore_eos=True)
    together = engine.generate(prompts, **kw)
    for i, p in enumerate(prompts):
        alone = engine.generate([p], **{k: (v[i] if isinstance(v, list) else v) for k, v in kw.items()})[0]
        assert together[i] == alone, i
    assert [len(o) for o in together] == kw["max_new_tokens"]


@REF4
def test_stop_tokens_and_eos(ref, engine):
    hcfg = ref[0]
    rng = np.random.default_rng(3)
    p = prompt(rng, 10, hcfg.vocab_size, hcfg.eos_token_id)
    free = engine.generate([p], max_new_tokens=25, ignore_eos=True)[0]
    stop_at = free[6]
    first = free.index(stop_at)
    got = engine.generate([p], max_new_tokens=25, stop=[stop_at], ignore_eos=True)[0]
    assert got == free[:first]  # the stop token ends generation and is not returned
    # EOS stops by default
    eos = hcfg.eos_token_id
    out = engine.generate([p], max_new_tokens=25)[0]
    assert eos not in out and (len(out) == 25 or free[len(out)] == eos)


@REF4
def test_compile_count_constant_over_long_generation(ref, engine):
    """warm_up compiles every program serving uses (decode in buckets of 1, 2 and 4 slots, plain and with
    logprobs, masks and filters); long generations of 1, 2 and 5 requests, sampled ones with top-p among them,
    then compile nothing more."""
    rng = np.random.default_rng(4)
    p = prompt(rng, 20, ref[0].vocab_size, ref[0].eos_token_id)
    engine.warm_up()
    assert engine.scheduler.runner.allocated  # the state too: the first request does not wait for it
    before = engine.scheduler.compile_counts()
    assert set(before) >= {"admit", "release", "prefill", "prefill[logprobs]", "prefill[score]"} | {
        f"decode{w}@{b}" for b in (1, 2, 4) for w in ("", "[logprobs,masks,filters]")}
    engine.generate([p], max_new_tokens=20, ignore_eos=True)
    engine.generate([p, p[:7]], max_new_tokens=100, ignore_eos=True, temperature=0.8, top_p=[1.0, 0.9], seed=1)
    engine.generate([p[: 3 + i] for i in range(5)], max_new_tokens=30, ignore_eos=True)
    assert engine.scheduler.compile_counts() == before


@REF4
def test_bad_requests_are_refused(engine):
    for bad in ([], [[]], [[1, 2, -1]], [[1, 2, 10_000]], [["a"]], "text"):
        with pytest.raises(ValueError):
            engine.generate(bad, max_new_tokens=3)
    with pytest.raises(ValueError, match="context holds"):
        engine.generate([[1] * 200], max_new_tokens=3)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([[1, 2]], max_new_tokens=3, top_p=0.0)
    with pytest.raises(ValueError, match="entries"):
        engine.generate([[1, 2]], max_new_tokens=3, seed=[1, 2])
    assert engine.generate([[1, 2]], max_new_tokens=2, ignore_eos=True)[0]  # still serving


def _device_bytes(tree) -> int:
    import jax

    return sum(int(a.nbytes) for a in jax.tree.leaves(tree))


@NVFP4
def test_planned_dense_bytes_are_the_loaded_bytes(nvfp4_dir, on_device):
    """The plan counts the dense weights as they sit on the device: the MTP head's experts stay FP8 in 128x128
    blocks with float32 tile scales (as stored, 2.6 GiB at full size, where dequantised bf16 took 5 GiB);
    mtp=False loads no MTP head and plans none."""
    from jaxflash.model.moe import FP8Block

    p = on_device.params
    assert isinstance(p.mtp.layer.moe.experts.gate, FP8Block)
    routed = _device_bytes([layer.moe.experts for layer in p.layers])
    assert on_device.plan.reserved["dense weights"] == _device_bytes(p) - routed
    bare = jaxflash.load(nvfp4_dir, expert_residency="device", mtp=False, **SMALL)
    assert bare.params.mtp is None and not bare.mtp
    assert bare.plan.reserved["dense weights"] == _device_bytes(bare.params) - routed
    with pytest.raises(ValueError, match="no MTP head is loaded"):
        bare.mtp_logits([1, 2, 3])
    with pytest.raises(ValueError, match="mtp=False leaves it out"):
        jaxflash.load(nvfp4_dir, expert_residency="device", mtp=False, mtp_drafts=True, **SMALL)


@NVFP4
def test_mtp_head_is_loaded_but_not_run_by_default(nvfp4_plain, on_device):
    """By default the head is loaded (Engine.mtp_logits works) but the decode steps do not run it: no drafts,
    no MTP state, the same tokens as an engine that drafts (conftest.py's nvfp4_plain: the same model and
    geometry, loaded with the defaults)."""
    plain = nvfp4_plain
    assert plain.params.mtp is not None and not plain.mtp
    assert plain.mtp_logits([1, 2, 3]).shape[0] == 2  # rows 0 and 1 guess tokens 2 and 3
    p = [int(t) for t in np.random.default_rng(12).integers(0, plain.config.vocab_size, 9)]
    toks, _, drafts = plain.scheduler.step_logits(p, steps=6)
    assert drafts is None and plain.scheduler.runner.state.mtp is None
    assert toks == on_device.scheduler.step_logits(p, steps=6)[0]


@NVFP4
def test_host_residency_equals_device(nvfp4_host, on_device):
    """conftest.py's engine with a host cache of 8 slots and 2 slots (shared with test_expert_kernel.py)."""
    host = nvfp4_host
    host.scheduler.stats = Stats()  # a shared engine: count this test's lookups only
    assert host.plan.residency == "host" and host.params.layers[0].moe.experts is None
    cfg = host.config
    rng = np.random.default_rng(5)
    prompts = [prompt(rng, n, cfg.vocab_size, cfg.eos_token_id, eos_at=[2]) for n in (40, 11)]
    kw = dict(max_new_tokens=30, ignore_eos=True, temperature=[0.0, 1.0], seed=7)
    assert host.generate(prompts, **kw) == on_device.generate(prompts, **kw)
    st = host.scheduler.stats
    assert st.expert_lookups > 0 and 0 < st.expert_misses < st.expert_lookups
    _, a, _ = host.scheduler.step_logits(prompts[0], 10)
    _, b, _ = on_device.scheduler.step_logits(prompts[0], 10)
    assert rel_err(a, b) < TOL
    with pytest.raises(ValueError, match="on the host"):
        host.logits([1, 2, 3])


@NVFP4
def test_constant_eviction(nvfp4_dir, on_device):
    """4 slots per layer for 16 experts routed 4 per token: nearly every step evicts."""
    tiny = jaxflash.load(nvfp4_dir, expert_residency="host", cache_slots=4, **{**SMALL, "max_batch": 1})
    cfg = tiny.config
    p = prompt(np.random.default_rng(6), 50, cfg.vocab_size, cfg.eos_token_id, eos_at=[10])
    got = tiny.generate([p], max_new_tokens=40, ignore_eos=True)[0]
    assert got == on_device.generate([p], max_new_tokens=40, ignore_eos=True)[0]
    st = tiny.scheduler.stats
    assert st.expert_misses > 0.5 * st.expert_lookups  # the cache really is thrashing


def test_sampling_rules():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 4000, np.float32))
    pos = np.arange(4000)

    def draw(**kw):
        rows = SamplingRows(*(np.full(4000, v, dt) for v, dt in (
            (kw.get("t", 1.0), np.float32), (kw.get("k", 0), np.int32), (kw.get("p", 1.0), np.float32),
            (kw.get("m", 0.0), np.float32), (kw.get("seed", 0), np.uint32))))
        return np.bincount(np.asarray(sample(logits, rows, pos)), minlength=4) / 4000

    assert np.abs(draw() - [0.5, 0.3, 0.15, 0.05]).max() < 0.03  # plain sampling follows the softmax
    assert np.abs(draw(k=2) - [0.625, 0.375, 0, 0]).max() < 0.03
    assert np.abs(draw(p=0.7) - [0.625, 0.375, 0, 0]).max() < 0.03  # 0.5 < 0.7: the second token is needed
    assert np.abs(draw(m=0.25) - [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]).max() < 0.03
    assert draw(t=0.0)[0] == 1.0
    assert draw(seed=1).tolist() != draw(seed=2).tolist()
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=2**31)  # the rows hold int32


def _kept_by_sorting(x, top_k, top_p, min_p):
    """The filters' kept set, by their definition on the sorted tokens (numpy, float64 sums)."""
    order = np.argsort(-x, kind="stable")
    s = x[order].astype(np.float64)
    probs = np.exp(s - s[0]) / np.exp(s - s[0]).sum()
    rank = np.arange(len(x))
    keep = (top_k <= 0) | (rank < top_k)
    mass = np.where(keep, probs, 0.0) / np.where(keep, probs, 0.0).sum()
    keep &= (np.cumsum(mass) - mass) < top_p
    keep &= probs >= min_p * probs[0]
    out = np.zeros(len(x), bool)
    out[order[keep]] = True
    return out


def test_filters_keep_the_sorted_prefix_ties_included():
    """sampling.kept (a mask in vocabulary order) against the filters' definition on the sorted tokens, on
    logits rounded to a coarse grid so that the cut often falls inside a run of equal values: the tied tokens
    are kept in vocabulary order up to the cut. The probability filters are compared where no prefix mass (or
    probability ratio) lies within float32 rounding of the threshold."""
    rng = np.random.default_rng(7)
    kept = jax.jit(jax.vmap(sampling.kept))
    compared = 0
    for v in (3, 17, 40):
        n = 120
        x = rng.normal(size=(n, v)) * 2
        x = np.where(rng.random((n, 1)) < 0.5, np.round(x), np.round(x, 1)).astype(np.float32)
        k = rng.integers(0, v + 2, n).astype(np.int32)
        p = np.where(rng.random(n) < 0.3, 1.0, rng.uniform(0.05, 1.0, n)).astype(np.float32)
        m = np.where(rng.random(n) < 0.5, 0.0, rng.uniform(0.0, 1.0, n)).astype(np.float32)
        got_p = np.asarray(kept(jnp.asarray(x), jnp.asarray(k), jnp.asarray(p), jnp.zeros(n, jnp.float32)))
        got_m = np.asarray(kept(jnp.asarray(x), jnp.asarray(k), jnp.ones(n, jnp.float32), jnp.asarray(m)))
        for i in range(n):
            s = np.sort(x[i].astype(np.float64))[::-1]
            probs = np.exp(s - s[0])
            top = probs[: k[i] or v]
            if np.abs(np.cumsum(top) / top.sum() - p[i]).min() > 1e-5:
                assert np.array_equal(got_p[i], _kept_by_sorting(x[i], k[i], p[i], 0.0)), (x[i], k[i], p[i])
                compared += 1
            if np.abs(probs - m[i]).min() > 1e-5:
                assert np.array_equal(got_m[i], _kept_by_sorting(x[i], k[i], 1.0, m[i])), (x[i], k[i], m[i])
                compared += 1
    assert compared > 500
    x = jnp.asarray([1.0, 3.0, 3.0, 0.0, 3.0, 3.0], jnp.float32)  # four-way tie at the top
    assert np.asarray(sampling.kept(x, 2, 1.0, 0.0)).tolist() == [False, True, True, False, False, False]
    assert np.asarray(sampling.kept(x, 3, 1.0, 0.0)).tolist() == [False, True, True, False, True, False]
    assert np.asarray(sampling.kept(x, 0, 0.3, 0.0)).tolist() == [False, True, True, False, False, False]
    assert np.asarray(sampling.kept(x, 0, 1.0, 0.9)).tolist() == [False, True, True, False, True, True]


def test_rows_that_do_not_filter_draw_the_same_without_the_sort():
    """A program built without Want.filters leaves the sort out; greedy and temperature-only rows draw the very
    same tokens there (same seed and position), and a filtering row's draws stay inside its kept set."""
    rng = np.random.default_rng(8)
    n, v = 256, 300
    logits = jnp.asarray(rng.normal(size=(n, v)) * 3, jnp.float32)
    pos = jnp.arange(n, dtype=jnp.int32)
    for t in (0.0, 0.6, 1.0, 1.7):
        rows = SamplingRows(jnp.full(n, t, jnp.float32), jnp.zeros(n, jnp.int32), jnp.ones(n, jnp.float32),
                            jnp.zeros(n, jnp.float32), jnp.arange(n, dtype=jnp.uint32))
        with_sort = np.asarray(sample(logits, rows, pos, filters=True))
        assert np.array_equal(with_sort, np.asarray(sample(logits, rows, pos, filters=False))), t
    rows = SamplingRows(jnp.full(n, 1.3, jnp.float32), jnp.full(n, 7, jnp.int32), jnp.full(n, 0.8, jnp.float32),
                        jnp.full(n, 0.02, jnp.float32), jnp.arange(n, dtype=jnp.uint32))
    toks = np.asarray(sample(logits, rows, pos))
    for i in range(n):
        assert _kept_by_sorting(np.asarray(logits[i]) / 1.3, 7, 0.8, 0.02)[toks[i]]
    assert SamplingParams(0.7, top_p=0.9).filtered and SamplingParams(0.7, min_p=0.1).filtered
    assert not SamplingParams(0.7).filtered and not SamplingParams(0.0, top_k=5).filtered


def test_planner_decisions():
    cfg = jaxflash.presets.full()
    GiB = 1 << 30
    mb = planner.ModelBytes(dense=17 * GiB, experts=60 * GiB, record_bytes=2_765_056)
    big = planner.plan(cfg, mb, budget=None, free=130 * GiB, free_note="test", max_batch=8)
    assert big.residency == "device" and big.max_seq_len == 32768
    small = planner.plan(cfg, mb, budget=32 * GiB, free=130 * GiB, free_note="test", max_batch=1)
    assert small.residency == "host" and small.cache_slots >= 30
    assert sum(small.reserved.values()) <= 32 * GiB
    assert any("expert cache" in n for n in small.notes)
    with pytest.raises(PlanError, match="fewer than"):
        planner.plan(cfg, mb, budget=20 * GiB, free=130 * GiB, free_note="test", max_batch=8)
    with pytest.raises(PlanError, match="cache_slots"):
        planner.plan(cfg, mb, budget=32 * GiB, free=130 * GiB, free_note="test", max_batch=8, cache_slots=10)
    with pytest.raises(PlanError, match="residency='device'"):
        planner.plan(cfg, mb, residency="device", budget=32 * GiB, free=130 * GiB, free_note="test")
    # The prefill chunk: the largest whose workspace fits a third of the budget and leaves the cache its slots.
    lean = planner.ModelBytes(dense=9 * GiB, experts=63 * GiB, record_bytes=2_765_056)
    one = planner.plan(cfg, lean, budget=32 * GiB, free=130 * GiB, free_note="test", max_batch=1)
    assert one.prefill_chunk == 8192 and one.cache_slots >= 3 * cfg.num_experts_per_tok
    eight = planner.plan(cfg, lean, budget=32 * GiB, free=130 * GiB, free_note="test", max_batch=8)
    assert eight.cache_slots >= 8 * cfg.num_experts_per_tok and eight.prefill_chunk < 8192
    assert planner.workspace_bytes(cfg, 2 * eight.prefill_chunk, eight.max_seq_len, 8) - eight.reserved["workspace"] \
        > (eight.cache_slots - 8 * cfg.num_experts_per_tok) * cfg.num_hidden_layers * lean.record_bytes
    steered = planner.plan(cfg, lean, budget=32 * GiB, free=130 * GiB, free_note="test", max_batch=1, cache_slots=140)
    assert steered.prefill_chunk < 8192 and "leaves the expert cache 140 slots" in steered.notes[-1]
    given = planner.plan(cfg, lean, budget=32 * GiB, free=130 * GiB, free_note="test", max_batch=8, prefill_chunk=512)
    assert given.prefill_chunk == 512 and "as given" in given.notes[-1]
    assert planner.parse_bytes("32GiB") == 32 * GiB and planner.parse_bytes("1.5GB") == 1_500_000_000
    with pytest.raises(ValueError):
        planner.parse_bytes("lots")


def test_bundled_model_is_the_trained_release_layout():
    import json
    import os

    from jaxflash.checkpoint import Checkpoint

    d = jaxflash.DEFAULT_MODEL
    assert os.path.getsize(d / "model.safetensors") <= 16 << 20
    ckpt = Checkpoint.open(d)
    names = ckpt.names()
    assert any(n.endswith("experts.0.gate_proj.weight_scale_2") for n in names)  # NVFP4 experts
    assert any(n.startswith("mtp.") for n in names)
    assert ckpt.info(next(n for n in names if "ngram_embedding.shard_0" in n)).dtype == "F8_E4M3"
    report = json.loads((d / "training_report.json").read_text())
    assert report["heldout_ppl_nvfp4"]["ppl"] < 40  # trained: a random model scores ~2000
    # the tokenizer's two files agree on which added tokens are special: control tokens yes, markup no
    spec = {t["content"]: t["special"] for t in json.loads((d / "tokenizer.json").read_text())["added_tokens"]}
    decl = json.loads((d / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert spec == {t["content"]: t["special"] for t in decl.values()}
    assert spec["<|im_end|>"] and spec["<|im_start|>"] and spec["<|endoftext|>"]
    assert not any(spec[t] for t in ("<think>", "</think>", "<tool_call>", "</tool_call>"))


@NVFP4
def test_mtp_drafts_equal_the_teacher_forced_head(on_device):
    """The step runs the MTP head on (state at t, token t+1) for every token, keeping its own KV pages: each
    draft equals Engine.mtp_logits over the whole sequence (which recomputes everything from position 0)."""
    cfg = on_device.config
    p = prompt(np.random.default_rng(7), 37, cfg.vocab_size, cfg.eos_token_id, eos_at=[12])  # 3 prefill chunks
    toks, _, drafts = on_device.scheduler.step_logits(p, steps=12)
    ref = on_device.mtp_logits(p + toks)  # row t: from the state at t and token t+1
    assert rel_err(drafts, ref[len(p) - 1 :]) < TOL
    on_device.scheduler.stats = Stats()  # a shared engine: count this generation's drafts only
    on_device.generate([p], max_new_tokens=20, ignore_eos=True)
    st = on_device.scheduler.stats
    assert st.mtp_drafts >= 19 and 0 <= st.mtp_acceptance <= 1


class Replay:
    """A RoutingSource that hands the engine precomputed expert ids [L, T, k] of one sequence in order: a
    prefill chunk takes the next n rows (and repeats its first for the padding), a decode step the next row
    (for every slot)."""

    def __init__(self, ids):
        self.ids, self.pos, self.calls = np.asarray(ids, np.int32), 0, 0

    def take(self, n):
        self.calls += 1
        self.pos += n
        return self.ids[:, self.pos - n : self.pos]

    def prefill_ids(self, slot, n, width):
        got = self.take(n)
        return np.concatenate([got, np.repeat(got[:, :1], width - n, axis=1)], axis=1)

    def decode_ids(self, batch):
        return np.repeat(self.take(1), batch, axis=1)


@NVFP4
def test_fixed_routing_replays_the_routers_choice(nvfp4_dir, on_device, nvfp4_routed):
    """Routing fixed from outside (runner.RoutingSource) to exactly what the routers choose gives the same
    tokens as the routers themselves, with every expert on the device (conftest.py's engine with fixed routing,
    shared with test_speculative.py) and through the host cache."""
    import jax
    import jax.numpy as jnp

    from jaxflash.model import transformer

    cfg = on_device.config
    p = prompt(np.random.default_rng(8), 14, cfg.vocab_size, cfg.eos_token_id, eos_at=[4])  # one 16-token chunk
    out = on_device.generate([p], max_new_tokens=12, ignore_eos=True)[0]
    seq = p + out
    routed = jax.jit(lambda w, t: transformer.forward_hidden(w, cfg, t, return_routing=True)[1])  # eager: 5x longer
    routing = routed(on_device.params, jnp.asarray(seq))
    ids = np.stack([np.asarray(r.ids) for r in routing])  # [L, T, k]
    engines = {}
    for residency in ("device", "host"):
        src = Replay(ids)
        if residency == "device":
            eng = engines[residency] = nvfp4_routed
            eng.routing.source = src
        else:
            eng = engines[residency] = jaxflash.load(nvfp4_dir, expert_residency=residency, routing=src,
                                                     cache_slots=4, **{**SMALL, "max_batch": 1})
        assert eng.generate([p], max_new_tokens=12, ignore_eos=True)[0] == out, residency
        assert src.calls >= 12
    # the same engine fed experts 0..k-1 instead (the source is read at every step): other tokens
    src.ids, src.pos = np.broadcast_to(np.arange(cfg.num_experts_per_tok, dtype=np.int32), ids.shape), 0
    assert engines["host"].generate([p], max_new_tokens=12, ignore_eos=True)[0] != out
