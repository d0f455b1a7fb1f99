"""The scheduler: continuous batching over the runner's programs, in plain Python values.

Up to `max_batch` sequences run at once, one per batch slot. A request is admitted when a slot and enough KV
pages for its prompt plus its token allowance are free (pages are reserved up front, so a running sequence
never runs out of cache); its prompt is prefilled in chunks; then it joins the batched decode steps until a
stop token, its max_new_tokens, the context end, its grammar's end, or cancellation. Requests can be
submitted and cancelled between any two steps. A `step()` admits a request when none is being prefilled,
dispatches the next prefill chunk of the one being prefilled (one chunk per step, so a long prompt does not
stall the running streams for its whole prefill: they get a decode step between any two of its chunks), then
one decode step for the running requests.

Decode is overlapped: `step()` dispatches decode step n+1 and only then reads step n's tokens, so the host's
work (reading tokens, stop rules, events, the caller's own work between steps) runs while the device computes.
The next input token already lives in the device state. A request that ends in step n (a stop token, its
max_new_tokens, a cancellation) was still computed in step n+1; that token is dropped, and its slot is
released after step n+1 (one step late). Grammar-constrained requests need each token before the next step's
mask can be made, so while one runs, steps are not overlapped.

Speculative decoding (a runner with draft_tokens K > 0): steps are verify steps, which feed each sequence its
last token and up to K drafts proposed on the device (engine/speculative.py) and emit 1 to K+1 tokens per
sequence. The stop rules apply token by token, so a stop token or max_new_tokens inside the accepted drafts
ends the request there. Each request's draft cap adapts to how often each draft position is kept and to what
the steps cost (`Spec`, `StepCosts`): it feeds the number of drafts that gives the most tokens per second of
step time as measured on this device, so where verify steps cost more than their kept drafts save (host
experts: each row brings its own misses) it drops to 0; a step in which every request is at 0 runs the plain
decode program. With MTP drafts that program does not run the head: it keeps its pairs on the device for it
(speculative.HeadLag). After LAG_ROWS plain steps in a row the catch_up program runs the head over them in one
chunk; before a verify step that follows plain steps the resume program does, and then drafts from the last of
them, so that the verify step that resumes speculation feeds drafts.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple, Sequence

import jax
import numpy as np

from .runner import LAG_PROGRAMS, Pending, Runner, StepOutput, Want
from .sampling import SamplingParams
from .speculative import catch_up_due

log = logging.getLogger(__name__)

# The decode programs the scheduler uses. A batch runs PLAIN unless a request in it needs more: logprobs, a
# grammar, or top-k / top-p / min-p (whose vocabulary sort PLAIN leaves out); RICH does all three, so filters
# cost no programs of their own.
PLAIN, RICH = Want(), Want(logprobs=True, masks=True, filters=True)
VERIFY_RICH = Want(logprobs=True, filters=True)  # verify steps take no grammar masks (such requests decode plainly)
# The short context bucket: while every running sequence is shorter, decode steps attend to this many positions
# instead of the whole context (an engine planned for 32768 tokens serving a short chat reads an eighth).
SHORT_SPAN = 4096
SHORT_CHUNK = 256  # the prefill bucket of short prompts (and of long ones' last pieces)


def context_spans(max_seq_len: int, page_size: int) -> list[int]:
    """The context buckets of the decode steps: SHORT_SPAN (when it is a whole number of pages below the
    context) and the whole context."""
    short = SHORT_SPAN if SHORT_SPAN < max_seq_len and SHORT_SPAN % page_size == 0 else None
    return ([short] if short else []) + [max_seq_len]


@dataclass(eq=False)
class Request:
    index: int
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop: frozenset
    logprobs: int | None = None  # top alternatives per generated token (0: the token's own only); None: off
    echo_logprobs: int | None = None  # score the prompt too (OpenAI `echo` with `logprobs`)
    constraint: Any = None  # has mask(bits_row) / accept(token) / finished(): grammar-constrained sampling
    out: list[int] = field(default_factory=list)
    finish: str | None = None  # "stop", "length", "cancelled", "error"
    error: str | None = None
    prompt_logprobs: list | None = None  # with echo_logprobs: [(logprob, [(id, logprob), ...]) per token]; [0]=None
    slot: int = -1
    pages: list[int] = field(default_factory=list)
    draft: int | None = None  # the MTP head's guess of the next token
    decoded: int = 0  # positions its dispatched steps may have fed: the next one writes from len(prompt) + decoded
    spec: Spec | None = None  # speculative decoding: its draft cap
    proposed: int = 0  # speculative decoding: drafts the device proposed after its latest token read (an MTP
    # engine's plain steps propose nothing and leave it: the resume program proposes before the next verify step)


@dataclass
class Spec:
    """A request's draft cap under speculative decoding, from how often each draft position is kept: rates[i] is a
    running mean, over the steps that fed draft i + 1 with the i before it kept, of whether it was kept (a draft
    after a rejected one says nothing). The cap is the number of leading positions kept at least LOW of the time,
    so a proposer whose first draft is good and whose later ones are not (the MTP head chained) feeds the first
    alone. Positions past what a step fed drift back up by RECOVER, so that they are tried again now and then.
    When the first position falls below LOW the cap is 0 for `wait` steps (doubling each time, up to WAIT_MAX),
    then the first position starts again at 1. choose() picks, below that cap, the number of drafts worth their
    step's measured cost."""

    k: int
    rates: list[float] = field(default_factory=list)
    wait: int = 0
    backoff: int = 4
    fed_any: bool = False  # whether any step fed it a draft (only then do its rates say anything)
    LOW = 0.3  # below this a position is not fed whatever the costs (they are measured, its rate would not be)
    ALPHA = 0.15
    RECOVER = 0.01  # from just below LOW, 7 or 8 steps until the position is tried again
    WAIT_MAX = 64

    def __post_init__(self):
        self.rates = self.rates or [1.0] * self.k

    @property
    def cap(self) -> int:
        if self.wait > 0:
            return 0
        n = 0
        while n < self.k and self.rates[n] >= self.LOW:
            n += 1
        return n

    def expected(self, n: int) -> float:
        """Tokens a step feeding n drafts is expected to emit: 1 + P(draft 1 kept) + P(drafts 1, 2 kept) + ...
        A position is taken to be kept no more often than the one before it: a later position's rate is seldom
        measured (only after every draft before it was kept) and starts high, and the optimism costs a verify
        step of many rows each time it is tried."""
        total = kept = 1.0
        rate = 1.0
        for r in self.rates[:n]:
            rate = min(rate, r)
            kept *= rate
            total += kept
        return total

    def choose(self, cost) -> int:
        """The drafts to feed next, of 0..cap: the most expected tokens per second, where cost(n) is the measured
        time of a step feeding at most n drafts per sequence (StepCosts.of), None while unmeasured: the fewest
        unmeasured n is chosen, so each is measured once before the rule relies on it."""
        n = self.cap
        times = [cost(c) for c in range(n + 1)]
        if None in times:
            return times.index(None)
        return max(range(n + 1), key=lambda c: (self.expected(c) / times[c], -c))

    def step(self, fed: int, kept: int) -> None:
        """After a step that fed `fed` drafts and kept the first `kept` of them."""
        if self.wait > 0:
            self.wait -= 1
            return
        self.fed_any |= fed > 0
        for i in range(min(fed, kept + 1)):  # drafts 1 .. kept were kept, draft kept + 1 (if fed) was not
            self.rates[i] += self.ALPHA * (float(i < kept) - self.rates[i])
        for i in range(fed, self.k):  # positions not fed (all of them when a step fed none for its cost)
            self.rates[i] += self.RECOVER * (1.0 - self.rates[i])
        if not fed:
            return
        if self.rates[0] < self.LOW:
            self.wait, self.backoff = self.backoff, min(2 * self.backoff, self.WAIT_MAX)
            self.rates[0] = 1.0
        elif kept == fed:
            self.backoff = 4


