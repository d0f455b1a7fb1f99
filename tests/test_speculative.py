"""Speculative decoding (n-gram and MTP drafts, verify steps) against plain decoding.

Greedy speculation must give plain decoding's tokens exactly: on the tiny reference model (4 layers: GDN, attention
with QSA past its 8-token budget, PLE), with prompts whose repetitions give drafts that are kept and drafts that are
rejected, in batches beside sequences without drafts, with stop tokens and max_new_tokens inside accepted drafts,
with host-resident experts and a cache that evicts nearly every step, and on the bundled model. MTP drafts: after
verify steps that keep every number of drafts, the drafts in the state equal the head chained over the whole
sequence recomputed from position 0 (its KV pages ended where the sequence ended), also after plain steps that left
the head to catch up on their pairs (catch_up, resume), which the scheduler runs where it must; greedy MTP
speculation gives plain decoding's tokens on the bundled model (whose trained head gets drafts kept) and with
host-resident experts.
Sampled speculation must keep the sampling distribution: a chi-square test over 40,000 seeds of the acceptance rule
on fixed logits (5 tokens), at a false-alarm rate of 1e-3 (fixed seeds, so the test is deterministic); and since the
rule shares plain sampling's randomness, a seeded sampled request emits plain sampling's tokens exactly.
Draft caps (scheduler.Spec) follow each position's acceptance and the measured step costs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash.engine import speculative
from jaxflash.engine.runner import Want
from jaxflash.engine.sampling import sample_row, verify_row
from jaxflash.engine.scheduler import VERIFY_RICH, Spec, Stats, StepCosts
from jaxflash.tokenizer import Tokenizer

from numerics import rel_err

SMALL = dict(max_batch=4, max_seq_len=128, prefill_chunk=16, progress=False)
TOL = 1e-4  # float32 logits of two programs: relative to the largest logit
# conftest.py's engines, shared with test_engine.py: the reference model's and the NVFP4 model's (and the bundled
# model's, shared with test_scheduler.py)
REF4, NVFP4 = pytest.mark.xdist_group("ref4"), pytest.mark.xdist_group("nvfp4")


class FlatCosts(StepCosts):
    """Every step costs the same, so draft caps follow acceptance alone (Spec.cap): tests that need verify steps
    get them whatever this machine's step times are (test_draft_cap_weighs... tests the costs' part)."""

    def add(self, rows, fed, seconds):
        pass

    def of(self, rows, fed):
        return 1.0


def speculating(engine):
    engine.scheduler.costs = FlatCosts()
    return engine


def repetitive(rng, vocab, eos, n, period):
    """A prompt repeating a random phrase of `period` tokens (no EOS): n-gram lookups find its continuation."""
    phrase = rng.integers(0, vocab, period)
    phrase[phrase == eos] = (eos + 1) % vocab
    return [int(x) for x in np.resize(phrase, n)]


@pytest.fixture(scope="module")
def engines(ref4, ref4_engine):
    """conftest.py's reference checkpoint (4 layers: 3 GDN, 1 attention with QSA, PLE at layer 2: every kind of
    state) plainly, in the engine test_engine.py shares, and speculating with 3 drafts."""
    return ref4_engine, speculating(jaxflash.load(ref4[2], speculative="ngram", draft_tokens=3, **SMALL))


def prompts_of(cfg, seed=1):
    rng = np.random.default_rng(seed)
    rand = [int(x) for x in rng.integers(0, cfg.vocab_size, 9)]
    rand[4] = cfg.eos_token_id  # an EOS inside the prompt: PLE n-grams start afresh there
    return [repetitive(rng, cfg.vocab_size, cfg.eos_token_id, 30, 7), rand,
            repetitive(rng, cfg.vocab_size, cfg.eos_token_id, 20, 3)]


def _with_logprobs(engine, prompts, n=40, temperature=0.0, top_k=0, seed=0):
    """Generation (greedy by default) with 2 logprobs per token: [(prompt index, token, (logprob, top)), ...]."""
    sched = engine.scheduler
    reqs = sched.make_requests(prompts, max_new_tokens=n, temperature=temperature, top_p=1.0, top_k=top_k, min_p=0.0,
                               seed=seed, stop=None, eos_ids=(), ignore_eos=True)
    for r in reqs:
        r.logprobs = 2
    return [(e.request.index, e.token, e.logprob) for e in sched.run(reqs) if e.token is not None]


@REF4
def test_greedy_speculation_equals_plain(engines):
    """A batch of three (one without repetitions) with logprobs, then each prompt alone: plain decoding's tokens,
    and logprobs from the verify rows within 1e-4 of plain decoding's (float32)."""
    plain, spec = engines
    prompts = prompts_of(plain.config)
    spec.scheduler.stats = Stats()  # this batch's drafts only
    a, b = _with_logprobs(plain, prompts), _with_logprobs(spec, prompts)
    by_req = lambda ev, i: [(t, lp) for j, t, lp in ev if j == i]  # noqa: E731
    want = []
    for i in range(len(prompts)):
        ra, rb = by_req(a, i), by_req(b, i)
        assert [t for t, _ in ra] == [t for t, _ in rb] and len(ra) == 40
        for (_, (c0, top0)), (_, (c1, top1)) in zip(ra, rb):
            assert abs(c0 - c1) < 1e-4 and [t for t, _ in top0] == [t for t, _ in top1]
        want.append([t for t, _ in ra])
    st = spec.scheduler.stats
    assert st.verify_steps > 0 and st.drafts_fed > 0  # drafts were proposed (this random model rarely repeats
    # itself, so they are rarely kept: test_verify_steps_with_chosen_drafts... and the bundled model's test keep them)
    for p, w in zip(prompts, want):  # and each alone (a batch of one)
        assert spec.generate([p], max_new_tokens=40, ignore_eos=True)[0] == w


