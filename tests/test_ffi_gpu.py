"""CUDA handlers against the references. Runs only where JAX sees a GPU and jaxflash_ffi_cuda is in use
(e.g. `JAX_PLATFORMS=cuda,cpu pytest tests/test_ffi_gpu.py`); skipped elsewhere."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxflash import ffi as F
from jaxflash import presets
from jaxflash.ffi.reference import LruModel, ngram_ids_reference
from test_ffi_support import SafetensorsIndex, random_pool, zipf_trace


def _gpu():
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return None
    return gpus[0] if gpus and F.module().has_cuda else None


GPU = _gpu()
pytestmark = pytest.mark.skipif(GPU is None, reason="needs a CUDA GPU visible to JAX and jaxflash_ffi_cuda")


@functools.partial(jax.jit, static_argnames=("S", "E", "pool_id", "mode"), donate_argnums=(1, 2))
def _run(trace, state, cache, *, S, E, pool_id, mode):
    def body(carry, ids):
        state, cache = carry
        r = F.resolve(ids, state, num_slots=S, num_experts=E)
        cache = F.gather(r.misses, r.info, cache, pool=pool_id, layer=0, mode=mode)
        return (r.state, cache), (r.slots, r.misses, r.info, r.state)

    return jax.lax.scan(body, (state, cache), trace)


@pytest.mark.parametrize("E,S,T,k,mode", [(512, 186, 1, 10, "zero_copy"), (512, 186, 18, 10, "memcpy"),
                                          (513, 100, 10, 10, "zero_copy"), (8192, 4096, 40, 8, "zero_copy")])
def test_resolve_and_gather_on_gpu_match_model(E, S, T, k, mode):
    rng = np.random.default_rng(E + S)
    steps = 60 if S < 1000 else 12
    trace = zipf_trace(rng, steps, T, k, E)
    R = 256
    pool_id, pool = random_pool(1, E, R, pin=True)
    try:
        with jax.default_device(GPU):
            (state, cache), (slots, misses, info, states) = _run(
                jnp.asarray(trace), jnp.asarray(F.lru_state_init(S, E)), F.cache_init(S, R), S=S, E=E,
                pool_id=pool_id, mode=mode)
        model = LruModel(S, E)
        M = min(T * k, S, E)
        slots, misses, info, states = map(np.asarray, (slots, misses, info, states))
        for s in range(steps):
            want_slots, want_misses, distinct = model.resolve(trace[s])
            np.testing.assert_array_equal(info[s], [len(want_misses), distinct, 0, 0], err_msg=f"step {s}")
            np.testing.assert_array_equal(slots[s].reshape(-1), want_slots, err_msg=f"step {s}")
            np.testing.assert_array_equal(misses[s], model.padded_misses(want_misses, M), err_msg=f"step {s}")
            np.testing.assert_array_equal(states[s], model.state(), err_msg=f"step {s}")
        cache = np.asarray(cache)
        for v, e in enumerate(model.holder):
            if e is not None:
                np.testing.assert_array_equal(cache[v], pool[0, e])
    finally:
        F.module().pool_release(pool_id)


def test_gpu_errors_come_back_in_info_and_leave_state_alone():
    S, E = 8, 50
    st0 = F.lru_state_init(S, E)
    with jax.default_device(GPU):
        r = F.resolve(np.arange(9, dtype=np.int32).reshape(3, 3), jnp.asarray(st0), num_slots=S, num_experts=E)
        assert np.asarray(r.info).tolist() == [0, 9, 2, 9]
        np.testing.assert_array_equal(np.asarray(r.state), st0)
        assert not np.asarray(r.slots).any() and (np.asarray(r.misses) == -1).all()
        with pytest.raises(F.ExpertCacheError, match="needs 9 distinct experts but the layer has only 8"):
            F.check_info(r.info, num_slots=S)
        r = F.resolve(np.array([[3, 4], [60, -2]], np.int32), jnp.asarray(st0), num_slots=S, num_experts=E)
        assert np.asarray(r.info).tolist() == [0, 0, 1, 60]
        np.testing.assert_array_equal(np.asarray(r.state), st0)


def test_ple_on_gpu_matches_reference(tmp_path):
    cfg = presets.tiny(vocab_size=512, eos_token_id=7)
    rows = cfg.ngram_table_rows()
    full = np.random.default_rng(0).integers(0, 0x7F, (rows, cfg.ngram_head_dim), dtype=np.uint8)
    path = tmp_path / "t.safetensors"
    save_file({"layers.1.ple.ple_embedding.ngram_embedding.weight": full.view(ml_dtypes.float8_e4m3fn)}, str(path))
    h = F.NgramHash.from_config(cfg)
    with F.NgramTable.from_checkpoint(SafetensorsIndex([path]), cfg, max_tokens=64) as table, \
            jax.default_device(GPU):
        assert table.staging_pinned, table.note
        rng = np.random.default_rng(1)
        step = jax.jit(lambda t, c, r: F.ple_step(t, c, table, h, reset=r), donate_argnums=1)
        ctx = jnp.asarray(F.ngram_context_init(4, 7))
        ref_ctx = F.ngram_context_init(4, 7)
        for i in range(20):
            tokens = rng.integers(0, 512, (4, 1 if i % 4 else 9)).astype(np.int32)
            tokens[rng.random(tokens.shape) < 0.2] = 7
            reset = (rng.random(4) < 0.1).astype(np.int32)
            out = step(tokens, ctx, reset)
            want, ref_ctx = ngram_ids_reference(tokens, ref_ctx, eos=7, multipliers=h.multipliers,
                                                head_sizes=h.head_sizes, head_offsets=h.head_offsets, reset=reset)
            np.testing.assert_array_equal(np.asarray(out.ids), want)
            np.testing.assert_array_equal(np.asarray(out.rows).view(np.uint8), full[want])
            np.testing.assert_array_equal(np.asarray(out.context), ref_ctx)
            assert np.asarray(out.info).tolist() == [0, 0]
            ctx = out.context
        bad = step(np.array([[1], [2], [600], [3]], np.int32), ctx, np.zeros(4, np.int32))
        assert np.asarray(bad.info).tolist() == [4, 600]
        np.testing.assert_array_equal(np.asarray(bad.context), ref_ctx)  # unchanged
        with pytest.raises(F.PleError, match="token id 600"):
            F.check_ple_info(bad.info)


@pytest.mark.parametrize("mode", ["memcpy", "zero_copy"])
def test_gather_beside_the_kernels_on_gpu(mode):
    """A prefill chunk's block loop in small: block b+1 is copied in on the side stream (gather_start, by the
    copy engines or the zero-copy kernel) while a reduction reads block b's slots, then gather_wait joins.
    Records of 1 MiB so each copy takes a while. Every block's reduction must see its own records, and the
    cache end up as plain gathers leave it."""
    E, S, R, B = 40, 8, 1 << 20, 4  # blocks of half the slots, as engine/experts.py runs them
    pool_id, pool = random_pool(1, E, R, pin=True)
    order = np.random.default_rng(5).permutation(E).astype(np.int32)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def run(state, cache, order):
        def block(b, state):
            return F.resolve(jax.lax.dynamic_slice_in_dim(order, b * B, B), state, num_slots=S, num_experts=E)

        def body(b, carry):
            state, cache, sums, slots = carry
            r = block(jnp.minimum(b + 1, E // B - 1), state)
            cache = F.gather_start(r.misses, r.info, cache, pool=pool_id, layer=0, mode=mode)
            total = jnp.sum(cache[slots].astype(jnp.uint32), axis=1)  # block b's records, read beside the copy
            cache, total = F.gather_wait(cache, total, r.misses, r.info)
            return r.state, cache, sums.at[b].set(total), r.slots

        r = block(0, state)
        cache = F.gather(r.misses, r.info, cache, pool=pool_id, layer=0)
        sums = jnp.zeros((E // B, B), jnp.uint32)
        return jax.lax.fori_loop(0, E // B, body, (r.state, cache, sums, r.slots))

    try:
        with jax.default_device(GPU):
            state, cache, sums, _ = run(jnp.asarray(F.lru_state_init(S, E)), F.cache_init(S, R), jnp.asarray(order))
        want = pool[0].astype(np.uint32).sum(axis=1)[order].reshape(E // B, B)
        np.testing.assert_array_equal(np.asarray(sums), want)
        holder = F.lru_state_fields(state, S, E)["slot_expert"]
        assert sorted(holder.tolist()) == sorted(order[-S:].tolist())
        cache = np.asarray(cache)
        for v, e in enumerate(holder):
            np.testing.assert_array_equal(cache[v], pool[0, e])
    finally:
        F.module().pool_release(pool_id)
