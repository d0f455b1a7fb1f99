"""XLA FFI custom calls of jaxflash: the expert store, the GPU-managed expert cache and the PLE host step.

    pool  = ExpertPool.from_checkpoint(ckpt, ExpertLayout.from_config(cfg), layers, cfg.num_experts)
    state = lru_state_init(num_slots, cfg.num_experts)           # per layer; donate it through the step
    cache = cache_init(num_slots, pool.layout.record_bytes)      # per layer; donate it too
    # inside the jitted step, per MoE layer l:
    r = resolve(topk_ids, state, num_slots=num_slots, num_experts=cfg.num_experts)
    cache = gather(r.misses, r.info, cache, pool=pool, layer=l)
    # ... expert matmuls read cache[r.slots] ...; after the step, on the host: check_info(r.info)

    table = NgramTable.from_checkpoint(ckpt, cfg); h = NgramHash.from_config(cfg)
    ctx = ngram_context_init(batch, cfg.eos_token_id)
    p = ple_step(tokens, ctx, table, h)                        # p.ids, p.rows, p.info, p.context

    x = uncaptured_copy(x)         # a per-call input, copied in outside the CUDA graph (ffi/copy.py)

The handlers live in the native modules `jaxflash_ffi` / `jaxflash_ffi_cuda` (see _ext.py); they are loaded
and registered with XLA on first use, so importing this package needs no build.
"""

from ._ext import handler_calls, module, reset_handler_calls
from .cache import (
    GATHER_MODES,
    ExpertCacheError,
    Resolved,
    cache_init,
    check_info,
    default_gather_mode,
    gather,
    gather_start,
    gather_wait,
    beside_mode,
    gathers_beside,
    lru_expert_slots,
    lru_state_fields,
    lru_state_init,
    lru_state_size,
    resolve,
)
from .copy import uncaptured_copy
from .experts import (
    ExpertLayout,
    ExpertPool,
    LoadStats,
    PinningWarning,
    expert_plan,
    layer_prefixes,
    normalize_dtype,
)
from .memory import HostMemory, pinning_fits, read_host_memory
from .ple import NgramHash, NgramTable, PleError, PleStep, check_ple_info, ngram_context_init, ple_step

__all__ = [
    "GATHER_MODES", "ExpertCacheError", "ExpertLayout", "ExpertPool", "HostMemory", "LoadStats", "NgramHash",
    "NgramTable", "PinningWarning", "PleError", "PleStep", "Resolved", "cache_init", "check_info",
    "check_ple_info", "default_gather_mode", "expert_plan", "gather", "gather_start", "gather_wait",
    "beside_mode", "gathers_beside", "handler_calls", "layer_prefixes",
    "lru_expert_slots", "lru_state_fields", "lru_state_init", "lru_state_size", "module", "ngram_context_init",
    "normalize_dtype",
    "pinning_fits", "ple_step", "read_host_memory", "reset_handler_calls", "resolve", "uncaptured_copy",
]
