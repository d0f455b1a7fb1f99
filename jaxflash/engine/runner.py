"""The runner: the model's weights, the device state of every batch slot, and the compiled programs over them.

Two programs run the model (both are the decoder layers of jaxflash.model.transformer over the state the
runner keeps):
  * a prefill chunk: the next C prompt tokens of one slot; when it holds the prompt's end, it samples the
    slot's first token and starts the slot decoding;
  * a decode step: one token for every decoding slot among the first `rows` (a batch-size bucket); the
    sampled token stays on the device as the next step's input, so the host can dispatch step n+1 before it
    has read step n.
Each is built for a fixed `Want` (which optional outputs it returns) and returns one fixed structure,
`StepOutput`. Two small programs admit a request into a slot and release it.

All state lives in one `DecodeState` that every program donates and returns, so its buffers keep their
addresses from step to step (XLA replays a program's CUDA graph only while the buffers it touches stay put;
docs/engine.md says what still moves). The runner holds the weights and the state as flat lists of arrays,
flattened once: a call hands XLA those lists as they are.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import ffi
from ..config import ModelConfig
from ..kernels import nvfp4_experts
from ..model import mtp as mtp_mod
from ..model.attention import PagedKV
from ..model.base import Array, TokenBatch, acc_dtype, pytree_dataclass, top_k, up
from ..model.gated_deltanet import GDNState
from ..model.moe import ResidentExperts
from ..model.transformer import LayerState, Params, commit_layers, final_logits, forward_layers, init_layer_state
from . import program_store
from . import speculative as spec_mod
from .experts import CachedExperts, ChunkExperts, HostExperts
from .sampling import SamplingParams, SamplingRows, sample, verify
from .speculative import SpecState

log = logging.getLogger("jaxflash")
TOP_LOGPROBS = 20  # alternatives returned per token when logprobs are asked for (OpenAI's maximum)
LAG_PROGRAMS = ("catch_up", "resume")  # the MTP head over the pairs plain steps kept (Setup.head_lags; catch_up)


# ----- state ------------------------------------------------------------------------------------------------
@pytree_dataclass
class SeqState:
    """Per-slot bookkeeping, leading axis = batch slot."""

    lengths: Array  # [B] int32: tokens in the cache
    page_table: Array  # [B, max_pages] int32: the KV pages of each slot (num_pages: none)
    ple_context: Array | None  # [B, 2] int32: the last token ids, for the n-gram hash (PLE models)


@pytree_dataclass
class DecodeState:
    seqs: SeqState
    layers: tuple  # LayerState per decoder layer: GDN rows per slot, attention pages shared through page_table
    experts: CachedExperts | None  # host residency: the VRAM expert caches (decode steps and prefill chunks)
    mtp: LayerState | None  # the MTP layer's KV pages (same page table), when the model has an MTP head
    sampling: SamplingRows
    active: Array  # [B] bool: decoding
    last_token: Array  # [B] int32: the token the next decode step feeds
    spec: SpecState | None = None  # speculative decoding: each slot's tokens and its next drafts
    mtp_lag: spec_mod.HeadLag | None = None  # Setup.head_lags: the pairs plain steps kept for the MTP head


@dataclass(frozen=True, eq=False)
class Setup:
    """What the compiled programs are specialised on."""

    cfg: ModelConfig
    max_batch: int
    num_pages: int
    page_size: int
    max_pages: int  # pages per sequence (max_seq_len / page_size)
    chunk: int  # prompt tokens per prefill chunk
    dtype: Any
    host: HostExperts | None  # None: every routed expert in the parameters
    table: Any = None  # ffi.NgramTable (PLE models)
    hash: Any = None  # ffi.NgramHash
    table_scale: float | None = None  # the FP8 table's global scale
    mtp: bool = False  # run the MTP head's layer over every kept pair (its KV cache), in every step unless
    # head_lags
    routing: Any = None  # a RoutingSource: fixed expert ids for every step instead of the routers' top-k
    expert_kernel: bool | str | None = None  # decode's resident experts by the NVFP4 kernels (None: where they
    # apply; "pallas" / "cuda": that route; host residency: host.kernel and host.route say the same for the slots)
    gdn_kernel: bool = False  # the GDN recurrent part by jaxflash.kernels.gdn_decode (decode steps) and gdn_chunk
    # (prefill chunks); the Engine turns it on on a GPU; elsewhere they run in interpret mode, for tests
    hc_kernel_rows: int = 0  # decode and verify steps of at most this many token rows run their hyper-connection
    # mixes in jaxflash.kernels.hc_mix (the Engine sets hc_mix.FASTER_ROWS on a GPU; elsewhere they run in
    # interpret mode, for tests)
    draft_tokens: int = 0  # speculative decoding: K drafts per sequence in a verify step (0: off)
    speculative: str | None = None  # their proposer: "ngram" or "mtp" (the MTP head chained; needs mtp)
    decode_drafts: bool = False  # plain decode steps also draft the token after next with the head (its logits,
    # for the acceptance statistics; needs mtp). Speculation does not need them: verify steps draft for the
    # next one, and a decode step of an MTP engine keeps its pair for the head (head_lags)
    attention_kernel: bool = False  # decode and verify steps attend in jaxflash.kernels.attention_decode (the
    # Engine turns it on on a GPU; elsewhere it runs in interpret mode, for tests)

    def __post_init__(self):
        if (self.speculative == "mtp" or self.decode_drafts) and not self.mtp:
            raise ValueError("MTP drafts need the MTP head (Setup.mtp)")

    @property
    def head_lags(self) -> bool:
        """Plain decode steps keep their pairs for the MTP head (speculative.HeadLag) instead of running it: an
        MTP engine whose plain steps do not draft. The `catch_up` program runs the head over them; a verify step
        needs the head's KV whole, so the scheduler runs it (as `resume`, which also drafts) before each verify step
        that follows a plain one."""
        return self.speculative == "mtp" and not self.decode_drafts

    @property
    def max_seq_len(self) -> int:
        return self.max_pages * self.page_size


class RoutingSource:
    """Expert ids for the runner's programs, chosen outside the model (routing studies; benchmarks that need
    the routing statistics of real text on a model with random weights). The routers still run and weight
    the given experts (jaxflash.model.moe.given_route). Implement decode_ids and prefill_ids, and verify_ids for a
    runner that speculates:"""

    def decode_ids(self, batch: int):
        """int32 [layers, batch, top_k]: the experts of each slot's token in the next decode step."""
        raise NotImplementedError

    def prefill_ids(self, slot: int, n: int, width: int):
        """int32 [layers, width, top_k]: the experts of a prefill chunk of slot `slot`, whose first n of width
        rows are real tokens (the rest is padding, routed anywhere)."""
        raise NotImplementedError

    def verify_ids(self, batch: int, width: int):
        """int32 [layers, batch * width, top_k]: the experts of a verify step's rows, slot-major (each slot's
        last token, then its width - 1 drafts)."""
        raise NotImplementedError(f"{type(self).__name__} does not route verify steps (no verify_ids)")


