"""Expert cache: resolve and gather (CPU handlers) against the plain-Python LRU model, byte for byte."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash import ffi as F
from jaxflash.ffi.reference import LruModel
from test_ffi_support import random_pool, uniform_trace, zipf_trace


@functools.partial(jax.jit, static_argnames=("S", "E", "pool_id", "layer"), donate_argnums=(1, 2))
def _run_trace(trace, state, cache, *, S, E, pool_id, layer):
    """Resolve + gather for every step of trace [steps, T, k] inside one scan."""

    def body(carry, ids):
        state, cache = carry
        r = F.resolve(ids, state, num_slots=S, num_experts=E, layer=layer)
        cache = F.gather(r.misses, r.info, cache, pool=pool_id, layer=layer)
        return (r.state, cache), (r.slots, r.misses, r.info, r.state)

    (state, cache), outs = jax.lax.scan(body, (state, cache), trace)
    return state, cache, outs


def _check_trace(trace, S, E, R=48):
    pool_id, pool = random_pool(1, E, R)
    try:
        state = jnp.asarray(F.lru_state_init(S, E))
        cache = F.cache_init(S, R)
        state, cache, (slots, misses, info, states) = _run_trace(jnp.asarray(trace), state, cache, S=S, E=E,
                                                                 pool_id=pool_id, layer=0)
        slots, misses, info, states = map(np.asarray, (slots, misses, info, states))
        model = LruModel(S, E)
        M = min(trace[0].size, S, E)
        for s, ids in enumerate(trace):
            want_slots, want_misses, distinct = model.resolve(ids)
            np.testing.assert_array_equal(slots[s].reshape(-1), want_slots, err_msg=f"step {s}")
            np.testing.assert_array_equal(misses[s], model.padded_misses(want_misses, M), err_msg=f"step {s}")
            np.testing.assert_array_equal(info[s], [len(want_misses), distinct, 0, 0], err_msg=f"step {s}")
            np.testing.assert_array_equal(states[s], model.state(), err_msg=f"step {s}")
        # Every filled slot holds its expert's record, byte for byte.
        cache = np.asarray(cache)
        for v, e in enumerate(model.holder):
            if e is not None:
                np.testing.assert_array_equal(cache[v], pool[0, e])
        return model
    finally:
        F.module().pool_release(pool_id)


@pytest.mark.parametrize("kind", ["uniform", "zipf"])
def test_long_decode_traces_match_lru_model(kind):
    rng = np.random.default_rng(1)
    E, S, k = 512, 40, 10
    trace = (uniform_trace if kind == "uniform" else zipf_trace)(rng, 1500, 1, k, E)
    model = _check_trace(trace, S, E)
    hit_rate = model.hits / (model.hits + model.misses)
    # Skewed routing must hit far more often than uniform routing (S/E ~ 8%).
    assert (hit_rate > 0.3) if kind == "zipf" else (hit_rate < 0.2)


@pytest.mark.parametrize("E,S,T,k", [(13, 7, 1, 4), (100, 33, 3, 11), (513, 186, 18, 10), (1000, 64, 8, 8),
                                     (37, 37, 4, 9)])
def test_non_power_of_two_experts_and_full_steps(E, S, T, k):
    """Expert counts that are not powers of two; T*k up to (and equal to) the slot count."""
    rng = np.random.default_rng(E)
    steps = 300
    trace = np.empty((steps, T, k), np.int32)
    for s in range(steps):
        # Draw T*k ids with at most S distinct: sometimes exactly S (every slot needed at once).
        pool = rng.choice(E, size=min(S, E), replace=False) if s % 3 else rng.choice(E, size=max(k, S // 3),
                                                                                     replace=False)
        for t in range(T):
            trace[s, t] = rng.choice(pool, k, replace=False)
    _check_trace(trace, S, E)


def test_all_slots_needed_each_step():
    """T*k == S distinct experts every step: every slot is needed, victims are exactly the non-hit slots."""
    rng = np.random.default_rng(3)
    E, S, T, k = 90, 30, 3, 10
    trace = np.stack([rng.permutation(E)[:S].reshape(T, k) for _ in range(200)]).astype(np.int32)
    _check_trace(trace, S, E)


def test_stacked_state_and_cache_touch_only_their_layer():
    E, S, L, R = 20, 6, 3, 32
    pool_id, pool = random_pool(L, E, R, seed=5)
    try:
        state = jnp.asarray(F.lru_state_init(S, E, num_layers=L))
        cache = F.cache_init(S, R, num_layers=L)
        ids = np.array([[2, 19, 7]], np.int32)
        r = F.resolve(ids, state, num_slots=S, num_experts=E, layer=1)
        cache2 = F.gather(r.misses, r.info, cache, pool=pool_id, layer=1)
        st = np.asarray(r.state)
        fresh = F.lru_state_init(S, E)
        np.testing.assert_array_equal(st[0], fresh)
        np.testing.assert_array_equal(st[2], fresh)
        model = LruModel(S, E)
        model.resolve(ids)
        np.testing.assert_array_equal(st[1], model.state())
        c = np.asarray(cache2)
        assert not c[0].any() and not c[2].any()
        for v, e in enumerate(model.holder):
            if e is not None:
                np.testing.assert_array_equal(c[1, v], pool[1, e])
    finally:
        F.module().pool_release(pool_id)


def test_stamp_rebase_matches_model():
    E, S = 11, 5
    model = LruModel(S, E)
    for ids in ([1, 2], [3, 4], [5], [1, 6]):
        model.resolve(ids)
    # Age the state to just below the rebase point: older slots end up tied at stamp 0.
    st = model.state()
    st[0] = (1 << 30) - 2
    f = F.lru_state_fields(st, S, E)
    f["slot_stamp"][f["slot_stamp"] >= 0] += (1 << 30) - 6
    f["slot_stamp"][0] = (1 << 29) - 5
    model = LruModel.from_state(st)
    state = jnp.asarray(st)
    for ids in ([7, 8], [9, 1], [2, 10], [3, 4, 5]):
        r = F.resolve(np.array(ids, np.int32), state, num_slots=S, num_experts=E)
        want_slots, want_misses, _ = model.resolve(ids)
        np.testing.assert_array_equal(np.asarray(r.slots), want_slots)
        np.testing.assert_array_equal(np.asarray(r.misses), model.padded_misses(want_misses, min(len(ids), S, E)))
        np.testing.assert_array_equal(np.asarray(r.state), model.state())
        state = r.state
    assert int(np.asarray(state)[0]) < (1 << 30)


def test_too_many_distinct_experts_raises():
    S, E = 8, 50
    state = F.lru_state_init(S, E)
    with pytest.raises(Exception, match="needs 9 distinct experts but the layer has only 8 cache slots"):
        jax.block_until_ready(F.resolve(np.arange(9, dtype=np.int32).reshape(3, 3), state, num_slots=S,
                                        num_experts=E))
    # Duplicates do not count: 16 ids, 8 distinct, fits.
    r = F.resolve(np.tile(np.arange(8, dtype=np.int32), 2).reshape(4, 4), state, num_slots=S, num_experts=E)
    assert np.asarray(r.info).tolist() == [8, 8, 0, 0]


@pytest.mark.parametrize("bad", [50, -1, 1 << 20])
def test_out_of_range_expert_id_raises(bad):
    S, E = 8, 50
    with pytest.raises(Exception, match=f"routed expert id {bad} is out of range \\[0, num_experts=50\\)"):
        jax.block_until_ready(F.resolve(np.array([[3, bad]], np.int32), F.lru_state_init(S, E), num_slots=S,
                                        num_experts=E))


def test_foreign_state_is_refused():
    with pytest.raises(ValueError, match="does not match num_slots=8"):
        F.resolve(np.array([[1]], np.int32), F.lru_state_init(9, 50), num_slots=8, num_experts=50)
    st = F.lru_state_init(8, 50)
    st[1] = 7  # header says another cache
    with pytest.raises(Exception, match="LRU state array does not belong"):
        jax.block_until_ready(F.resolve(np.array([[1]], np.int32), st, num_slots=8, num_experts=50))


def test_check_info_messages():
    F.check_info(np.array([3, 3, 0, 0]))
    with pytest.raises(F.ExpertCacheError, match="needs 300 distinct experts but the layer has only 186"):
        F.check_info(np.array([0, 300, 2, 300]), num_slots=186)
    with pytest.raises(F.ExpertCacheError, match="routed expert id 512 is out of range"):
        F.check_info(np.array([[0, 0, 0, 0], [0, 0, 1, 512]]), num_experts=512)


def test_gather_errors_are_clear():
    with pytest.raises(Exception, match="no expert pool with id 987654"):
        jax.block_until_ready(F.gather(np.full((2, 2), -1, np.int32), np.zeros(4, np.int32),
                                       jnp.zeros((4, 64), jnp.uint8), pool=987654, layer=0))
    pool_id, _ = random_pool(1, 4, 64)
    try:
        with pytest.raises(Exception, match="cache must be uint8 \\[num_slots, 64\\]"):
            jax.block_until_ready(F.gather(np.full((2, 2), -1, np.int32), np.zeros(4, np.int32),
                                           jnp.zeros((4, 32), jnp.uint8), pool=pool_id, layer=0))
        with pytest.raises(Exception, match="layer 1 is outside the pool's 1 layers"):
            jax.block_until_ready(F.gather(np.full((2, 2), -1, np.int32), np.zeros(4, np.int32),
                                           jnp.zeros((4, 64), jnp.uint8), pool=pool_id, layer=1))
        with pytest.raises(ValueError, match="gather mode 'dma'"):
            F.gather_start(np.full((2, 2), -1, np.int32), np.zeros(4, np.int32), jnp.zeros((4, 64), jnp.uint8),
                           pool=pool_id, layer=0, mode="dma")
    finally:
        F.module().pool_release(pool_id)


@pytest.mark.parametrize("mode", ["auto", "memcpy", "zero_copy"])
def test_gather_start_and_wait_equal_gather(mode):
    """gather_start (each mode its own custom call) then gather_wait leave the cache as gather does, and hand
    `after` through unchanged."""
    S, E, R = 4, 10, 64
    pool_id, _ = random_pool(1, E, R)
    try:
        ids = jnp.asarray([7, 2, 9], jnp.int32)
        r = F.resolve(ids, jnp.asarray(F.lru_state_init(S, E)), num_slots=S, num_experts=E)
        want = np.asarray(F.gather(r.misses, r.info, F.cache_init(S, R), pool=pool_id, layer=0))
        after = jnp.arange(5.0)

        @jax.jit
        def beside(cache, after):
            cache = F.gather_start(r.misses, r.info, cache, pool=pool_id, layer=0, mode=mode)
            return F.gather_wait(cache, after * 2, r.misses, r.info)

        cache, after2 = beside(F.cache_init(S, R), after)
        np.testing.assert_array_equal(np.asarray(cache), want)
        np.testing.assert_array_equal(np.asarray(after2), np.arange(5.0) * 2)
        assert int(np.asarray(r.info)[0]) == 3  # three records copied
    finally:
        F.module().pool_release(pool_id)


def test_captured_in_jit_with_donation_reuses_buffers():
    """The state round-trips through a donated jit argument; results equal eager calls."""
    S, E = 16, 64
    step = jax.jit(lambda ids, st: F.resolve(ids, st, num_slots=S, num_experts=E), donate_argnums=1)
    rng = np.random.default_rng(0)
    state = jnp.asarray(F.lru_state_init(S, E))
    model = LruModel(S, E)
    for _ in range(50):
        ids = rng.choice(E, 6, replace=False).astype(np.int32).reshape(2, 3)
        r = step(ids, state)
        model.resolve(ids)
        state = r.state
        np.testing.assert_array_equal(np.asarray(state), model.state())
