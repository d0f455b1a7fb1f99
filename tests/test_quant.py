"""NVFP4 / FP8 numerics against values worked out by hand (derivations in the comments)."""

import ml_dtypes
import numpy as np
import pytest

from jaxflash import quant as q

F8 = ml_dtypes.float8_e4m3fn


def fp8(*byte_values):
    """FP8-E4M3 values from their bit patterns (sign | 4-bit exponent, bias 7 | 3-bit mantissa)."""
    return np.array(byte_values, np.uint8).view(F8)


def test_fp8_bit_patterns_used_below():
    # 0x38 = 0 0111 000 -> 2^(7-7) = 1;  0x40 = 0 1000 000 -> 2;  0x30 = 0 0110 000 -> 0.5;  0x48 = 0 1001 000 -> 4
    # 0x7E = 0 1111 110 -> 2^8 * 1.75 = 448 (largest finite);  0x01 = subnormal 2^-6 * 1/8 = 2^-9
    assert fp8(0x38, 0x40, 0x30, 0x48, 0x7E, 0x01).astype(np.float32).tolist() == [1, 2, 0.5, 4, 448, 2**-9]


def test_nibble_order_low_first():
    # byte 0x21: low nibble 1 is element 0, high nibble 2 is element 1
    assert q.unpack_fp4(np.array([[0x21, 0xF0]], np.uint8)).tolist() == [[1, 2, 0, 15]]
    assert q.pack_fp4(np.array([[1, 2, 0, 15]], np.uint8)).tolist() == [[0x21, 0xF0]]
    codes = np.random.default_rng(0).integers(0, 16, (3, 8, 32)).astype(np.uint8)
    np.testing.assert_array_equal(q.unpack_fp4(q.pack_fp4(codes)), codes)
    with pytest.raises(ValueError):
        q.pack_fp4(np.zeros((1, 3), np.uint8))
    with pytest.raises(ValueError):
        q.pack_fp4(np.array([[16, 0]], np.uint8))


def test_every_e2m1_code():
    want = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    got = q.e2m1_decode(np.arange(16, dtype=np.uint8))
    assert got.tolist() == want
    assert np.signbit(got[8]) and not np.signbit(got[0])  # code 8 is negative zero


def test_dequantize_nvfp4_hand_example():
    # One row, K = 32 = two 16-blocks. Block 0 codes: 1 (0.5), 7 (6), 15 (-6), 8 (-0), rest 0.
    # Block 1 codes: 2 (1.0), 12 (-2), rest 0. Packed low nibble first: (1,7)->0x71, (15,8)->0x8F, (2,12)->0xC2.
    packed = np.zeros((1, 16), np.uint8)
    packed[0, 0], packed[0, 1], packed[0, 8] = 0x71, 0x8F, 0xC2
    scale = fp8(0x40, 0x30).reshape(1, 2)  # block scales 2.0 and 0.5
    w = q.dequantize_nvfp4(packed, scale, np.float32(0.25))
    # block 0: 0.5*2*0.25 = 0.25, 6*2*0.25 = 3, -6*0.5 = -3, -0.0;  block 1: 1*0.5*0.25 = 0.125, -2*0.125 = -0.25
    want = np.zeros((1, 32), np.float32)
    want[0, :4] = [0.25, 3.0, -3.0, -0.0]
    want[0, 16:18] = [0.125, -0.25]
    np.testing.assert_array_equal(w, want)
    assert np.signbit(w[0, 3])
    with pytest.raises(ValueError):
        q.dequantize_nvfp4(packed, fp8(0x40).reshape(1, 1), 0.25)


