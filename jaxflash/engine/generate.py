"""Generation: a continuous-batching scheduler over the compiled programs of step.py.

Up to `max_batch` sequences run at once, one per batch slot. A request is admitted when a slot and enough KV
pages for its prompt plus its token allowance are free (pages are reserved up front, so a running sequence
never runs out of cache); its prompt is prefilled in chunks; then it joins the batched decode steps until a
stop token, its max_new_tokens, the context end, its grammar's end, or cancellation. Requests can be
submitted and cancelled between any two steps (`step()` runs one round: admissions, then one decode step).
The only host synchronisation per step is reading back the sampled tokens (and the FFI status words and, when
asked for, log-probabilities that travel with them).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import ffi
from . import step as step_mod
from .sampling import SamplingParams, SamplingRows


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


class Event(NamedTuple):
    request: Request
    token: int | None  # None: the request ended (request.finish says why)
    logprob: tuple | None = None  # (logprob, [(id, logprob), ...]) when the request asked for logprobs


@dataclass
class Stats:
    """Counters since the generator was built: tokens and the expert cache's hits (host residency)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    expert_lookups: int = 0  # distinct (layer, expert) uses per decode step, summed
    expert_misses: int = 0
    mtp_drafts: int = 0  # MTP greedy drafts compared with the token then sampled
    mtp_accepted: int = 0

    @property
    def hit_rate(self) -> float | None:
        return None if not self.expert_lookups else 1.0 - self.expert_misses / self.expert_lookups

    @property
    def mtp_acceptance(self) -> float | None:
        return None if not self.mtp_drafts else self.mtp_accepted / self.mtp_drafts


