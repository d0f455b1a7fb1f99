"""The user-facing model object: load a checkpoint, generate, run full-sequence logits (and MTP drafts).

    engine = jaxflash.load("path/to/checkpoint", dtype="float32")
    outs = engine.generate([[1, 2, 3]], max_new_tokens=20)   # a list of generated token-id lists
    logits = engine.logits([1, 2, 3])               # [T, vocab] float32
    many = engine.logits([[1, 2, 3], [4, 5]])       # one array per sequence

Ragged batches are right-padded to a shared bucket length and run as one batch: every layer is causal, so the
padding never changes the logits of real tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .. import ffi
from ..checkpoint import Checkpoint
from ..config import ModelConfig
from ..kernels import attention_decode, gdn_chunk, gdn_decode, hc_mix, nvfp4_experts, on_gpu
from ..model import mtp as mtp_mod
from ..model import ple as ple_mod
from ..model import transformer
from ..model.weights import load_params
from . import planner as planner_mod
from . import runner as runner_mod
from .experts import HostExperts
from .scheduler import Scheduler

log = logging.getLogger("jaxflash")

# The model bundled with the package: what every tool uses when given no --model.
DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "assets" / "default_model"

# A table up to this size goes to the device; a larger one (the real 48 GiB one) stays memory-mapped on the host.
DEVICE_TABLE_MAX_BYTES = 1 << 30


def _bucket(n: int) -> int:
    """Sequence lengths are padded to a few sizes so that ragged inputs reuse compiled programs."""
    return max(16, 1 << (n - 1).bit_length()) if n <= 1024 else -(-n // 1024) * 1024


class Engine:
    def __init__(self, config: ModelConfig, params: transformer.Params, host_table=None,
                 checkpoint: Checkpoint | None = None, plan: planner_mod.Plan | None = None,
                 host_experts: HostExperts | None = None, ngram=None, mtp_drafts: bool = False,
                 routing: runner_mod.RoutingSource | None = None, expert_kernel: bool | str | None = None,
                 gdn_kernel: bool | None = None, hc_kernel: bool | None = None, speculative: str | None = None,
                 draft_tokens: int = 1, attention_kernel: bool | None = None):
        """ngram: (ffi.NgramTable, FP8 scale or None) for the decode path's PLE step; by default it is opened
        from the checkpoint on first use. mtp_drafts: run the MTP head in every decode step (see load).
        routing: fixed expert ids for generation instead of the routers' choice (runner.RoutingSource).
        expert_kernel: compute the decode steps' routed experts with the NVFP4 kernels (None: where they apply,
        NVFP4 experts on a GPU; False: the jnp path, e.g. to compare numerics; "pallas" / "cuda": that route of
        the kernels, jaxflash.kernels.nvfp4_experts).
        gdn_kernel: run the GDN recurrent part of decode steps in jaxflash.kernels.gdn_decode and of prefill chunks
        in jaxflash.kernels.gdn_chunk (None: on a GPU for a model they take; True elsewhere runs them in
        interpret mode). hc_kernel: steps of few token rows run their hyper-connection mixes in
        jaxflash.kernels.hc_mix (see load).
        attention_kernel: decode and verify steps attend in jaxflash.kernels.attention_decode (None: on a GPU for a
        model it takes; True elsewhere runs it in interpret mode).
        speculative, draft_tokens: see load."""
        self.config, self.params, self.host_table, self.checkpoint = config, params, host_table, checkpoint
        self.plan, self.host_experts, self.ngram, self.routing = plan, host_experts, ngram, routing
        nvfp4_experts.expert_kernel_choice(expert_kernel)  # a bad value fails here, before anything compiles
        self.expert_kernel = expert_kernel
        gdn_takes = gdn_decode.takes(config, params.dtype) and gdn_chunk.takes(config, params.dtype)
        if gdn_kernel and not gdn_takes:
            raise ValueError("gdn_kernel=True: the GDN kernels take bfloat16 or float32 models with head sizes "
                             "that are powers of two of at least 16")
        if gdn_kernel is None:
            gdn_kernel = on_gpu() and gdn_takes
        self.gdn_kernel = gdn_kernel
        if hc_kernel is None:
            hc_kernel = on_gpu() and hc_mix.FASTER_ROWS
        self.hc_kernel_rows = hc_mix.MAX_ROWS if hc_kernel is True else int(hc_kernel)
        attn_ok = attention_decode.takes(config.num_attention_heads, config.num_key_value_heads, config.head_dim, 1,
                                         params.dtype)
        if attention_kernel and not attn_ok:
            raise ValueError("attention_kernel=True: the attention kernel takes bfloat16 or float32 models with a "
                             "power-of-two head dim and at most 64 query heads per KV head")
        self.attention_kernel = on_gpu() and attn_ok if attention_kernel is None else attention_kernel
        self.draft_tokens = _draft_tokens(speculative, draft_tokens)
        self.speculative = speculative if self.draft_tokens else None
        if params.mtp is None:
            _no_mtp_head(mtp_drafts, speculative, "no MTP head is loaded (the checkpoint has none, or mtp=False)")
        self.mtp = mtp_drafts or self.speculative == "mtp"  # the head's layer runs over every pair (its KV)
        self.mtp_drafts = mtp_drafts  # and its guess in every decode step (the acceptance statistics)
        self._scheduler: Scheduler | None = None
        self._hidden = jax.jit(lambda p, t, rows: transformer.forward_hidden(p, config, t, ple_rows=rows))
        self._logits = jax.jit(lambda p, t, rows: transformer.forward(p, config, t, ple_rows=rows))
        self._mtp = jax.jit(lambda p, h, nxt: mtp_mod.mtp_forward(p, config, h, nxt))

    @property
    def dtype(self):
        return self.params.dtype

    # ----- inputs -------------------------------------------------------------------------------------------
    def _batch(self, tokens) -> tuple[np.ndarray, list[int], bool]:
        """(padded [B, L] int32 batch, lengths, whether a single sequence was given)."""
        if isinstance(tokens, np.ndarray | jax.Array) and np.ndim(tokens) == 1 or (
                isinstance(tokens, list | tuple) and tokens and np.isscalar(tokens[0])):
            seqs, single = [np.asarray(tokens)], True
        else:
            seqs, single = [np.asarray(s) for s in tokens], False
        if not seqs or any(s.ndim != 1 or s.size == 0 for s in seqs):
            raise ValueError("tokens must be a non-empty sequence of token ids, or a list of such sequences")
        for s in seqs:
            if s.dtype.kind not in "iu":
                raise ValueError(f"token ids must be integers, got dtype {s.dtype}")
            if s.min() < 0 or s.max() >= self.config.vocab_size:
                raise ValueError(f"token id out of range [0, {self.config.vocab_size}): "
                                 f"min {s.min()}, max {s.max()}")
        lengths = [len(s) for s in seqs]
        batch = np.zeros((len(seqs), _bucket(max(lengths))), np.int32)
        for i, s in enumerate(seqs):
            batch[i, : len(s)] = s
        return batch, lengths, single

    def ple_rows(self, batch: np.ndarray):
        """Host-side n-gram rows of a [B, T] batch when the table lives on the host; None when it is on the
        device (the model gathers the rows itself)."""
        if self.host_table is None:
            return None
        ids, _ = ple_mod.ngram_ids(self.config, batch)
        return jnp.asarray(self.host_table.gather(ids, np.float32))

    def _need_device_experts(self, what: str) -> None:
        if self.host_experts is not None:
            raise ValueError(f"{what} runs whole sequences with every expert on the device; this engine keeps its "
                             "experts on the host (load with expert_residency='device', or use generate)")

    # ----- outputs ------------------------------------------------------------------------------------------
    def logits(self, tokens):
        """float32 logits [T, vocab] for one sequence, or a list of them for a list of sequences."""
        self._need_device_experts("logits")
        batch, lengths, single = self._batch(tokens)
        out = self._logits(self.params, jnp.asarray(batch), self.ple_rows(batch))
        out = np.asarray(out)
        res = [out[i, :n] for i, n in enumerate(lengths)]
        return res[0] if single else res

    def hidden(self, tokens):
        """The pre-mixer multi-stream state [T, W] float32 (per sequence), what the MTP head reads."""
        self._need_device_experts("hidden")
        batch, lengths, single = self._batch(tokens)
        out = np.asarray(self._hidden(self.params, jnp.asarray(batch), self.ple_rows(batch)))
        res = [out[i, :n] for i, n in enumerate(lengths)]
        return res[0] if single else res

    def mtp_logits(self, tokens):
        """MTP draft logits [T-1, vocab] of one sequence: row t predicts token t+2 from the main model's state at
        t and token t+1 (teacher-forced over the sequence)."""
        if self.params.mtp is None:
            raise ValueError("no MTP head is loaded: the checkpoint has no mtp.* tensors, or it was loaded with "
                             "mtp=False")
        self._need_device_experts("mtp_logits")
        batch, lengths, single = self._batch(tokens)
        if min(lengths) < 2:
            raise ValueError("MTP needs sequences of at least 2 tokens")
        h = self._hidden(self.params, jnp.asarray(batch), self.ple_rows(batch))
        nxt = jnp.asarray(np.concatenate([batch[:, 1:], batch[:, -1:]], axis=1))
        out, _ = self._mtp(self.params, h, nxt)
        out = np.asarray(out)
        res = [out[i, : n - 1] for i, n in enumerate(lengths)]
        return res[0] if single else res


    # ----- generation -----------------------------------------------------------------------------------------
    @property
    def scheduler(self) -> Scheduler:
        """The scheduler, its runner and their state (KV pages, expert caches), allocated on first use."""
        if self._scheduler is None:
            self._scheduler = Scheduler(runner_mod.Runner(self.params, self.setup()), self.plan,
                                        self.config.vocab_size)
        return self._scheduler

    def setup(self) -> runner_mod.Setup:
        """What the compiled programs are specialised on: config, KV geometry, host experts, the n-gram table."""
        if self.plan is None:
            raise ValueError("generation needs a memory plan: make the engine with jaxflash.load")
        cfg, plan = self.config, self.plan
        table = hash_ = scale = None
        if cfg.ple_layer_ids:
            if self.ngram is None:
                if self.checkpoint is None:
                    raise ValueError("generation needs the n-gram table: pass ngram=(table, scale) or a checkpoint")
                table = ffi.NgramTable.from_checkpoint(  # the most tokens one program feeds
                    self.checkpoint, cfg,
                    max_tokens=max(plan.prefill_chunk, plan.max_batch * (1 + self.draft_tokens)))
                self.ngram = (table, self.checkpoint.read_ngram_table().scale)
            table, scale = self.ngram
            hash_ = ffi.NgramHash.from_config(cfg)
        host = self.host_experts
        if host is not None:
            use, route = nvfp4_experts.expert_kernel_choice(self.expert_kernel)
            host = dataclasses.replace(host, kernel=use, route=route)
        return runner_mod.Setup(cfg, plan.max_batch, plan.num_pages, plan.page_size,
                                plan.max_seq_len // plan.page_size, plan.prefill_chunk, self.dtype,
                                host, table, hash_,
                                None if scale is None else float(scale), self.mtp, self.routing,
                                self.expert_kernel, self.gdn_kernel, self.hc_kernel_rows, self.draft_tokens,
                                self.speculative, decode_drafts=self.mtp_drafts,
                                attention_kernel=self.attention_kernel)

    def warm_up(self, serving: bool = True) -> dict[str, float]:
        """Compile (or load from the persistent compilation cache, see jaxflash.compile_cache) the programs that
        serving uses (serving=False: those plain generation uses), so that the first request does not wait
        for them; returns each program's seconds."""
        return self.scheduler.warm_up(serving)

    def generate_stream(self, prompts, max_new_tokens=256, *, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                        seed=None, stop=None, ignore_eos: bool = False):
        """Like generate, but yields (prompt index, token id) as tokens are produced, and (prompt index, None)
        when a prompt's generation ends."""
        gen = self.scheduler
        reqs = gen.make_requests(prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                 top_k=top_k, min_p=min_p, seed=seed, stop=stop,
                                 eos_ids=self.config.eos_token_ids,
                                 ignore_eos=ignore_eos)
        if not gen.idle:
            raise RuntimeError("the scheduler is serving other requests (a server owns it)")
        try:
            for ev in gen.run(reqs):
                if ev.request.finish == "error":
                    raise RuntimeError(f"generation failed: {ev.request.error}")
                yield ev.request.index, ev.token
        finally:  # closed early (or failed): stop what is left, so the scheduler is idle for the next call
            for r in reqs:
                gen.cancel(r)
            while not gen.idle:
                gen.step()

    def generate(self, prompts, max_new_tokens=256, *, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None,
                 stop=None, ignore_eos: bool = False) -> list[list[int]]:
        """Generate for a list of prompts (token-id lists); returns the generated token ids of each.

        Sampling settings are one value for all prompts or a list with one per prompt: temperature (0 = greedy),
        top_p, top_k (0 = off), min_p, seed (None = random; a fixed seed gives the same tokens whatever else is
        in the batch). Generation stops at max_new_tokens, at the end of the context, or at a stop token:
        the model's EOS tokens (unless ignore_eos) and `stop` (token ids; a list per prompt allowed). Stop
        tokens are not included in the output."""
        out = [[] for _ in prompts] if isinstance(prompts, (list, tuple)) else None
        for i, tok in self.generate_stream(prompts, max_new_tokens, temperature=temperature, top_p=top_p,
                                           top_k=top_k, min_p=min_p, seed=seed, stop=stop, ignore_eos=ignore_eos):
            if tok is not None:
                out[i].append(tok)
        return out