@dataclass
class StepCosts:
    """Seconds per decode step by (rows, most drafts any sequence could feed: 0 for the plain decode program):
    the median of the last SAMPLES steps run back to back (dispatched while the step before was in flight, so
    the time between their results is the step's own on the device, or the host loop's where that is longer;
    an interval in which a program compiled is not counted, the median drops a stall now and then, and a cost
    not refreshed for STALE steps is measured again). A verify step costs more than a plain one by how much its
    extra rows cost where they are computed: little with the experts on the device, the rows' own expert
    misses with the experts on the host (benchmarks/RESULTS.md)."""

    samples: dict = field(default_factory=dict)
    steps: int = 0  # decode steps read so far
    SAMPLES = 5
    TRUSTED = 3  # samples before a cost is used: a lone slow step would keep its kind from being chosen again
    STALE = 256  # steps after which a cost is measured again (contexts grow, the expert cache changes)

    def tick(self) -> None:
        self.steps += 1

    def _stale(self, when: int) -> bool:
        return self.steps - when > self.STALE

    def add(self, rows: int, fed: int, seconds: float) -> None:
        got, when = self.samples.get((rows, fed), (None, 0))
        if got is None or self._stale(when):  # a stale cost is measured afresh
            got = deque(maxlen=self.SAMPLES)
        got.append(seconds)
        self.samples[rows, fed] = (got, self.steps)

    def of(self, rows: int, fed: int) -> float | None:
        got, when = self.samples.get((rows, fed), ((), 0))
        if len(got) < self.TRUSTED or self._stale(when):
            return None
        return float(np.median(got))

    @property
    def seconds(self) -> dict:
        """{(rows, drafts): the cost of such a step}, for what has been measured enough."""
        return {key: float(np.median(got)) for key, (got, _) in self.samples.items() if len(got) >= self.TRUSTED}