class Generator:
    def __init__(self, params, ctx: step_mod.StepContext, plan, dtype):
        self.params, self.ctx, self.plan, self.dtype = params, ctx, plan, dtype
        self.max_batch, self.max_seq_len = plan.max_batch, plan.max_seq_len
        self.chunk = plan.prefill_chunk
        self.mask_words = -(-ctx.cfg.vocab_size // 32)
        self._reset_state()
        self.stats = Stats()
        self.pending: deque[Request] = deque()
        self.running: list[Request] = []
        self._decode = jax.jit(lambda p, st: step_mod.decode_step(p, ctx, st), donate_argnums=1)
        self._decode_rich = jax.jit(lambda p, st, m: step_mod.decode_step(p, ctx, st, masks=m, want_logprobs=True),
                                    donate_argnums=1)
        self._decode_logits = jax.jit(lambda p, st: step_mod.decode_step(p, ctx, st, True), donate_argnums=1)
        self._prefill = jax.jit(lambda p, st, slot, tok, n, last, m, f: step_mod.prefill_step(
            p, ctx, st, slot, tok, n, last, m, f), donate_argnums=1)
        self._prefill_logits = jax.jit(lambda p, st, slot, tok, n, last, m, f: step_mod.prefill_step(
            p, ctx, st, slot, tok, n, last, m, f, True), donate_argnums=1)
        self._prefill_score = jax.jit(lambda p, st, slot, tok, n, nxt, f: step_mod.prefill_step(
            p, ctx, st, slot, tok, n, jnp.asarray(False), None, f, score=nxt), donate_argnums=1)
        self._admit = jax.jit(lambda st, slot, pages, samp: step_mod.admit(ctx, st, slot, pages, samp),
                              donate_argnums=0)
        self._release = jax.jit(step_mod.release, donate_argnums=0)
        self._all_allowed = np.full(self.mask_words, -1, np.int32)

    def _reset_state(self) -> None:
        self.state = step_mod.init_state(self.params, self.ctx, self.plan.max_batch, self.plan.num_pages, self.dtype)
        self.free_pages = list(range(self.plan.num_pages - 1, -1, -1))
        self.free_slots = list(range(self.plan.max_batch - 1, -1, -1))

    # ----- bookkeeping ----------------------------------------------------------------------------------------
    def compile_counts(self) -> dict[str, int]:
        """How many programs each jitted entry point has compiled (constant once warm)."""
        return {n: getattr(self, n)._cache_size() for n in ("_decode", "_decode_rich", "_prefill", "_admit", "_release")}

    @property
    def idle(self) -> bool:
        return not self.pending and not self.running

    def _check(self, info) -> None:
        if "ple" in info:
            ffi.check_ple_info(info["ple"])
        if "resolve" in info:
            ffi.check_info(info["resolve"], num_slots=self.ctx.host.slots, num_experts=self.ctx.cfg.num_experts)

    def pages_for(self, req: Request) -> int:
        return math.ceil((len(req.prompt) + req.max_new_tokens) / self.plan.page_size)

    def _admit_one(self, req: Request) -> None:
        req.slot = self.free_slots.pop()
        n = self.pages_for(req)
        req.pages = [self.free_pages.pop() for _ in range(n)]
        row = np.zeros(self.ctx.max_pages, np.int32)
        row[:n] = req.pages
        self.state = self._admit(self.state, jnp.int32(req.slot), jnp.asarray(row), SamplingRows.of(req.sampling))

    def _free(self, req: Request) -> None:
        if req.slot >= 0:
            self.state = self._release(self.state, jnp.int32(req.slot))
            self.free_slots.append(req.slot)
            self.free_pages.extend(req.pages)
        req.slot, req.pages = -1, []

    def _end(self, req: Request, why: str) -> Event:
        req.finish = why
        self._free(req)
        if req in self.running:
            self.running.remove(req)
        return Event(req, None)

    def _mask_row(self, req: Request) -> np.ndarray:
        if req.constraint is None:
            return self._all_allowed
        row = np.zeros(self.mask_words, np.int32)
        req.constraint.mask(row)
        return row

    def _chunks(self, tokens: Sequence[int], after: int = 0):
        """(start, piece, padded buffer, last?, the token after the piece) per prefill chunk."""
        c = self.chunk
        for start in range(0, len(tokens), c):
            piece = tokens[start : start + c]
            buf = np.zeros(c, np.int32)
            buf[: len(piece)] = piece
            end = start + len(piece)
            yield start, piece, buf, end >= len(tokens), jnp.int32(tokens[end] if end < len(tokens) else after)

    def _score_prompt(self, req: Request) -> None:
        """Prefill all prompt tokens but the last with per-position scoring: the log-probability of each next
        prompt token, and the top alternatives."""
        body = req.prompt[:-1]
        out: list = [None]
        for start, piece, buf, _, follow in self._chunks(body, after=req.prompt[-1]):
            nxt = np.zeros(self.chunk, np.int32)
            seg = req.prompt[start + 1 : start + 1 + len(piece)]
            nxt[: len(seg)] = seg
            self.state, info, (lp, top_id, top_lp) = self._prefill_score(
                self.params, self.state, jnp.int32(req.slot), jnp.asarray(buf), jnp.int32(len(piece)),
                jnp.asarray(nxt), follow)
            self._check(info)
            lp, top_id, top_lp = np.asarray(lp), np.asarray(top_id), np.asarray(top_lp)
            n_top = req.echo_logprobs or 0
            for i in range(len(piece)):
                out.append((float(lp[i]), [(int(a), float(b)) for a, b in zip(top_id[i, :n_top], top_lp[i, :n_top])]))
        req.prompt_logprobs = out

    def _prefill_all(self, req: Request) -> tuple[int, tuple]:
        """Run the prompt through in chunks; returns the first sampled token and its log-probabilities."""
        tokens = req.prompt
        if req.echo_logprobs is not None:
            self._score_prompt(req)
            tokens = req.prompt[-1:]
        mask = jnp.asarray(self._mask_row(req))
        for _, piece, buf, last, follow in self._chunks(tokens):
            self.state, tok, info, lps = self._prefill(self.params, self.state, jnp.int32(req.slot),
                                                       jnp.asarray(buf), jnp.int32(len(piece)), jnp.asarray(last),
                                                       mask, follow)
        tok = int(tok)  # the read-back that ends the prefill
        self._check(info)
        self.stats.prompt_tokens += len(req.prompt)
        if "draft" in info:
            req.draft = int(info["draft"])
        return tok, lps

    def _accept(self, req: Request, tok: int, lps, draft: int | None = None) -> list[Event]:
        """Record a sampled token; the events it makes (the token, and the end if the request is done).
        draft: the MTP head's guess of the token after this one."""
        if req.draft is not None and req.out:  # the guess made one step ago, against what was sampled now
            self.stats.mtp_drafts += 1
            self.stats.mtp_accepted += int(tok == req.draft)
            req.draft = None
        if draft is not None:
            req.draft = draft
        if tok in req.stop:
            return [self._end(req, "stop")]
        req.out.append(tok)
        self.stats.generated_tokens += 1
        lp = None
        if req.logprobs is not None:
            chosen, top_id, top_lp = lps
            n = req.logprobs
            lp = (float(chosen), [(int(a), float(b)) for a, b in zip(top_id[:n], top_lp[:n])])
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

    # ----- the loop -------------------------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        if self.pages_for(req) > self.plan.num_pages:
            raise ValueError(f"request needs {len(req.prompt) + req.max_new_tokens} tokens of KV cache; the engine "
                             f"holds {self.plan.kv_tokens}")
        self.pending.append(req)

    def cancel(self, req: Request) -> list[Event]:
        """Stop a request now (between steps): frees its slot and pages."""
        if req.finish is not None:
            return []
        if req in self.pending:
            self.pending.remove(req)
        return [self._end(req, "cancelled")]

    def step(self) -> list[Event]:
        """Admit the next waiting request if it fits (prefilling its prompt), then one decode step for every
        running request. One admission per step: a burst of arrivals does not stall the running sequences for
        all of its prefills at once, and the first arrival gets its first token after one prefill."""
        events: list[Event] = []
        if self.pending and self.free_slots and self.pages_for(self.pending[0]) <= len(self.free_pages):
            events.extend(self._admit_next())
        if not self.running:
            return events
        rich = any(r.logprobs is not None or r.constraint is not None for r in self.running)
        try:
            if rich:
                masks = np.full((self.max_batch, self.mask_words), -1, np.int32)
                for r in self.running:
                    if r.constraint is not None:
                        masks[r.slot] = self._mask_row(r)
                self.state, toks, info, lps = self._decode_rich(self.params, self.state, jnp.asarray(masks))
                lps = tuple(np.asarray(a) for a in lps)
            else:
                self.state, toks, info = self._decode(self.params, self.state)
            toks = np.asarray(toks)
            self._check(info)
        except Exception as e:  # noqa: BLE001 -- a failed step fails the requests in it
            for r in list(self.running):
                r.error = f"{type(e).__name__}: {e}"
                events.append(self._end(r, "error"))
            events.extend(self._recover())
            return events
        self.stats.decode_steps += 1
        if "resolve" in info:
            ri = np.asarray(info["resolve"])
            self.stats.expert_misses += int(ri[:, 0].sum())
            self.stats.expert_lookups += int(ri[:, 1].sum())
        drafts = np.asarray(info["draft"]) if "draft" in info else None
        for req in list(self.running):
            row = tuple(a[req.slot] for a in lps) if rich else None
            draft = None if drafts is None else int(drafts[req.slot])
            events.extend(self._accept(req, int(toks[req.slot]), row, draft))
        return events

    def _admit_next(self) -> list[Event]:
        req = self.pending.popleft()
        try:
            self._admit_one(req)
            if req.max_new_tokens == 0:  # prompt scoring only
                self._score_prompt(req)
                self.stats.prompt_tokens += len(req.prompt)
                return [self._end(req, "length")]
            tok, lps = self._prefill_all(req)
        except Exception as e:  # noqa: BLE001 -- this request fails alone; the state is rebuilt if lost
            req.error = f"{type(e).__name__}: {e}"
            return [self._end(req, "error")] + self._recover()
        self.running.append(req)
        return self._accept(req, tok, lps)

    def _recover(self) -> list[Event]:
        """After a failed program: if the donated state was lost, start a fresh one (running requests end)."""
        if not any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(self.state)):
            return []
        events = []
        for r in list(self.running):
            r.error = r.error or "the engine state was lost by a failed step"
            events.append(self._end(r, "error"))
        self._reset_state()
        return events

    def run(self, requests: Sequence[Request]) -> Iterator[Event]:
        """Serve the requests to completion, yielding their events."""
        for r in requests:
            self.submit(r)
        while not self.idle:
            yield from self.step()

    def step_logits(self, prompt: Sequence[int], steps: int):
        """Prefill `prompt`, then run `steps` greedy decode steps. Returns (tokens [steps + 1], logits
        [steps + 1, V], MTP draft logits [steps + 1, V] or None): row 0 is what the prefill produced for the
        prompt's last token, row i the i-th decode step's; tokens[i] is the greedy pick of row i, and draft row i
        guesses the token after tokens[i]. For tests and scoring."""
        (req,) = self.make_requests([list(prompt)], max_new_tokens=steps + 1, temperature=0.0, top_p=1.0, top_k=0,
                                    min_p=0.0, seed=0, stop=None, eos_ids=(), ignore_eos=True)
        if not self.idle or not self.free_slots or self.pages_for(req) > len(self.free_pages):
            raise RuntimeError("step_logits needs an idle generator")
        self._admit_one(req)
        out, toks, drafts = [], [], []
        try:
            mask = jnp.asarray(self._all_allowed)
            for _, piece, buf, last, follow in self._chunks(req.prompt):
                self.state, tok, info, _, logits = self._prefill_logits(
                    self.params, self.state, jnp.int32(req.slot), jnp.asarray(buf), jnp.int32(len(piece)),
                    jnp.asarray(last), mask, follow)
            self._check(info)
            out.append(np.asarray(logits))
            toks.append(int(tok))
            if "draft_logits" in info:
                drafts.append(np.asarray(info["draft_logits"]))
            for _ in range(steps):
                self.state, tok_b, info, logits = self._decode_logits(self.params, self.state)
                self._check(info)
                out.append(np.asarray(logits)[req.slot])
                toks.append(int(np.asarray(tok_b)[req.slot]))
                if "draft_logits" in info:
                    drafts.append(np.asarray(info["draft_logits"])[req.slot])
        finally:
            self._free(req)
        return toks, np.stack(out), np.stack(drafts) if drafts else None

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

        vocab = self.ctx.cfg.vocab_size
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
        vocab = self.ctx.cfg.vocab_size
        if arr.min() < 0 or arr.max() >= vocab:
            raise ValueError(f"{what}: token id out of range [0, {vocab})")
        if len(p) >= self.max_seq_len:
            raise ValueError(f"{what} has {len(p)} tokens; the context holds {self.max_seq_len} "
                             "(the engine's max_seq_len)")
        return [int(x) for x in arr]