def test_quantize_nvfp4_hand_example():
    # weight_scale_2 = 0.25 given; block amax 6 -> block scale 6 / (6 * 0.25) = 4 (0x48); divisor 4 * 0.25 = 1, so
    # each code is the E2M1 rounding of w itself, ties to the even mantissa:
    w = np.array([[6, 3, -1.5, 0.75, 0.25, -0.1, 0, 5, 2.5, 1.75, 1.25, 3.5, -6, 0.5, 4, 1]], np.float32)
    codes = [7, 5, 11, 2, 0, 8, 0, 6, 4, 4, 2, 6, 15, 1, 6, 2]
    # 0.75 -> 1 (code 2), 0.25 -> 0, -0.1 -> -0 (code 8), 5 -> 4 (code 6), 2.5 -> 2 (code 4), 1.75 -> 2,
    # 1.25 -> 1, 3.5 -> 4, -1.5 -> code 8|3 = 11.  Pairs (7,5)->0x57 (11,2)->0x2B (0,8)->0x80 (0,6)->0x60
    # (4,4)->0x44 (2,6)->0x62 (15,1)->0x1F (6,2)->0x26
    out = q.quantize_nvfp4(w, weight_scale_2=0.25)
    assert q.unpack_fp4(out.weight).tolist() == [codes]
    assert out.weight.tolist() == [[0x57, 0x2B, 0x80, 0x60, 0x44, 0x62, 0x1F, 0x26]]
    assert out.weight_scale.view(np.uint8).tolist() == [[0x48]]
    assert out.weight_scale_2 == np.float32(0.25) and out.weight_scale_2.dtype == np.float32
    assert out.input_scale == np.float32(16) / np.float32(2688)  # synthetic activation amax 16 / (6 * 448)


def test_quantize_nvfp4_global_scale_and_special_blocks():
    # Without a given weight_scale_2: amax / (6 * 448) in float32.
    w = np.zeros((1, 48), np.float32)
    w[0, :16] = 6.0
    w[0, 32] = 1e-6  # block 2: amax 1e-6
    out = q.quantize_nvfp4(w)
    g = np.float32(6) / np.float32(2688)
    assert out.weight_scale_2 == g
    # block 0: 6 / (6 g) ~ 448 -> 0x7E;  block 1 all zero -> scale 1.0 (0x38);
    # block 2: 1e-6 / (6 g) = 4.5e-4 < 2^-9 -> clamped to the smallest subnormal 0x01 (never a zero scale)
    assert out.weight_scale.view(np.uint8).tolist() == [[0x7E, 0x38, 0x01]]
    # block 0 divides by f32(448) * g ~ 1 -> code 7 (6.0); blocks 1, 2 round to 0
    assert q.unpack_fp4(out.weight)[0, :16].tolist() == [7] * 16
    assert q.unpack_fp4(out.weight)[0, 16:].tolist() == [0] * 32
    # an all-zero tensor quantizes to zero codes, unit block scales and weight_scale_2 = 0
    z = q.quantize_nvfp4(np.zeros((2, 32), np.float32))
    assert z.weight.max() == 0 and z.weight_scale_2 == 0 and (z.weight_scale.astype(np.float32) == 1).all()


def test_e2m1_rounding_boundaries():
    x = np.array([0.25, 0.2500001, 0.7499999, 0.75, 1.25, 1.2500001, 1.75, 2.5, 3.5, 5.0, 5.0001, 7, 100,
                  -0.25, -0.26, -0.0, 0.0, -100], np.float32)
    # midpoints go to the even neighbour (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4); just past a
    # midpoint rounds up; beyond 6 saturates (code 7); -0.25 -> sign with magnitude 0 = code 8; -0.0 -> code 0
    want = [0, 1, 1, 2, 2, 3, 4, 4, 6, 6, 7, 7, 7, 8, 9, 0, 0, 15]
    assert q.e2m1_encode(x).tolist() == want


def _modelopt_cast_fp4(x):
    """An independent transcription of ModelOpt's rule (bucket by midpoints, bump exact odd midpoints)."""
    bounds = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    a = np.abs(x)
    o = np.searchsorted(bounds, a, side="left").astype(np.uint8)
    o += np.isin(a, bounds[[1, 3, 5]]).astype(np.uint8)
    return o | ((x < 0).astype(np.uint8) << 3)


def test_e2m1_encode_matches_modelopt_rule_on_random_data():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(100_000).astype(np.float32) * 3,
                        np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32) * rng.choice([-1, 1], 7)])
    np.testing.assert_array_equal(q.e2m1_encode(x), _modelopt_cast_fp4(x))


