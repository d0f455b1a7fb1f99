"""Expert sources for host residency: every routed expert sits in a pinned host pool (jaxflash.ffi.ExpertPool)
and the model computes from copies in VRAM. Each source is a pytree value that decoder layers take and
return updated (see jaxflash.model.moe, "expert source"):

  * CachedExperts (decode steps): a per-layer LRU cache of VRAM slots. The layer's routed ids are resolved
    against it on the device (FFI resolve), only the misses are copied in (FFI gather), and the experts are
    computed from their slots (on a GPU by the NVFP4 expert kernels, which read the slot records in place).
  * StagedExperts (prefill chunks): the experts a chunk hits are copied into one staging area, `staging`
    records at a time, and computed there (the tiled path); the decode cache is left as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from .. import ffi
from ..model.base import Array, pytree_dataclass, static
from ..kernels import nvfp4_experts
from ..model.moe import NVFP4, Experts, MoE, experts_gather, tiled_with_fetch


@dataclass(frozen=True, eq=False)
class HostExperts:
    """The host pool and the geometry of its VRAM caches (fixed for the engine's lifetime)."""

    pool: Any  # ffi.ExpertPool, pool layer i = decoder layer i
    layout: Any  # ffi.ExpertLayout
    slots: int  # cache slots per layer (decode)
    staging: int  # records staged at once (prefill)
    gather_mode: str = "auto"
    kernel: bool | None = None  # compute decode experts with the NVFP4 kernels (None: for NVFP4 on a GPU)
    route: str = "auto"  # the kernels' route (nvfp4_experts.ROUTES)

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


@pytree_dataclass
class StagedExperts:
    """The prefill staging area (uint8 [staging, record_bytes]), shared by the layers of a chunk in turn."""

    area: Array
    host: HostExperts = static()

    @staticmethod
    def empty(host: HostExperts) -> StagedExperts:
        return StagedExperts(jnp.zeros((host.staging, host.layout.record_bytes), jnp.uint8), host)

    def routed(self, layer: int, p: MoE, x: Array, ids: Array, w: Array, valid: Array):
        host = self.host
        ids = stand_in_ids(ids, valid)
        n = host.staging
        lane = jnp.arange(n)

        def fetch(area, ex, n_live):  # copy the `n_live` experts ex[:n_live] into the first lanes
            misses = jnp.where((lane < n_live)[:, None], jnp.stack([ex, lane], axis=1), -1).astype(jnp.int32)
            note = jnp.stack([n_live, n_live, 0, 0]).astype(jnp.int32)
            with jax.named_scope("gather"):
                area = ffi.gather(misses, note, area, pool=host.pool, layer=layer, mode=host.gather_mode)
            return area, records_as_experts(host.layout, area)

        y, area = tiled_with_fetch(fetch, self.area, x, ids, w, host.num_experts, tiles_per_step=n)
        return y, StagedExperts(area, host)


def _set(items: tuple, i: int, value) -> tuple:
    return items[:i] + (value,) + items[i + 1:]