@REF4
def test_stops_and_lengths_inside_drafts(engines):
    """A stop token or max_new_tokens that lands inside an accepted draft ends the request there."""
    plain, spec = engines
    p = prompts_of(plain.config)[0]
    full = plain.generate([p], max_new_tokens=30, ignore_eos=True)[0]
    for n in range(1, 12):
        assert spec.generate([p], max_new_tokens=n, ignore_eos=True)[0] == full[:n]
    for j in range(2, 20, 3):
        kw = dict(max_new_tokens=30, ignore_eos=True, stop=[full[j]])
        assert spec.generate([p], **kw) == plain.generate([p], **kw)


@REF4
def test_compile_counts_stay_constant(engines):
    """After a first round of requests no program compiles again."""
    _, spec = engines
    spec.generate(prompts_of(spec.config, seed=3)[:1], max_new_tokens=20, ignore_eos=True)
    counts = dict(spec.scheduler.compile_counts())
    for seed in (4, 5):
        spec.generate(prompts_of(spec.config, seed=seed)[:1], max_new_tokens=20, ignore_eos=True)
    assert spec.scheduler.compile_counts() == counts
    assert all(v == 1 for v in counts.values()) and any(k.startswith("verify") for k in counts)


@REF4
def test_sampled_speculation_equals_plain_sampling(engines):
    """A sampled batch of three, seeded: the tokens of plain sampled decoding with the same seeds (the acceptance
    rule shares its randomness), and the same again. With logprobs asked, which change no token, so that the
    batch runs the programs the greedy batch compiled. This random model's sampled text gives the n-gram
    proposer little to propose: the bundled model's test below keeps sampled drafts."""
    plain, spec = engines
    prompts = prompts_of(spec.config, seed=5)

    def tokens(engine):
        events = _with_logprobs(engine, prompts, 25, temperature=0.9, top_k=20, seed=11)
        return [[t for j, t, _ in events if j == i] for i in range(len(prompts))]

    a = tokens(spec)
    assert a == tokens(plain) == tokens(spec)
    assert all(len(x) == 25 and all(0 <= t < spec.config.vocab_size for t in x) for x in a)


@NVFP4
@pytest.mark.parametrize("proposer", ["ngram", "mtp"])
def test_host_residency_with_constant_eviction(nvfp4_dir, nvfp4_mtp, proposer):
    """Verify steps over host-resident experts (one sequence, 2 drafts: 12 slots for 16 experts, 4 per token,
    the fewest a step of 3 rows may need) equal plain decoding with every expert on the device (an engine that
    also runs its MTP head each step, which changes no token: test_engine.py checks). The random model's MTP
    head guesses badly: its drafts are rarely kept, and its requests fall back to plain steps (Spec)."""
    host = speculating(jaxflash.load(nvfp4_dir, expert_residency="host", cache_slots=12, speculative=proposer,
                                     draft_tokens=2, **{**SMALL, "max_batch": 1}))
    cfg = host.config
    rng = np.random.default_rng(6)
    kw = dict(max_new_tokens=40, ignore_eos=True)
    for _ in range(6):  # phrases of 2 to 5 tokens: some continuations repeat, and their drafts are kept
        p = [repetitive(rng, cfg.vocab_size, cfg.eos_token_id, 20, int(rng.integers(2, 6)))]
        assert host.generate(p, **kw) == nvfp4_mtp.generate(p, **kw)
    st = host.scheduler.stats
    assert st.verify_steps > 0 and st.expert_misses > 0.15 * st.expert_lookups  # it evicts (measured: 24% miss)
    if proposer == "ngram":
        assert st.drafts_accepted > 0