def init_state(params: Params, setup: Setup) -> DecodeState:
    """An empty state: no slot active, every page free, empty expert caches."""
    cfg, b = setup.cfg, setup.max_batch
    layers = tuple(init_layer_state(l, cfg, b, setup.dtype, setup.num_pages, setup.page_size)
                   for l in params.layers)
    ctx = jnp.full((b, cfg.ngram_size - 1), cfg.eos_token_id, jnp.int32) if setup.table is not None else None
    seqs = SeqState(lengths=jnp.zeros(b, jnp.int32),
                    page_table=jnp.full((b, setup.max_pages), setup.num_pages, jnp.int32), ple_context=ctx)
    experts = None
    if setup.host is not None:
        experts = CachedExperts.empty(setup.host, cfg.num_hidden_layers)
    mtp = None
    if setup.mtp:
        mtp = init_layer_state(params.mtp.layer, cfg, b, setup.dtype, setup.num_pages, setup.page_size)
    spec = lag = None
    if setup.draft_tokens:
        width = spec_mod.history_width(setup.max_seq_len, setup.chunk, setup.draft_tokens)
        spec = SpecState.empty(b, width if setup.speculative == "ngram" else 0, setup.draft_tokens)
    if setup.head_lags:
        lag = spec_mod.HeadLag.empty(b, cfg.hc_count * cfg.hidden_size, acc_dtype(setup.dtype))
    return DecodeState(seqs, layers, experts, mtp, SamplingRows.init(b), jnp.zeros(b, bool),
                       jnp.zeros(b, jnp.int32), spec, lag)


# ----- outputs ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Want:
    """The optional parts a program is built to compute (and which its StepOutput then holds)."""

    logprobs: bool = False  # log-probability and top alternatives of each sampled token
    logits: bool = False  # the raw logits (and the MTP draft logits): tests, scoring tools
    masks: bool = False  # decode: take per-slot token masks (grammar constraints)
    filters: bool = False  # decode and verify: honour top-k, top-p and min-p (a sort of the vocabulary per row;
    # without it rows sample from their whole distribution, see sampling.sample). Prefill always does.
    score: bool = False  # prefill: log-probabilities of given next tokens at every chunk position


@pytree_dataclass
class LogProbs:
    """Under the model's own distribution (before temperature or masks)."""

    chosen: Array  # [...] log-probability of the token
    top_ids: Array  # [..., TOP_LOGPROBS] int32
    top: Array  # [..., TOP_LOGPROBS]


@pytree_dataclass
class StepOutput:
    """What every program returns. Fields a program was not built for are None."""

    tokens: Array  # decode [B] / prefill [] / verify [B, K+1] int32: the sampled tokens (stale for slots not
    # decoding); a verify step's row b emits tokens[b, :accepted[b] + 1]
    drafts: Array | None  # like tokens: the MTP head's greedy guess of the token after each sampled one
    logprobs: LogProbs | None  # Want.logprobs: of the sampled tokens
    logits: Array | None  # Want.logits: [B, V] / [V] float32
    draft_logits: Array | None  # Want.logits with an MTP head: [B, V] / [V]; verify, MTP drafts: [B, K, V]
    prompt_logprobs: LogProbs | None  # Want.score: [C] for the given next tokens of a prefill chunk
    ple_status: Array | None  # int32[2]: the PLE host step's status words (PLE models)
    cache_status: Array | None  # int32[L, 4]: each layer's resolve status words (host residency)
    expert_misses: Array | None  # int32: experts copied into the VRAM caches by this program (host residency)
    expert_lookups: Array | None  # int32: distinct (layer, expert) uses looked up in them; both None without
    # host experts (constant outputs cost a copy and a transfer each per step)
    accepted: Array | None = None  # verify [B] int32: the drafts each row kept
    n_draft: Array | None = None  # verify [B] int32: the drafts each row fed
    proposed: Array | None = None  # speculation: [B] / prefill [] int32: the drafts proposed for the next step


SCORE_ROWS = 256  # prompt scoring computes the logits of (at most) this many chunk rows at a time


def logprobs_of(logits: Array, tokens: Array) -> LogProbs:
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0]
    top, top_id = top_k(lp, TOP_LOGPROBS)  # in two stages over a vocabulary row: no sort of the whole row
    return LogProbs(chosen, top_id.astype(jnp.int32), top)


