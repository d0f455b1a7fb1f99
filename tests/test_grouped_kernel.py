"""The grouped NVFP4 kernels of prefill chunks (jaxflash/kernels/nvfp4_grouped.py) against their jnp twin
(moe.expert_tiles), and a chunk's routed experts through the VRAM cache in blocks (engine/experts.py).

On the CPU the kernels run in Pallas interpret mode, on a GPU compiled (Triton). Inputs are random NVFP4 bytes
(every code, negative zero included), odd expert counts, experts spanning several tiles, tiles marked -1 that
must keep y0's rows, resident tensors and cache-slot records. Tolerances, relative to the largest output:
  * float32 rows: the kernels dequantise exactly as the twin does and sum in another order, 1e-5 (float32
    noise; the twin's roundings of g, u and the activation to the token dtype are float32 no-ops here);
  * bfloat16 rows: that order may move a bf16 rounding of g, u or the activation by one ulp, 8e-3 (two bf16
    ulps); compiled on a GPU the tensor cores sum in yet another order, the same bound.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash import ffi
from jaxflash.engine.experts import CachedExperts, ChunkExperts, HostExperts, records_as_experts
from jaxflash.ffi.experts import ExpertLayout
from jaxflash.kernels import nvfp4_experts as K
from jaxflash.kernels import nvfp4_grouped as G
from jaxflash.model import moe

from numerics import rel_err
from test_expert_kernel import random_experts, records_of

pytestmark = pytest.mark.xdist_group("grouped_kernel")
TOLS = {jnp.float32: 1e-5, jnp.bfloat16: 8e-3}


def twin(ex, xs, ids, y0, tile):
    """expert_tiles per tile; rows of tiles with id -1 keep y0."""
    we = moe.take_experts(ex, jnp.maximum(ids, 0))
    y = moe.expert_tiles(we, xs.reshape(ids.shape[0], tile, -1)).reshape(xs.shape[0], -1)
    return jnp.where(jnp.repeat(ids >= 0, tile)[:, None], y, y0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("source", ["resident", "records"])
def test_grouped_kernels_equal_the_twin(dtype, source):
    rng = np.random.default_rng(1)
    e, h, i, tile = 5, 128, 64, 16
    ex = random_experts(rng, e, h, i)
    ids = jnp.asarray([3, 0, -1, 4, 3, -1, 1], jnp.int32)  # expert 3 twice, two skipped tiles
    xs = jnp.asarray(rng.normal(size=(ids.shape[0] * tile, h)), dtype)
    y0 = jnp.asarray(rng.normal(size=(ids.shape[0] * tile, h)), dtype)
    if source == "resident":
        place, ops = K.resident_operands(ex)
        slot_ids = ids
    else:  # the records sit in shuffled slots of a larger cache
        layout = ExpertLayout("nvfp4", h, i)
        perm = rng.permutation(e + 2)[:e]
        slots = np.zeros((e + 2, layout.record_bytes), np.uint8)
        slots[perm] = records_of(layout, ex)
        place, ops = K.record_operands(layout, jnp.asarray(slots))
        slot_ids = jnp.where(ids >= 0, jnp.asarray(perm, jnp.int32)[jnp.maximum(ids, 0)], -1)
    got = G.grouped_experts(place, ops, xs, slot_ids, tile, y0=y0)
    want = twin(ex, xs, ids, y0, tile)
    assert got.dtype == dtype and got.shape == (xs.shape[0], h)
    assert rel_err(got, want) < TOLS[dtype]
    skipped = np.repeat(np.asarray(ids) < 0, tile)
    np.testing.assert_array_equal(np.asarray(got)[skipped], np.asarray(y0)[skipped])  # untouched, exactly
    bare = np.asarray(G.grouped_experts(place, ops, xs, slot_ids, tile))  # no y0: the kernel writes zeros there
    assert (bare[skipped] == 0).all()
    np.testing.assert_array_equal(bare[~skipped], np.asarray(got)[~skipped])


def test_grouped_path_equals_the_tiled_path():
    """moe.experts_grouped (the kernels over moe.plan_tiles' tiles) gives moe.experts_tiled's sum, with one
    expert spanning three tiles, experts no token chose, and ties in the routing order."""
    rng = np.random.default_rng(2)
    e, h, i, k, n = 7, 64, 32, 2, 150
    ex = random_experts(rng, e, h, i)
    ids = np.stack([rng.choice([0, 1, 3, 4, 5], k, replace=False) for _ in range(n)]).astype(np.int32)
    ids[:, 0] = 2  # 150 rows of expert 2: three tiles of 64; experts 6 unused
    x = jnp.asarray(rng.normal(size=(n, h)), jnp.float32)
    w = jnp.asarray(rng.uniform(size=(n, k)), jnp.float32)
    ids = jnp.asarray(ids)
    plan = moe.plan_tiles(ids, e, moe.GROUP_TILE)
    assert int(plan.live) < plan.tile_expert.shape[0] and int(jnp.sum(plan.tile_expert < 0)) > 0
    got = moe.experts_grouped(ex, x, ids, w)
    want = moe.experts_tiled(ex, x, ids, w)
    assert rel_err(got, want) < 1e-5
    assert rel_err(got, moe.experts_gather(ex, x, ids, w)) < 1e-5  # float32: the gather path's sum too


def test_plan_tiles_puts_every_pair_in_a_tile_of_its_expert():
    ids = jnp.asarray([[2, 0], [2, 1], [2, 0], [0, 2]], jnp.int32)
    plan = moe.plan_tiles(ids, 4, 2)
    flat = np.asarray(ids).reshape(-1)
    rows, order = np.asarray(plan.row), np.asarray(plan.order)
    te = np.asarray(plan.tile_expert)
    assert sorted(rows.tolist()) == sorted(set(rows.tolist()))  # one row per pair
    for pos, r in enumerate(rows):
        assert te[r // 2] == flat[order[pos]]
    # experts 0, 1, 2 hold 3, 1, 4 pairs: 2 + 1 + 2 live tiles of 2 rows; the bound is 8 / 2 + 4
    assert int(plan.live) == 5 and te.shape == (8,) and (te[5:] == -1).all()
    x = jnp.arange(1, 4 * 3 + 1, dtype=jnp.float32).reshape(4, 3)
    xs = np.asarray(plan.sort_rows(x))  # each pair's token row at its row, zeros elsewhere
    want = np.zeros((16, 3), np.float32)
    want[rows] = np.asarray(x)[order // 2]
    np.testing.assert_array_equal(xs, want)


def _cache(layout, ex, slots, kernel, overlap=False):
    """A one-layer host pool holding ex's records and an empty CachedExperts of `slots` slots over it; overlap
    False, or the mode of the copy beside the kernels (HostExperts.overlap_mode)."""
    e = ex.gate.packed.shape[0]
    pool = ffi.ExpertPool(layout, 1, e)
    pool.array[0] = records_of(layout, ex)
    host = HostExperts(pool, layout, slots, kernel=kernel, overlap=bool(overlap), overlap_mode=overlap or "auto")
    return pool, CachedExperts.empty(host, 1)


# What the cache holds after the test's second chunk: without overlap, blocks of 4 slots; with it, blocks of 2
# ((5, 6) and (7, 8) in place, then (0, 2) evicts 6 and 5, and 3 evicts 7: ties evict the lower slot).
SECOND_CHUNK_LEAVES = {False: [0, 2, 3, 5], True: [0, 2, 3, 8]}


@pytest.mark.parametrize("overlap", [False, "auto", "zero_copy"])
@pytest.mark.parametrize("kernel", [False, True])
def test_a_chunk_goes_through_the_cache_in_blocks(kernel, overlap):
    """9 experts, 4 slots: a chunk hitting 7 of them runs in blocks (of 4, or of 2 when each block's copy runs
    beside the previous block's kernels). Its output equals the resident sum; each expert it hits is copied at
    most once, cached ones not at all; afterwards the cache holds the last blocks' experts (what the chunk used
    most recently), and the status word counts the whole chunk. The CPU copies block b+1 before block b's
    kernels run, so a copy landing in a slot that block b reads would change the output."""
    rng = np.random.default_rng(3)
    e, h, i, k, n = 9, 64, 32, 2, 24
    ex = random_experts(rng, e, h, i)
    layout = ExpertLayout("nvfp4", h, i)
    pool, cache = _cache(layout, ex, 4, kernel, overlap)
    ffi.reset_handler_calls()
    with pool:
        used = np.array([0, 2, 3, 5, 6, 7, 8])
        ids = jnp.asarray(np.stack([rng.choice(used, k, replace=False) for _ in range(n)]).astype(np.int32))
        ids = ids.at[0].set(jnp.asarray([0, 8], jnp.int32))  # every used expert appears
        ids = ids.at[1:7, 0].set(jnp.asarray(used[1:7], jnp.int32))
        x = jnp.asarray(rng.normal(size=(n, h)), jnp.float32)
        w = jnp.asarray(rng.uniform(size=(n, k)), jnp.float32)
        valid = jnp.ones(n, bool)
        src = ChunkExperts(cache)
        y, src = jax.jit(lambda s, x, ids, w: s.routed(0, None, x, ids, w, valid))(src, x, ids, w)
        assert rel_err(y, moe.experts_gather(ex, x, ids, w)) < 1e-5
        n_miss, n_distinct, status, _ = np.asarray(src.cache.status[0]).tolist()
        assert (n_miss, n_distinct, status) == (7, 7, 0)  # a cold cache: each hit expert copied once
        f = ffi.lru_state_fields(src.cache.lru[0], 4, e)
        assert sorted(f["slot_expert"].tolist()) == [5, 6, 7, 8]  # the second block: the latest used
        for s, ex_id in enumerate(f["slot_expert"]):  # and the slots hold those records
            np.testing.assert_array_equal(np.asarray(src.cache.slots[0][s]), pool.array[0][ex_id])
        # the same chunk again: the cached experts come first, so block 1 (5, 6, 7, 8) reads all four in place
        # and block 2 (0, 2, 3) copies only those three
        y2, src2 = jax.jit(lambda s, x, ids, w: s.routed(0, None, x, ids, w, valid))(src, x, ids, w)
        np.testing.assert_array_equal(np.asarray(y2), np.asarray(y))
        assert int(src2.cache.status[0][0]) == 3
        f = ffi.lru_state_fields(src2.cache.lru[0], 4, e)
        assert sorted(f["slot_expert"].tolist()) == SECOND_CHUNK_LEAVES[bool(overlap)]
        calls = ffi.handler_calls()
        assert (calls["gather_wait_cpu"] + calls.get("gather_wait_cuda", 0) > 0) == bool(overlap)
        # a padding row routes like the first token and brings nothing in
        valid = valid.at[-1].set(False)
        y3, src3 = jax.jit(lambda s, x, ids, w: s.routed(0, None, x, ids.at[-1].set(jnp.asarray([1, 4])), w,
                                                          valid))(src2, x, ids, w)
        assert int(src3.cache.status[0][1]) == 7  # experts 1 and 4 were not looked up


@pytest.mark.parametrize("overlap", [False, "auto", "zero_copy"])
def test_chunk_blocks_update_the_slots_in_place(overlap):
    """The block loop reads and writes the layer's slots in place: the compiled chunk holds no copy of the
    slot array (unrolled blocks made XLA copy every layer's slots; a side-stream copy must not either)."""
    rng = np.random.default_rng(4)
    e, h, i, k, n = 9, 64, 32, 2, 24
    ex = random_experts(rng, e, h, i)
    layout = ExpertLayout("nvfp4", h, i)
    pool, cache = _cache(layout, ex, 4, False, overlap)
    with pool:
        ids = jnp.asarray(rng.integers(0, e, (n, k)), jnp.int32)
        x = jnp.asarray(rng.normal(size=(n, h)), jnp.float32)
        w = jnp.asarray(rng.uniform(size=(n, k)), jnp.float32)
        f = jax.jit(lambda s, x, ids, w: s.routed(0, None, x, ids, w, jnp.ones(n, bool)), donate_argnums=0)
        hlo = f.lower(ChunkExperts(cache), x, ids, w).compile().as_text()
        slot_shape = f"u8[4,{layout.record_bytes}]"
        copies = [l for l in hlo.splitlines() if " copy(" in l and slot_shape in l.split("=")[1].split(" copy(")[0]]
        assert not copies, copies
        assert ("jaxflash_gather_wait" in hlo) == bool(overlap)
        # each mode of the copy beside the kernels is its own custom call (on the CPU one copy path serves both)
        starts = set(re.findall(r'custom_call_target="(jaxflash_gather_start\w*)"', hlo))
        assert starts == {False: set(), "auto": {"jaxflash_gather_start_memcpy"},
                          "zero_copy": {"jaxflash_gather_start"}}[overlap]