class LayerRouting:
    """A RoutingSource (runner.RoutingSource) that routes every token of layer l to the same experts, different
    per layer: plain and verify steps then route alike wherever their rows lie."""

    def __init__(self, cfg):
        k, e = cfg.num_experts_per_tok, cfg.num_experts
        self.ids = ((np.arange(k)[None] * 3 + 5 * np.arange(cfg.num_hidden_layers)[:, None]) % e).astype(np.int32)
        self.widths = []

    def rows(self, n):
        return np.repeat(self.ids[:, None], n, axis=1)

    def prefill_ids(self, slot, n, width):
        return self.rows(width)

    def decode_ids(self, batch):
        return self.rows(batch)

    def verify_ids(self, batch, width):
        self.widths.append(width)
        return self.rows(batch * width)


@NVFP4
def test_fixed_routing_reaches_verify_steps(nvfp4_dir, nvfp4_mtp, nvfp4_routed):
    """Verify steps take their expert ids from the runner's RoutingSource too (benchmarks time speculation
    under a routing model that way): greedy speculation with host-resident experts equals plain decoding under
    the same fixed routing (conftest.py's engine with fixed routing, every expert on the device), and differs
    from the routers' own choice (conftest.py's engine without fixed routing, whose MTP head changes no token)."""
    cfg = nvfp4_mtp.config
    kw = dict(max_new_tokens=24, ignore_eos=True)
    rng = np.random.default_rng(55)  # its continuation repeats a phrase of its own: n-gram drafts are kept
    prompts = [repetitive(rng, cfg.vocab_size, cfg.eos_token_id, 20, 3)]
    plain_src, spec_src = LayerRouting(cfg), LayerRouting(cfg)
    plain = nvfp4_routed
    plain.routing.source = plain_src
    spec = speculating(jaxflash.load(nvfp4_dir, expert_residency="host", cache_slots=12, routing=spec_src,
                                     speculative="ngram", draft_tokens=2, **{**SMALL, "max_batch": 1}))
    want = plain.generate(prompts, **kw)
    assert spec.generate(prompts, **kw) == want
    assert spec.scheduler.stats.drafts_accepted > 0 and set(spec_src.widths) == {3}
    assert nvfp4_mtp.generate(prompts, **kw) != want  # the routers' own experts give other tokens


@pytest.mark.xdist_group("bundled")
@pytest.mark.parametrize("proposer", ["ngram", "mtp"])
def test_bundled_model_greedy_equals_plain(bundled, proposer):
    """On the trained model drafts are kept (n-gram: its text repeats; MTP: its head was trained), in a batch of
    three on two slots (the third waits for one) whose lengths and stop tokens end inside accepted drafts too;
    the tokens are plain decoding's (conftest.py's engine, 3 slots), greedy and sampled with seeds, and greedy
    again with the draft counts chosen by the step times the scheduler measures (both kinds of step get timed).
    Two slots rather than three: one program per bucket fewer to compile, each bucket's code the same."""
    spec = speculating(jaxflash.load(None, speculative=proposer, draft_tokens=3, max_batch=2, max_seq_len=192,
                                     prefill_chunk=16, progress=False))
    tok = Tokenizer(jaxflash.DEFAULT_MODEL)
    texts = ["The cat sat on the mat. The cat sat on the mat. The dog sat on the",
             "In the beginning God created the heaven and the earth.", "And God said, Let there be"]
    prompts, n = [tok.encode(t) for t in texts], [40, 23, 31]
    want = bundled.generate(prompts, max_new_tokens=n)
    assert spec.generate(prompts, max_new_tokens=n) == want
    assert spec.generate(prompts[:1], max_new_tokens=40) == want[:1]
    stops = [[w[5]] for w in want]  # a token each continuation reaches (where a step may keep drafts past it)
    assert spec.generate(prompts, max_new_tokens=n, stop=stops) == bundled.generate(prompts, max_new_tokens=n,
                                                                                    stop=stops)
    assert spec.scheduler.stats.drafts_accepted > 0
    spec.scheduler.stats = Stats()
    # sampled from the whole distribution (no top-k/p/min-p), so both engines run the programs greedy decoding
    # compiled; the filtered verify rows are test_sampled_speculation_equals_plain_sampling's
    sampled = dict(max_new_tokens=64, temperature=0.3, seed=[3, 4, 5])
    assert spec.generate(prompts, **sampled) == bundled.generate(prompts, **sampled)
    assert spec.scheduler.stats.drafts_accepted > 0
    spec.scheduler.costs = StepCosts()  # the scheduler's own: draft counts by measured step times
    assert spec.generate(prompts, max_new_tokens=n) == want
    measured = spec.scheduler.costs.seconds  # of plain and verify steps, by (rows, drafts fed at most)
    assert any(d == 0 for _, d in measured) and any(d > 0 for _, d in measured)
    assert all(t > 0 for t in measured.values())


def test_bad_arguments_fail_before_loading(tmp_path):
    for kw, msg in ((dict(speculative="eagle"), "speculative must be"), (dict(speculative="ngram", draft_tokens=0),
                    "draft_tokens"), (dict(speculative="mtp", draft_tokens=4), "draft_tokens")):
        with pytest.raises(ValueError, match=msg):
            jaxflash.load(tmp_path / "missing", **kw)  # the path is never opened


