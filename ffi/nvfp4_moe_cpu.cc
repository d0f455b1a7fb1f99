// The CPU handler of jaxflash_nvfp4_moe: the function of the CUDA kernels (nvfp4_moe.cu), one pair at a time.
// It uses the same code placement, the same float16 products and per-group float16 sums (emulated exactly, up to
// rare double roundings in a fused multiply-add) and the same scaling of the token rows; only the order of the
// float32 sums differs. So the CPU tests exercise the arithmetic the GPU runs, against the jnp twin.
#include <cstring>
#include <vector>

#include "common.h"
#include "handler_util.h"

namespace jaxflash {

namespace {

using namespace nvfp4;

// A row of bfloat16 values scaled by 2^sx (largest |value| into [2^14, 2^15)) and rounded to float16.
int stage_row(const uint16_t* row, int64_t n, std::vector<double>& out) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(bf16_bits_to_float(row[i])));
  const int sx = row_scale_exp(m);
  const float f = exp2i(sx);
  out.resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) out[size_t(i)] = round_f16(double(bf16_bits_to_float(row[i]) * f));
  return sx;
}

// One output of a matrix row (len inputs: len/2 code bytes, len/16 scale bytes) against staged inputs, before
// the global scale and the powers of two.
float dot_row(const uint8_t* codes, const uint8_t* scales, const std::vector<double>& xs, int64_t len) {
  float acc = 0.0f;
  for (int64_t u = 0; u < len / 32; ++u) {  // 16 bytes, 32 codes, two scale groups
    uint32_t w[4];
    std::memcpy(w, codes + 16 * u, 16);
    for (int g = 0; g < 2; ++g) {
      double lo = 0.0, hi = 0.0;  // the group's two float16 accumulators (codes k and k+4 of each word)
      bool first = true;
      for (int wd = 2 * g; wd < 2 * g + 2; ++wd) {
        for (int k = 0; k < 4; ++k) {
          const uint32_t pr = e2m1_pair(w[wd], k);
          const size_t c = size_t(32 * u + 8 * wd + k);
          lo = round_f16(double(f16_bits_to_float(uint16_t(pr & 0xFFFF))) * xs[c] + (first ? 0.0 : lo));
          hi = round_f16(double(f16_bits_to_float(uint16_t(pr >> 16))) * xs[c + 4] + (first ? 0.0 : hi));
          first = false;
        }
      }
      const float s = f16_bits_to_float(e4m3_as_f16_bits(scales[2 * u + g]));
      acc = std::fma(float(lo) + float(hi), s, acc);
    }
  }
  return acc;
}

// Row r (of `bytes` bytes) of part `part` of expert e.
const uint8_t* row(const Operands& ops, int part, int64_t e, int64_t r, int64_t bytes) {
  return ops.base[part] + e * ops.stride[part] + r * bytes;
}

float global_scale(const Operands& ops, int part, int64_t e) {
  float v;
  std::memcpy(&v, ops.base[part] + e * ops.stride[part], 4);
  return v;
}

ffi::Error Nvfp4MoeCpu(ffi::AnyBuffer ids, ffi::AnyBuffer x, ffi::RemainingArgs operands, ffi::Result<ffi::AnyBuffer> y,
                       ffi::Result<ffi::AnyBuffer> act, ffi::Span<const int64_t> part_arg,
                       ffi::Span<const int64_t> part_offset, int64_t lanes_gu, int64_t lanes_down,
                       int64_t threads_gu, int64_t threads_down, int64_t stages, int64_t blocks_gu,
                       int64_t blocks_down, int64_t prefetch) {
  g_calls[kCallNvfp4MoeCpu].fetch_add(1, std::memory_order_relaxed);
  // the CUDA kernels' block shapes mean nothing here
  (void)lanes_gu, (void)lanes_down, (void)threads_gu, (void)threads_down, (void)stages, (void)blocks_gu,
      (void)blocks_down, (void)prefetch;
  auto shape = check_nvfp4_moe(ids, x, operands, *y, *act, part_arg, part_offset, false);
  if (shape.has_error()) return shape.error();
  const MoeShape& s = *shape;
  const Operands& ops = s.ops;
  const int64_t H = s.hidden, I = s.inter;
  const int32_t* id = static_cast<const int32_t*>(ids.untyped_data());
  const uint16_t* xs = static_cast<const uint16_t*>(x.untyped_data());
  uint16_t* a_out = static_cast<uint16_t*>(act->untyped_data());
  uint16_t* y_out = static_cast<uint16_t*>(y->untyped_data());
  std::vector<double> staged;
  for (int64_t q = 0; q < s.pairs; ++q) {
    const int64_t e = id[q], n = q / s.top_k;
    uint16_t* a = a_out + q * I;
    uint16_t* yq = y_out + q * H;
    if (e < 0 || e >= ops.num_experts) {  // as the kernels: no expert, no contribution
      std::memset(a, 0, size_t(I) * 2);
      std::memset(yq, 0, size_t(H) * 2);
      continue;
    }
    const int sx = stage_row(xs + n * H, H, staged);
    const float fg = global_scale(ops, kGateS2, e) * kDecodeFactor * exp2i(-sx);
    const float fu = global_scale(ops, kUpS2, e) * kDecodeFactor * exp2i(-sx);
    for (int64_t r = 0; r < I; ++r) {
      const float g = round_bf16(fg * dot_row(row(ops, kGate, e, r, H / 2), row(ops, kGateScale, e, r, H / 16),
                                              staged, H));
      const float u = round_bf16(fu * dot_row(row(ops, kUp, e, r, H / 2), row(ops, kUpScale, e, r, H / 16),
                                              staged, H));
      a[r] = float_to_bf16_bits(round_bf16(g * (1.0f / (1.0f + std::exp(-g))) * u));
    }
    const int sa = stage_row(a, I, staged);
    const float fd = global_scale(ops, kDownS2, e) * kDecodeFactor * exp2i(-sa);
    for (int64_t r = 0; r < H; ++r)
      yq[r] = float_to_bf16_bits(round_bf16(
          fd * dot_row(row(ops, kDown, e, r, I / 2), row(ops, kDownScale, e, r, I / 16), staged, I)));
  }
  return ffi::Error::Success();
}

}  // namespace

}  // namespace jaxflash

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashNvfp4MoeCpu, jaxflash::Nvfp4MoeCpu,
                              JAXFLASH_NVFP4_MOE_BINDING(xla::ffi::Ffi::Bind()));
