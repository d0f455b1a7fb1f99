"""The GPU-managed expert cache: `resolve` (LRU bookkeeping on the device) and `gather` (copy the misses in).

Per layer the cache is S slots of one expert record each (experts.py gives the layout), held in a uint8 array
[S, record_bytes] -- or all layers stacked, [L, S, record_bytes], with `layer` picking the slice. One array per
layer is the recommended form: each gather then aliases only its own layer's buffer.

LRU state: one int32 array per layer (or stacked [L, n]), n = 4 + 2S + E:
    [0] step   [1] S   [2] E   [3] 0   slot_expert[S]   slot_stamp[S]   expert_slot[E]
(-1 marks an empty slot / an uncached expert). Thread it through the jitted step with donation; resolve aliases
it in and out, so its address never changes and a captured step stays valid.

resolve(ids [T, k]) for one layer, per step:
  * the distinct experts are taken in ascending id order; cached ones are hits and their slots' stamps become
    this step's stamp (step + 1);
  * the misses, in ascending expert id, take the victims in ascending (stamp, slot index) order among the slots
    holding no expert this step needs -- empty slots (stamp -1) first, lowest index first;
  * returns slots [T, k] (the slot of each routed expert), misses [M, 2] of (expert, slot) padded with -1,
    M = min(T*k, S, E), and info int32[4] = (n_miss, n_distinct, status, detail).
  * stamps are rebased (lowered by 2^29, clamped at 0) before the step that would reach 2^30.
Errors (an expert id outside [0, E), more distinct experts than slots, a foreign or corrupt state): the CPU
handler raises; the CUDA handler cannot stop the device, so it leaves the state untouched, writes slot 0 and
no misses, and sets info[2]. The step's outputs are then garbage: call `check_info(info)` on the host after
the step (the engine reads the sampled token anyway) and discard the step if it raises.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _ext

HEADER = 4
STATUS = {0: "ok", 1: "bad expert id", 2: "too many distinct experts", 3: "bad LRU state", 4: "bad token id",
          5: "bad length", 6: "bad n-gram context"}
GATHER_MODES = ("zero_copy", "memcpy")


class ExpertCacheError(RuntimeError):
    """A resolve or gather step reported an error through its info output."""


def lru_state_size(num_slots: int, num_experts: int) -> int:
    return HEADER + 2 * num_slots + num_experts


def lru_state_init(num_slots: int, num_experts: int, num_layers: int | None = None) -> np.ndarray:
    """A fresh (empty) LRU state: int32 [n], or [num_layers, n] when stacked."""
    if num_slots <= 0 or num_experts <= 0:
        raise ValueError(f"num_slots={num_slots} and num_experts={num_experts} must be positive")
    st = np.full(lru_state_size(num_slots, num_experts), -1, np.int32)
    st[:HEADER] = (0, num_slots, num_experts, 0)
    return st if num_layers is None else np.tile(st, (num_layers, 1))


def lru_state_fields(state, num_slots: int, num_experts: int) -> dict[str, np.ndarray]:
    """The named fields of one layer's state (numpy): step, slot_expert, slot_stamp, expert_slot."""
    st = np.asarray(state)
    S = num_slots
    return {
        "step": st[..., 0],
        "slot_expert": st[..., HEADER : HEADER + S],
        "slot_stamp": st[..., HEADER + S : HEADER + 2 * S],
        "expert_slot": st[..., HEADER + 2 * S : HEADER + 2 * S + num_experts],
    }


def lru_expert_slots(state: jax.Array, num_slots: int, num_experts: int) -> jax.Array:
    """The slot of each expert (int32 [E], -1: not cached) from one layer's state, as a traced array: the
    expert_slot field, for code that orders its work by what is cached."""
    start = HEADER + 2 * num_slots
    return jax.lax.slice_in_dim(state, start, start + num_experts, axis=-1)


def cache_init(num_slots: int, record_bytes: int, num_layers: int | None = None) -> jax.Array:
    """An empty VRAM cache (uint8 [S, R], or [L, S, R] stacked) on JAX's default device."""
    shape = (num_slots, record_bytes) if num_layers is None else (num_layers, num_slots, record_bytes)
    return jnp.zeros(shape, jnp.uint8)


class Resolved(NamedTuple):
    slots: jax.Array  # int32, the shape of ids
    misses: jax.Array  # int32 [M, 2] (expert, slot), -1 padded
    info: jax.Array  # int32 [4]: n_miss, n_distinct, status, detail
    state: jax.Array  # the updated LRU state (aliases the input)


def resolve(ids, state, *, num_slots: int, num_experts: int, layer: int = 0) -> Resolved:
    """One layer's LRU step for the routed expert ids of a step ([T, k], or any shape). `layer` selects the
    row of a stacked [L, n] state and is ignored for a per-layer state."""
    _ext.module()
    ids = jnp.asarray(ids, jnp.int32)
    if ids.size == 0:
        raise ValueError("resolve needs at least one routed expert id")
    state = jnp.asarray(state)
    if state.dtype != jnp.int32:
        raise TypeError(f"the LRU state must be int32, got {state.dtype}")
    n = lru_state_size(num_slots, num_experts)
    if state.shape not in ((n,),) and not (state.ndim == 2 and state.shape[1] == n):
        raise ValueError(f"LRU state of shape {state.shape} does not match num_slots={num_slots}, "
                         f"num_experts={num_experts} (expected [{n}] or [L, {n}])")
    M = min(ids.size, num_slots, num_experts)
    out = (
        jax.ShapeDtypeStruct(ids.shape, jnp.int32),
        jax.ShapeDtypeStruct((M, 2), jnp.int32),
        jax.ShapeDtypeStruct((4,), jnp.int32),
        jax.ShapeDtypeStruct(state.shape, jnp.int32),
    )
    call = jax.ffi.ffi_call("jaxflash_resolve", out, input_output_aliases={1: 3})
    slots, misses, info, new_state = call(ids, state, num_slots=np.int64(num_slots),
                                          num_experts=np.int64(num_experts), layer=np.int64(layer))
    return Resolved(slots, misses, info, new_state)


