"""The memory planner: where the experts live and how the rest of the VRAM budget is split.

Rules (docs/engine.md, "Memory plan"): all routed experts in VRAM when they fit the budget beside everything
else; otherwise all of them on the host, with the VRAM they would have used given to a per-layer LRU cache of
expert slots (never a partial residency). The budget is the smaller of `vram_budget` and the memory the device
reports free. The planner reserves, in order: the dense weights, a compute workspace, per-sequence state, the
KV cache for `max_batch` sequences of `max_seq_len` tokens, and gives the rest to the cache (prefill chunks go
through the same cache, a block of experts at a time: no separate staging area).
Every decision is logged with its numbers; what cannot fit raises PlanError before anything is allocated.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import jax

from ..config import FULL_ATTENTION, ModelConfig

log = logging.getLogger("jaxflash.planner")
GiB, MiB = 1 << 30, 1 << 20
PAGE = 16  # tokens per KV page
DEFAULT_MAX_SEQ_LEN = 32768
MIN_AUTO_SEQ_LEN = 2048  # the planner shortens an unrequested context down to this before giving up
RESIDENCIES = ("auto", "device", "host")


class PlanError(RuntimeError):
    """The model cannot run within the memory it was given."""


def size(n: int) -> str:
    """A byte count for people: GiB above 1 GiB, else MiB."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def parse_bytes(value) -> int | None:
    """'32GiB', '24GB', '512MiB', 1e9 -> bytes (None stays None)."""
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    s = str(value).strip().replace(" ", "")
    units = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": MiB,
             "g": 1000**3, "gb": 1000**3, "gib": GiB, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}
    num = s.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = s[len(num):].lower()
    try:
        n = float(num)
    except ValueError:
        n = -1
    if unit not in units or n <= 0:
        raise ValueError(f"cannot read {value!r} as a memory size (examples: 32GiB, 24GB, 512MiB)")
    return int(n * units[unit])


@dataclass(frozen=True)
class ModelBytes:
    """What the planner must know about the checkpoint's weights."""

    dense: int  # everything but the routed experts of the decoder layers, in the compute dtype
    experts: int  # the routed experts of all decoder layers as they would sit in VRAM
    record_bytes: int  # one expert in the cache/pool record layout (0: no host residency possible)
    ple_table_device: int = 0  # an n-gram table kept in VRAM (0: on the host)


@dataclass
class Plan:
    residency: str  # "device" or "host"
    budget: int
    max_batch: int
    max_seq_len: int
    page_size: int
    num_pages: int
    cache_slots: int  # per layer (0 when experts are on the device)
    prefill_chunk: int
    reserved: dict = field(default_factory=dict)  # what each part takes, bytes
    notes: list = field(default_factory=list)

    @property
    def kv_tokens(self) -> int:
        return self.num_pages * self.page_size

    def summary(self) -> str:
        parts = ", ".join(f"{k} {size(v)}" for k, v in self.reserved.items())
        cache = f", cache {self.cache_slots} slots/layer" if self.residency == "host" else ""
        return (f"experts on {self.residency}{cache}; {self.max_batch} sequences x {self.max_seq_len} tokens "
                f"(KV {self.kv_tokens} tokens in {self.num_pages} pages); budget {size(self.budget)}: {parts}")


