// The routed experts of a decode step from NVFP4 weights, as an FFI call (jaxflash_nvfp4_moe): what the CPU
// handler (nvfp4_moe_cpu.cc) and the CUDA kernels (nvfp4_moe.cu) share. For N tokens x [N, H] (bfloat16) and
// their top-k expert ids [N, k] (expert rows of the resident tensors, or VRAM cache slots), for every pair
// q = n*k + j with e = ids[n, j]:
//
//     act[q] = bf16( silu(bf16(gate_e x_n)) * bf16(up_e x_n) )        [I]
//     y[q]   = bf16( down_e act[q] )                                  [H]
//
// (jaxflash.model.moe.experts_gather's function before its weighted sum over j, which stays in XLA). Weights
// are read as stored: packed E2M1 codes (low nibble first), FP8 E4M3 block scales (one per 16 inputs) and a
// float32 global scale per matrix, wherever the operands hold them (nine parts, each an operand index and a
// byte offset inside an expert's row of that operand).
//
// Arithmetic (both handlers): each token row is scaled by a power of two so that its largest |value| lies in
// [2^14, 2^15), then rounded to float16; a code's E2M1 value is placed into a float16 bit pattern (the value
// times 2^-14, exactly; 0.5 becomes the subnormal 2^-15); products are float16 fused multiply-adds, eight per
// float16 accumulator (one scale group of 16 codes in two halves); each group's two halves are summed in
// float32 and multiplied by the block scale, then by the global scale and the powers of two. Products stay
// below 12 and group halves below 96, far inside float16's range, and the float16 rounding of a product
// (2^-11) is under the bfloat16 rounding of the result (2^-9).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#ifdef __CUDACC__
#define JF_HD __host__ __device__ __forceinline__
#else
#define JF_HD inline
#endif

namespace jaxflash {
namespace nvfp4 {

constexpr int kMaxTokens = 32;   // decode batches and speculative verify rows (max_batch x (K+1))
constexpr int kMaxPairs = 512;   // tokens x top-k
constexpr int kGroup = 16;       // codes per FP8 block scale
constexpr int kXScaleExp = 14;   // token rows are scaled into [2^14, 2^15)

// The nine parts, in the order of the part_arg / part_offset attributes.
enum Part : int { kGate, kUp, kDown, kGateScale, kUpScale, kDownScale, kGateS2, kUpS2, kDownS2, kNumParts };

// Where every expert's parts are: part p of expert e starts at base[p] + e * stride[p] (bytes).
struct Operands {
  const uint8_t* base[kNumParts];
  int64_t stride[kNumParts];
  int64_t num_experts;  // ids outside [0, num_experts) contribute zeros
};

// ----- decoding (host and device) --------------------------------------------------------------------------
// Codes k and k+4 of a 32-bit word (8 codes, code 0 in bits 0..3) as two float16 bit patterns (code k in the
// low half): the three magnitude bits go to float16 bits 9..11 and the sign to bit 15, which is the code's E2M1
// value times 2^-14 exactly (exponent field e1e0, mantissa bit m: 2^(e-15) (1 + m/2), or the subnormal m 2^-15
// when e = 0). Pairing k with k+4 lets one shift move both codes; the inputs are stored in the same order.
JF_HD uint32_t e2m1_pair(uint32_t q, int k) {
  const uint32_t mag = (k < 3 ? q << (9 - 4 * k) : q >> 3) & 0x0E000E00u;
  const uint32_t sign = (q << (12 - 4 * k)) & 0x80008000u;
  return mag | sign;
}

// An FP8 E4M3 byte as a float16 bit pattern of its value times 2^-8, exactly (E4M3's exponent field lands in
// float16's low four exponent bits, its mantissa in the top three mantissa bits; subnormals map to
// subnormals). The NaN codes 0x7F/0xFF read as +-480 (checkpoint scales are finite).
JF_HD uint16_t e4m3_as_f16_bits(uint32_t b) {
  return static_cast<uint16_t>(((b & 0x7Fu) << 7) | ((b & 0x80u) << 8));
}

JF_HD uint32_t float_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
#endif
}

JF_HD float bits_float(uint32_t b) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, 4);
  return f;
#endif
}

// The power of two sx that scales a row with largest |value| m into [2^14, 2^15) (0 for m = 0; clamped so
// that 2^sx and 2^-sx are normal floats).
JF_HD int row_scale_exp(float m) {
  const uint32_t bits = float_bits(m);
  if (m == 0.0f) return 0;
  const int e = int((bits >> 23) & 0xFF) - 127;  // floor(log2 m) for a normal m; -127 for a subnormal one
  const int s = kXScaleExp - e;
  return s < -126 ? -126 : (s > 126 ? 126 : s);
}

JF_HD float exp2i(int s) { return bits_float(uint32_t(127 + s) << 23); }  // 2^s for s in [-126, 127], exactly

// The combined power of two a dot product's float32 sum lacks: 2^14 (code placement) * 2^8 (scale placement).
constexpr float kDecodeFactor = 4194304.0f;  // 2^22

// ----- host-side helpers (the CPU handler, and checks shared with the CUDA handler) ---------------------------
inline float f16_bits_to_float(uint16_t h) {
  const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
  float v;
  if (e == 0)
    v = std::ldexp(float(m), -24);
  else if (e == 31)
    v = m ? NAN : INFINITY;
  else
    v = std::ldexp(float(m | 0x400), e - 25);
  return (h & 0x8000) ? -v : v;
}

// Round to the nearest float16 value (ties to even, subnormals, overflow to infinity), returned as a double.
inline double round_f16(double v) {
  if (v == 0.0 || !std::isfinite(v)) return v;
  const double a = std::fabs(v);
  int e;
  std::frexp(a, &e);
  const int exp = std::max(e - 1, -14);  // a in [2^exp, 2^(exp+1)); subnormals step 2^-24
  const double step = std::ldexp(1.0, exp - 10);
  double r = std::nearbyint(a / step) * step;
  if (r >= 65520.0) r = INFINITY;
  return std::copysign(r, v);
}

inline float round_bf16(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  if ((b & 0x7F800000u) == 0x7F800000u) return v;  // inf, nan
  b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
  float r;
  std::memcpy(&r, &b, 4);
  return r;
}

inline float bf16_bits_to_float(uint16_t h) {
  const uint32_t b = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

inline uint16_t float_to_bf16_bits(float v) {  // v already rounded to bfloat16 (or any float: truncates)
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return static_cast<uint16_t>(b >> 16);
}

}  // namespace nvfp4
}  // namespace jaxflash
