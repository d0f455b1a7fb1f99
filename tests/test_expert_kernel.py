"""The NVFP4 expert kernels (jaxflash/kernels/nvfp4_experts.py) against their jnp twin, moe.experts_gather.

On the CPU the kernels run in Pallas interpret mode, on a GPU compiled (Triton). Inputs are random NVFP4 bytes
(every code, negative zero included), odd expert counts and top-k, tokens that share experts, resident tensors
and cache-slot records. Tolerances, relative to the largest output:
  * float32 products (float32 tokens): interpret mode does the twin's float32 arithmetic in another order, 1e-6
    (measured 0); compiled on a GPU the twin's bf16 roundings may land elsewhere (XLA may keep excess
    precision), 8e-3 (two bf16 ulps; measured 4e-3 on the H200).
  * float16x2 products (bfloat16 tokens): each product is rounded to float16 (2^-11), which moves some of the
    bf16 roundings of g, u and the activation by one ulp: 1.6e-2 (four bf16 ulps; measured 7e-4 to 6e-3 on
    the CPU).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxflash
from jaxflash import kernels, quant
from jaxflash.engine.experts import records_as_experts
from jaxflash.ffi.experts import ExpertLayout
from jaxflash.kernels import nvfp4_experts as K
from jaxflash.model.moe import NVFP4, Experts, ResidentExperts, experts_gather

from numerics import rel_err

TOL = 8e-3 if K.on_gpu() else 1e-6  # float32 products
TOL_F16X2 = 1.6e-2  # float16x2 products (the default for bfloat16 tokens)


def tol(dtype) -> float:
    return TOL_F16X2 if K.resolve_math(K.Tiles(), dtype) == "f16x2" else TOL


def random_nvfp4(rng, e, n, k):
    packed = rng.integers(0, 256, (e, n, k // 2), dtype=np.uint8)
    packed.reshape(-1)[:: 7] = 0x88  # negative zero in both nibbles, now and then
    scale = np.exp2(rng.uniform(-6, 2, (e, n, k // 16))).astype(ml_dtypes.float8_e4m3fn)
    return NVFP4(jnp.asarray(packed), jnp.asarray(scale), jnp.asarray(rng.uniform(0.5, 2, e), jnp.float32))


def random_experts(rng, e, h, i):
    return Experts(random_nvfp4(rng, e, i, h), random_nvfp4(rng, e, i, h), random_nvfp4(rng, e, h, i))


def records_of(layout, ex) -> np.ndarray:
    out = []
    for e in range(ex.gate.packed.shape[0]):
        t = {}
        for name, m in (("gate", ex.gate), ("up", ex.up), ("down", ex.down)):
            t[f"{name}_proj.weight"] = np.asarray(m.packed[e])
            t[f"{name}_proj.weight_scale"] = np.asarray(m.scale[e])
            t[f"{name}_proj.weight_scale_2"] = np.asarray(m.scale2[e])
        out.append(layout.pack(t))
    return np.stack(out)


def top_k_ids(rng, n, e, k):
    return np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)


def extreme_cases():
    """Two bfloat16 token rows far outside float16's range (scaled by 1e6, 3e4, 1e-6, and with halves 1e4 apart)
    through 6 random experts, top-3: (place, ops, x, ids, w, the jnp twin's output) per scale."""
    rng = np.random.default_rng(8)
    h, i = 256, 128
    ex = random_experts(rng, 6, h, i)
    place, ops = K.resident_operands(ex)
    ids = jnp.asarray(top_k_ids(rng, 2, 6, 3))
    w = jnp.asarray(rng.uniform(size=(2, 3)), jnp.bfloat16)
    for scale in (1e6, 3e4, 1e-6, None):
        x = rng.normal(size=(2, h)) * (scale or 1.0)
        if scale is None:
            x[:, h // 2:] *= 1e4
        x = jnp.asarray(x, jnp.bfloat16)
        yield place, ops, x, ids, w, experts_gather(ex, x, ids, w)


def test_unpack_decodes_every_byte():
    b = np.arange(256, dtype=np.uint8)
    lo, hi = jax.jit(K._unpack)(jnp.asarray(b))
    codes = quant.unpack_fp4(b[:, None]).reshape(256, 2)
    want = quant.e2m1_decode(codes) * np.float32(2.0**-14)
    np.testing.assert_array_equal(np.asarray(lo), want[:, 0])
    np.testing.assert_array_equal(np.asarray(hi), want[:, 1])
    assert np.array_equal(np.signbit(np.asarray(lo)), np.signbit(want[:, 0]))  # code 8 is -0.0


def test_f16x2_products_every_byte():
    """The float16x2 path's per-byte product lo * xe + hi * xo (interpret mode: its emulation) against float64
    over all 256 bytes: within two float16 roundings of the terms (the product, then the fused add)."""
    rng = np.random.default_rng(2)
    b = jnp.asarray(np.tile(np.arange(256, dtype=np.uint8), 4))
    xe = jnp.asarray(rng.uniform(-1, 1, b.shape), jnp.float16)
    xo = jnp.asarray(rng.uniform(-1, 1, b.shape), jnp.float16)
    p = np.asarray(K._f16x2_products(b, xe, xo, interpret=True), np.float64)
    codes = quant.unpack_fp4(np.asarray(b)[:, None]).reshape(-1, 2)
    v = quant.e2m1_decode(codes).astype(np.float64) * 2.0**-6
    terms = v[:, 0] * np.asarray(xe, np.float64), v[:, 1] * np.asarray(xo, np.float64)
    bound = 2 * 2.0**-11 * (np.abs(terms[0]) + np.abs(terms[1])) + 2.0**-24  # float16 subnormal step
    assert (np.abs(p - (terms[0] + terms[1])) <= bound).all()


def test_pow2_above_is_exact():
    for m in (0.0, 2.0**-130, 1e-30, 0.3, 0.5, 1.0, 1.5, 3.0, 1000.0, 65504.0):
        s, inv = (float(v) for v in K._pow2_above(jnp.float32(m)))
        if m == 0:
            assert s == 0.0
            continue
        assert s >= m and np.log2(s) == int(np.log2(s)) and s * inv == 1.0
        assert s / 2 < m or (m < 2.0**-126 and s == 2.0**-126)  # the least one (2^-126 for subnormals)


@pytest.mark.parametrize("x_scale", ["chunk", "row"])
def test_f16x2_keeps_large_and_small_tokens(x_scale):
    """bfloat16 tokens far outside float16's range (3e4 .. 1e6) or tiny (1e-6), and a row whose halves lie 1e4
    apart, stay accurate: the inputs are scaled by a power of two into [-1, 1] (per chunk of the walk, or per
    row) before the float16 products. Small chunks, so that a walk has several."""
    tiles = K.Tiles(math="f16x2", x_scale=x_scale, chunk_gu=64, chunk_down=16)
    for place, ops, x, ids, w, want in extreme_cases():
        out = K.routed_experts(place, ops, x, ids, w, tiles=tiles)
        assert np.isfinite(np.asarray(out)).all()
        assert rel_err(out, want) < TOL_F16X2
    with pytest.raises(ValueError, match="x_scale"):
        K.routed_experts(place, ops, x, ids, w, tiles=K.Tiles(x_scale="tile"))


@pytest.mark.parametrize("n_exp,k,n_tok,dtype", [(7, 3, 1, jnp.bfloat16), (7, 3, 3, jnp.bfloat16),
                                                 (16, 4, 5, jnp.float32), (5, 1, 2, jnp.bfloat16)])
def test_resident_matches_twin(n_exp, k, n_tok, dtype):
    rng = np.random.default_rng(n_exp * 100 + k * 10 + n_tok)
    h, i = 64, 32
    ex = random_experts(rng, n_exp, h, i)
    ids = top_k_ids(rng, n_tok, n_exp, k)
    if n_tok >= 3:
        ids[2] = ids[0]  # one token repeats another's experts
        ids[1, 0] = ids[0, -1]  # and one shares a single expert
    x = jnp.asarray(rng.normal(size=(n_tok, h)), dtype)
    w = jnp.asarray(rng.uniform(size=(n_tok, k)), dtype)
    twin = experts_gather(ex, x, jnp.asarray(ids), w)
    place, ops = K.resident_operands(ex)
    out = K.routed_experts(place, ops, x, jnp.asarray(ids), w)
    assert out.shape == (n_tok, h) and out.dtype == jnp.float32
    assert np.isfinite(np.asarray(out)).all()
    assert rel_err(out, twin) < tol(dtype)
    # and through the model's expert source
    y, _ = ResidentExperts("kernel").routed(0, _MoEStub(ex), x, jnp.asarray(ids), w, jnp.ones(n_tok, bool))
    assert rel_err(y, twin) < tol(dtype)
    if dtype == jnp.bfloat16:  # the float32 products on bfloat16 tokens too
        out32 = K.routed_experts(place, ops, x, jnp.asarray(ids), w, tiles=K.Tiles(math="f32"))
        assert rel_err(out32, twin) < TOL


class _MoEStub:
    def __init__(self, experts):
        self.experts = experts


def every_slot_case(rng, h, i, k, n_tok):
    """n_tok * k cache-slot records of random experts and a batch whose ids cover every slot in a shuffled
    order: (layout, slots, ids, x, w)."""
    layout = ExpertLayout("nvfp4", h, i)
    slots = jnp.asarray(records_of(layout, random_experts(rng, n_tok * k, h, i)))
    ids = jnp.asarray(rng.permutation(n_tok * k).reshape(n_tok, k).astype(np.int32))
    x = jnp.asarray(rng.normal(size=(n_tok, h)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(size=(n_tok, k)), jnp.bfloat16)
    return layout, slots, ids, x, w


def test_records_read_every_slot():
    """Cache-slot records: the batch's ids cover every slot, in a shuffled order."""
    layout, slots, ids, x, w = every_slot_case(np.random.default_rng(11), 64, 48, 3, 4)
    twin = experts_gather(records_as_experts(layout, slots), x, ids, w)
    place, ops = K.record_operands(layout, slots)
    out = K.routed_experts(place, ops, x, ids, w)
    assert rel_err(out, twin) < TOL_F16X2
    # each token's output depends on its own experts only: a token routed elsewhere changes only its row
    ids2 = ids.at[1].set(ids[0])
    out2 = K.routed_experts(place, ops, x, ids2, w)
    np.testing.assert_array_equal(np.asarray(out2)[[0, 2, 3]], np.asarray(out)[[0, 2, 3]])
    assert rel_err(out2, experts_gather(records_as_experts(layout, slots), x, ids2, w)) < TOL_F16X2


def test_each_expert_is_computed_by_one_program():
    """_group: of the pairs that share an expert only the first works, and it serves every token of that
    expert at that token's pair (the kernels read a shared expert once)."""
    ids = np.array([[4, 1, 6], [1, 4, 2], [6, 5, 4]], np.int32)
    n_tok, k = ids.shape
    flat = jnp.asarray(ids.reshape(-1))
    served = {}
    for p in range(n_tok * k):
        e, first, hits, pairs = K._group(flat, p, n_tok, k)
        if bool(first):
            e = int(e)
            assert e not in served
            served[e] = {n: int(pairs[n]) for n in range(n_tok) if bool(hits[n])}
    assert set(served) == set(ids.reshape(-1).tolist())
    for e, tok_pairs in served.items():
        want = {n: n * k + int(np.where(ids[n] == e)[0][0]) for n in range(n_tok) if e in ids[n]}
        assert tok_pairs == want


ONE = K.Tiles(launch="one", rows_gu=8, rows_down=16, chunk_gu=16, chunk_down=16, warps_gu=4, warps_down=4)


@pytest.mark.parametrize("n_tok,records", [(1, False), (3, False), (8, True)])
def test_one_launch_equals_the_pair(n_tok, records):
    """The one-launch form computes every item as the pair of kernels does with the same tiles: the outputs are
    equal bit for bit (compiled on a GPU its programs run at once, so the down items really wait for their
    activations; in interpret mode one program does every item in order). Tokens share experts at 3 and 8."""
    rng = np.random.default_rng(20 + n_tok)
    h, i, n_exp, k = 128, 64, 9, 5
    ex = random_experts(rng, n_exp, h, i)
    ids = top_k_ids(rng, n_tok, n_exp, k)
    if n_tok >= 3:
        ids[2] = ids[0]
        ids[1, 0] = ids[0, -1]
    if records:
        layout = ExpertLayout("nvfp4", h, i)
        place, ops = K.record_operands(layout, jnp.asarray(records_of(layout, ex)))
    else:
        place, ops = K.resident_operands(ex)
    ids = jnp.asarray(ids)
    x = jnp.asarray(rng.normal(size=(n_tok, h)), jnp.bfloat16)
    pair, _ = K.choice_outputs(place, ops, x, ids, dataclasses.replace(ONE, launch="pair"))
    one, gave_up = K.choice_outputs(place, ops, x, ids, ONE)
    assert int(gave_up) == 0
    np.testing.assert_array_equal(np.asarray(one, np.float32), np.asarray(pair, np.float32))
    w = jnp.asarray(rng.uniform(size=(n_tok, k)), jnp.bfloat16)
    assert rel_err(K.routed_experts(place, ops, x, ids, w, ONE), experts_gather(ex, x, ids, w)) < TOL_F16X2


def test_one_launch_flags_a_wait_that_gives_up(monkeypatch):
    """Two programs in interpret mode run one after the other, so the first one's down items wait for
    activations the second has not written: they give up after SPIN_LIMIT polls and are counted, not hung."""
    if K.on_gpu():
        pytest.skip("interpret mode only: compiled, both programs are resident and nothing gives up")
    monkeypatch.setattr(kernels, "SPIN_LIMIT", 3)
    rng = np.random.default_rng(5)
    ex = random_experts(rng, 4, 64, 32)
    place, ops = K.resident_operands(ex)
    x = jnp.asarray(rng.normal(size=(1, 64)), jnp.bfloat16)
    _, gave_up = K.choice_outputs(place, ops, x, jnp.asarray([[0, 2]], jnp.int32),
                                  dataclasses.replace(ONE, programs=2))
    assert int(gave_up) > 0


def test_bad_inputs_are_refused():
    rng = np.random.default_rng(3)
    ex = random_experts(rng, 4, 32, 16)
    place, ops = K.resident_operands(ex)
    ids = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        K.routed_experts(place, ops, jnp.zeros((1, 32), jnp.int8), ids, jnp.ones((1, 2)))
    with pytest.raises(ValueError, match="up to"):
        K.routed_experts(place, ops, jnp.zeros((K.MAX_TOKENS + 1, 32), jnp.bfloat16),
                         jnp.zeros((K.MAX_TOKENS + 1, 2), jnp.int32), jnp.ones((K.MAX_TOKENS + 1, 2)))
    dense = Experts(jnp.zeros((4, 16, 32)), jnp.zeros((4, 16, 32)), jnp.zeros((4, 32, 16)))
    with pytest.raises(TypeError, match="NVFP4"):
        K.resident_operands(dense)
    with pytest.raises(ValueError, match="launch"):
        K.routed_experts(place, ops, jnp.zeros((1, 32), jnp.bfloat16), ids, jnp.ones((1, 2)), K.Tiles(launch="x"))
    with pytest.raises(ValueError, match="NVFP4 records"):
        K.record_operands(ExpertLayout("bf16", 32, 16), jnp.zeros((2, 8), jnp.uint8))


@pytest.mark.xdist_group("nvfp4")  # conftest.py's NVFP4 engines, shared with test_engine.py
@pytest.mark.parametrize("residency", ["device", "host"])
def test_engine_decode_with_kernels_equals_jnp(nvfp4_dir, nvfp4_plain, nvfp4_host, trace_decode, residency,
                                               monkeypatch):
    """Decoding through the kernels (interpret mode on the CPU) gives the jnp path's tokens, and every decode
    step's logits agree to float32 noise (1e-5 of the largest logit on the CPU). The jnp path is conftest.py's
    engine of the same model and geometry (every expert on the device and 4 slots, or a host cache of 8 slots
    and 2 slots) where that is its default (not on a GPU)."""
    traced = []
    real = K.routed_experts
    monkeypatch.setattr(K, "routed_experts", lambda *a, **k: traced.append(a[3].shape) or real(*a, **k))
    kw = dict(expert_residency=residency, max_batch=4, max_seq_len=128, prefill_chunk=16, progress=False)
    if residency == "host":
        kw.update(cache_slots=8, max_batch=2)
    on = jaxflash.load(nvfp4_dir, expert_kernel=True, **kw)
    shared = nvfp4_plain if residency == "device" else nvfp4_host
    off = shared if not K.on_gpu() else jaxflash.load(nvfp4_dir, expert_kernel=False, **kw)
    cfg = on.config
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, cfg.vocab_size, 9)]
    toks_on, logits_on, _ = on.scheduler.step_logits(prompt, 8)
    # decode layers only: the decode step's rows (its slots), never a prefill chunk's 16
    assert len(traced) >= cfg.num_hidden_layers and {s[0] for s in traced} == {kw["max_batch"]}
    n = len(traced)
    toks_off, logits_off, _ = off.scheduler.step_logits(prompt, 8)
    trace_decode(off)  # its programs may have been built before the patch: trace its decode step again
    assert len(traced) == n  # the jnp engine never calls the kernels
    assert toks_on == toks_off
    assert rel_err(logits_on, logits_off) < (TOL if K.on_gpu() else 1e-5)