def device_free_bytes(device=None) -> tuple[int | None, str]:
    """(free bytes of the device, where the number came from)."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 -- backends without memory stats
        stats = None
    if stats and "bytes_limit" in stats:
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        return free, f"{device.platform} reports {free / GiB:.2f} GiB free"
    from ..ffi.memory import read_host_memory

    mem = read_host_memory()
    return mem.available, f"{device.platform} device: host memory ({mem.describe()})"


def state_bytes(cfg: ModelConfig, dtype_bytes: int) -> tuple[int, int]:
    """(per-sequence fixed state bytes, KV bytes per token) for the compute dtype."""
    n_attn = sum(t == FULL_ATTENTION for t in cfg.layer_types)
    n_gdn = cfg.num_hidden_layers - n_attn
    gdn = (cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
           + (cfg.linear_conv_kernel_dim - 1) * cfg.linear_conv_dim * dtype_bytes)
    per_seq = n_gdn * gdn + (cfg.ple_conv_state_len + 1) * cfg.hc_hidden_size * 4 + 64
    per_token = n_attn * (2 * cfg.num_key_value_heads * cfg.head_dim
                          + (cfg.indexer_head_dim if cfg.qsa_enabled else 0)) * dtype_bytes
    return per_seq, per_token


def workspace_bytes(cfg: ModelConfig, chunk: int, max_seq_len: int, max_batch: int) -> int:
    """Temporary memory of the compiled steps (an estimate with margin), the largest of:
      * a prefill chunk: its attention (at most ATTEND_Q_BLOCK queries against the whole context at once: the
        blocked form's scores and QSA selection), its MoE tiles (rows of the (token, k) pairs padded per expert,
        in, out and the activation), the residual streams and the rows of prompt scoring's logits;
      * a decode step: each sequence's gathered KV."""
    from ..model.attention import ATTEND_K_BLOCK, ATTEND_Q_BLOCK
    from ..model.moe import GROUP_TILE
    from .runner import SCORE_ROWS

    q = min(chunk, ATTEND_Q_BLOCK)
    kb = min(ATTEND_K_BLOCK, max_seq_len)
    attn = (q * cfg.num_attention_heads * (max_seq_len if chunk <= ATTEND_Q_BLOCK else 2 * kb) * 4
            + q * max_seq_len * 2 + 2 * max_seq_len * cfg.num_key_value_heads * cfg.head_dim * 4)
    rows = chunk * cfg.num_experts_per_tok + cfg.num_experts * GROUP_TILE
    moe = rows * (3 * cfg.hidden_size + 2 * cfg.moe_intermediate_size) * 2
    acts = chunk * 16 * cfg.hc_hidden_size * 4 + min(chunk, SCORE_ROWS) * cfg.vocab_size * 4 * 2
    kv_gather = max_batch * max_seq_len * 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    return int(1.25 * max(attn + moe + acts, kv_gather)) + 256 * MiB


# What chunk_options picks from. On the H200 (full size, bf16, an 8192-token context) the prefill program of
# 8192-token chunks takes 8.9 GiB of temporaries with host experts and 4.5 GiB with resident ones, against
# workspace_bytes' 9.8 GiB (benchmarks/RESULTS.md); the scheduler's warm-up warns if a compiled program ever
# needs more than the planner reserved (Scheduler._check_workspace).
PREFILL_CHUNKS = (8192, 4096, 2048, 1024, 512, 256)
# A chosen chunk's workspace takes at most 1 / WORKSPACE_SHARE of the budget. With host experts a chunk of 2048
# tokens or more hits most of a layer's experts, so each chunk copies nearly the whole bank over PCIe and a
# prompt prefills about in proportion to its chunk. H200, 32 GiB, calibrated routing, an 8192-token prompt:
# chunks of 2048 / 4096 / 8192 leave 151 / 134 / 102 cache slots and prefill at 1,795 / 3,061 / 4,600 tok/s,
# while decode at 102 slots runs 10% slower than at 148 (45.2 against 50.3 tok/s). For one sequence a third
# picks 8192 at 32 GiB and 4096 at 24 GiB; plan() steps down where the cache would lose its slots (256 at
# 16 GiB; 2048 at 32 GiB for 8 sequences, whose steps may need 80 slots).
WORKSPACE_SHARE = 3