def default_gather_mode(pool) -> str:
    """zero_copy (a kernel reading the mapped pool; capturable) for a pinned pool, else memcpy."""
    return "zero_copy" if getattr(pool, "pinned", True) else "memcpy"


def gather(misses, info, cache, *, pool, layer: int, mode: str = "auto") -> jax.Array:
    """Copy resolve's misses of pool layer `layer` into their slots of `cache` (aliased: donate it).

    mode "zero_copy": a kernel reads the mapped host pool directly; command-buffer compatible (CUDA graphs).
    mode "memcpy": one cudaMemcpyAsync per run of adjacent records after reading the miss list back (a stream
    sync), so XLA keeps it outside command buffers; works for unpinned pools. "auto" picks per pool. The CPU
    backend has a single copy path."""
    _ext.module()
    if mode == "auto":
        mode = default_gather_mode(pool)
    if mode not in GATHER_MODES:
        raise ValueError(f"gather mode {mode!r}: expected 'auto' or one of {GATHER_MODES}")
    target = "jaxflash_gather" if mode == "zero_copy" else "jaxflash_gather_memcpy"
    return _gather_call(target, "gather", misses, info, cache, pool, layer)


def _gather_call(target: str, who: str, misses, info, cache, pool, layer: int) -> jax.Array:
    """One of the gather custom calls: misses and info in, the cache aliased to the output."""
    pool_id = int(getattr(pool, "id", pool))
    if pool_id <= 0:
        raise ValueError(f"{who}: the expert pool is closed")
    cache = jnp.asarray(cache)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(cache.shape, cache.dtype), input_output_aliases={2: 0})
    return call(jnp.asarray(misses, jnp.int32), jnp.asarray(info, jnp.int32), cache, pool_id=np.int64(pool_id),
                layer=np.int64(layer))


def gathers_beside(pool, mode: str = "auto") -> bool:
    """Whether gather_start serves this pool and mode: on a GPU the zero-copy kernel needs a pinned pool, the
    copy engines (memcpy) take any pool (asynchronous only from pinned memory); the CPU backend has one copy
    path for every mode."""
    if jax.default_backend() == "cpu":
        return True
    return beside_mode(mode) == "memcpy" or getattr(pool, "pinned", True)


def beside_mode(mode: str = "auto") -> str:
    """gather_start's mode: "auto" is memcpy, the copy engines, which leave the SMs to the kernels that run
    beside the copy (the zero-copy kernel's loads compete with them for the SMs)."""
    if mode == "auto":
        return "memcpy"
    if mode not in GATHER_MODES:
        raise ValueError(f"gather mode {mode!r}: expected 'auto' or one of {GATHER_MODES}")
    return mode


def gather_start(misses, info, cache, *, pool, layer: int, mode: str = "auto") -> jax.Array:
    """`gather` started beside what follows it: on a GPU the misses are copied on a side stream once everything
    enqueued before this call is done, while XLA's stream goes on. Until `gather_wait` the missed slots are
    being written: read only other slots in between. mode (beside_mode) "memcpy": the copy engines, after the
    miss list is read back (a stream sync, so not under capture); "zero_copy": the gather kernel. The CPU
    copies before returning."""
    _ext.module()
    mode = beside_mode(mode)
    if int(getattr(pool, "id", pool)) > 0 and not gathers_beside(pool, mode):
        raise ValueError("gather_start with mode='zero_copy' needs a pinned pool on a GPU; use mode='memcpy'")
    target = "jaxflash_gather_start" if mode == "zero_copy" else "jaxflash_gather_start_memcpy"
    return _gather_call(target, "gather_start", misses, info, cache, pool, layer)


def gather_wait(cache, after, misses, info) -> tuple[jax.Array, jax.Array]:
    """Join every `gather_start` so far: returns (cache, after) once the copies are in (both aliased: donate
    them). `after` is the last work that reads the cache beside the copy (its output): taking it orders that
    work before the join. `misses` and `info` (gather_start's) stay alive until here, as the copy reads them."""
    _ext.module()
    cache, after = jnp.asarray(cache), jnp.asarray(after)
    call = jax.ffi.ffi_call("jaxflash_gather_wait", (jax.ShapeDtypeStruct(cache.shape, cache.dtype),
                                                     jax.ShapeDtypeStruct(after.shape, after.dtype)),
                            input_output_aliases={0: 0, 1: 1})
    return tuple(call(cache, after, jnp.asarray(misses, jnp.int32), jnp.asarray(info, jnp.int32)))


def check_info(info, *, num_slots: int | None = None, num_experts: int | None = None, what: str = "resolve") -> None:
    """Raise ExpertCacheError if a resolve info (int32[4], or stacked [..., 4]) reports an error."""
    arr = np.asarray(info).reshape(-1, 4)
    for row, (_, _, status, detail) in enumerate(arr):
        if status:
            where = f" (row {row})" if len(arr) > 1 else ""
            msg = _ext.module().status_message(int(status), int(detail), num_slots if num_slots is not None else -1,
                                               num_experts if num_experts is not None else -1)
            raise ExpertCacheError(f"expert cache {what}{where}: {msg}")