def test_nvfp4_round_trip_error_bound():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 256)).astype(np.float32) * 0.02
    out = q.quantize_nvfp4(w)
    dq = q.dequantize_nvfp4(out.weight, out.weight_scale, out.weight_scale_2)
    assert dq.shape == w.shape and dq.dtype == np.float32
    np.testing.assert_array_equal(dq, out.as_weight().dequantize())
    # each block's unit d = f32(scale) * scale_2; the largest E2M1 gap is 2 (4 -> 6) and FP8 rounding of the
    # block scale can push |w|/d up to 6 * (1 + 2^-4) < 6.4, so |error| <= d everywhere
    d = np.repeat(out.weight_scale.astype(np.float32) * out.weight_scale_2, 16, axis=1)
    assert (np.abs(dq - w) <= d).all()
    assert np.sqrt(np.mean((dq - w) ** 2)) / np.sqrt(np.mean(w ** 2)) < 0.15  # FP4 keeps ~3 bits


def test_fp8_per_tensor_hand_example():
    # amax 448 -> scale 1: 448 -> 0x7E, -224 = -2^7 * 1.75 -> 1 1110 110 = 0xF6, 1 -> 0x38, 0 -> 0x00
    data, scale = q.quantize_fp8_per_tensor(np.array([448, -224, 1, 0], np.float32))
    assert scale == np.float32(1) and data.view(np.uint8).tolist() == [0x7E, 0xF6, 0x38, 0x00]
    # same values halved: scale 0.5 / ... amax 224 -> scale 0.5; codes unchanged, dequant restores exactly
    data, scale = q.quantize_fp8_per_tensor(np.array([224, -112, 0.5, 0], np.float32))
    assert scale == np.float32(0.5) and data.view(np.uint8).tolist() == [0x7E, 0xF6, 0x38, 0x00]
    assert q.dequantize_fp8_per_tensor(data, scale).tolist() == [224, -112, 0.5, 0]


def test_fp8_per_tensor_round_trip():
    x = np.random.default_rng(3).standard_normal(10_000).astype(np.float32) * 0.015
    data, scale = q.quantize_fp8_per_tensor(x)
    assert scale == np.float32(np.abs(x).max()) / np.float32(448)
    err = np.abs(q.dequantize_fp8_per_tensor(data, scale) - x)
    # E4M3 has 3 mantissa bits: relative error <= 2^-4 for normals, absolute <= 2^-10 * scale below 2^-6
    assert (err <= np.abs(x) * 2**-4 + scale * 2**-10).all()


def test_fp8_block_hand_example():
    # [130, 130] -> 2 x 2 tiles, the last row/column of tiles partial.
    w = np.zeros((130, 130), np.float32)
    w[0, 0] = 896.0  # tile (0,0): amax 896 -> scale 2, code 448 (0x7E)
    w[128, 3] = 1.0  # tile (1,0): scale 1/448, code 448
    w[129, 129] = -3.5  # tile (1,1): scale 3.5/448 = 2^-7, code -448 (0xFE)
    # tile (0,1) is all zero: scale stays 0 and the data 0
    data, scale = q.quantize_fp8_block(w)
    assert data.shape == (130, 130) and scale.shape == (2, 2) and scale.dtype == np.float32
    assert scale.tolist() == [[2.0, 0.0], [np.float32(1) / np.float32(448), 2.0**-7]]
    u = data.view(np.uint8)
    assert (u[0, 0], u[128, 3], u[129, 129]) == (0x7E, 0x7E, 0xFE)
    assert np.count_nonzero(u) == 3
    np.testing.assert_array_equal(q.dequantize_fp8_block(data, scale), w)
    assert q.FP8BlockWeight(data, scale).dequantize().tolist() == w.tolist()
    with pytest.raises(ValueError):
        q.dequantize_fp8_block(data, scale[:1])


def test_fp8_block_round_trip():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((300, 200)).astype(np.float32) * np.linspace(0.01, 1, 200, dtype=np.float32)
    data, scale = q.quantize_fp8_block(w)
    dq = q.dequantize_fp8_block(data, scale)
    s = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:300, :200]
    assert (np.abs(dq - w) <= np.abs(w) * 2**-4 + s * 2**-10).all()
    # every tile's largest element lands on +-448 exactly
    for i in range(3):
        for j in range(2):
            tile = np.abs(data[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].astype(np.float32))
            assert tile.max() == 448