# ----- the proposer and the acceptance rule ----------------------------------------------------------------
def test_ngram_proposal():
    h = jnp.asarray([5, 6, 7, 8, 9, 5, 6, 7, 0, 0, 0, 0], jnp.int32)
    d, n = speculative.propose(h, jnp.int32(7), jnp.int32(100), 3)  # last 3 tokens 5 6 7 occurred at 0..2
    assert int(n) == 3 and list(map(int, d)) == [8, 9, 5]
    d, n = speculative.propose(h, jnp.int32(7), jnp.int32(9), 3)  # capacity 9: positions 7, 8 only
    assert int(n) == 1 and int(d[0]) == 8
    d, n = speculative.propose(h, jnp.int32(4), jnp.int32(100), 3)  # 8 9 never occurred before
    assert int(n) == 0
    h2 = jnp.asarray([1, 2, 3, 1, 2, 4, 1, 2, 0], jnp.int32)  # "1 2" twice before: the latest wins
    d, n = speculative.propose(h2, jnp.int32(7), jnp.int32(100), 3)
    assert int(n) == 3 and list(map(int, d)) == [4, 1, 2]
    h3 = jnp.asarray([7, 8, 7, 8, 0, 0, 0], jnp.int32)
    d, n = speculative.propose(h3, jnp.int32(3), jnp.int32(100), 3)
    assert int(n) == 2 and list(map(int, d[:2])) == [7, 8]  # only tokens up to the last one exist


def test_verify_row_without_drafts_is_plain_sampling():
    rng = np.random.default_rng(0)
    for t, k, p, m in ((0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 5, 0.9, 0.05)):
        for pos in range(20):
            logits = jnp.asarray(rng.normal(size=(4, 50)) * 3, jnp.float32)
            toks, acc = verify_row(logits, jnp.zeros(3, jnp.int32), 0, t, k, p, m, 9, pos)
            assert int(acc) == 0 and int(toks[0]) == int(sample_row(logits[0], t, k, p, m, 9, pos))


def test_verify_row_emits_what_plain_sampling_draws():
    """Whatever the drafts, the emitted tokens are sample_row's draws at their positions, and the drafts kept are
    the leading ones equal to those draws (within n_draft)."""
    rng = np.random.default_rng(3)
    for t, k, p, m in ((1.0, 0, 1.0, 0.0), (0.7, 5, 0.9, 0.05), (0.0, 0, 1.0, 0.0)):
        for pos in range(12):
            logits = jnp.asarray(rng.normal(size=(4, 6)) * 2, jnp.float32)  # 6 tokens: drafts are often right
            plain = [int(sample_row(logits[i], t, k, p, m, 5, pos + i)) for i in range(4)]
            drafts = np.asarray(plain[:3]) if pos % 3 == 0 else rng.integers(0, 6, 3)
            n_draft = pos % 4
            toks, acc = verify_row(logits, jnp.asarray(drafts, jnp.int32), n_draft, t, k, p, m, 5, pos)
            want = 0
            while want < n_draft and drafts[want] == plain[want]:
                want += 1
            assert int(acc) == want and list(map(int, toks[: want + 1])) == plain[: want + 1]


def test_verify_row_greedy_keeps_the_argmax_prefix():
    logits = jnp.asarray(np.eye(8, dtype=np.float32)[[3, 5, 1, 6]] * 5)  # argmax 3, 5, 1, 6 at positions 0..3
    for drafts, n_draft, acc in (([3, 5, 1], 3, 3), ([3, 5, 2], 3, 2), ([4, 5, 1], 3, 0), ([3, 5, 1], 1, 1)):
        toks, a = verify_row(logits, jnp.asarray(drafts, jnp.int32), n_draft, 0.0, 0, 1.0, 0.0, 0, 10)
        assert int(a) == acc and list(map(int, toks[: acc + 1])) == [3, 5, 1, 6][: acc + 1]


CHI2_999 = {4: 18.467, 2: 13.816}  # chi-square quantiles at 0.999 by degrees of freedom


