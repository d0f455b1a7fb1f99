"""Expert sources for host residency: every routed expert sits in a pinned host pool (jaxflash.ffi.ExpertPool)
and the model computes from copies in VRAM. Each source is a pytree value that decoder layers take and
return updated (see jaxflash.model.moe, "expert source"):

  * CachedExperts: a per-layer LRU cache of VRAM slots. The layer's routed ids are resolved against it on
    the device (FFI resolve), only the misses are copied in (FFI gather), and the experts are computed from
    their slots (on a GPU by the NVFP4 expert kernels, which read the slot records in place).
    A decode or verify step resolves all its rows' experts at once.
  * ChunkExperts (prefill chunks): the same caches. A chunk may hit more distinct experts than there are
    slots, so it goes through the cache in blocks of at most `slots` experts (those already cached first):
    resolve the block, copy its misses in, compute its tiles from the slots (on a GPU by the grouped NVFP4
    kernels). Each expert the chunk hits crosses PCIe at most once per chunk, experts already cached are read
    in place, and after the chunk the cache holds what it used most recently, so decoding starts warm. With
    HostExperts.overlap, blocks are half the slots and block b+1 is copied in on a side stream while block
    b's kernels run (ffi.gather_start / gather_wait), by the copy engines unless HostExperts.overlap_mode says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from .. import ffi
from ..model.base import Array, pytree_dataclass, static
from ..kernels import nvfp4_experts
from ..kernels import nvfp4_grouped
from ..model.moe import GROUP_TILE, NVFP4, Experts, MoE, expert_tiles, experts_gather, plan_tiles, take_experts


@dataclass(frozen=True, eq=False)
class HostExperts:
    """The host pool and the geometry of its VRAM caches (fixed for the engine's lifetime)."""

    pool: Any  # ffi.ExpertPool, pool layer i = decoder layer i
    layout: Any  # ffi.ExpertLayout
    slots: int  # cache slots per layer
    gather_mode: str = "auto"
    kernel: bool | None = None  # compute experts with the NVFP4 kernels, decode's and prefill's grouped ones
    # (None: where they apply, NVFP4 on a GPU)
    route: str = "auto"  # the kernels' route (nvfp4_experts.ROUTES)
    overlap: bool = True  # prefill blocks copied in beside the previous block's kernels, where the gather can
    # (ffi.gathers_beside). By the copy engines, it hides the kernels under the copy: H200, 8k prompt in one
    # chunk, 32 GiB: 4,762 against 4,085 tok/s copying first (docs/engine.md)
    overlap_mode: str = "auto"  # the copy beside the kernels (ffi.beside_mode): auto = the copy engines; the
    # zero-copy kernel's loads take SMs from the kernels beside it (no faster than copying first)

    def use_kernel(self, x) -> bool:
        if self.kernel is not None:
            return self.kernel
        return self.layout.kind == "nvfp4" and nvfp4_experts.takes(x, self.route)

    @property
    def num_experts(self) -> int:
        return self.pool.num_experts


def records_as_experts(layout, records: Array) -> Experts:
    """Expert records (uint8 [..., R], the pool/cache layout) as an Experts pytree with the records' leading axes."""
    i = layout.intermediate_size
    if layout.kind == "bf16":
        gu, dn = layout.view(records, "gate_up_weight"), layout.view(records, "down_weight")
        return Experts(gate=gu[..., :i, :], up=gu[..., i:, :], down=dn)
    gu, gs = layout.view(records, "gate_up_weight"), layout.view(records, "gate_up_scale")
    s2 = layout.view(records, "scale_2")
    return Experts(gate=NVFP4(gu[..., :i, :], gs[..., :i, :], s2[..., 0]),
                   up=NVFP4(gu[..., i:, :], gs[..., i:, :], s2[..., 1]),
                   down=NVFP4(layout.view(records, "down_weight"), layout.view(records, "down_scale"), s2[..., 2]))


def stand_in_ids(ids: Array, valid: Array) -> Array:
    """Padding tokens route like the first real token, so they bring no extra experts in."""
    first = jnp.argmax(valid)
    return jnp.where(valid[:, None], ids, ids[first][None, :])


@pytree_dataclass
class CachedExperts:
    """The VRAM expert caches of all decoder layers (decode steps). Per layer: the LRU state (int32, see
    jaxflash.ffi.cache), the slots (uint8 [S, record_bytes]) and the last resolve's status words int32[4]
    (n_miss, n_distinct, status, detail), which the step returns for the host to check and count."""

    lru: tuple
    slots: tuple
    status: tuple
    host: HostExperts = static()

    @staticmethod
    def empty(host: HostExperts, num_layers: int) -> CachedExperts:
        r = host.layout.record_bytes
        lru = ffi.lru_state_init(host.slots, host.num_experts)
        return CachedExperts(lru=tuple(jnp.asarray(lru) for _ in range(num_layers)),
                             slots=tuple(jnp.zeros((host.slots, r), jnp.uint8) for _ in range(num_layers)),
                             status=tuple(jnp.zeros(4, jnp.int32) for _ in range(num_layers)), host=host)

    def routed(self, layer: int, p: MoE, x: Array, ids: Array, w: Array, valid: Array):
        host = self.host
        ids = stand_in_ids(ids, valid)
        with jax.named_scope("resolve"):
            r = ffi.resolve(ids, self.lru[layer], num_slots=host.slots, num_experts=host.num_experts)
        with jax.named_scope("gather"):
            slots = ffi.gather(r.misses, r.info, self.slots[layer], pool=host.pool, layer=layer,
                               mode=host.gather_mode)
        if host.use_kernel(x):
            place, operands = nvfp4_experts.record_operands(host.layout, slots)
            y = nvfp4_experts.routed_experts(place, operands, x, r.slots, w, route=host.route)
        else:
            y = experts_gather(records_as_experts(host.layout, slots), x, r.slots, w)
        return y, CachedExperts(_set(self.lru, layer, r.state), _set(self.slots, layer, slots),
                                _set(self.status, layer, r.info), host)

    def routed_in_blocks(self, layer: int, x: Array, ids: Array, w: Array, valid: Array):
        """A prefill chunk's routed experts through the cache, a block of distinct experts at a time (see the
        module docstring). The status word kept is the first block's that reports an error, else the last's;
        its n_miss and n_distinct count the whole chunk."""
        host = self.host
        ids = stand_in_ids(ids, valid)
        num_experts, slots_n = host.num_experts, host.slots
        plan = plan_tiles(ids, num_experts, GROUP_TILE)
        xs = plan.sort_rows(x)
        lru, cache = self.lru[layer], self.slots[layer]
        present = plan.counts > 0
        n_distinct = jnp.sum(present).astype(jnp.int32)
        # The distinct experts, those already cached first (ascending ids within each group), then the last of
        # them repeated: a block past the chunk's experts resolves that one again (a hit, nothing copied).
        # Cached first, so that the first blocks read them in place before later blocks evict them: a chunk
        # copies only its experts that are not cached, and the next chunk finds this one's last blocks cached.
        cached = ffi.lru_expert_slots(lru, slots_n, num_experts) >= 0
        rank = jnp.where(present, jnp.where(cached, 0, 1), 2) * num_experts + jnp.arange(num_experts)
        distinct = jnp.argsort(rank).astype(jnp.int32)
        distinct = jnp.where(jnp.arange(num_experts) < n_distinct, distinct, distinct[n_distinct - 1])
        # Overlapped (HostExperts.overlap): block b+1's misses are copied on a side stream while block b's
        # kernels run. Blocks of half the slots keep them apart: the LRU evicts for block b+1 the
        # least recently used slots, and block b's were just used, so b+1's copies never land in b's slots.
        overlap = host.overlap and slots_n >= 2 and ffi.gathers_beside(host.pool, host.overlap_mode)
        block = min(slots_n // 2 if overlap else slots_n, num_experts)
        kernel = host.layout.kind == "nvfp4" and (host.kernel if host.kernel is not None else nvfp4_grouped.takes(x))
        # the kernels' even/odd input columns, split once here: inside the block loop XLA split them per block
        xs_split = nvfp4_grouped.split_inputs(xs) if kernel else None

        def resolve(b, lru):
            """Block b's resolve and the slot of each of its tiles (-1: another block's tile)."""
            lane = b * block + jnp.arange(block)
            ex = distinct[jnp.minimum(lane, num_experts - 1)]
            with jax.named_scope("resolve"):
                r = ffi.resolve(ex, lru, num_slots=slots_n, num_experts=num_experts)
            mine = lane < n_distinct  # this block's own experts (the repeats are the previous block's)
            slot_of = jnp.full(num_experts, -1, jnp.int32).at[jnp.where(mine, ex, num_experts)].set(
                r.slots, mode="drop")
            return r, jnp.where(plan.tile_expert >= 0, slot_of[jnp.maximum(plan.tile_expert, 0)], -1)

        def compute(cache, tile_slot, ys):
            """The tiles of one block, from their slots; other tiles keep their rows of ys."""
            if kernel:
                place, operands = nvfp4_experts.record_operands(host.layout, cache)
                return nvfp4_grouped.grouped_experts(place, operands, xs_split, tile_slot, GROUP_TILE, y0=ys)
            we = take_experts(records_as_experts(host.layout, cache), jnp.maximum(tile_slot, 0))  # the twin
            yt = expert_tiles(we, xs.reshape(-1, GROUP_TILE, x.shape[-1])).reshape(ys.shape)
            return jnp.where(jnp.repeat(tile_slot >= 0, GROUP_TILE)[:, None], yt, ys)

        def count(info, r):  # misses summed; the first error's status kept, else the latest
            return jnp.where(info[2] != 0, info, r.info).at[0].set(info[0] + r.info[0])

        def gather(r, cache):
            with jax.named_scope("gather"):
                return ffi.gather(r.misses, r.info, cache, pool=host.pool, layer=layer, mode=host.gather_mode)

        def one_block(b, carry):  # resolve, copy in, compute
            lru, cache, ys, info = carry
            r, tile_slot = resolve(b, lru)
            cache = gather(r, cache)
            return r.state, cache, compute(cache, tile_slot, ys), count(info, r)

        def overlapped_block(b, carry):  # block b+1 resolved and copied in beside block b's kernels
            lru, cache, ys, info, tile_slot = carry
            r, next_slot = resolve(b + 1, lru)  # past the last block: a repeat (a hit, nothing copied)
            with jax.named_scope("gather"):
                cache = ffi.gather_start(r.misses, r.info, cache, pool=host.pool, layer=layer,
                                         mode=host.overlap_mode)
            ys = compute(cache, tile_slot, ys)
            cache, ys = ffi.gather_wait(cache, ys, r.misses, r.info)
            return r.state, cache, ys, count(info, r), next_slot

        # A loop, not unrolled blocks: the slots are updated in place by each block's gather after the previous
        # block's kernels read them, and across unrolled blocks XLA kept the old contents by copying every
        # layer's cache (19 GiB of temporaries at full size on the H200). Its trip count is data: only the
        # blocks the chunk's distinct experts fill run.
        n_blocks = (n_distinct + block - 1) // block
        # The tiles' outputs start as their inputs, not zeros: every tile holding pairs is computed by one block,
        # and combine reads only the pairs' rows. A zero-filled start would depend on nothing, and XLA builds
        # such buffers for all layers at once at the start of the program, where they stay.
        ys = xs
        info = jnp.zeros(4, jnp.int32)
        if overlap:
            r, tile_slot = resolve(0, lru)  # the first block alone: mostly cached experts
            cache = gather(r, cache)
            lru, cache, ys, info, _ = jax.lax.fori_loop(0, n_blocks, overlapped_block,
                                                        (r.state, cache, ys, count(info, r), tile_slot))
        else:
            lru, cache, ys, info = jax.lax.fori_loop(0, n_blocks, one_block, (lru, cache, ys, info))
        info = info.at[1].set(n_distinct)
        cached = CachedExperts(_set(self.lru, layer, lru), _set(self.slots, layer, cache),
                               _set(self.status, layer, info), host)
        return plan.combine(ys, w, x.shape[0]), cached


@pytree_dataclass
class ChunkExperts:
    """A prefill chunk's expert source: the decode step's VRAM caches, gone through in blocks of experts
    (CachedExperts.routed_in_blocks); the runner keeps `cache` afterwards."""

    cache: CachedExperts

    def routed(self, layer: int, p: MoE, x: Array, ids: Array, w: Array, valid: Array):
        y, cache = self.cache.routed_in_blocks(layer, x, ids, w, valid)
        return y, ChunkExperts(cache)


def _set(items: tuple, i: int, value) -> tuple:
    return items[:i] + (value,) + items[i + 1:]
