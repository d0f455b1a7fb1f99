"""Generation: a scheduler over the compiled programs of step.py.

Up to `max_batch` sequences run at once, one per batch slot. A request is admitted when a slot and enough KV
pages for its prompt plus its token allowance are free (pages are reserved up front, so a running sequence
never runs out of cache); its prompt is prefilled in chunks; then it joins the batched decode steps until a
stop token, its max_new_tokens or the context end. The only host synchronisation per step is reading back the
sampled tokens (and the FFI status words that travel with them).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import ffi
from . import step as step_mod
from .sampling import SamplingParams, SamplingRows


@dataclass
class Request:
    index: int
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop: frozenset
    out: list[int] = field(default_factory=list)
    finish: str | None = None  # "stop", "length"
    slot: int = -1
    pages: list[int] = field(default_factory=list)


@dataclass
class Stats:
    """Counters since the generator was built: tokens and the expert cache's hits (host residency)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    expert_lookups: int = 0  # distinct (layer, expert) uses per decode step, summed
    expert_misses: int = 0

    @property
    def hit_rate(self) -> float | None:
        return None if not self.expert_lookups else 1.0 - self.expert_misses / self.expert_lookups


class Generator:
    def __init__(self, params, ctx: step_mod.StepContext, plan, dtype):
        self.params, self.ctx, self.plan = params, ctx, plan
        self.max_batch, self.max_seq_len = plan.max_batch, plan.max_seq_len
        self.chunk = plan.prefill_chunk
        self.state = step_mod.init_state(params, ctx, plan.max_batch, plan.num_pages, dtype)
        self.free_pages = list(range(plan.num_pages - 1, -1, -1))
        self.free_slots = list(range(plan.max_batch - 1, -1, -1))
        self.stats = Stats()
        self._decode = jax.jit(lambda p, st: step_mod.decode_step(p, ctx, st), donate_argnums=1)
        self._prefill = jax.jit(lambda p, st, slot, tok, n, last: step_mod.prefill_step(p, ctx, st, slot, tok, n, last),
                                donate_argnums=1)
        self._decode_logits = jax.jit(lambda p, st: step_mod.decode_step(p, ctx, st, True), donate_argnums=1)
        self._prefill_logits = jax.jit(
            lambda p, st, slot, tok, n, last: step_mod.prefill_step(p, ctx, st, slot, tok, n, last, True),
            donate_argnums=1)
        self._admit = jax.jit(lambda st, slot, pages, samp: step_mod.admit(ctx, st, slot, pages, samp),
                              donate_argnums=0)
        self._release = jax.jit(step_mod.release, donate_argnums=0)

    # ----- bookkeeping ----------------------------------------------------------------------------------------
    def compile_counts(self) -> dict[str, int]:
        """How many programs each jitted entry point has compiled (constant once warm)."""
        return {n: getattr(self, n)._cache_size() for n in ("_decode", "_prefill", "_admit", "_release")}

    def _check(self, info) -> None:
        if "ple" in info:
            ffi.check_ple_info(info["ple"])
        if "resolve" in info:
            ffi.check_info(info["resolve"], num_slots=self.ctx.host.slots, num_experts=self.ctx.cfg.num_experts)

    def _pages_for(self, req: Request) -> int:
        return math.ceil((len(req.prompt) + req.max_new_tokens) / self.plan.page_size)

    def _admit_one(self, req: Request) -> None:
        req.slot = self.free_slots.pop()
        n = self._pages_for(req)
        req.pages = [self.free_pages.pop() for _ in range(n)]
        row = np.zeros(self.ctx.max_pages, np.int32)
        row[:n] = req.pages
        self.state = self._admit(self.state, jnp.int32(req.slot), jnp.asarray(row), SamplingRows.of(req.sampling))

    def _finish(self, req: Request, why: str) -> None:
        req.finish = why
        self.state = self._release(self.state, jnp.int32(req.slot))
        self.free_slots.append(req.slot)
        self.free_pages.extend(req.pages)
        req.slot, req.pages = -1, []

    def _prefill_all(self, req: Request) -> int:
        """Run the prompt through in chunks; returns the first sampled token."""
        p = req.prompt
        c = self.chunk
        tok = None
        for start in range(0, len(p), c):
            piece = p[start : start + c]
            buf = np.zeros(c, np.int32)
            buf[: len(piece)] = piece
            last = start + c >= len(p)
            self.state, tok, info = self._prefill(self.params, self.state, jnp.int32(req.slot), jnp.asarray(buf),
                                                  jnp.int32(len(piece)), jnp.asarray(last))
        tok = int(tok)  # the read-back that ends the prefill
        self._check(info)
        self.stats.prompt_tokens += len(p)
        return tok

    def _accept(self, req: Request, tok: int) -> bool:
        """Record a sampled token; True when the request is finished."""
        if tok in req.stop:
            self._finish(req, "stop")
            return True
        req.out.append(tok)
        self.stats.generated_tokens += 1
        if len(req.out) >= req.max_new_tokens:
            self._finish(req, "length")
            return True
        return False

    # ----- the loop -------------------------------------------------------------------------------------------
    def run(self, requests: Sequence[Request]) -> Iterator[tuple[Request, int | None]]:
        """Serve the requests; yields (request, token) for each generated token and (request, None) when a
        request finishes."""
        pending = deque(requests)
        running: list[Request] = []
        while pending or running:
            while pending and self.free_slots and self._pages_for(pending[0]) <= len(self.free_pages):
                req = pending.popleft()
                self._admit_one(req)
                tok = self._prefill_all(req)
                done = self._accept(req, tok)
                if req.out and not (done and req.finish == "stop"):
                    yield req, req.out[-1]
                if done:
                    yield req, None
                else:
                    running.append(req)
            if not running:
                if pending:  # cannot happen: a lone request always fits (checked on submission)
                    raise RuntimeError("a request does not fit the KV cache even alone")
                break
            self.state, toks, info = self._decode(self.params, self.state)
            toks = np.asarray(toks)
            self._check(info)
            self.stats.decode_steps += 1
            if "resolve" in info:
                ri = np.asarray(info["resolve"])
                self.stats.expert_misses += int(ri[:, 0].sum())
                self.stats.expert_lookups += int(ri[:, 1].sum())
            still = []
            for req in running:
                tok = int(toks[req.slot])
                done = self._accept(req, tok)
                if req.finish != "stop":
                    yield req, tok
                if done:
                    yield req, None
                else:
                    still.append(req)
            running = still

    def step_logits(self, prompt: Sequence[int], steps: int) -> tuple[list[int], np.ndarray]:
        """Prefill `prompt`, then run `steps` greedy decode steps. Returns (tokens [steps + 1], logits
        [steps + 1, V]): row 0 is what the prefill produced for the prompt's last token, row i the i-th decode
        step's; tokens[i] is the greedy pick of row i. For tests and scoring."""
        (req,) = self.make_requests([list(prompt)], max_new_tokens=steps + 1, temperature=0.0, top_p=1.0, top_k=0,
                                    min_p=0.0, seed=0, stop=None, eos_ids=(), ignore_eos=True)
        if not self.free_slots or self._pages_for(req) > len(self.free_pages):
            raise RuntimeError("step_logits needs an idle generator")
        self._admit_one(req)
        out, toks = [], []
        try:
            c = self.chunk
            for start in range(0, len(req.prompt), c):
                piece = req.prompt[start : start + c]
                buf = np.zeros(c, np.int32)
                buf[: len(piece)] = piece
                self.state, tok, info, logits = self._prefill_logits(
                    self.params, self.state, jnp.int32(req.slot), jnp.asarray(buf), jnp.int32(len(piece)),
                    jnp.asarray(start + c >= len(req.prompt)))
            self._check(info)
            out.append(np.asarray(logits))
            toks.append(int(tok))
            for _ in range(steps):
                self.state, tok_b, info, logits = self._decode_logits(self.params, self.state)
                self._check(info)
                out.append(np.asarray(logits)[req.slot])
                toks.append(int(np.asarray(tok_b)[req.slot]))
        finally:
            self._finish(req, "length")
        return toks, np.stack(out)

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
        seeds = per("seed", seed)
        reqs = []
        for i, (p, m, t, tp, tk, mp, sd, st) in enumerate(zip(
                prompts, per("max_new_tokens", max_new_tokens), per("temperature", temperature),
                per("top_p", top_p), per("top_k", top_k), per("min_p", min_p), seeds, stops)):
            if isinstance(p, (str, bytes)) or not hasattr(p, "__len__") or len(p) == 0:
                raise ValueError(f"prompt {i} must be a non-empty list of token ids")
            arr = np.asarray(p)
            if arr.ndim != 1 or arr.dtype.kind not in "iu":
                raise ValueError(f"prompt {i} must be a flat list of integer token ids")
            if arr.min() < 0 or arr.max() >= vocab:
                raise ValueError(f"prompt {i}: token id out of range [0, {vocab})")
            if int(m) != m or m < 1:
                raise ValueError(f"max_new_tokens must be a positive integer, got {m}")
            room = self.max_seq_len - len(p)
            if room < 1:
                raise ValueError(f"prompt {i} has {len(p)} tokens; the context holds {self.max_seq_len} "
                                 "(load with a larger max_seq_len)")
            stop_ids = set() if ignore_eos else set(eos_ids)
            for s in st or ():
                if int(s) != s or not 0 <= s < vocab:
                    raise ValueError(f"stop token {s!r} is not a token id in [0, {vocab})")
                stop_ids.add(int(s))
            sp = SamplingParams(float(t), int(tk), float(tp), float(mp),
                                int(sd) if sd is not None else int(np.random.SeedSequence().entropy % 2**32))
            reqs.append(Request(i, [int(x) for x in arr], min(int(m), room), sp, frozenset(stop_ids)))
        return reqs