def _chi2(counts, probs):
    keep = probs > 0
    assert counts[~keep].sum() == 0  # nothing outside the distribution's support
    n, c, p = counts.sum(), counts[keep], probs[keep]
    return float(((c - n * p) ** 2 / (n * p)).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("top_k", [0, 3])
def test_speculative_sampling_keeps_the_distribution(top_k):
    """Over 40,000 seeds: the first emitted token follows p0 (drafts d0 kept or not), and the second, given
    that d0 was kept, follows p1; the acceptance rate of d0 is p0(d0)."""
    v, n = 5, 40000
    logits = jnp.asarray([[1.0, 0.2, -0.5, 0.7, -1.0], [0.1, -0.3, 0.9, 0.0, 0.4], [0.0] * 5], jnp.float32)
    drafts = jnp.asarray([3, 2], jnp.int32)

    def probs(row):
        p = np.exp(np.asarray(row, np.float64) / 0.9)
        if top_k:
            p[np.argsort(-p)[top_k:]] = 0
        return p / p.sum()

    run = jax.jit(jax.vmap(lambda seed: verify_row(logits, drafts, 2, 0.9, top_k, 1.0, 0.0, seed, 7)))
    toks, acc = (np.asarray(a) for a in run(jnp.arange(n, dtype=jnp.uint32)))
    p0, p1 = probs(logits[0]), probs(logits[1])
    stat, df = _chi2(np.bincount(toks[:, 0], minlength=v), p0)
    assert stat < CHI2_999[df]
    kept = toks[:, 0] == 3
    assert np.array_equal(kept, acc >= 1)
    stat, df = _chi2(np.bincount(toks[kept, 1], minlength=v), p1)
    assert stat < CHI2_999[df]
    assert abs(kept.mean() - p0[3]) < 4 * np.sqrt(p0[3] * (1 - p0[3]) / n)


def _set_drafts(runner, drafts: np.ndarray, n_draft: np.ndarray) -> None:
    """Put chosen drafts into the runner's state, where the proposer would have put its own."""
    st = runner.state
    spec = dataclasses.replace(st.spec, drafts=jnp.asarray(drafts, jnp.int32), n_draft=jnp.asarray(n_draft, jnp.int32))
    runner._state = jax.tree.leaves(dataclasses.replace(st, spec=spec))


def _prefilled(sched, prompts):
    """Greedy requests for `prompts`, admitted and prefilled through the runner's programs (no scheduler step):
    (the requests, each one's tokens so far: its first sampled token)."""
    reqs = sched.make_requests(prompts, max_new_tokens=60, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=0,
                               stop=None, eos_ids=(), ignore_eos=True)
    emitted = []
    for r in reqs:
        sched._admit(r)
        for _, piece, buf, last, follow in sched._chunks(r.prompt):
            out = sched.runner.prefill(r.slot, buf, len(piece), last, sched._all_allowed, follow).result()
        emitted.append([int(out.tokens)])
    return reqs, emitted


def _vocab_reads(runner, setup) -> int:
    """Matrix products with a [vocab, hidden] operand in the decode step built for `setup` (nested jaxprs too)."""
    import jax.extend.core as jax_core

    from jaxflash.engine import runner as runner_mod

    cfg = setup.cfg
    closed = jax.make_jaxpr(lambda p, st: runner_mod.decode_step(p, setup, Want(), st, None, None))(
        runner.params, runner.state)

    def count(jaxpr) -> int:
        n = 0
        for e in jaxpr.eqns:
            if e.primitive.name == "dot_general":
                n += any(getattr(v.aval, "shape", None) == (cfg.vocab_size, cfg.hidden_size) for v in e.invars)
            for sub in jax_core.jaxprs_in_params(e.params):
                n += count(sub)
        return n

    return count(closed.jaxpr)


def _verify_chosen(runner, reqs, emitted, ref, step: int, want: Want):
    """One verify step fed plain decoding's next tokens (ref[b], the tokens after the prompt) as drafts, with a
    first wrong one placed by step and row ((step + b) % (K + 2); K + 1: no drafts fed) so that successive
    steps keep every number from 0 to K. The emitted tokens go to `emitted`; returns (the step's output, what
    each row must keep)."""
    k, vocab = runner.setup.draft_tokens, runner.setup.cfg.vocab_size
    drafts = np.zeros((runner.setup.max_batch, k), np.int32)
    n_draft = np.zeros(runner.setup.max_batch, np.int32)
    want_kept = []
    for b, r in enumerate(reqs):
        n = len(emitted[b])
        drafts[r.slot] = ref[b][n : n + k]
        wrong = (step + b) % (k + 2)
        n_draft[r.slot] = 0 if wrong == k + 1 else k
        if wrong < k:
            drafts[r.slot, wrong] = (ref[b][n + wrong] + 1) % vocab
        want_kept.append(0 if wrong == k + 1 else min(wrong, k))
    _set_drafts(runner, drafts, n_draft)
    o = runner.verify(np.full(runner.setup.max_batch, k, np.int32), want).result()
    for b, r in enumerate(reqs):
        assert int(o.n_draft[r.slot]) == n_draft[r.slot]
        emitted[b] += [int(t) for t in o.tokens[r.slot, : int(o.accepted[r.slot]) + 1]]
    return o, want_kept


@REF4
def test_verify_steps_with_chosen_drafts_equal_plain_decoding(engines):
    """Two sequences in one batch, fed plain decoding's own next tokens as drafts with one wrong token placed so
    that every step keeps a different number (0 to K, and none fed): each step emits exactly plain decoding's
    tokens, and after the steps the next decode step's logits equal plain decoding's at that position (1e-5 of
    the largest logit, both float32): the GDN, conv, PLE and KV state moved exactly as far as the kept tokens."""
    plain, spec = engines
    k = spec.scheduler.runner.setup.draft_tokens
    prompts = [prompts_of(plain.config)[0], prompts_of(plain.config)[1]]
    ref = [plain.scheduler.step_logits(p, 40) for p in prompts]  # (tokens, logits, _): logits[i] gives tokens[i]
    sched, runner = spec.scheduler, spec.scheduler.runner
    reqs, emitted = _prefilled(sched, prompts)
    try:
        seen = set()
        for step in range(7):
            # with logprobs: the verify program of the greedy batch (whose outputs hold these fields too)
            o, want_kept = _verify_chosen(runner, reqs, emitted, [t for t, _, _ in ref], step, VERIFY_RICH)
            kept = [int(o.accepted[r.slot]) for r in reqs]
            assert kept == want_kept
            seen.update(kept)
        o = runner.decode(Want(logits=True)).result()
    finally:
        slots = [r.slot for r in reqs]
        for r in reqs:
            sched._free(r)
    assert seen == set(range(k + 1))
    for b, slot in enumerate(slots):
        toks, logits, _ = ref[b]
        n = len(emitted[b])
        assert emitted[b] == toks[:n]
        assert rel_err(o.logits[slot], logits[n]) < 1e-5


def _chained_head(engine, seq: list[int], k: int, width: int = 64):
    """The MTP drafts after seq (its last token not yet fed), recomputed from position 0 with the whole-sequence
    forward: draft 1 is the head's guess from the pair (main state at len-2, token at len-1); each next one
    runs the head over the pairs so far plus (its own previous output state, its previous draft). Sequences are
    padded to `width` positions, which the causal forward never reads, so each function compiles once (64: the
    padded length of test_engine.py's Engine.mtp_logits call on the same engine, which compiles them too).
    Returns (drafts [k], the logits [k, V] each was chosen from)."""
    assert len(seq) + k <= width
    t = len(seq)
    h = engine.hidden(seq + [0] * (width - t))  # [width, W]: rows 0 .. t-2 are the pairs' states
    hidden, nxt = np.zeros_like(h), np.zeros(width, np.int32)
    hidden[: t - 1], nxt[: t - 1] = h[: t - 1], seq[1:]
    drafts, rows = [], []
    for i in range(k):
        logits, hm = engine._mtp(engine.params, jnp.asarray(hidden)[None], jnp.asarray(nxt)[None])
        row = np.asarray(logits[0, t - 2 + i], np.float32)
        drafts.append(int(row.argmax()))
        rows.append(row)
        hidden[t - 1 + i], nxt[t - 1 + i] = np.asarray(hm[0, t - 2 + i]), drafts[-1]
    return drafts, np.stack(rows)


def _assert_drafts_equal(got: list[int], got_logits, want: list[int], want_logits: np.ndarray) -> None:
    """Each draft's logits within 1e-4 of the largest logit (both float32; measured ~1e-6), and the drafts
    equal, up to the first near tie of the reference (top two logits within 1e-4 of the largest), from which
    on the chains may part."""
    for i, row in enumerate(want_logits):
        if got_logits is not None:
            assert rel_err(got_logits[i], row) < TOL
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] < TOL * np.abs(row).max():
            return
        assert got[i] == want[i]