def apply_mask(logits: Array, bits: Array) -> Array:
    """Keep the tokens allowed by a packed bitmask bits [..., ceil(V/32)] int32 (token v: bit v%32 of word
    v//32, llguidance's layout); the rest get -inf."""
    v = jnp.arange(logits.shape[-1])
    allowed = (jnp.take(bits, v // 32, axis=-1) >> (v % 32)) & 1
    return jnp.where(allowed != 0, logits, -jnp.inf)


# ----- the programs -----------------------------------------------------------------------------------------
def _ple_rows(setup: Setup, tokens: Array, context: Array | None, n_new: Array):
    """The n-gram rows of the new tokens [b, T] (FFI host step: hash + table lookup), the new context, the
    step's status words; (None, None, None) for a model without PLE. The context may have more rows than
    tokens (a decode bucket passes the whole [max_batch, 2] context, see _first_rows): the rows past b are fed
    nothing and keep their context."""
    if setup.table is None:
        return None, None, None
    b, extra = tokens.shape[0], context.shape[0] - tokens.shape[0]
    if extra:
        tokens = jnp.pad(tokens, ((0, extra), (0, 0)))
        n_new = jnp.pad(n_new, (0, extra))
    with jax.named_scope("ple_host_step"):
        step = ffi.ple_step(tokens, context, setup.table, setup.hash, lengths=n_new)
        rows = up(step.rows[:b])
        if setup.table_scale is not None:
            rows = rows * setup.table_scale
    return rows, step.context, step.info


def _span_table(setup: Setup, page_table: Array, span: int | None) -> Array:
    """The page-table columns of the first `span` positions (a context bucket; None: all)."""
    return page_table if span is None else page_table[:, : span // setup.page_size]


def _step_experts(setup: Setup, st: DecodeState, decode: bool = True):
    """The routed experts' source of a decode or verify step (or a prefill chunk): the VRAM caches, or the
    resident experts (a prefill chunk takes the default paths: expert_kernel names the decode kernels)."""
    if setup.host is not None:
        return st.experts if decode else ChunkExperts(st.experts)
    if not decode:
        return ResidentExperts()
    use, route = nvfp4_experts.expert_kernel_choice(setup.expert_kernel)
    return ResidentExperts({None: "auto", True: "kernel", False: "gather"}[use], route)


def _capacity(setup: Setup, page_table: Array) -> Array:
    """Positions each row may write: its owned pages (ids below num_pages) times the page size."""
    return jnp.sum(page_table < setup.num_pages, axis=-1).astype(jnp.int32) * setup.page_size


def _cache_counts(experts: CachedExperts | None):
    if experts is None:
        return None, None, None
    status = jnp.stack(experts.status)
    return status, jnp.sum(status[:, 0]), jnp.sum(status[:, 1])


def decode_step(params: Params, setup: Setup, want: Want, st: DecodeState, masks: Array | None,
                expert_ids: Array | None, span: int | None = None):
    """One token for every active slot: feeds last_token, samples the next (within masks [B, ceil(V/32)] when
    built with Want.masks; routed to expert_ids [L, B, k] when the runner has a RoutingSource). Slots not
    decoding are computed too (a fixed shape) but change no state. span: the positions attention reads (a
    context bucket: every active slot's new token lies below it; default the whole context), since the
    attention layers' work grows with the keys they read, not with the sequences' lengths."""
    cfg = setup.cfg
    n_new = st.active.astype(jnp.int32)
    batch = TokenBatch.after(st.seqs.lengths, n_new, 1, _span_table(setup, st.seqs.page_table, span))
    fed = st.last_token[:, None]
    rows, context, ple_status = _ple_rows(setup, fed, st.seqs.ple_context, n_new)
    experts = _step_experts(setup, st)
    hc_kernel = fed.size <= setup.hc_kernel_rows
    h, layers, experts, _ = forward_layers(params, cfg, fed, batch, st.layers, experts, rows, expert_ids,
                                           setup.gdn_kernel, hc_kernel, attn_kernel=setup.attention_kernel)
    logits = final_logits(params, cfg, h[:, 0], hc_kernel)
    with jax.named_scope("sampling"):
        lengths = st.seqs.lengths + n_new
        tokens = sample(logits if masks is None else apply_mask(logits, masks), st.sampling, lengths,
                        filters=want.filters)
    drafts = draft_logits = None
    mtp, lag = st.mtp, st.mtp_lag
    if setup.head_lags:  # the pair (state at t, token t+1) kept; the head runs over it before drafts are next made
        lag = spec_mod.keep_pairs(lag, h[:, 0], tokens, st.seqs.lengths, st.active)
    elif setup.mtp:  # the MTP head on (state at t, token t+1): its KV at t, so that a later step's drafts read
        # every pair; with decode_drafts, also its guess of token t+2
        hm, mtp, _ = mtp_mod.mtp_layer(params, cfg, h, tokens[:, None], batch, st.mtp)
        if setup.decode_drafts:
            draft_logits = mtp_mod.mtp_logits(params, cfg, hm[:, 0])
            drafts = spec_mod.greedy(draft_logits)
    spec, proposed = st.spec, None
    if setup.speculative == "mtp":  # no drafts from a plain step: a sequence steps plainly when drafts do not pay
        # for it, and the head's logits (a pass over the vocabulary's weights) and chain cost the most of the
        # head. The resume program drafts for the verify step that follows (catch_up); proposed stays None, so
        # the scheduler keeps what it last read.
        spec = dataclasses.replace(spec, n_draft=jnp.zeros_like(spec.n_draft))
    elif spec is not None:  # the new token into each row's history, and the next verify step's drafts
        spec = spec_mod.advance(spec, lengths, tokens[:, None], lengths, _capacity(setup, st.seqs.page_table),
                                st.active)
        proposed = spec.n_draft
    st = dataclasses.replace(
        st, seqs=SeqState(lengths, st.seqs.page_table, context), layers=layers,
        experts=experts if setup.host is not None else None, mtp=mtp,
        last_token=jnp.where(st.active, tokens, st.last_token), spec=spec, mtp_lag=lag)
    cache_status, misses, lookups = _cache_counts(st.experts)
    out = StepOutput(tokens=tokens, drafts=drafts, logprobs=logprobs_of(logits, tokens) if want.logprobs else None,
                     logits=logits if want.logits else None,
                     draft_logits=draft_logits if want.logits else None, prompt_logprobs=None,
                     ple_status=ple_status, cache_status=cache_status, expert_misses=misses, expert_lookups=lookups,
                     proposed=proposed)
    return st, out


def verify_step(params: Params, setup: Setup, want: Want, st: DecodeState, caps: Array,
                expert_ids: Array | None, span: int | None = None):
    """Speculative decoding: every active slot feeds its last token and its first min(n_draft, caps[b])
    drafts (SpecState), K+1 rows per slot in one pass over the weights; sampling.verify keeps the longest
    accepted prefix plus one token, and the state moves exactly that far: the GDN and PLE states are committed
    after the accepted tokens alone (transformer.commit_layers), the lengths, PLE context and history advance
    by accepted + 1, and the next drafts are proposed. KV rows written for rejected drafts (the MTP head's too)
    lie past the sequence's length, where nothing reads them before they are overwritten. Slots not decoding
    change nothing. expert_ids [L, B*(K+1), k], span: as in decode_step. With Setup.head_lags, the MTP head's
    KV must hold every pair before the step (catch_up)."""
    cfg, k = setup.cfg, setup.draft_tokens
    sp = st.spec
    n_draft = jnp.where(st.active, jnp.clip(jnp.minimum(sp.n_draft, caps), 0, k), 0)
    n_new = jnp.where(st.active, n_draft + 1, 0)
    batch = TokenBatch.after(st.seqs.lengths, n_new, k + 1, _span_table(setup, st.seqs.page_table, span))
    fed = jnp.concatenate([st.last_token[:, None], sp.drafts], axis=1)  # [B, K+1]
    ctx0 = st.seqs.ple_context
    rows, _, ple_status = _ple_rows(setup, fed, ctx0, n_new)
    experts = _step_experts(setup, st)
    hc_kernel = fed.size <= setup.hc_kernel_rows
    h, pending, experts, _ = forward_layers(params, cfg, fed, batch, st.layers, experts, rows, expert_ids,
                                            setup.gdn_kernel, hc_kernel, pending=True,
                                            attn_kernel=setup.attention_kernel)
    logits = final_logits(params, cfg, h, hc_kernel)  # [B, K+1, V]
    with jax.named_scope("sampling"):
        tokens, accepted = verify(logits, sp.drafts, n_draft, st.sampling, st.seqs.lengths + 1,
                                  filters=want.filters)
    keep = jnp.where(st.active, accepted + 1, 0)
    layers = commit_layers(cfg, pending, keep)
    lengths = st.seqs.lengths + keep
    mtp, spec, lag = st.mtp, sp, st.mtp_lag
    if lag is not None:
        lag = spec_mod.caught_up(lag, lengths, st.active)
    if setup.mtp:  # the head on every fed row's pair (state at t, the token sampled after it: the next draft
        # where that was kept); its guess from the last kept pair is the next first draft
        hm, mtp, _ = mtp_mod.mtp_layer(params, cfg, h, tokens, batch, st.mtp)
        hm = jnp.take_along_axis(hm, accepted[:, None, None], axis=1)[:, 0]
        first_logits = mtp_mod.mtp_logits(params, cfg, hm)
    draft_logits = None
    if setup.speculative == "mtp":  # the next drafts (with Want.logits, their logits [B, K, V] too)
        spec, mtp, draft_logits = spec_mod.mtp_chain(
            params, cfg, hm, spec_mod.greedy(first_logits), lengths, _capacity(setup, batch.page_table),
            batch.page_table, mtp, k, st.active, first_logits if want.logits else None)
    context = ctx0
    if ctx0 is not None:  # the last tokens fed and kept (the PLE step's own context counts every fed token);
        # a bucket's context is the whole [max_batch, 2] (see _first_rows): its first rows move
        b = fed.shape[0]
        context = ctx0.at[:b].set(jax.vmap(
            lambda c, f, n: lax.dynamic_slice_in_dim(jnp.concatenate([c, f]), n, c.shape[0]))(ctx0[:b], fed, keep))
    last = jnp.take_along_axis(tokens, accepted[:, None], axis=1)[:, 0]
    if setup.speculative == "ngram":
        spec = spec_mod.advance(sp, st.seqs.lengths + 1, tokens, lengths, _capacity(setup, st.seqs.page_table),
                                st.active)
    st = dataclasses.replace(
        st, seqs=SeqState(lengths, st.seqs.page_table, context), layers=layers,
        experts=experts if setup.host is not None else None, mtp=mtp,
        last_token=jnp.where(st.active, last, st.last_token), spec=spec, mtp_lag=lag)
    cache_status, misses, lookups = _cache_counts(st.experts)
    out = StepOutput(tokens=tokens, drafts=None, logprobs=logprobs_of(logits, tokens) if want.logprobs else None,
                     logits=logits if want.logits else None, draft_logits=draft_logits, prompt_logprobs=None,
                     ple_status=ple_status, cache_status=cache_status, expert_misses=misses, expert_lookups=lookups,
                     accepted=accepted, n_draft=n_draft, proposed=spec.n_draft)
    return st, out


def _row(tree, slot):
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, slot, axis=0, keepdims=True), tree)


def _set_row(tree, slot, row):
    return jax.tree.map(lambda a, r: lax.dynamic_update_index_in_dim(a, r.astype(a.dtype), slot, axis=0), tree, row)


def _per_slot(fn, *layers: tuple) -> tuple:
    """fn over the per-slot parts (GDN rows, PLE conv rows) of aligned tuples of layer states, one argument per
    tuple: fn(part) to read rows, fn(old, cut, new) to write them. The shared KV pages come from the last tuple
    as they are."""
    def one(*states: LayerState) -> LayerState:
        last = states[-1]
        mixer = last.mixer if isinstance(last.mixer, PagedKV) else fn(*(s.mixer for s in states))
        return LayerState(mixer, None if last.ple_conv is None else fn(*(s.ple_conv for s in states)))

    return tuple(one(*states) for states in zip(*layers))


def _first_rows(st: DecodeState, rows: int) -> DecodeState:
    """The state of slots [0, rows) (a decode bucket): per-slot arrays cut to their first rows; shared parts
    (KV pages, expert caches), the GDN states and the PLE context whole: the step reads and updates their
    first rows in place (gated_deltanet_batch, _ple_rows), where a cut and its write-back would be device
    copies outside the CUDA graph, two per GDN layer and step (3 MB per slot for a recurrent state at full
    size); the PLE host step's cut context kept that FFI call out of the graph, and the host waited there for
    the previous step's token."""
    cut = lambda t: jax.tree.map(lambda a: a[:rows], t)  # noqa: E731

    def cut_mixer(m):
        return m if isinstance(m, GDNState) else cut(m)

    seqs = dataclasses.replace(cut(st.seqs), ple_context=st.seqs.ple_context)
    return dataclasses.replace(st, seqs=seqs, layers=_per_slot(cut_mixer, st.layers),
                               sampling=cut(st.sampling), active=st.active[:rows], last_token=st.last_token[:rows],
                               spec=cut(st.spec))


def _put_first_rows(st: DecodeState, rows: int, cut: DecodeState, sub: DecodeState) -> DecodeState:
    """The whole state after a bucket's step: sub (the step's result from cut = _first_rows(st, rows)) written
    into rows [0, rows) of st. A leaf the step returned as it got it (sampling rows, page tables, active flags)
    keeps st's array: writing its own rows back costs XLA a pair of device copies each (seen in the H200's
    optimized HLO; copies run outside the CUDA graph). A leaf the step got whole (the PLE context) comes back
    whole."""
    def put(t, c, r):
        return jax.tree.map(lambda a, b, n: a if n is b else n if n.shape == a.shape else a.at[:rows].set(n),
                            t, c, r)

    def put_mixer(old, before, new):
        return new if isinstance(old, GDNState) else put(old, before, new)

    return dataclasses.replace(sub, seqs=put(st.seqs, cut.seqs, sub.seqs),
                               layers=_per_slot(put_mixer, st.layers, cut.layers, sub.layers),
                               sampling=put(st.sampling, cut.sampling, sub.sampling),
                               active=put(st.active, cut.active, sub.active),
                               last_token=put(st.last_token, cut.last_token, sub.last_token),
                               spec=put(st.spec, cut.spec, sub.spec))


def prefill_chunk(params: Params, setup: Setup, want: Want, st: DecodeState, slot: Array, tokens: Array,
                  n: Array, last: Array, mask: Array, follow: Array, targets: Array | None,
                  expert_ids: Array | None):
    """The next n (<= C) prompt tokens of slot `slot` (tokens [C], padded). `follow` is the prompt token after
    them (the MTP head's pair for the last one; unused when `last`). With `last`, the slot samples its first
    token within `mask` (a packed [ceil(V/32)] bitmask) and starts decoding. Built with Want.score, it also
    returns the log-probabilities of targets [C] (the token after each prompt token) at every position."""
    cfg = setup.cfg
    seq = _row(st.seqs, slot)
    batch = TokenBatch.after(seq.lengths, n[None], tokens.shape[0], seq.page_table)
    rows, context, ple_status = _ple_rows(setup, tokens[None], seq.ple_context, n[None])
    experts = _step_experts(setup, st, decode=False)
    states = _per_slot(lambda t: _row(t, slot), st.layers)
    h, states, experts, _ = forward_layers(params, cfg, tokens[None], batch, states, experts, rows, expert_ids,
                                           setup.gdn_kernel)
    layers = _per_slot(lambda t, r: _set_row(t, slot, r), st.layers, states)
    experts = experts.cache if setup.host is not None else None
    status, misses, lookups = _cache_counts(experts)
    h_last = h[0, n - 1]
    logits = final_logits(params, cfg, h_last)
    with jax.named_scope("sampling"):
        token = sample(apply_mask(logits, mask)[None], _row(st.sampling, slot), seq.lengths + n)[0]
    drafts = draft_logits = None
    mtp = st.mtp
    if setup.mtp:  # pairs (state at t, token t+1): the prompt's own next tokens, then what follows the chunk
        nxt = jnp.concatenate([tokens[1:], tokens[:1]]).at[n - 1].set(jnp.where(last, token, follow))
        hm, mtp, _ = mtp_mod.mtp_layer(params, cfg, h, nxt[None], batch, st.mtp)
        draft_logits = mtp_mod.mtp_logits(params, cfg, hm[0, n - 1])
        drafts = spec_mod.greedy(draft_logits)
    prompt_lp = None
    if want.score:  # in blocks of rows: a chunk's whole [C, V] logits would be gigabytes at full size
        rows_lp = math.gcd(SCORE_ROWS, tokens.shape[0])
        blocks = jax.lax.map(lambda a: logprobs_of(final_logits(params, cfg, a[0]), a[1]),
                             (h[0].reshape(-1, rows_lp, h.shape[-1]), targets.reshape(-1, rows_lp)))
        prompt_lp = jax.tree.map(lambda a: a.reshape(tokens.shape[0], *a.shape[2:]), blocks)
    seqs = _set_row(st.seqs, slot, SeqState(seq.lengths + n, seq.page_table, context))
    spec = st.spec
    if setup.speculative == "mtp":  # after the last chunk, the first verify step's drafts (mtp_chain)
        row, mtp, _ = spec_mod.mtp_chain(params, cfg, hm[:, n - 1], drafts[None], seq.lengths + n,
                                         _capacity(setup, seq.page_table), seq.page_table, mtp, setup.draft_tokens,
                                         last[None])
        spec = _set_row(spec, slot, row)
    elif spec is not None:  # the chunk's tokens (and the first sampled one) into the history; after the last
        # chunk, the first verify step's drafts
        row = _row(spec, slot)
        hist = spec_mod.write(row.history[0], seq.lengths[0], tokens)
        hist = jnp.where(last, spec_mod.write(hist, seq.lengths[0] + n, token[None]), hist)
        row = spec_mod.propose_rows(SpecState(hist[None], row.drafts, row.n_draft), seq.lengths + n,
                                    _capacity(setup, seq.page_table), last[None])
        spec = _set_row(spec, slot, row)
    lag = st.mtp_lag
    if lag is not None:  # the chunk ran the head over its pairs
        lag = dataclasses.replace(lag, length=lag.length.at[slot].set(seq.lengths[0] + n))
    st = dataclasses.replace(
        st, seqs=seqs, layers=layers, experts=experts, mtp=mtp, mtp_lag=lag,
        active=st.active.at[slot].set(last | st.active[slot]),
        last_token=st.last_token.at[slot].set(jnp.where(last, token, st.last_token[slot])), spec=spec)
    out = StepOutput(tokens=token, drafts=drafts, logprobs=logprobs_of(logits, token) if want.logprobs else None,
                     logits=logits if want.logits else None,
                     draft_logits=draft_logits if want.logits else None, prompt_logprobs=prompt_lp,
                     ple_status=ple_status, cache_status=status, expert_misses=misses,
                     expert_lookups=lookups, proposed=None if spec is None else spec.n_draft[slot])
    return st, out


def admit(setup: Setup, st: DecodeState, slot: Array, pages: Array, sampling: SamplingRows) -> DecodeState:
    """Start a fresh sequence in `slot`: its KV pages [max_pages], empty state, its sampling settings."""
    def fresh(tree):  # zero the slot's rows of the per-sequence parts; the shared KV pages stay
        return jax.tree.map(lambda a: a.at[slot].set(jnp.zeros_like(a[slot])), tree)

    layers = tuple(LayerState(s.mixer if isinstance(s.mixer, PagedKV) else fresh(s.mixer),
                              None if s.ple_conv is None else fresh(s.ple_conv)) for s in st.layers)
    ctx = st.seqs.ple_context
    if ctx is not None:
        ctx = ctx.at[slot].set(setup.cfg.eos_token_id)
    seqs = SeqState(st.seqs.lengths.at[slot].set(0), st.seqs.page_table.at[slot].set(pages.astype(jnp.int32)),
                    ctx)
    lag = st.mtp_lag
    if lag is not None:  # its kept pairs (those of the slot's last sequence) count as none
        lag = dataclasses.replace(lag, length=lag.length.at[slot].set(0))
    return dataclasses.replace(st, seqs=seqs, layers=layers,
                               sampling=jax.tree.map(lambda a, r: a.at[slot].set(r), st.sampling, sampling),
                               active=st.active.at[slot].set(False), last_token=st.last_token.at[slot].set(0),
                               spec=None if st.spec is None else fresh(st.spec), mtp_lag=lag)


def catch_up(params: Params, setup: Setup, st: DecodeState, rows: int, span: int | None = None,
             draft: bool = False) -> DecodeState:
    """Setup.head_lags: the MTP head over the pairs that plain decode steps kept for slots [0, rows) (each active
    slot's, up to its length; speculative.catch_up), so that its KV pages hold every pair. With `draft` (the
    `resume` program, before a verify step), a slot that had kept pairs then gets its drafts: the head's guess
    from its last pair, chained (speculative.draft_after_lag), as a verify step would have proposed them; the other
    slots keep theirs (proposed by their prefill's last chunk or a verify step). span: as in decode_step (every
    kept pair, and the chained drafts, lie below it)."""
    cfg, table = setup.cfg, _span_table(setup, st.seqs.page_table[:rows], span)
    lengths, active = st.seqs.lengths[:rows], st.active[:rows]
    lag, mtp, n = spec_mod.catch_up(params, cfg, st.mtp_lag, lengths, active, table, st.mtp)
    spec = st.spec
    if draft:
        kept = n > 0  # slots that had pairs to run
        new, mtp = spec_mod.draft_after_lag(params, cfg, lag, lengths, kept, _capacity(setup, table), table, mtp,
                                            setup.draft_tokens)
        drafts = spec.drafts.at[:rows].set(jnp.where(kept[:, None], new.drafts, spec.drafts[:rows]))
        n_draft = spec.n_draft.at[:rows].set(jnp.where(kept, new.n_draft, spec.n_draft[:rows]))
        spec = dataclasses.replace(spec, drafts=drafts, n_draft=n_draft)
    return dataclasses.replace(st, mtp=mtp, mtp_lag=lag, spec=spec)


def release(st: DecodeState, slot: Array) -> DecodeState:
    return dataclasses.replace(st, active=st.active.at[slot].set(False))


# ----- the runner -------------------------------------------------------------------------------------------
class Pending:
    """A dispatched program's output. Its transfer to the host starts at once; result() waits for it (and
    for nothing dispatched later), checks the FFI status words, and returns the StepOutput as numpy."""

    def __init__(self, out: StepOutput, runner: Runner):
        self._out, self._runner = out, runner
        for a in jax.tree.leaves(out):
            a.copy_to_host_async()

    def result(self) -> StepOutput:
        out = jax.device_get(self._out)
        self._runner.check(out)
        return out


class Runner:
    """Owns the weights and the DecodeState; every call dispatches one compiled program and returns at once."""

    def __init__(self, params: Params, setup: Setup):
        self.setup = setup
        self._params, self._params_def = jax.tree.flatten(params)
        self._programs: dict = {}
        # the state's structure and shapes, known without allocating it: programs compile before it exists
        self._state_shapes, self._state_def = jax.tree.flatten(jax.eval_shape(lambda: init_state(params, setup)))
        self._state: list | None = None  # allocated on the first call
        self._filtered = np.zeros(setup.max_batch, bool)  # slots admitted with top-k, top-p or min-p

    def reset(self) -> None:
        """A fresh state: every slot free, the expert caches empty (also after a failure lost the donated one).
        The old state goes first, so the two are never held at once."""
        self._state = None
        self._filtered[:] = False
        self._state = jax.tree.leaves(init_state(self.params, self.setup))

    def allocate(self) -> None:
        """Allocate the state now if there is none (warm-up: the first request then does not wait for it)."""
        if self._state is None:
            self.reset()
            jax.block_until_ready(self._state)

    @property
    def allocated(self) -> bool:
        return self._state is not None

    def free(self) -> None:
        """Drop the state (its device memory returns to the allocator); the next call starts a fresh one."""
        self._state = None

    @property
    def params(self) -> Params:
        return jax.tree.unflatten(self._params_def, self._params)

    @property
    def state(self) -> DecodeState:
        """The current state (for inspection; dispatching a program consumes it)."""
        if self._state is None:
            self.reset()
        return jax.tree.unflatten(self._state_def, self._state)

    def state_lost(self) -> bool:
        """Whether a failed program consumed the donated state."""
        return self._state is not None and any(a.is_deleted() for a in self._state)

    def check(self, out: StepOutput) -> None:
        """Raise if an FFI step of this output reported an error (the step's results are then garbage)."""
        if out.ple_status is not None:
            ffi.check_ple_info(out.ple_status)
        if out.cache_status is not None:
            h = self.setup.host
            ffi.check_info(out.cache_status, num_slots=h.slots, num_experts=h.num_experts)

    # ----- programs ---------------------------------------------------------------------------------------
    def _key(self, name: str, want: Want | None = None, rows: int | None = None, span: int | None = None) -> tuple:
        """Programs are named by (name, Want, rows, span): admit, release, catch_up and resume have no Want; the
        model's programs default to Want(); a decode step (verify, catch_up, resume) runs the first `rows` slots
        (a batch-size bucket, default all) and attends to the first `span` positions (a context bucket, a multiple
        of the page size; None: all); a prefill chunk holds `rows` tokens (default, and None: the setup's chunk;
        fewer for short prompts)."""
        if name not in ("admit", "release", "decode", "prefill", "verify") + LAG_PROGRAMS:
            raise ValueError(f"no program {name!r}")
        if name in ("admit", "release"):
            return name, None, None, None
        s = self.setup
        if name == "prefill":
            if rows is not None and not 1 <= rows <= s.chunk:
                raise ValueError(f"a prefill chunk of {rows} tokens; this runner's chunks hold up to {s.chunk}")
            return name, want or Want(), None if rows == s.chunk else rows, None
        rows = rows or s.max_batch
        if not 1 <= rows <= s.max_batch:
            raise ValueError(f"a decode bucket of {rows} rows; this runner has {s.max_batch} slots")
        if name == "verify" and not s.draft_tokens:
            raise ValueError("no verify program: this runner does not speculate (draft_tokens=0)")
        if name in LAG_PROGRAMS and not s.head_lags:
            raise ValueError(f"no {name} program: this runner's plain steps keep no pairs for an MTP head")
        if span == s.max_pages * s.page_size:
            span = None
        if span is not None and not (0 < span < s.max_pages * s.page_size and span % s.page_size == 0):
            raise ValueError(f"a decode span of {span} positions; it must be a multiple of the page size "
                             f"{s.page_size} below the context ({s.max_pages * s.page_size})")
        return name, None if name in LAG_PROGRAMS else want or Want(), rows, span

    def _program(self, name: str, want: Want | None = None, rows: int | None = None, span: int | None = None):
        """The compiled program, built on first use (see `compile`)."""
        key = self._key(name, want, rows, span)
        if key not in self._programs:
            self._programs[key], _ = self._build_or_load(key)
        return self._programs[key]

    def compile(self, programs) -> dict[str, float]:
        """Compile the programs [(name, Want or None[, rows[, span]]), ...] that are not built yet, side by side (XLA
        compiles in native threads); a server does this before it says it is ready. Returns each one's seconds
        (a program found in the program store takes a file read; one found in JAX's persistent compilation cache
        its tracing time)."""
        todo = [k for k in dict.fromkeys(self._key(*p) for p in programs) if k not in self._programs]

        def build(key):
            t0 = time.perf_counter()
            compiled, how = self._build_or_load(key)
            return compiled, how, time.perf_counter() - t0

        seconds = {}
        with concurrent.futures.ThreadPoolExecutor(max(1, len(todo))) as pool:
            for key, (compiled, how, dt) in zip(todo, pool.map(build, todo)):
                self._programs[key] = compiled
                seconds[_label(*key)] = dt
                log.info("%s %s in %.1f s", how, _label(*key), dt)
        return seconds

    def _build_or_load(self, key: tuple):
        """(the compiled program, "loaded" from the program store or "compiled"); see engine/program_store.py.
        A runner with a RoutingSource (benchmarks) is never stored."""
        fp = None
        if self.setup.routing is None and program_store.directory() is not None:
            fp = program_store.fingerprint(_label(*key), self.setup, self._params, self._params_def,
                                           self._state_shapes, self._state_def, self._inputs(*key))
            stored = program_store.load(fp)
            if stored is not None:
                return stored, "loaded"
        compiled = self._build(*key)
        if fp is not None:
            program_store.save(fp, compiled)
        return compiled, "compiled"

    def _build(self, name: str, want: Want | None, rows: int | None, span: int | None):
        """Trace and compile one program ahead of time: its inputs' shapes are fixed by the setup, so each
        program compiles exactly once."""
        return self.lower(name, want, rows, span).compile()

    def lower(self, name: str, want: Want | None = None, rows: int | None = None, span: int | None = None):
        """One program traced and lowered, not compiled (jax's Lowered: benchmarks compile it with other XLA
        options)."""
        run, args = self.program_fn(name, want, rows, span)
        return jax.jit(run, donate_argnums=1).lower(*args)

    def program_fn(self, name: str, want: Want | None = None, rows: int | None = None, span: int | None = None):
        """(the function a program computes, its arguments): run(weight leaves, state leaves, *inputs) ->
        (state leaves, output), the arguments the weights, the state's shapes and the inputs' shapes."""
        name, want, rows, span = self._key(name, want, rows, span)
        setup, p_def, s_def = self.setup, self._params_def, self._state_def

        def run(param_leaves, state_leaves, *args):
            params = jax.tree.unflatten(p_def, param_leaves)
            st = jax.tree.unflatten(s_def, state_leaves)
            # per-call inputs are fresh buffers on every call: copied in outside the CUDA graph, so that the
            # graph does not read buffers that move (ffi/copy.py; the outputs still do, see docs/engine.md)
            args = ffi.uncaptured_copy(args)
            if name == "admit":
                st, out = admit(setup, st, *args), None
            elif name == "release":
                st, out = release(st, *args), None
            elif name == "prefill":
                st, out = prefill_chunk(params, setup, want, st, *args)
            elif name in LAG_PROGRAMS:
                st, out = catch_up(params, setup, st, rows, span, draft=name == "resume"), None
            else:  # a decode or verify bucket: slots [0, rows) only, positions [0, span)
                step = decode_step if name == "decode" else verify_step
                cut = _first_rows(st, rows)
                sub, out = step(params, setup, want, cut, *args, span=span)
                st = _put_first_rows(st, rows, cut, sub)
            leaves, treedef = jax.tree.flatten(st)
            if treedef != s_def:
                raise AssertionError(f"{name} changed the state's structure")
            return leaves, out

        run.__name__ = name  # the program's name in traces and HLO dumps: jit(decode), jit(prefill), ...
        return run, (self._params, self._state_shapes, *self._inputs(name, want, rows))

    def _inputs(self, name: str, want: Want | None, rows: int | None, span: int | None = None) -> tuple:
        """The shapes of a program's inputs after the weights and the state."""
        s, cfg = self.setup, self.setup.cfg
        i32, scalar = jnp.int32, jax.ShapeDtypeStruct((), jnp.int32)
        words = -(-cfg.vocab_size // 32)

        def ids(rows):  # fixed routing, when the runner has a RoutingSource
            return None if s.routing is None else jax.ShapeDtypeStruct(
                (cfg.num_hidden_layers, rows, cfg.num_experts_per_tok), i32)

        if name == "admit":
            rows = SamplingRows(*(jax.ShapeDtypeStruct((), a.dtype) for a in jax.tree.leaves(SamplingRows.init(1))))
            return scalar, jax.ShapeDtypeStruct((s.max_pages,), i32), rows
        if name == "release":
            return (scalar,)
        if name in LAG_PROGRAMS:
            return ()
        if name == "prefill":
            width = rows or s.chunk
            chunk = jax.ShapeDtypeStruct((width,), i32)
            return (scalar, chunk, scalar, jax.ShapeDtypeStruct((), bool), jax.ShapeDtypeStruct((words,), i32),
                    scalar, chunk if want.score else None, ids(width))
        if name == "verify":
            return jax.ShapeDtypeStruct((rows,), i32), ids(rows * (s.draft_tokens + 1))
        return (jax.ShapeDtypeStruct((rows, words), i32) if want.masks else None, ids(rows))

    def _call(self, name: str, want: Want | None, *args, rows: int | None = None, span: int | None = None):
        program = self._program(name, want, rows, span)
        if self._state is None:
            self.reset()
        self._state, out = program(self._params, self._state, *args)
        return out

    def admit(self, slot: int, pages: np.ndarray, sampling: SamplingParams) -> None:
        self._call("admit", None, jnp.int32(slot), jnp.asarray(pages, jnp.int32), SamplingRows.of(sampling))
        self._filtered[slot] = sampling.filtered

    def release(self, slot: int) -> None:
        self._call("release", None, jnp.int32(slot))
        self._filtered[slot] = False

    def _check_filters(self, want: Want, rows: int) -> None:
        """A program without Want.filters would sample a filtering slot from its whole distribution."""
        if not want.filters and self._filtered[:rows].any():
            slots = np.flatnonzero(self._filtered[:rows]).tolist()
            raise ValueError(f"slots {slots} sample with top-k, top-p or min-p: run a program built with "
                             "Want(filters=True)")

    def prefill(self, slot: int, tokens: np.ndarray, n: int, last: bool, mask: np.ndarray, follow: int,
                want: Want = Want(), targets: np.ndarray | None = None) -> Pending:
        """Dispatch a prefill chunk (tokens [C], the first n real; C the setup's chunk or a shorter bucket, each
        its own program); see prefill_chunk."""
        if want.score != (targets is not None):
            raise ValueError("prefill: pass targets exactly when the program is built with Want(score=True)")
        routing = self.setup.routing
        ids = None if routing is None else jnp.asarray(routing.prefill_ids(slot, n, len(tokens)), jnp.int32)
        out = self._call("prefill", want, jnp.int32(slot), jnp.asarray(tokens, jnp.int32), jnp.int32(n),
                         jnp.asarray(last, bool), jnp.asarray(mask, jnp.int32), jnp.int32(follow),
                         None if targets is None else jnp.asarray(targets, jnp.int32), ids, rows=len(tokens))
        return Pending(out, self)

    def decode(self, want: Want = Want(), masks: np.ndarray | None = None, rows: int | None = None,
               span: int | None = None) -> Pending:
        """Dispatch a decode step for slots [0, rows) (default: every slot; masks [rows, words]) attending to
        positions [0, span) (default: the whole context); see decode_step. Its outputs have `rows` rows."""
        if want.masks != (masks is not None):
            raise ValueError("decode: pass masks exactly when the program is built with Want(masks=True)")
        rows = rows or self.setup.max_batch
        self._check_filters(want, rows)
        routing = self.setup.routing
        ids = None if routing is None else jnp.asarray(routing.decode_ids(rows), jnp.int32)
        out = self._call("decode", want, None if masks is None else jnp.asarray(masks, jnp.int32), ids, rows=rows,
                         span=span)
        return Pending(out, self)

    def verify(self, caps: np.ndarray, want: Want = Want(), rows: int | None = None,
               span: int | None = None) -> Pending:
        """Dispatch a verify step for slots [0, rows) with at most caps[b] drafts each (caps [rows]); see
        verify_step. Its outputs have `rows` rows."""
        rows = rows or self.setup.max_batch
        if want.masks:
            raise ValueError("verify: grammar masks need each token before the next; use decode")
        self._check_filters(want, rows)
        routing = self.setup.routing
        ids = None if routing is None else jnp.asarray(routing.verify_ids(rows, self.setup.draft_tokens + 1),
                                                       jnp.int32)
        out = self._call("verify", want, jnp.asarray(caps, jnp.int32), ids, rows=rows, span=span)
        return Pending(out, self)

    def catch_up(self, rows: int | None = None, span: int | None = None, draft: bool = False) -> None:
        """Dispatch the catch_up program (with `draft`, resume) for slots [0, rows) attending to positions
        [0, span) (defaults as in decode): the MTP head over the pairs plain steps kept (Setup.head_lags), and
        with `draft` the drafts of the slots that kept any; see catch_up."""
        self._call("resume" if draft else "catch_up", None, rows=rows or self.setup.max_batch, span=span)

    def program_text(self, name: str, want: Want | None = None, rows: int | None = None,
                     span: int | None = None) -> str:
        """The optimized HLO of a compiled program (what benchmarks/trace_parts.py reads)."""
        return self._program(name, want, rows, span).as_text()

    def program_cost(self, name: str, want: Want | None = None, rows: int | None = None,
                     span: int | None = None) -> dict | None:
        """XLA's cost analysis of a compiled program, {"flops": ..., "bytes": ...} (the bytes it counts its
        operations accessing), None where the backend gives none: what benchmarks compare programs by where
        wall-clock times are too noisy to."""
        program = self._program(name, want, rows, span)
        try:
            c = program.cost_analysis()
        except Exception:  # noqa: BLE001 -- backends without a cost analysis
            return None
        c = c[0] if isinstance(c, list) else c
        return {"flops": float(c.get("flops", 0.0)), "bytes": float(c.get("bytes accessed", 0.0))} if c else None

    def temp_bytes(self, name: str, want: Want | None = None, rows: int | None = None,
                   span: int | None = None) -> int | None:
        """Bytes of temporaries XLA assigned a compiled program (None where the backend does not say): what
        the planner's workspace must hold."""
        program = self._program(name, want, rows, span)  # a failed compile raises here, not below
        try:
            return int(program.memory_analysis().temp_size_in_bytes)
        except Exception:  # noqa: BLE001 -- backends without a memory analysis
            return None

    @property
    def programs_built(self) -> int:
        """How many programs this runner has compiled or loaded (cheap: the scheduler reads it every step)."""
        return len(self._programs)

    def compile_counts(self) -> dict[str, int]:
        """The programs compiled so far (each exactly once), by label: decode@4 is the decode step of slots
        [0, 4), decode[logprobs,masks,filters]@8 the one with logprobs, grammar masks and filters over 8 slots,
        decode@8:4096 the one of 8 slots over the first 4096 positions."""
        return {_label(*key): 1 for key in self._programs}


def _label(name: str, want: Want | None, rows: int | None = None, span: int | None = None) -> str:
    """admit, prefill, prefill[score], decode@8, decode[logprobs,masks,filters]@1, decode@2:4096, ..."""
    label = name
    if want not in (None, Want()):
        label += "[" + ",".join(f.name for f in dataclasses.fields(want) if getattr(want, f.name)) + "]"
    label = label if rows is None else f"{label}@{rows}"
    return label if span is None else f"{label}:{span}"