def _weights_bar(ckpt: Checkpoint, show: bool | None, skip_experts: bool, skip_mtp: bool = False):
    """A byte-counting progress bar over the weights load_params reads (the n-gram table is read separately)."""
    from tqdm.auto import tqdm

    total = sum(ckpt.info(n).nbytes for n in ckpt.expected()
                if "ngram_embedding" not in n and not (skip_experts and _ROUTED.match(n))
                and not (skip_mtp and n.startswith("mtp.")))
    return tqdm(total=total, desc="loading weights", unit="B", unit_scale=True, unit_divisor=1024,
                disable=None if show is None else not show, dynamic_ncols=True)


_ROUTED = re.compile(r"^layers\.\d+\.mlp\.experts\.")  # a decoder layer's routed experts (not the MTP layer's)


def expert_layout(ckpt: Checkpoint, cfg: ModelConfig) -> ffi.ExpertLayout | None:
    """The host pool's record layout for this checkpoint's routed experts, or None if it has no such layout."""
    first = [n for n in ckpt.expected() if n.startswith("layers.0.mlp.experts.")]
    if any(n.endswith("weight_scale_2") for n in first):
        return ffi.ExpertLayout.from_config(cfg, "nvfp4")
    if first and all(ckpt.info(n).dtype == "BF16" for n in first):
        return ffi.ExpertLayout.from_config(cfg, "bf16")
    return None