def chunk_options(cfg: ModelConfig, max_seq_len: int, max_batch: int, budget: int) -> list[int]:
    """Prefill chunk sizes the planner may pick when none is given, largest first: those of PREFILL_CHUNKS (no
    longer than the context) whose workspace fits 1 / WORKSPACE_SHARE of the budget, or the smallest. Larger
    chunks bring each expert a prompt hits over PCIe once per chunk instead of once per smaller one; with host
    experts plan() takes the largest that still leaves the cache its slots."""
    fits = [c for c in PREFILL_CHUNKS if c <= max_seq_len
            and workspace_bytes(cfg, c, max_seq_len, max_batch) * WORKSPACE_SHARE <= budget]
    return fits or [min(PREFILL_CHUNKS[-1], max_seq_len)]


def _chunk_note(chunk: int, why: str, workspace: int) -> str:
    return f"prefill chunks of {chunk} tokens ({why}; workspace {size(workspace)})"


LARGEST = f"the largest whose workspace fits 1/{WORKSPACE_SHARE} of the budget"


def plan(cfg: ModelConfig, mb: ModelBytes, *, residency: str = "auto", budget: int | None = None,
         free: int | None = None, free_note: str = "", max_batch: int = 8, max_seq_len: int | None = None,
         cache_slots: int | None = None, prefill_chunk: int | None = None, dtype_bytes: int = 2,
         rows_per_seq: int = 1) -> Plan:
    """Decide residency, cache slots, KV pages and max_seq_len (see the module docstring). rows_per_seq: token
    rows a decode step feeds per sequence (1 + the drafts of a speculative verify step)."""
    if residency not in RESIDENCIES:
        raise ValueError(f"expert_residency must be one of {RESIDENCIES}, got {residency!r}")
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if free is None and budget is None:
        raise PlanError("no memory figure: the device reports none and no vram_budget was given")
    total = min(x for x in (budget, free) if x is not None)
    why = (f"budget {size(total)} = min(vram_budget {size(budget)}, {free_note})"
           if budget is not None and free is not None else
           f"budget {size(total)} from " + ("vram_budget" if budget is not None else free_note))
    log.info(why)
    notes = [why]
    k, E, L = cfg.num_experts_per_tok, cfg.num_experts, cfg.num_hidden_layers
    seq_wanted = max_seq_len or min(cfg.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
    if seq_wanted > cfg.max_position_embeddings:
        raise PlanError(f"max_seq_len {seq_wanted} exceeds the model's max_position_embeddings "
                        f"{cfg.max_position_embeddings}")
    align = math.lcm(PAGE, cfg.indexer_compress_ratio if cfg.qsa_enabled else 1)
    if seq_wanted % align:
        rounded = -(-seq_wanted // align) * align
        msg = (f"max_seq_len {seq_wanted} rounded up to {rounded}: the KV cache holds whole pages of "
               f"{align} tokens")
        log.warning(msg)
        notes.append(msg)
    per_seq, per_token = state_bytes(cfg, dtype_bytes)

    def aligned(seq):
        return -(-seq // align) * align

    def chunks(seq):  # the prefill chunks to try at an (aligned) context, largest first
        return [prefill_chunk] if prefill_chunk else chunk_options(cfg, seq, max_batch, total)

    def fixed(seq, chunk):  # everything but the experts / the cache
        return {"dense weights": mb.dense + mb.ple_table_device,
                "workspace": workspace_bytes(cfg, chunk, seq, max_batch),
                "sequence state": max_batch * per_seq,
                "KV cache": max_batch * seq * per_token}

    def note(msg):
        log.info(msg)
        notes.append(msg)

    want_device = residency == "device" or (residency == "auto" and cache_slots is None)
    if want_device:
        seq = aligned(seq_wanted)
        chunk = chunks(seq)[0]
        res = fixed(seq, chunk)
        need = sum(res.values()) + mb.experts
        if need <= total:
            res["experts"] = mb.experts
            note(f"experts on the device: {size(mb.experts)} of experts + {size(need - mb.experts)} "
                 f"of the rest fit the {size(total)} budget")
            note(_chunk_note(chunk, "as given" if prefill_chunk else LARGEST, res["workspace"]))
            return Plan("device", total, max_batch, seq, PAGE, max_batch * seq // PAGE, 0, chunk, res, notes)
        if residency == "device":
            raise PlanError(f"expert_residency='device' needs {size(need)} ("
                            + ", ".join(f"{n} {size(v)}" for n, v in res.items())
                            + f", experts {size(mb.experts)}); the budget is {size(total)}")
        note(f"experts on the host: they need {size(mb.experts)} and the rest {size(need - mb.experts)}"
             f", over the {size(total)} budget")
    if mb.record_bytes <= 0:
        raise PlanError("host-resident experts need NVFP4 or BF16 expert tensors in the checkpoint")

    rows = max_batch * rows_per_seq
    min_slots = min(E, rows * k)  # a decode (or verify) step may route its rows to rows * k distinct experts
    good_slots = min(E, max(min_slots, 3 * k))  # below ~3 x top_k slots an LRU cache retains nothing
    seq = seq_wanted
    want_slots = cache_slots or good_slots
    while True:
        seq = aligned(seq)
        options = chunks(seq)
        # The largest chunk that leaves the cache its slots: its workspace comes out of the cache.
        for chunk in options:
            res = fixed(seq, chunk)
            left = total - sum(res.values())
            fit = max(0, left // (L * mb.record_bytes))
            if fit >= want_slots:
                break
        slots = min(E, fit) if cache_slots is None else cache_slots
        if cache_slots is not None or fit >= good_slots or max_seq_len or seq <= MIN_AUTO_SEQ_LEN:
            break
        note(f"max_seq_len {seq}: only {fit} cache slots/layer would fit; halving the context")
        seq = max(MIN_AUTO_SEQ_LEN, seq // 2)
    if cache_slots is not None:
        if not min_slots <= cache_slots <= E:
            raise PlanError(f"cache_slots={cache_slots}: a step of {rows} token rows may need {min_slots} "
                            f"distinct experts per layer, so cache_slots must be in [{min_slots}, {E}]")
        if cache_slots > fit:
            raise PlanError(f"cache_slots={cache_slots} x {L} layers x {mb.record_bytes / MiB:.2f} MiB does not fit:"
                            f" {size(max(left, 0))} is left after "
                            + ", ".join(f"{n} {size(v)}" for n, v in res.items()))
    if slots < min_slots:
        raise PlanError(f"the expert cache would get {slots} slots per layer, fewer than the {min_slots} a step of "
                        f"{max_batch} sequences may need: {size(total)} budget minus "
                        + ", ".join(f"{n} {size(v)}" for n, v in res.items())
                        + ". Raise vram_budget, or lower max_batch or max_seq_len")
    if slots < good_slots:
        note(f"warning: {slots} cache slots/layer is below 3 x top_k = {3 * k}; expect few cache hits")
    res["expert cache"] = slots * L * mb.record_bytes
    note(f"expert cache: {slots} slots/layer x {L} layers x {mb.record_bytes / MiB:.2f} MiB = "
         f"{size(res['expert cache'])} ({slots / E:.0%} of the experts); prefill chunks go through it "
         f"{min(slots, E)} experts at a time")
    note(f"KV cache: {max_batch} x {seq} tokens = {size(res['KV cache'])}")
    if prefill_chunk:
        why = "as given"
    elif chunk == options[0]:
        why = LARGEST
    elif fit >= want_slots:
        why = f"{LARGEST} and leaves the expert cache {want_slots} slots/layer"
    else:
        why = f"the smallest tried: none leaves the expert cache {want_slots} slots/layer"
    note(_chunk_note(chunk, why, res["workspace"]))
    return Plan("host", total, max_batch, seq, PAGE, max_batch * seq // PAGE, slots, chunk,
                res, notes)
