"""The CUDA route of the NVFP4 expert kernels (jaxflash.ffi.nvfp4_moe: ffi/nvfp4_moe.cu on a GPU, its C++ handler
ffi/nvfp4_moe_cpu.cc on the CPU) against the jnp twin, moe.experts_gather.

The CPU handler runs the kernels' arithmetic (the same decode code, float16 products and per-group float16 sums,
the same scaling of token rows), so on the CPU these tests check what the GPU computes, up to the order of the
float32 sums; on a GPU they run the CUDA kernels themselves. Tolerances, relative to the largest output:
  * exact decodes (one-hot inputs, unit scales): each output is silu of one decoded value, rounded to bfloat16;
    it may differ from the twin's by one bfloat16 ulp where the two silu implementations round differently
    (2^-8 of the value).
  * random data: float16 products move some bfloat16 roundings of g, u and the activation by one ulp, as in
    the Pallas kernels' float16x2 path: 1.6e-2 (four bfloat16 ulps; measured 8e-4 to 5.5e-3 on the CPU).
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxflash
from jaxflash import synthetic
from jaxflash.engine.experts import records_as_experts
from jaxflash.ffi import nvfp4_moe
from jaxflash.ffi.experts import ExpertLayout
from jaxflash.kernels import nvfp4_experts as K
from jaxflash.model.moe import NVFP4, Experts, ResidentExperts, experts_gather

from numerics import rel_err
from test_expert_kernel import every_slot_case, extreme_cases, random_experts, records_of, top_k_ids

TOL = 1.6e-2
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
ONE_E4M3 = 0x38  # 1.0


def cuda(place, ops, x, ids, w):
    return K.routed_experts(place, ops, x, ids, w, route="cuda")


def nvfp4(codes: np.ndarray, scale_bytes: np.ndarray, s2) -> NVFP4:
    """An NVFP4 stack from codes [E, N, K] (0..15) and raw FP8 scale bytes [E, N, K/16]."""
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    scale = scale_bytes.astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
    return NVFP4(jnp.asarray(packed), jnp.asarray(scale), jnp.asarray(np.asarray(s2, np.float32)))


def silu_bf16(v: np.ndarray) -> np.ndarray:
    v = v.astype(np.float32)
    return (v / (1 + np.exp(-v))).astype(ml_dtypes.bfloat16).astype(np.float32)


def identity_down(h: int) -> NVFP4:
    """down = the identity (code 2 = 1.0 on the diagonal, unit scales): y = the activation."""
    codes = np.where(np.eye(h, dtype=bool), 2, 0)[None]
    return nvfp4(codes, np.full((1, h, h // 16), ONE_E4M3), [1.0])


def one_hot_run(gate: NVFP4, h: int, c: int):
    """The routed output for x = e_c through gate, up = all codes 1.0 and down = the identity: for each
    output row r, silu(gate[r, c] * scales) rounded like the model. Returns (cuda route, twin) as float32."""
    up = nvfp4(np.full((1, h, h), 2), np.full((1, h, h // 16), ONE_E4M3), [1.0])
    ex = Experts(gate, up, identity_down(h))
    x = jnp.asarray(np.eye(h)[c][None], jnp.bfloat16)
    ids, w = jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), jnp.bfloat16)
    place, ops = K.resident_operands(ex)
    return np.asarray(cuda(place, ops, x, ids, w))[0], np.asarray(experts_gather(ex, x, ids, w))[0]


def assert_close_ulp(got, want):
    np.testing.assert_allclose(got, want, rtol=2.0**-8, atol=1e-30)


@pytest.mark.parametrize("c", [0, 1, 3, 4, 7, 8, 13, 16, 21, 31])
def test_every_code_decodes_exactly(c):
    """Input position c (low or high nibble, each of a word's pairs, both scale groups): row r of gate holds code
    r % 16 there (random codes elsewhere, which the one-hot input must ignore), so output r is silu of that
    code's E2M1 value."""
    h = 32
    rng = np.random.default_rng(c)
    codes = rng.integers(0, 16, (1, h, h))
    codes[0, :, c] = np.arange(h) % 16
    got, twin = one_hot_run(nvfp4(codes, np.full((1, h, h // 16), ONE_E4M3), [1.0]), h, c)
    assert_close_ulp(got, silu_bf16(E2M1[np.arange(h) % 16]))
    assert_close_ulp(got, twin)


def test_every_block_scale_decodes_exactly():
    """Row r's block scale is an FP8 byte (all 254 finite E4M3 values, subnormals and negatives included, 32 per
    run) and its code 1.0: output r is silu(scale * global scale). 32 consecutive bytes per run keep each
    activation row within a few powers of two, so that the down projection's float16 products of the identity
    stay normal (a row spanning 1e5 would put its smallest products among float16 subnormals)."""
    h, c, s2 = 32, 21, 0.0234375  # 1.5 * 2^-6: |g| up to 10.5
    for first in range(0, 256, h):
        bytes_ = np.arange(first, first + h)
        bytes_[(bytes_ == 0x7F) | (bytes_ == 0xFF)] = ONE_E4M3  # the NaN codes
        scales = np.full((1, h, h // 16), ONE_E4M3)
        scales[0, :, c // 16] = bytes_
        got, twin = one_hot_run(nvfp4(np.full((1, h, h), 2), scales, [s2]), h, c)
        values = bytes_.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(s2)
        assert_close_ulp(got, silu_bf16(values))
        assert_close_ulp(got, twin)


@pytest.mark.parametrize("n_exp,k,n_tok,h,i", [(7, 3, 1, 64, 32), (7, 3, 3, 64, 32), (16, 4, 5, 128, 64),
                                               (5, 1, 2, 256, 96), (13, 10, 32, 64, 32)])
def test_matches_twin(n_exp, k, n_tok, h, i):
    """Random NVFP4 bytes (every code, negative zero), odd expert counts and top-k, tokens sharing some or all
    of their experts (32 tokens over 13 experts: every expert serves many tokens, in chunks on the GPU), up to
    the route's MAX_TOKENS; resident tensors and cache records give identical results."""
    rng = np.random.default_rng(n_exp * 100 + k * 10 + n_tok)
    ex = random_experts(rng, n_exp, h, i)
    ids = top_k_ids(rng, n_tok, n_exp, k)
    if n_tok >= 3:
        ids[2] = ids[0]  # one token repeats another's experts
        ids[1, 0] = ids[0, -1]  # and one shares a single expert
    ids = jnp.asarray(ids)
    x = jnp.asarray(rng.normal(size=(n_tok, h)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(size=(n_tok, k)), jnp.bfloat16)
    twin = experts_gather(ex, x, ids, w)
    place, ops = K.resident_operands(ex)
    out = cuda(place, ops, x, ids, w)
    assert out.shape == (n_tok, h) and out.dtype == jnp.float32
    assert np.isfinite(np.asarray(out)).all()
    assert rel_err(out, twin) < TOL
    layout = ExpertLayout("nvfp4", h, i)
    rplace, rops = K.record_operands(layout, jnp.asarray(records_of(layout, ex)))
    np.testing.assert_array_equal(np.asarray(cuda(rplace, rops, x, ids, w)), np.asarray(out))
    # and through the model's expert source
    y, _ = ResidentExperts("kernel", "cuda").routed(0, _MoEStub(ex), x, ids, w, jnp.ones(n_tok, bool))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(out))


class _MoEStub:
    def __init__(self, experts):
        self.experts = experts


def test_every_slot_and_ids_outside_the_slots():
    """Cache records, the ids covering every slot in a shuffled order; an id outside the slots (-1, S) makes its
    pair contribute zeros, and the other pairs are unaffected."""
    k, n_tok = 3, 4
    layout, slots, ids, x, w = every_slot_case(np.random.default_rng(11), 64, 64, k, n_tok)
    as_experts = records_as_experts(layout, slots)
    place, ops = K.record_operands(layout, slots)
    out = cuda(place, ops, x, ids, w)
    assert rel_err(out, experts_gather(as_experts, x, ids, w)) < TOL
    bad = ids.at[1, 2].set(-1).at[3, 0].set(n_tok * k)
    zeroed = w.at[1, 2].set(0).at[3, 0].set(0)
    got = cuda(place, ops, x, bad, w)
    np.testing.assert_array_equal(np.asarray(got)[[0, 2]], np.asarray(out)[[0, 2]])
    assert rel_err(got, experts_gather(as_experts, x, ids, zeroed)) < TOL


def test_tokens_far_outside_float16_range():
    """bfloat16 tokens of 3e4 .. 1e6, 1e-6, and a row whose halves lie 1e4 apart stay accurate: each row is
    scaled by a power of two into float16's range before the products."""
    for place, ops, x, ids, w, want in extreme_cases():
        out = cuda(place, ops, x, ids, w)
        assert np.isfinite(np.asarray(out)).all()
        assert rel_err(out, want) < TOL


def test_bad_inputs_are_refused():
    rng = np.random.default_rng(3)
    ex = random_experts(rng, 4, 64, 32)
    place, ops = K.resident_operands(ex)
    ids, w = jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2), jnp.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 tokens"):
        cuda(place, ops, jnp.zeros((1, 64), jnp.float32), ids, w)
    n = nvfp4_moe.MAX_TOKENS + 1
    with pytest.raises(ValueError, match="1..32 tokens"):
        cuda(place, ops, jnp.zeros((n, 64), jnp.bfloat16), jnp.zeros((n, 2), jnp.int32), jnp.ones((n, 2)))
    odd = random_experts(rng, 4, 48, 32)  # H = 48: valid NVFP4, not a multiple of 32
    oplace, oops = K.resident_operands(odd)
    with pytest.raises(ValueError, match="multiples of 32"):
        cuda(oplace, oops, jnp.zeros((1, 48), jnp.bfloat16), ids, w)
    with pytest.raises(ValueError, match="route"):
        K.routed_experts(place, ops, jnp.zeros((1, 64), jnp.bfloat16), ids, w, route="triton")
    with pytest.raises(ValueError, match="expert_kernel"):
        K.expert_kernel_choice("fast")
    with pytest.raises(ValueError, match="expert_kernel"):
        jaxflash.load(expert_kernel="fast", progress=False)  # before anything loads or compiles
    assert K.choose_route("auto") == "pallas"  # the measured default (benchmarks/RESULTS.md)


@pytest.fixture(scope="module")
def nvfp4_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("nvfp4_cuda")
    synthetic.make_model("tiny", "nvfp4", seed=9, out=str(out), progress=False)
    return str(out)


def test_engine_decode_through_the_cuda_route(nvfp4_dir, monkeypatch):
    """A bfloat16 engine with host-resident experts and expert_kernel="cuda" calls the route on its cache slots in
    every decode layer and decodes what the jnp path decodes: the same greedy tokens up to the first step whose
    top two logits lie closer than the two paths' difference, and logits within 2e-2 of the largest (bfloat16
    activations through 4 layers). (Resident experts take the route through ResidentExperts, test_matches_twin.)"""
    residency = "host"
    calls = []
    real = nvfp4_moe.expert_pairs
    monkeypatch.setattr(nvfp4_moe, "expert_pairs", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    kw = dict(dtype="bfloat16", expert_residency=residency, cache_slots=8, max_batch=1, max_seq_len=64,
              prefill_chunk=16, progress=False)
    on = jaxflash.load(nvfp4_dir, expert_kernel="cuda", **kw)
    off = jaxflash.load(nvfp4_dir, expert_kernel=False, **kw)
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, on.config.vocab_size, 9)]
    toks_on, logits_on, _ = on.scheduler.step_logits(prompt, 6)
    assert len(calls) >= on.config.num_hidden_layers and {s[0] for s in calls} == {1}  # decode layers only
    toks_off, logits_off, _ = off.scheduler.step_logits(prompt, 6)
    lo, lf = np.asarray(logits_on, np.float32), np.asarray(logits_off, np.float32)
    for t in range(len(toks_off)):
        assert rel_err(lo[t], lf[t]) < 2e-2
        top2 = np.sort(lf[t])[-2:]
        if top2[1] - top2[0] < 2 * np.abs(lo[t] - lf[t]).max():
            break  # a near tie: the paths may pick differently from here on
        assert toks_on[t] == toks_off[t]