@pytest.fixture(scope="module")
def nvfp4_spec_mtp(nvfp4_dir):
    """The NVFP4 model with every expert on the device, speculating with 3 MTP drafts."""
    return jaxflash.load(nvfp4_dir, expert_residency="device", speculative="mtp", draft_tokens=3, **SMALL)


@NVFP4
def test_mtp_drafts_equal_the_head_chained_over_the_sequence(nvfp4_spec_mtp, nvfp4_plain, nvfp4_mtp):
    """MTP drafts, K = 3: two sequences in one batch, fed plain decoding's own next tokens as drafts with one
    wrong token placed so that the steps keep every number of drafts (0 to K, and none fed). After the prefill
    and after every verify step the drafts the state holds for the next step equal the head chained over the
    sequence recomputed from position 0 (_chained_head), so the head's KV pages hold exactly the kept pairs (the
    verify steps' draft logits too); the steps emit plain decoding's tokens. Plain decode steps neither draft nor
    run the head: they keep their pairs (speculative.HeadLag), as many as it holds, across a wrap of its rows.
    The catch_up program runs the head over them; after three more plain steps the resume program runs it over
    those and drafts the same chain, which the next verify step feeds.
    The whole-sequence forward is conftest.py's engine of the same checkpoint (same weights), whose programs
    for it test_engine.py compiles too."""
    k, spec = 3, nvfp4_spec_mtp
    assert spec.mtp and spec.speculative == "mtp" and spec.scheduler.runner.setup.draft_tokens == k
    cfg = spec.config
    rng = np.random.default_rng(31)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, n)] for n in (11, 19)]  # one and two chunks
    ref = [nvfp4_plain.scheduler.step_logits(p, 40)[0] for p in prompts]
    sched, runner = spec.scheduler, spec.scheduler.runner
    reqs, emitted = _prefilled(sched, prompts)

    def check_drafts(draft_logits=None):
        st = runner.state.spec
        for b, r in enumerate(reqs):
            assert int(st.n_draft[r.slot]) == k
            want, logits = _chained_head(nvfp4_mtp, prompts[b] + emitted[b], k)
            _assert_drafts_equal([int(d) for d in st.drafts[r.slot]],
                                 None if draft_logits is None else draft_logits[r.slot], want, logits)

    # a plain step reads the vocabulary's weights once (the model's logits), twice with the head's guess
    assert _vocab_reads(runner, runner.setup) == 1
    assert _vocab_reads(runner, dataclasses.replace(runner.setup, decode_drafts=True)) == 2
    try:
        check_drafts()
        seen = set()
        for step in range(6):
            o, want_kept = _verify_chosen(runner, reqs, emitted, ref, step, Want(logits=True))
            kept = [int(o.accepted[r.slot]) for r in reqs]
            assert kept == want_kept
            seen.update(kept)
            check_drafts(o.draft_logits)
        head_at = [int(runner.state.mtp_lag.length[r.slot]) for r in reqs]
        assert head_at == [len(p) + len(e) - 1 for p, e in zip(prompts, emitted)]  # every pair but the last token's
        n0 = len(emitted[0])
        for _ in range(speculative.LAG_ROWS + 3):  # plain steps: no drafts, no draft logits, their pairs kept
            o = runner.decode(Want(logits=True)).result()
            assert o.drafts is None and o.draft_logits is None and o.proposed is None
            assert not np.asarray(runner.state.spec.n_draft).any()
            for b, r in enumerate(reqs):
                emitted[b].append(int(o.tokens[r.slot]))
            if len(emitted[0]) == n0 + speculative.LAG_ROWS:
                assert [int(runner.state.mtp_lag.length[r.slot]) for r in reqs] == head_at
                runner.catch_up()  # the head over every kept pair: no drafts
                assert not np.asarray(runner.state.spec.n_draft).any()
        runner.catch_up(draft=True)  # resume: the head over the last three pairs, then the drafts
        check_drafts()
        o = runner.verify(np.full(runner.setup.max_batch, k, np.int32), Want(logits=True)).result()
        for b, r in enumerate(reqs):
            assert int(o.n_draft[r.slot]) == k
            emitted[b] += [int(t) for t in o.tokens[r.slot, : int(o.accepted[r.slot]) + 1]]
        check_drafts(o.draft_logits)
    finally:
        for r in reqs:
            sched._free(r)
    assert seen == set(range(k + 1))
    assert all(e == t[: len(e)] for e, t in zip(emitted, ref))


