"""The scheduler's overlapped decode on the bundled model: the host dispatches decode step n+1 before it reads
step n, so a request that ends in step n has already been computed once more. These tests check that nothing
of that extra step leaks: no token after EOS, a stop token, a stop string or max_new_tokens, none after a
cancellation while a step is in flight, and that requests admitted while others decode give what they give
alone. Greedy decoding on the bundled model (float32 on the CPU); equalities are exact token for token.
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxflash
from jaxflash.engine import runner as runner_mod
from jaxflash.engine import scheduler as scheduler_mod
from jaxflash.tokenizer import Tokenizer


pytestmark = pytest.mark.xdist_group("bundled")  # conftest.py's bundled engine, shared with test_speculative.py


@pytest.fixture
def engine(bundled):
    """3 slots of 192 tokens, 16-token prefill chunks (conftest.py)."""
    return bundled


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(jaxflash.DEFAULT_MODEL)


def requests(engine, prompts, **kw):
    args = dict(max_new_tokens=20, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=0, stop=None,
                eos_ids=engine.config.eos_token_ids, ignore_eos=False)
    return engine.scheduler.make_requests(prompts, **{**args, **kw})


def run_events(sched, reqs, on_event=None):
    """All events of serving `reqs`, in order; on_event(ev) may cancel requests between steps."""
    for r in reqs:
        sched.submit(r)
    events = []
    while not sched.idle:
        for ev in sched.step():
            events.append(ev)
            if on_event:
                on_event(ev)
    return events


def assert_clean_stream(events):
    """Per request: tokens, then exactly one end event, nothing after it."""
    ended = set()
    for ev in events:
        assert id(ev.request) not in ended, "an event after the request ended"
        if ev.token is None:
            ended.add(id(ev.request))


def alone(engine, prompt, **kw):
    return engine.generate([prompt], **kw)[0]


def test_steps_overlap(engine, tok, monkeypatch):
    """In steady decoding, step n's output is read only after step n+1 was dispatched."""
    log = []
    real_decode, real_result = runner_mod.Runner.decode, runner_mod.Pending.result

    def decode(self, *a, **k):
        p = real_decode(self, *a, **k)
        p.n = sum(1 for e in log if e[0] == "dispatch")
        log.append(("dispatch", p.n))
        return p

    def result(self):
        if hasattr(self, "n"):
            log.append(("read", self.n))
        return real_result(self)

    monkeypatch.setattr(runner_mod.Runner, "decode", decode)
    monkeypatch.setattr(runner_mod.Pending, "result", result)
    out = alone(engine, tok.encode("In the beginning"), max_new_tokens=12, ignore_eos=True)
    assert len(out) == 12
    reads = [n for kind, n in log if kind == "read"]
    assert reads == sorted(reads) and len(reads) >= 10
    for n in reads[:-1]:  # every read but the drain at the end comes after the next step's dispatch
        assert log.index(("dispatch", n + 1)) < log.index(("read", n))


def test_max_new_tokens_exact(engine, tok):
    p = tok.encode("And God said")
    full = alone(engine, p, max_new_tokens=12, ignore_eos=True)
    sched = engine.scheduler
    for m in (1, 2, 5, 12):
        events = run_events(sched, requests(engine, [p, tok.encode("def f(")], max_new_tokens=[m, 9],
                                            ignore_eos=True))
        assert_clean_stream(events)
        got = [ev.token for ev in events if ev.request.index == 0 and ev.token is not None]
        assert got == full[:m]
        assert [ev.request.finish for ev in events if ev.token is None and ev.request.index == 0] == ["length"]
    assert sched.idle and len(sched.free_slots) == sched.max_batch
    assert len(sched.free_pages) == sched.plan.num_pages