class Event(NamedTuple):
    request: Request
    token: int | None  # None: the request ended (request.finish says why)
    logprob: tuple | None = None  # (logprob, [(id, logprob), ...]) when the request asked for logprobs


@dataclass
class Stats:
    """Counters since the scheduler was built: tokens and the expert cache's hits (host residency)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    expert_lookups: int = 0  # distinct (layer, expert) uses per decode step, summed
    expert_misses: int = 0
    mtp_drafts: int = 0  # MTP greedy drafts compared with the token then sampled
    mtp_accepted: int = 0
    verify_steps: int = 0  # speculative decoding: verify steps (also counted in decode_steps)
    catch_ups: int = 0  # MTP drafts: catch_up and resume programs run (the head over the pairs plain steps kept)
    drafts_fed: int = 0  # drafts fed to verify steps, summed over their sequences
    drafts_accepted: int = 0

    @property
    def hit_rate(self) -> float | None:
        return None if not self.expert_lookups else 1.0 - self.expert_misses / self.expert_lookups

    @property
    def mtp_acceptance(self) -> float | None:
        return None if not self.mtp_drafts else self.mtp_accepted / self.mtp_drafts

    @property
    def draft_acceptance(self) -> float | None:
        return None if not self.drafts_fed else self.drafts_accepted / self.drafts_fed


@dataclass(eq=False)
class _Flight:
    """A dispatched program whose output the scheduler has not read yet."""

    pending: Pending
    owners: tuple  # decode: the request in each slot when it was dispatched (None: no one)
    first_of: Request | None = None  # prefill: the request whose first token it sampled
    fed: int = 1  # decode: positions per sequence it may feed (K+1 for a verify step)
    cost_key: tuple | None = None  # decode: (rows, most drafts a sequence may feed), when it ran back to back
    earlier: tuple = ()  # prefill: the prompt's earlier chunks, read with it only for their status checks


class Scheduler:
    def __init__(self, runner: Runner, plan, vocab_size: int):
        self.runner, self.plan, self.vocab_size = runner, plan, vocab_size
        self.max_batch, self.max_seq_len = plan.max_batch, plan.max_seq_len
        # decode buckets: a step computes the first `rows` slots only, the smallest bucket that holds every
        # running request (new requests take the lowest free slot), so a lone request costs a batch of one
        self.buckets = sorted({min(1 << i, self.max_batch) for i in range(self.max_batch.bit_length() + 1)})
        # and context buckets: it attends to the first `span` positions, the smallest bucket past every running
        # request's new token (attention reads every position of its span, whatever the sequences' lengths)
        self.spans = context_spans(self.max_seq_len, plan.page_size)
        self.chunk = plan.prefill_chunk
        # prefill buckets: a prompt's last piece (a short prompt's only one) takes the smallest that holds it,
        # so that a 67-token prompt does not compute a chunk of thousands of rows (plain prefills; with
        # logprobs or scoring, the whole chunk)
        self.prefill_buckets = sorted({min(SHORT_CHUNK, self.chunk), self.chunk})
        self.k = runner.setup.draft_tokens  # speculative decoding: drafts per verify step (0: off)
        # MTP drafts: the head's chained drafts write K - 1 positions past the sequence's new last token
        self.chain = self.k - 1 if runner.setup.speculative == "mtp" else 0
        # and their plain steps keep pairs for the head: plain steps since it last ran over every slot's
        self.lagging = runner.setup.head_lags
        self.lag = 0
        self.mask_words = -(-vocab_size // 32)
        self._all_allowed = np.full(self.mask_words, -1, np.int32)
        self.stats = Stats()
        self.costs = StepCosts()
        # the draft positions' acceptance a new request starts from: the ended requests' (half each), since a
        # short request would otherwise spend its first steps finding what the last one knew
        self.spec_prior = [1.0] * self.k
        self._last_result = (0, 0.0)  # (programs compiled, time) when the latest decode step's result was read
        self.pending: deque[Request] = deque()
        self.running: list[Request] = []  # decoding (prefilled) and not finished
        self.prefilling: Request | None = None  # admitted, its prompt's chunks not all dispatched yet
        self._chunks_left: Iterator | None = None  # its chunks still to dispatch (see _prefill)
        self._earlier_chunks: list[Pending] = []  # the outputs of its chunks dispatched so far
        self._in_flight: deque[_Flight] = deque()
        self._reset_slots()

    def _reset_slots(self) -> None:
        self.free_pages = list(range(self.plan.num_pages - 1, -1, -1))
        self.free_slots = list(range(self.max_batch - 1, -1, -1))
        self._owner: list[Request | None] = [None] * self.max_batch

    @property
    def idle(self) -> bool:
        return not self.pending and not self.running and self.prefilling is None and not self._in_flight

    def compile_counts(self) -> dict[str, int]:
        return self.runner.compile_counts()

    def programs(self, serving: bool = True) -> list:
        """The programs plain generation of one request runs, or (serving) all that step() and its helpers may
        run: every decode bucket (batch size x context), plain and rich."""
        base = [("admit", None), ("release", None)] + [("prefill", Want(), b) for b in self.prefill_buckets]
        extra = (("verify",) if self.k else ()) + (LAG_PROGRAMS if self.lagging else ())
        if not serving:
            return base + [(name, PLAIN, 1, span) for span in self.spans for name in ("decode",) + extra]
        verify = [("verify", want, rows, span) for rows in self.buckets for want in (PLAIN, VERIFY_RICH)
                  for span in self.spans] if self.k else []
        catch_up = [(name, None, rows, span) for rows in self.buckets for span in self.spans
                    for name in LAG_PROGRAMS if self.lagging]
        return base + [("prefill", Want(logprobs=True)), ("prefill", Want(score=True))] + [
            ("decode", want, rows, span) for rows in self.buckets for want in (PLAIN, RICH)
            for span in self.spans] + verify + catch_up

    def warm_up(self, serving: bool = True) -> dict[str, float]:
        """Compile the programs serving (or plain generation) uses, side by side, and allocate the state (KV
        cache, expert caches; 0.6 s of op-by-op work for the bundled model on the CPU, which the first request
        paid before); returns each program's seconds."""
        programs = self.programs(serving)
        seconds = self.runner.compile(programs)
        self._check_workspace(programs)
        self.runner.allocate()
        return seconds

    def _check_workspace(self, programs) -> None:
        """Warn when a compiled program's temporaries exceed the workspace the planner reserved for them: the
        planner's figure is an estimate, and past it the expert cache and the temporaries may not both fit."""
        planned = self.plan.reserved.get("workspace")
        temps = [(t, p) for p in programs if (t := self.runner.temp_bytes(*p)) is not None]
        t, p = max(temps, key=lambda tp: tp[0], default=(0, None))
        if planned and t > planned:
            log.warning("program %s needs %.2f GiB of temporaries, more than the %.2f GiB workspace the planner "
                        "reserved: lower prefill_chunk or vram_budget if the device runs out of memory", p[0],
                        t / 2**30, planned / 2**30)

    # ----- requests ---------------------------------------------------------------------------------------------
    def pages_for(self, req: Request) -> int:
        """KV pages for the prompt and the allowance. The step computed after a request's last one (overlap)
        feeds the last token, so it writes position len(prompt) + max_new_tokens - 1: still inside."""
        return math.ceil((len(req.prompt) + req.max_new_tokens) / self.plan.page_size)

    def submit(self, req: Request) -> None:
        if self.pages_for(req) > self.plan.num_pages:
            raise ValueError(f"request needs {len(req.prompt) + req.max_new_tokens} tokens of KV cache; the engine "
                             f"holds {self.plan.kv_tokens}")
        self.pending.append(req)

    def cancel(self, req: Request) -> list[Event]:
        """Stop a request now (between steps): no token of it is returned after this; its slot and pages are
        freed (the device may still compute it in a step already dispatched, whose token is dropped)."""
        if req.finish is not None:
            return []
        if req in self.pending:
            self.pending.remove(req)
        return [self._end(req, "cancelled")]

    def _admit(self, req: Request) -> None:
        req.spec = Spec(self.k, list(self.spec_prior)) if self.k else None
        req.slot = min(self.free_slots)
        self.free_slots.remove(req.slot)
        n = self.pages_for(req)
        req.pages = [self.free_pages.pop() for _ in range(n)]
        row = np.full(self.runner.setup.max_pages, self.plan.num_pages, np.int32)  # num_pages: not owned
        row[:n] = req.pages
        self._owner[req.slot] = req
        self.runner.admit(req.slot, row, req.sampling)

    def _free(self, req: Request) -> None:
        if req.slot >= 0:
            self.runner.release(req.slot)
            self._owner[req.slot] = None
            self.free_slots.append(req.slot)
            self.free_pages.extend(req.pages)
        req.slot, req.pages = -1, []

    def _end(self, req: Request, why: str) -> Event:
        req.finish = why
        if req.spec is not None and req.spec.fed_any:  # what its drafts taught, for the next requests
            self.spec_prior = [p + 0.5 * (r - p) for p, r in zip(self.spec_prior, req.spec.rates)]
        self._free(req)
        if req in self.running:
            self.running.remove(req)
        if req is self.prefilling:
            self.prefilling, self._chunks_left, self._earlier_chunks = None, None, []
        return Event(req, None)

    def _mask_row(self, req: Request) -> np.ndarray:
        if req.constraint is None:
            return self._all_allowed
        row = np.zeros(self.mask_words, np.int32)
        req.constraint.mask(row)
        return row

    # ----- prefill ----------------------------------------------------------------------------------------------
    def _chunks(self, tokens: Sequence[int], after: int = 0, buckets: Sequence[int] | None = None):
        """(start, piece, padded buffer, last?, the token after the piece) per prefill chunk; each buffer is the
        smallest of `buckets` (default: the chunk alone) that holds its piece."""
        c = self.chunk
        buckets = buckets or [c]
        for start in range(0, len(tokens), c):
            piece = tokens[start : start + c]
            buf = np.zeros(next(b for b in buckets if b >= len(piece)), np.int32)
            buf[: len(piece)] = piece
            end = start + len(piece)
            yield start, piece, buf, end >= len(tokens), tokens[end] if end < len(tokens) else after

    def _score_prompt(self, req: Request) -> None:
        """Prefill all prompt tokens but the last with per-position scoring: the log-probability of each next
        prompt token, and the top alternatives."""
        body = req.prompt[:-1]
        out: list = [None]
        n_top = req.echo_logprobs or 0
        for start, piece, buf, _, follow in self._chunks(body, after=req.prompt[-1]):
            targets = np.zeros(self.chunk, np.int32)
            seg = req.prompt[start + 1 : start + 1 + len(piece)]
            targets[: len(seg)] = seg
            lp = self.runner.prefill(req.slot, buf, len(piece), False, self._all_allowed, follow, Want(score=True),
                                     targets).result().prompt_logprobs
            for i in range(len(piece)):
                out.append((float(lp.chosen[i]), [(int(a), float(b)) for a, b in
                                                   zip(lp.top_ids[i, :n_top], lp.top[i, :n_top])]))
        req.prompt_logprobs = out

    def _prefill(self, req: Request) -> Iterator[tuple[Pending, bool]]:
        """Dispatch the prompt's chunks, one per next() (yielding each output and whether it was the last); the
        last samples the first token (read when its flight is processed). Prompt scoring (echo) runs first, at
        once."""
        tokens = req.prompt
        if req.echo_logprobs is not None:
            self._score_prompt(req)
            tokens = req.prompt[-1:]
        mask = self._mask_row(req)
        want = Want(logprobs=req.logprobs is not None)
        for _, piece, buf, last, follow in self._chunks(tokens, buckets=self.prefill_buckets if want == Want()
                                                        else None):
            yield self.runner.prefill(req.slot, buf, len(piece), last, mask, follow, want), last

    def _admit_next(self) -> list[Event]:
        req = self.pending.popleft()
        try:
            self._admit(req)
            if req.max_new_tokens == 0:  # prompt scoring only
                self._score_prompt(req)
                self.stats.prompt_tokens += len(req.prompt)
                return [self._end(req, "length")]
        except Exception as e:  # noqa: BLE001 -- this request fails alone; the state is rebuilt if lost
            req.error = f"{type(e).__name__}: {e}"
            return [self._end(req, "error")] + self._recover()
        self.prefilling, self._chunks_left = req, self._prefill(req)
        return []

    def _prefill_next(self) -> list[Event]:
        """Dispatch the next chunk of the request being prefilled; after its last, it decodes."""
        req = self.prefilling
        try:
            pending, last = next(self._chunks_left)
        except Exception as e:  # noqa: BLE001 -- this request fails alone; the state is rebuilt if lost
            req.error = f"{type(e).__name__}: {e}"
            return [self._end(req, "error")] + self._recover()
        if not last:  # kept: a chunk's expert-cache and PLE status words are checked when its output is read
            self._earlier_chunks.append(pending)
            return []
        self.prefilling, self._chunks_left = None, None
        self.stats.prompt_tokens += len(req.prompt)
        self.running.append(req)
        earlier, self._earlier_chunks = tuple(self._earlier_chunks), []
        self._in_flight.append(_Flight(pending, (), first_of=req, earlier=earlier))
        return []

    # ----- the loop -----------------------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """Admit the next waiting request if it fits and none is being prefilled, dispatch the next chunk of the
        one being prefilled, then one decode step for every running request; then read what earlier steps
        produced. One prefill chunk per step: a burst of arrivals or a long prompt does not stall the running
        sequences for whole prefills."""
        events: list[Event] = []
        if (self.prefilling is None and self.pending and self.free_slots
                and self.pages_for(self.pending[0]) <= len(self.free_pages)):
            events += self._admit_next()
        chunk = self.prefilling is not None
        if chunk:
            events += self._prefill_next()
        overlap = not any(r.constraint is not None for r in self.running)
        if not overlap:  # each grammar mask depends on the token before it
            events += self._drain()
        dispatched = bool(self.running) and self._dispatch_decode(events, timed=not chunk)
        keep = 1 if dispatched and overlap else 0
        while len(self._in_flight) > keep:
            events += self._process(self._in_flight.popleft())
        return events

    def _dispatch_decode(self, events: list, timed: bool = True) -> bool:
        """timed: no prefill chunk was dispatched since the last decode step (StepCosts times the intervals
        between decode steps run back to back)."""
        rich = any(r.logprobs is not None or r.constraint is not None or r.sampling.filtered for r in self.running)
        top = max(r.slot for r in self.running) + 1
        rows = next(b for b in self.buckets if b >= top)
        caps = np.zeros(rows, np.int32)
        if self.k and not any(r.constraint is not None for r in self.running):
            cost = lambda n: self.costs.of(rows, n)  # noqa: E731
            for r in self.running:  # no proposal in the latest step read: likely none now (one step stale)
                caps[r.slot] = r.spec.choose(cost) if r.proposed else 0
        fed = self.k + 1 if caps.any() else 1  # positions this step may feed per sequence
        need = min(max(len(r.prompt) + r.decoded + fed + self.chain for r in self.running), self.max_seq_len)
        span = next(s for s in self.spans if s >= need)
        # the MTP head over the pairs plain steps kept: when they fill, or before a verify step (which needs its
        # KV whole, and drafts from the last pair: resume)
        catch_up = self.lagging and catch_up_due(self.lag, fed > 1)
        try:
            if catch_up:
                self.runner.catch_up(rows=rows, span=span, draft=fed > 1)
                self.lag = 0
                self.stats.catch_ups += 1
            if fed > 1:  # no request in the batch has a grammar (caps above), so `rich` is logprobs or filters
                want = VERIFY_RICH if rich else PLAIN
                pending = self.runner.verify(caps, want, rows=rows, span=span)
            elif rich:
                masks = np.full((rows, self.mask_words), -1, np.int32)
                for r in self.running:
                    if r.constraint is not None:
                        masks[r.slot] = self._mask_row(r)
                pending = self.runner.decode(RICH, masks, rows=rows, span=span)
            else:
                pending = self.runner.decode(PLAIN, rows=rows, span=span)
        except Exception as e:  # noqa: BLE001 -- a step that cannot run fails the requests in it
            events += self._fail(list(self.running), e)
            return False
        for r in self.running:
            r.decoded += fed  # corrected by what the step kept, once it is read
        self.lag += self.lagging and fed == 1
        back_to_back = timed and not catch_up and bool(self._in_flight) and self._in_flight[-1].first_of is None
        self._in_flight.append(_Flight(pending, tuple(self._owner[:rows]), fed=fed,
                                       cost_key=(rows, int(caps.max())) if back_to_back else None))
        return True

    def _drain(self) -> list[Event]:
        events = []
        while self._in_flight:
            events += self._process(self._in_flight.popleft())
        return events

    def _process(self, flight: _Flight) -> list[Event]:
        """Read a flight's output and turn it into events for the requests still waiting for it."""
        owners = (flight.first_of,) if flight.first_of is not None else flight.owners
        try:
            for chunk in flight.earlier:
                chunk.result()
            out = flight.pending.result()
        except Exception as e:  # noqa: BLE001 -- the program failed on the device: so do its requests
            return self._fail([r for r in owners if r is not None and r.finish is None], e)
        if flight.first_of is not None:
            req = flight.first_of
            if req.finish is not None:
                return []
            if out.proposed is not None:
                req.proposed = int(out.proposed)
            return self._accept(req, int(out.tokens), _logprob_row(out, None, req), _draft(out, None))
        self.costs.tick()
        programs, now = self.runner.programs_built, time.perf_counter()
        last_programs, last_time = self._last_result
        if flight.cost_key is not None and programs == last_programs:  # no compilation in the interval
            self.costs.add(*flight.cost_key, now - last_time)
        self._last_result = (programs, now)
        self.stats.decode_steps += 1
        if out.expert_lookups is not None:
            self.stats.expert_misses += int(out.expert_misses)
            self.stats.expert_lookups += int(out.expert_lookups)
        events = []
        if out.accepted is not None:  # a verify step: 1 to K+1 tokens per sequence
            self.stats.verify_steps += 1
            for slot, req in enumerate(flight.owners):
                if req is None or req.finish is not None:
                    continue
                kept, fed = int(out.accepted[slot]), int(out.n_draft[slot])
                req.proposed = int(out.proposed[slot])
                self.stats.drafts_fed += fed
                self.stats.drafts_accepted += kept
                req.spec.step(fed, kept)
                req.decoded -= flight.fed - (kept + 1)
                for i in range(kept + 1):
                    events += self._accept(req, int(out.tokens[slot, i]), _logprob_row(out, (slot, i), req), None)
                    if req.finish is not None:
                        break
            return events
        for slot, req in enumerate(flight.owners):
            if req is not None and req.finish is None:
                if out.proposed is not None:
                    req.proposed = int(out.proposed[slot])
                if req.spec is not None:  # a plain step counts down a cap of 0 too
                    req.spec.step(0, 0)
                events += self._accept(req, int(out.tokens[slot]), _logprob_row(out, slot, req), _draft(out, slot))
        return events

    def _accept(self, req: Request, tok: int, lp, draft: int | None) -> list[Event]:
        """Record a sampled token; the events it makes (the token, and the end if the request is done).
        draft: the MTP head's guess of the token after this one."""
        if req.draft is not None and req.out:  # the guess made one step ago, against what was sampled now
            self.stats.mtp_drafts += 1
            self.stats.mtp_accepted += int(tok == req.draft)
        req.draft = draft
        if tok in req.stop:
            return [self._end(req, "stop")]
        req.out.append(tok)
        self.stats.generated_tokens += 1
        events = [Event(req, tok, lp)]
        done = None
        if req.constraint is not None:
            req.constraint.accept(tok)
            if req.constraint.finished():
                done = "stop"
        if done is None and len(req.out) >= req.max_new_tokens:
            done = "length"
        if done:
            events.append(self._end(req, done))
        return events

    def _fail(self, reqs: list[Request], e: Exception) -> list[Event]:
        events = []
        for r in reqs:
            r.error = f"{type(e).__name__}: {e}"
            events.append(self._end(r, "error"))
        return events + self._recover()

    def _recover(self) -> list[Event]:
        """After a failed program: if the donated state was lost, start a fresh one (running requests end)."""
        if not self.runner.state_lost():
            return []
        events = []
        for r in list(self.running) + ([self.prefilling] if self.prefilling is not None else []):
            r.error = r.error or "the engine state was lost by a failed step"
            events.append(self._end(r, "error"))
        self._in_flight.clear()
        self.lag = 0
        self.runner.reset()
        self._reset_slots()
        return events

    def run(self, requests: Sequence[Request]) -> Iterator[Event]:
        """Serve the requests to completion, yielding their events."""
        for r in requests:
            self.submit(r)
        while not self.idle:
            yield from self.step()

    # ----- for tests and scoring ------------------------------------------------------------------------------
    def step_logits(self, prompt: Sequence[int], steps: int):
        """Prefill `prompt`, then run `steps` greedy decode steps, each read before the next. Returns (tokens
        [steps + 1], logits [steps + 1, V], MTP draft logits [steps + 1, V] or None): row 0 is what the prefill
        produced for the prompt's last token, row i the i-th decode step's; tokens[i] is the greedy pick of row
        i, and draft row i guesses the token after tokens[i]."""
        (req,) = self.make_requests([list(prompt)], max_new_tokens=steps + 1, temperature=0.0, top_p=1.0, top_k=0,
                                    min_p=0.0, seed=0, stop=None, eos_ids=(), ignore_eos=True)
        if not self.idle or not self.free_slots or self.pages_for(req) > len(self.free_pages):
            raise RuntimeError("step_logits needs an idle scheduler")
        self._admit(req)
        toks, logits, drafts = [], [], []
        try:
            for _, piece, buf, last, follow in self._chunks(req.prompt):
                pending = self.runner.prefill(req.slot, buf, len(piece), last, self._all_allowed, follow,
                                              Want(logits=True))
            outs = [(None, pending.result())]
            outs += [(req.slot, self.runner.decode(Want(logits=True)).result()) for _ in range(steps)]
        finally:
            self._free(req)
        for slot, out in outs:
            row = (lambda a: a) if slot is None else (lambda a: a[slot])
            toks.append(int(row(out.tokens)))
            logits.append(row(out.logits))
            if out.draft_logits is not None:
                drafts.append(row(out.draft_logits))
        return toks, np.stack(logits), np.stack(drafts) if drafts else None

    def make_requests(self, prompts, *, max_new_tokens, temperature, top_p, top_k, min_p, seed, stop,
                      eos_ids: Sequence[int], ignore_eos: bool) -> list[Request]:
        """Validate the inputs (a clear error before anything runs) and build the requests."""
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of token-id lists")
        n = len(prompts)

        def per(name, v):
            if isinstance(v, (list, tuple)):
                if len(v) != n:
                    raise ValueError(f"{name} has {len(v)} entries for {n} prompts")
                return list(v)
            return [v] * n

        vocab = self.vocab_size
        stops = [None] * n if stop is None else (
            [stop] * n if not stop or not isinstance(stop[0], (list, tuple)) else per("stop", stop))
        reqs = []
        for i, (p, m, t, tp, tk, mp, sd, st) in enumerate(zip(
                prompts, per("max_new_tokens", max_new_tokens), per("temperature", temperature),
                per("top_p", top_p), per("top_k", top_k), per("min_p", min_p), per("seed", seed), stops)):
            p = self.check_prompt(p, f"prompt {i}")
            if int(m) != m or m < 1:
                raise ValueError(f"max_new_tokens must be a positive integer, got {m}")
            stop_ids = set() if ignore_eos else set(eos_ids)
            for s in st or ():
                if int(s) != s or not 0 <= s < vocab:
                    raise ValueError(f"stop token {s!r} is not a token id in [0, {vocab})")
                stop_ids.add(int(s))
            sp = SamplingParams(float(t), int(tk), float(tp), float(mp),
                                int(sd) if sd is not None else int(np.random.SeedSequence().entropy % 2**32))
            reqs.append(Request(i, p, min(int(m), self.max_seq_len - len(p)), sp, frozenset(stop_ids)))
        return reqs

    def check_prompt(self, p, what: str = "the prompt") -> list[int]:
        """A prompt as a list of ints, or ValueError saying what is wrong with it."""
        if isinstance(p, (str, bytes)) or not hasattr(p, "__len__") or len(p) == 0:
            raise ValueError(f"{what} must be a non-empty list of token ids")
        arr = np.asarray(p)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ValueError(f"{what} must be a flat list of integer token ids")
        vocab = self.vocab_size
        if arr.min() < 0 or arr.max() >= vocab:
            raise ValueError(f"{what}: token id out of range [0, {vocab})")
        if len(p) >= self.max_seq_len:
            raise ValueError(f"{what} has {len(p)} tokens; the context holds {self.max_seq_len} "
                             "(the engine's max_seq_len)")
        return [int(x) for x in arr]


def _logprob_row(out: StepOutput, slot, req: Request) -> tuple | None:
    """(logprob, [(id, logprob), ...]) of one sampled token, when the request asked for logprobs. slot: None
    (prefill), the slot (decode) or (slot, position) (verify)."""
    if req.logprobs is None or out.logprobs is None:
        return None
    lp = out.logprobs if slot is None else jax.tree.map(lambda a: a[slot], out.logprobs)
    n = req.logprobs
    return float(lp.chosen), [(int(a), float(b)) for a, b in zip(lp.top_ids[:n], lp.top[:n])]


def _draft(out: StepOutput, slot: int | None) -> int | None:
    if out.drafts is None:
        return None
    return int(out.drafts if slot is None else out.drafts[slot])