def model_bytes(ckpt: Checkpoint, cfg: ModelConfig, dtype, layout, table_on_device: int,
                mtp: bool = True) -> planner_mod.ModelBytes:
    """Device bytes of the dense weights and of the routed experts once loaded for `dtype` (mtp=False: without
    the MTP head, which is then not loaded)."""
    item = jnp.dtype(dtype).itemsize
    dense = experts = 0
    for name in ckpt.expected():
        if "ngram_embedding" in name or (not mtp and name.startswith("mtp.")):
            continue  # the n-gram table is planned apart; with mtp=False no MTP head is loaded
        info = ckpt.info(name)
        numel = int(np.prod(info.shape, dtype=np.int64))
        base = name.rsplit(".", 1)[0]
        if (ckpt.has(base + ".weight_scale_2") or info.dtype == "F8_E4M3"
                or name.endswith((".weight_scale", ".weight_scale_inv"))):
            size = info.nbytes  # NVFP4 and FP8 128-block weights stay as stored, with their scales
        elif info.dtype == "I64":
            size = 0  # the PLE hash buffers are not weights
        else:
            size = numel * item
        if _ROUTED.match(name):
            experts += size
        else:
            dense += size
    return planner_mod.ModelBytes(dense, experts, layout.record_bytes if layout else 0, table_on_device)