def test_no_token_after_a_stop_token_or_eos(engine, tok):
    p = tok.encode("The LORD is my shepherd")
    full = alone(engine, p, max_new_tokens=24, ignore_eos=True)
    stop = full[5]
    first = full.index(stop)
    other = tok.encode("import os")
    events = run_events(engine.scheduler, requests(engine, [p, other], max_new_tokens=24, stop=[stop],
                                                   ignore_eos=True))
    assert_clean_stream(events)
    assert [ev.token for ev in events if ev.request.index == 0 and ev.token is not None] == full[:first]
    assert [ev.token for ev in events if ev.request.index == 1 and ev.token is not None] == \
        alone(engine, other, max_new_tokens=24, ignore_eos=True)
    eos = engine.config.eos_token_ids[0]
    out = alone(engine, p, max_new_tokens=24)  # EOS stops by default
    assert eos not in out and out == full[: len(out)] and (len(out) == 24 or full[len(out)] == eos)


def test_no_token_after_a_stop_string(engine, tok):
    """What the server does with a stop string: cancel the request once its text contains it. The step in
    flight at that moment computes one more token for it, which must not come out."""
    p = tok.encode("In the beginning God created")
    full = alone(engine, p, max_new_tokens=30, ignore_eos=True)
    text = tok.decode(full)
    target = text[len(text) // 3 : len(text) // 3 + 4]
    sched = engine.scheduler
    cut = {}

    def on_event(ev):
        r = ev.request
        if ev.token is not None and r.index == 0 and target in tok.decode(r.out):
            cut["at"] = len(r.out)
            sched.cancel(r)

    events = run_events(sched, requests(engine, [p, tok.encode("class A:")], max_new_tokens=30,
                                        ignore_eos=True), on_event)
    assert_clean_stream(events)
    got = [ev.token for ev in events if ev.request.index == 0 and ev.token is not None]
    assert "at" in cut and got == full[: cut["at"]]
    assert sched.idle and len(sched.free_slots) == sched.max_batch


def test_cancel_while_a_step_is_in_flight(engine, tok):
    a, b = tok.encode("Blessed are the"), tok.encode("The list type")
    solo_b = alone(engine, b, max_new_tokens=16, ignore_eos=True)
    sched = engine.scheduler
    ra, rb = requests(engine, [a, b], max_new_tokens=[40, 16], ignore_eos=True)
    sched.submit(ra)
    sched.submit(rb)
    events = []
    while len(ra.out) < 3:
        events += sched.step()
    assert sched._in_flight, "a decode step should be in flight between steps"
    events += sched.cancel(ra)
    while not sched.idle:
        events += sched.step()
    assert_clean_stream(events)
    assert [ev.token for ev in events if ev.request is ra and ev.token is not None] == ra.out
    assert len(ra.out) == 3 and ra.finish == "cancelled"
    assert rb.out == solo_b
    assert len(sched.free_slots) == sched.max_batch and len(sched.free_pages) == sched.plan.num_pages


def test_admitted_while_another_decodes(engine, tok):
    """B joins after A has decoded a few tokens (and C while both run); sampled rows are seeded, so each
    request gives what it gives alone."""
    prompts = [tok.encode("And it came to pass"), tok.encode("Return a new"), tok.encode("Thou shalt")]
    kw = dict(max_new_tokens=[18, 10, 8], temperature=[0.0, 0.9, 0.7], seed=[1, 2, 3], ignore_eos=True)
    solo = [alone(engine, prompts[i], **{k: v[i] if isinstance(v, list) else v for k, v in kw.items()})
            for i in range(3)]
    sched = engine.scheduler
    ra, rb, rc = requests(engine, prompts, **kw)
    sched.submit(ra)
    events = []
    while len(ra.out) < 4:
        events += sched.step()
    sched.submit(rb)
    while len(rb.out) < 2:
        events += sched.step()
    sched.submit(rc)
    while not sched.idle:
        events += sched.step()
    assert_clean_stream(events)
    assert [ra.out, rb.out, rc.out] == solo


def test_a_long_prompt_is_prefilled_between_decode_steps(engine, tok, monkeypatch):
    """B's prompt spans 5 prefill chunks (16 tokens each, conftest.py): each step dispatches one of them, then
    a decode step for A, so A keeps producing tokens while B prefills; both give what they give alone."""
    words = " ".join(["and the earth was without form and void"] * 10)
    pa, pb = tok.encode("In the beginning"), tok.encode(words)[:70]
    assert -(-len(pb) // engine.scheduler.chunk) == 5
    kw = dict(max_new_tokens=[30, 6], temperature=[0.0, 0.8], seed=[4, 5], ignore_eos=True)
    solo = [alone(engine, p, **{k: v[i] if isinstance(v, list) else v for k, v in kw.items()})
            for i, p in enumerate((pa, pb))]
    log = []
    real_prefill, real_decode = runner_mod.Runner.prefill, runner_mod.Runner.decode
    monkeypatch.setattr(runner_mod.Runner, "prefill",
                        lambda self, *a, **k: log.append("prefill") or real_prefill(self, *a, **k))
    monkeypatch.setattr(runner_mod.Runner, "decode",
                        lambda self, *a, **k: log.append("decode") or real_decode(self, *a, **k))
    sched = engine.scheduler
    ra, rb = requests(engine, [pa, pb], **kw)
    sched.submit(ra)
    events = []
    while len(ra.out) < 3:
        events += sched.step()
    sched.submit(rb)
    log.clear()
    a_tokens = []
    while rb.slot < 0 or not rb.out:
        got = sched.step()
        a_tokens.append(sum(1 for ev in got if ev.request is ra and ev.token is not None))
        events += got
    chunks = [i for i, kind in enumerate(log) if kind == "prefill"]
    assert len(chunks) == 5 and all(log[i + 1] == "decode" for i in chunks)  # a decode step after each chunk
    assert sum(a_tokens[:4]) >= 3  # A's tokens kept coming while B's first chunks were in
    while not sched.idle:
        events += sched.step()
    assert_clean_stream(events)
    assert [ra.out, rb.out] == solo


def test_an_error_in_an_earlier_prefill_chunk_fails_its_request(engine, tok, monkeypatch):
    """Every chunk's output is read for its status checks (expert cache, PLE), not only the last one's: a chunk
    before the last that reports an error ends its request with that error; a request decoding beside it goes
    on and gives what it gives alone."""
    from jaxflash import ffi

    words = " ".join(["and the earth was without form and void"] * 10)
    pa, pb = tok.encode("In the beginning"), tok.encode(words)[:70]
    kw = dict(max_new_tokens=12, ignore_eos=True)
    solo = alone(engine, pa, **kw)
    real_prefill = runner_mod.Runner.prefill
    calls = []

    class Failing:  # the second chunk's output, as read when its status words report a bad expert id
        def __init__(self, pending):
            self.pending = pending

        def result(self):
            self.pending.result()
            raise ffi.ExpertCacheError("expert cache resolve: bad expert id 9999 (injected)")

    def prefill(self, *a, **k):
        calls.append(a)
        pending = real_prefill(self, *a, **k)
        return Failing(pending) if len(calls) == 2 else pending

    sched = engine.scheduler
    ra, rb = requests(engine, [pa, pb], **kw)
    sched.submit(ra)
    events = []
    while not ra.out:
        events += sched.step()
    monkeypatch.setattr(runner_mod.Runner, "prefill", prefill)
    sched.submit(rb)
    while not sched.idle:
        events += sched.step()
    assert len(calls) == 5  # every chunk dispatched; the error shows when the outputs are read
    assert rb.finish == "error" and "bad expert id 9999" in rb.error and not rb.out
    assert_clean_stream(events)
    assert ra.out == solo


def test_short_prompts_take_the_short_prefill_bucket(engine, monkeypatch):
    """A plain prefill's last piece (a short prompt's only one) goes to the smallest bucket that holds it: with
    a short bucket of 8 tokens beside the 16-token chunk, prompts of 5 and 21 tokens run chunks of 8 and
    16 + 8 rows, and give the tokens they give with whole chunks; logprob requests keep whole chunks."""
    from jaxflash.engine import scheduler as scheduler_mod

    sched = engine.scheduler
    rng = np.random.default_rng(22)
    v = engine.config.vocab_size
    prompts = [[int(t) for t in rng.integers(0, v, n)] for n in (5, 21)]
    kw = dict(max_new_tokens=6, ignore_eos=True)
    whole = engine.generate(prompts, **kw)
    widths = []
    real = sched.runner.prefill
    with monkeypatch.context() as m:
        m.setattr(sched, "prefill_buckets", [8, sched.chunk])
        m.setattr(sched.runner, "prefill", lambda slot, tokens, *a, **k: widths.append(len(tokens))
                  or real(slot, tokens, *a, **k))
        assert engine.generate(prompts, **kw) == whole
        assert sorted(widths) == [8, 8, 16]
        widths.clear()
        reqs = requests(engine, prompts[:1], max_new_tokens=2)
        reqs[0].logprobs = 0
        list(sched.run(reqs))
        assert widths == [16] and reqs[0].finish == "length"
    assert "prefill@8" in sched.compile_counts()
    assert scheduler_mod.SHORT_CHUNK == 256 and sched.prefill_buckets == [16]  # 16-token chunks: one bucket


def test_warm_up_warns_when_temporaries_outgrow_the_workspace(engine, monkeypatch, caplog):
    """The planner's workspace is an estimate: a compiled program needing more says so (at warm-up)."""
    import logging

    sched = engine.scheduler
    programs = [("prefill", runner_mod.Want())]
    need = sched.runner.temp_bytes(*programs[0])
    assert need and need > 0  # XLA's buffer assignment says it on the CPU too
    with caplog.at_level(logging.WARNING, logger="jaxflash.engine.scheduler"):
        monkeypatch.setitem(sched.plan.reserved, "workspace", need)
        sched._check_workspace(programs)
        assert not caplog.records
        monkeypatch.setitem(sched.plan.reserved, "workspace", need - 1)
        sched._check_workspace(programs)
    assert "prefill needs" in caplog.text and "lower prefill_chunk" in caplog.text


class CountUp:
    """A constraint allowing only (previous token + 1) mod V: each mask depends on the token just sampled, so
    it is only right if every step is read before the next is dispatched."""

    def __init__(self, vocab: int, start: int, steps: int):
        self.vocab, self.prev, self.left = vocab, start, steps

    def mask(self, row):
        nxt = (self.prev + 1) % self.vocab
        row[nxt // 32] |= np.int32(np.uint32(1 << (nxt % 32)).view(np.int32))

    def accept(self, token):
        self.prev, self.left = token, self.left - 1

    def finished(self):
        return self.left == 0


def test_constrained_requests_step_in_lockstep(engine, tok):
    p = tok.encode("Count:")
    v = engine.config.vocab_size
    (r, other) = requests(engine, [p, tok.encode("def main")], max_new_tokens=[20, 20], ignore_eos=True)
    r.constraint = CountUp(v, 100, 7)
    events = run_events(engine.scheduler, [r, other])
    assert_clean_stream(events)
    assert r.out == list(range(101, 108)) and r.finish == "stop"
    assert other.out == alone(engine, tok.encode("def main"), max_new_tokens=20, ignore_eos=True)


def test_decode_runs_the_smallest_bucket(engine, tok, monkeypatch):
    """A lone request decodes in a batch of one; while three run, steps cover the first three slots; when the
    later ones end, steps shrink back (each request still gives what it gives alone)."""
    rows = []
    real = runner_mod.Runner.decode

    def decode(self, *args, **kw):
        rows.append(kw.get("rows"))
        return real(self, *args, **kw)

    monkeypatch.setattr(runner_mod.Runner, "decode", decode)
    p = tok.encode("In the beginning")
    solo = alone(engine, p, max_new_tokens=6, ignore_eos=True)
    assert set(rows) == {1}
    rows.clear()
    prompts = [p, tok.encode("def f("), tok.encode("Thou")]
    reqs = requests(engine, prompts, max_new_tokens=[30, 6, 6], ignore_eos=True)
    run_events(engine.scheduler, reqs)
    assert reqs[0].out[:6] == solo and reqs[0].out == alone(engine, p, max_new_tokens=30, ignore_eos=True)
    assert 3 in rows and rows[-1] == 1  # the batch grew to three slots, then back to one


def test_steps_sort_the_vocabulary_only_while_a_request_filters(engine, tok, monkeypatch):
    """Decode steps run the program without the vocabulary sort (PLAIN) unless a request in the batch samples
    with top-k, top-p or min-p; then the batch runs RICH, which filters. A seeded temperature-only request
    gives the same tokens in either (its draw does not depend on the program), and a program without the
    filters refuses a batch holding a filtering slot."""
    wants = []
    real = runner_mod.Runner.decode

    def decode(self, want=runner_mod.Want(), *args, **kw):
        wants.append(want)
        return real(self, want, *args, **kw)

    monkeypatch.setattr(runner_mod.Runner, "decode", decode)
    p, q = tok.encode("In the beginning"), tok.encode("def f(")
    solo = alone(engine, p, max_new_tokens=24, ignore_eos=True, temperature=0.9, seed=11)
    assert set(wants) == {scheduler_mod.PLAIN}
    wants.clear()
    reqs = requests(engine, [p, q], max_new_tokens=[24, 8], ignore_eos=True, temperature=[0.9, 0.8],
                    top_p=[1.0, 0.7], seed=[11, 3])
    run_events(engine.scheduler, reqs)
    assert reqs[0].out == solo  # beside the filtering request it ran in RICH steps, then in PLAIN ones
    assert scheduler_mod.RICH in wants and wants[-1] == scheduler_mod.PLAIN
    (r,) = requests(engine, [q], top_k=5, temperature=0.5)
    sched = engine.scheduler
    sched._admit(r)
    try:
        with pytest.raises(ValueError, match="Want\\(filters=True\\)"):
            sched.runner.decode(scheduler_mod.PLAIN, rows=1)
    finally:
        sched._free(r)


def test_bucket_steps_pass_untouched_state_through(engine):
    """A bucket's step writes back into the whole state only what it changed: a leaf it returns as it got it
    (sampling rows, page tables, active flags) leaves the program as its input (in the trace: the same
    variable), since writing its rows back costs a pair of device copies outside the CUDA graph on the GPU."""
    import dataclasses

    import jax

    st = engine.scheduler.runner.state

    def step(state):  # a stand-in step of bucket 1 that changes the last token alone
        cut = runner_mod._first_rows(state, 1)
        return runner_mod._put_first_rows(state, 1, cut, dataclasses.replace(cut, last_token=cut.last_token + 1))

    closed = jax.make_jaxpr(step)(st)
    ins, outs = closed.jaxpr.invars, closed.jaxpr.outvars
    for i, leaf in enumerate(jax.tree.leaves(st)):
        assert (outs[i] is ins[i]) != (leaf is st.last_token), i
    new = jax.jit(step)(st)
    assert int(new.last_token[0]) == int(st.last_token[0]) + 1
    assert (new.last_token[1:] == st.last_token[1:]).all()


def test_bucket_steps_update_the_ple_context_in_place(engine):
    """A bucket's decode step hands the PLE host step the state's whole [max_batch, 2] context leaf and returns
    that call's output as the new leaf: a cut context and its write-back kept the FFI call out of the CUDA
    graph on the H200 (the host then waited in every step for the previous token). Rows past the bucket are
    fed nothing and keep their context (the tokens of buckets against the lone request: the test above)."""
    import jax

    runner = engine.scheduler.runner
    st, setup = runner.state, runner.setup
    assert st.seqs.ple_context is not None and setup.max_batch > 1

    def step(params, state):
        cut = runner_mod._first_rows(state, 1)
        sub, _ = runner_mod.decode_step(params, setup, runner_mod.Want(), cut, None, None)
        return runner_mod._put_first_rows(state, 1, cut, sub)

    params = runner.params
    closed = jax.make_jaxpr(step)(params, st)
    n_params = len(jax.tree.leaves(params))
    leaves = jax.tree.leaves(st)
    at = next(i for i, a in enumerate(leaves) if a is st.seqs.ple_context)
    ctx_in, ctx_out = closed.jaxpr.invars[n_params + at], closed.jaxpr.outvars[at]
    calls = [e for e in closed.jaxpr.eqns if "jaxflash_ple_step" in str(e.params.get("target_name", ""))]
    assert len(calls) == 1 and calls[0].invars[3] is ctx_in and calls[0].outvars[3] is ctx_out
    context = np.asarray(jax.jit(step)(params, st).seqs.ple_context)
    assert (context[1:] == np.asarray(st.seqs.ple_context)[1:]).all()


def test_context_buckets_give_the_whole_context_tokens(engine, monkeypatch):
    """With a short context bucket of 64 positions in a 192-token engine, decode steps read 64 positions while
    every running sequence is shorter, then the whole context; the tokens equal the one-bucket engine's, for a
    sequence crossing the bucket alone and beside a longer one (whose length sets the bucket of the step). The
    same engine serves both ways: its scheduler picks each step's span from `spans`, which it builds from
    context_spans, so the buckets of SHORT_SPAN 64 are set there for the bucketed runs."""
    from jaxflash.engine import scheduler as scheduler_mod

    assert scheduler_mod.context_spans(32768, 16) == [4096, 32768]
    assert scheduler_mod.context_spans(4096, 16) == [4096] and scheduler_mod.context_spans(192, 16) == [192]
    sched = engine.scheduler
    assert sched.spans == scheduler_mod.context_spans(sched.max_seq_len, engine.plan.page_size) == [192]
    monkeypatch.setattr(scheduler_mod, "SHORT_SPAN", 64)
    short = scheduler_mod.context_spans(sched.max_seq_len, engine.plan.page_size)
    assert short == [64, 192]
    spans = []
    real = sched.runner.decode

    def bucketed(prompts, **kw):
        """Generate with the 64-position bucket; every decode step's span recorded."""
        with monkeypatch.context() as m:
            m.setattr(sched, "spans", short)
            m.setattr(sched.runner, "decode", lambda *a, **k: spans.append(k["span"]) or real(*a, **k))
            return engine.generate(prompts, **kw)

    rng = np.random.default_rng(21)
    v = engine.config.vocab_size
    crossing = [int(t) for t in rng.integers(0, v, 50)]  # positions 50..89: the bucket changes at 63
    longer = [int(t) for t in rng.integers(0, v, 100)]
    kw = dict(max_new_tokens=40, ignore_eos=True)
    assert bucketed([crossing], **kw) == engine.generate([crossing], **kw)
    assert spans[0] == 64 and spans[-1] == 192 and spans.count(64) == 64 - 50  # positions 50..63 fit in 64
    spans.clear()
    assert bucketed([crossing, longer], **kw) == engine.generate([crossing, longer], **kw)
    # the crossing one decodes alone while the longer one's chunks go in (one per step), then the whole context
    first = spans.index(192)
    assert first == -(-len(longer) // sched.chunk) and set(spans[first:]) == {192}
    assert "decode@1:64" in sched.compile_counts()
    assert sched.spans == [192] and sched.runner.decode == real  # the shared engine as it was