class PlainFirst(FlatCosts):
    """Verify steps cost too much for the first `plain` decode steps (so every request decodes plainly), then
    every step costs the same."""

    def __init__(self, plain: int):
        super().__init__()
        self.plain = plain

    def of(self, rows, fed):
        return 1.0 if fed == 0 or self.steps >= self.plain else 1e9


@NVFP4
def test_mtp_plain_steps_keep_pairs_until_the_head_catches_up(nvfp4_spec_mtp, nvfp4_mtp):
    """An MTP engine's scheduler runs the head over the pairs plain steps kept after LAG_ROWS plain steps in a
    row (catch_up) and before a verify step that follows plain steps (resume, which also drafts), never later:
    three requests decode plainly for 40 steps (two full lags), then speculate. Their tokens are plain
    decoding's (an engine whose head runs in every step; test_mtp_drafts_equal... checks the head's KV and drafts
    after both programs)."""
    spec = nvfp4_spec_mtp
    sched, runner = spec.scheduler, spec.scheduler.runner
    rng = np.random.default_rng(8)
    prompts = [[int(t) for t in rng.integers(0, spec.config.vocab_size, n)] for n in (9, 14, 21)]
    kw = dict(max_new_tokens=48, ignore_eos=True)
    calls = []

    def logged(name):
        method = getattr(runner, name)
        return lambda *a, **k: (calls.append("resume" if k.get("draft") else name), method(*a, **k))[1]

    sched.costs, sched.stats = PlainFirst(40), Stats()
    for name in ("decode", "verify", "catch_up"):
        setattr(runner, name, logged(name))
    try:
        got = spec.generate(prompts, **kw)
    finally:
        for name in ("decode", "verify", "catch_up"):
            delattr(runner, name)
    assert got == nvfp4_mtp.generate(prompts, **kw)
    plain = 0  # plain steps since the head last ran over every pair
    for name in calls:
        plain = plain + 1 if name == "decode" else 0
        assert plain <= speculative.LAG_ROWS
    for before, name, after in zip(["verify"] + calls, calls, calls[1:] + ["end"]):
        if name == "verify":  # resume runs exactly where a verify step follows a plain one
            assert before in ("verify", "resume")
        if name in ("resume", "catch_up"):
            assert before == "decode" and after == ("verify" if name == "resume" else "decode")
    first_verify = calls.index("verify")
    assert calls[:first_verify].count("catch_up") == 2 and calls[first_verify - 1] == "resume"
    assert sched.stats.catch_ups == calls.count("catch_up") + calls.count("resume") and sched.stats.verify_steps > 0