def load(path: str | os.PathLike | None = None, dtype: str = "float32", *, ple_table: str = "auto",
         expert_residency: str = "auto", vram_budget=None, cache_slots: int | None = None, max_batch: int = 8,
         max_seq_len: int | None = None, prefill_chunk: int | None = None, mtp: bool | None = None,
         mtp_drafts: bool = False, device=None, progress: bool | None = None,
         routing: runner_mod.RoutingSource | None = None, expert_kernel: bool | str | None = None,
         gdn_kernel: bool | None = None, hc_kernel: bool | None = None, speculative: str | None = None,
         draft_tokens: int = 1, attention_kernel: bool | None = None) -> Engine:
    """Open a checkpoint (default: the bundled model), plan its memory and load it for `dtype` ("float32",
    "bfloat16", or "float64" with jax_enable_x64).

    expert_residency: "device" keeps every routed expert in VRAM; "host" keeps them in a pinned host pool with
    a VRAM cache of `cache_slots` experts per layer; "auto" picks "device" when everything fits the budget.
    vram_budget caps the device memory the engine plans for (e.g. "32GiB" to act as a 32 GB card).
    max_batch concurrent sequences of up to max_seq_len tokens (default: what fits, at most 32768, 4096 on the
    CPU); prefill_chunk tokens per prefill step (default: the planner's choice, the largest of 256 to 8192
    whose workspace takes at most a third of the budget and leaves the expert cache its slots; 64 on the CPU).
    mtp: load the MTP head (default: when the checkpoint has one; `Engine.mtp_logits` needs it); mtp=False
    leaves it on disk and its VRAM to the expert cache (2.6 GiB at full size). mtp_drafts: also run the head in
    every decode step, keeping its KV cache current and drafting the token after next
    (`engine.scheduler.stats.mtp_acceptance` then reports how often the draft was right). Off by default: it
    costs a decoder layer and a second lm_head read per step, and speculative="mtp" does not need it (its
    plain steps keep their pairs, and the head catches up on them before it drafts in a verify step).
    routing: fixed expert ids for generation instead of the routers' choice (a runner.RoutingSource; for
    routing studies and benchmarks).
    expert_kernel: decode steps compute NVFP4 routed experts with the Pallas expert kernels (default: on a GPU;
    True elsewhere runs them in interpret mode, False keeps the jnp path everywhere); "cuda" takes the CUDA route
    of jaxflash.kernels.nvfp4_experts instead (bfloat16 models; slower than Pallas up to 8 rows on the H200, but
    it takes up to 32 rows a step; on the CPU its C++ handler runs), "pallas" names the default.
    gdn_kernel: decode steps run the GDN recurrent part in one kernel per layer (jaxflash.kernels.gdn_decode),
    prefill chunks its chunked form in three (jaxflash.kernels.gdn_chunk); default: on a GPU where they apply,
    bfloat16 or float32; True elsewhere runs them in interpret mode, False keeps XLA's form.
    hc_kernel: decode and verify steps run the hyper-connection mixes in two kernels each, with the
    combine before the MoE's mix inside them (jaxflash.kernels.hc_mix). Default: on a GPU for steps of one or two
    token rows (hc_mix.FASTER_ROWS; from 4 rows XLA's mix is faster, measured on an H100); an int: steps of at
    most that many rows; True: every step the kernels take (up to hc_mix.MAX_ROWS rows; elsewhere than a GPU in
    interpret mode); False: never.
    attention_kernel: decode and verify steps attend over the paged KV cache in one kernel per layer
    (jaxflash.kernels.attention_decode; default: on a GPU where it applies, bfloat16 or float32; True elsewhere
    runs it in interpret mode, False keeps XLA's form).
    speculative: decode speculatively with up to draft_tokens (1 to 3) drafts per sequence and step, checked in
    one verify step; the output is what plain decoding gives, token for token (greedy, or sampled with the same
    seed). "ngram" proposes them from the sequence's own earlier tokens, "mtp" by the MTP head chained
    draft_tokens times in each verify step (jaxflash.engine.speculative; a plain decode step does not run the
    head: it keeps its pair, and the head catches up on the kept pairs in one chunk before it next drafts). The
    drafts fed per step adapt to their acceptance and the measured step times (scheduler.Spec), down to plain
    steps. None (the default) decodes one token per step: with host experts speculation loses on the H200; with
    every expert on the device, "mtp" with draft_tokens=1 measured best (benchmarks/RESULTS.md).
    ple_table: "device" puts the n-gram table in device memory for full-sequence logits; "host" leaves it
    memory-mapped on the host and gathers the rows each call needs; "auto" picks "device" up to 1 GiB.
    Weights go to the device layer by layer, so host memory holds at most one layer at a time.
    """
    if dtype not in ("float32", "bfloat16", "float64"):
        raise ValueError(f"dtype must be 'float32', 'bfloat16' or 'float64', got {dtype!r}")
    if dtype == "float64" and not jax.config.read("jax_enable_x64"):
        raise ValueError("dtype='float64' needs jax.config.update('jax_enable_x64', True) first")
    k_drafts = _draft_tokens(speculative, draft_tokens)  # bad values fail before loading
    if ple_table not in ("auto", "device", "host"):
        raise ValueError(f"ple_table must be 'auto', 'device' or 'host', got {ple_table!r}")
    nvfp4_experts.expert_kernel_choice(expert_kernel)
    if cache_slots is not None and expert_residency == "device":
        raise ValueError("cache_slots sizes the host-residency expert cache; it contradicts expert_residency='device'")
    budget = planner_mod.parse_bytes(vram_budget)
    ckpt = Checkpoint.open(DEFAULT_MODEL if path is None else path)
    cfg = ckpt.config
    table = ckpt.read_ngram_table() if cfg.ple_layer_ids else None
    on_device = None
    if table is not None:
        nbytes = table.rows * table.dim * table.dtype.itemsize
        if ple_table == "device" or (ple_table == "auto" and nbytes <= DEVICE_TABLE_MAX_BYTES):
            on_device = (table.gather_raw(np.arange(table.rows)), table.scale)
            table = None

    dev = device or jax.devices()[0]
    cpu = dev.platform == "cpu"
    layout = expert_layout(ckpt, cfg)
    with_mtp = mtp is not False and ckpt.has("mtp.fc_hidden.weight")
    if not with_mtp:  # checked against the checkpoint before anything loads; Engine checks the params
        _no_mtp_head(mtp_drafts, speculative, "mtp=False leaves it out" if mtp is False else "the checkpoint has none")
    table_bytes = 0 if on_device is None else on_device[0].nbytes + (4 if on_device[1] is not None else 0)
    mb = model_bytes(ckpt, cfg, dtype, layout, table_bytes, mtp=with_mtp)
    free, note = planner_mod.device_free_bytes(dev)
    plan = planner_mod.plan(
        cfg, mb, residency=expert_residency, budget=budget, free=free, free_note=note, max_batch=max_batch,
        max_seq_len=max_seq_len or (min(cfg.max_position_embeddings, 4096) if cpu else None),
        cache_slots=cache_slots, prefill_chunk=prefill_chunk or (64 if cpu else None),
        dtype_bytes=jnp.dtype(dtype).itemsize, rows_per_seq=1 + k_drafts)
    host = plan.residency == "host"
    if host and layout is None:
        raise planner_mod.PlanError("host-resident experts need NVFP4 or BF16 routed experts in the checkpoint")
    log.info("plan: %s", plan.summary())

    with _weights_bar(ckpt, progress, skip_experts=host, skip_mtp=not with_mtp) as bar:
        params = load_params(ckpt, cfg, dtype, ple_table=on_device, device=device, routed_experts=not host,
                             with_mtp=with_mtp, on_read=lambda name: bar.update(ckpt.info(name).nbytes))
        bar.update(bar.total - bar.n)  # what was not read: input_scale, the PLE hash buffers
    host_experts = None
    if host:
        pool = ffi.ExpertPool.from_checkpoint(ckpt, layout, range(cfg.num_hidden_layers), cfg.num_experts)
        log.info("expert pool: %.2f GiB on the host (%s)", pool.nbytes / 2**30,
                 "pinned" if pool.pinned else "pageable: " + (pool.note or "no CUDA device"))
        host_experts = HostExperts(pool, layout, plan.cache_slots)
    return Engine(cfg, params, host_table=table, checkpoint=ckpt, plan=plan, host_experts=host_experts,
                  mtp_drafts=mtp_drafts, routing=routing, expert_kernel=expert_kernel, gdn_kernel=gdn_kernel,
                  hc_kernel=hc_kernel, speculative=speculative, draft_tokens=draft_tokens,
                  attention_kernel=attention_kernel)


SPECULATIVE = (None, "ngram", "mtp")  # the proposers (jaxflash.engine.speculative)


def _no_mtp_head(mtp_drafts: bool, speculative, why: str) -> None:
    """ValueError if the settings need the MTP head, which is missing (why: the reason it is)."""
    for asked, what in ((mtp_drafts, "mtp_drafts=True"), (speculative == "mtp", "speculative='mtp'")):
        if asked:
            raise ValueError(f"{what} needs the MTP head: {why}")


def _draft_tokens(speculative, draft_tokens) -> int:
    """The runner's drafts per verify step (0: no speculation), or ValueError for a bad combination."""
    if speculative not in SPECULATIVE:
        raise ValueError(f"speculative must be one of {SPECULATIVE}, got {speculative!r}")
    if speculative is None:
        return 0
    if isinstance(draft_tokens, bool) or int(draft_tokens) != draft_tokens or not 1 <= draft_tokens <= 3:
        raise ValueError(f"draft_tokens must be an integer from 1 to 3, got {draft_tokens!r}")
    return int(draft_tokens)