def _caps(spec: Spec, kept_of, steps: int) -> list[int]:
    """The caps of `steps` steps, each feeding the cap's drafts and keeping kept_of(cap) of them."""
    caps = []
    for _ in range(steps):
        caps.append(spec.cap)
        spec.step(caps[-1], kept_of(caps[-1]))
    return caps


def test_draft_cap_follows_each_positions_acceptance():
    """scheduler.Spec, K = 3: drafts always kept keep the cap at 3; a first draft always kept and the later ones
    never (as the MTP head chained can do) bring it to 1 after 8 steps, with 3 tried again every 7 or 8 steps; a
    first draft never kept gives 8 steps at 3, then a cap of 0 for 4 steps, 3 again, then 0 for 8 steps."""
    assert _caps(Spec(3), lambda c: c, 40) == [3] * 40
    caps = _caps(Spec(3), lambda c: min(c, 1), 60)
    assert caps[:9] == [3] * 8 + [1] and set(caps[8:]) == {1, 3} and 6 <= caps[8:].count(3) <= 8
    assert _caps(Spec(3), lambda c: 0, 40) == [3] * 8 + [0] * 4 + [3] * 8 + [0] * 8 + [3] * 8 + [0] * 4
    assert _caps(Spec(3), lambda c: min(c, 2), 30).count(2) >= 18  # the third position alone dropped


def test_step_costs_are_measured_again_when_stale():
    """A cost is trusted from TRUSTED samples on (the median of the last SAMPLES), reading it changes nothing,
    and after STALE steps without a sample it is unknown until TRUSTED fresh samples replace the old ones."""
    c = StepCosts()
    for t in (1.0, 9.0):
        c.add(1, 0, t)
    assert c.of(1, 0) is None
    c.add(1, 0, 2.0)
    assert c.of(1, 0) == 2.0 and c.of(1, 0) == 2.0 and c.of(2, 0) is None
    for t in (3.0, 4.0, 5.0):
        c.add(1, 0, t)
    assert c.of(1, 0) == 4.0  # 9, 2, 3, 4, 5
    for _ in range(StepCosts.STALE + 1):
        c.tick()
    assert c.of(1, 0) is None and c.of(1, 0) is None
    for t in (7.0, 8.0):
        c.add(1, 0, t)
        assert c.of(1, 0) is None
    c.add(1, 0, 6.0)
    assert c.of(1, 0) == 7.0  # the old samples are gone


def test_draft_cap_weighs_the_measured_step_costs():
    """Spec.choose over 3000 simulated steps (seeded): step costs measured on the H200 (benchmarks/RESULTS.md: a
    plain step, and verify steps feeding 1 to 3 drafts, with every expert on the device and with host experts),
    drafts kept at the rates given per position. The tokens per second it reaches are within 5% of the best
    fixed number of drafts, which is 0 (plain decoding) where speculation loses: every draft position is tried
    now and then, and the rule weighs what it measured. The acceptance-only rule (Spec.cap) loses 15-40% with
    host experts where the first draft is kept 2 times in 3 or less. Costs not yet measured are tried first, the fewest drafts first."""
    costs = {"device": [6.66, 9.37, 11.4, 13.38], "host": [19.84, 34.02, 47.0, 59.93]}
    rates = ([0.66, 0.4, 0.3], [0.66, 0.0, 0.0], [0.9, 0.8, 0.7], [0.3, 0.3, 0.3], [0.0, 0.0, 0.0])

    def tokens_per_ms(times, accept, rule):
        rng, spec, tokens, ms = np.random.default_rng(0), Spec(3), 0, 0.0
        for _ in range(3000):
            n = rule(spec, times)
            kept = 0
            while kept < n and rng.random() < accept[kept]:
                kept += 1
            spec.step(n, kept)
            tokens, ms = tokens + kept + 1, ms + times[n]
        return tokens / ms

    for where, times in costs.items():
        for accept in rates:
            best = max((1 + sum(np.prod(accept[:i + 1]) for i in range(n))) / times[n] for n in range(4))
            got = tokens_per_ms(times, accept, lambda spec, t: spec.choose(lambda n: t[n]))
            assert got > 0.95 * best, (where, accept)
            if where == "host" and accept[0] < 0.9:
                assert tokens_per_ms(times, accept, lambda spec, t: spec.cap) < 0.87 * best
    unmeasured = [1.0, None, None, None]
    assert Spec(3).choose(lambda n: unmeasured[n]) == 1
    assert Spec(3).choose(lambda n: None) == 0
