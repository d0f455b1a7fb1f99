// CUDA kernels of jaxflash_nvfp4_moe (the function and its arithmetic: nvfp4_moe.h). Two kernels per call, both
// captured in XLA's command buffers (the handler only enqueues them):
//
//   nvfp4_moe_gate_up  grid (pair p, B blocks): act[q] for every pair q whose expert is p's, when p is the first
//                      pair of that expert (the others return at once), so an expert shared by several tokens
//                      of a step is read once. The expert's I outputs come in row blocks of `rows` gate rows
//                      and the same `rows` up rows (so the SiLU product happens in the block), spread over the
//                      B blocks; a unit of `lanes` threads computes one row.
//   nvfp4_moe_down     grid (pair p, B blocks): y[q] = down_e act[q] for the same pairs, row blocks of H.
//
// Why it is shaped so: at decode sizes a layer's experts are a few tens of MB, so the kernels are bound by how
// many bytes are in flight and for how long, not by arithmetic. Each block streams its row blocks through a ring
// of `stages` shared-memory buffers with asynchronous copies (cp.async): the first stages are requested before
// the block even knows whether it serves its expert, and a stage is refilled as soon as it has been used, so
// loads overlap the block's own setup and compute; B is sized so that all blocks are resident at once (one
// wave), each paying its setup once. The decode is a few integer operations per code (no conversion
// instructions, which Hopper issues slowly) and the products are float16 fused multiply-adds. The token rows
// are scaled and staged in shared memory once per block, in the order the codes decode to. Optionally the
// gate_up blocks also prefetch their expert's down weights into L2 for the down kernel.
//
// Measured on the H200 (benchmarks/RESULTS.md, "The CUDA route of the expert kernels"): slower than the Pallas
// kernels at 1 to 8 rows (30.9 against 20.3 us per layer at batch 1), latency-bound at 25% occupancy; the
// engine's default route is Pallas and this one is taken by name.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <string>

#include "common.h"
#include "handler_util.h"

namespace jaxflash {

namespace {

using namespace nvfp4;

constexpr int kTT = 4;     // at most this many token rows staged at once (an expert's tokens come in chunks)
constexpr int kMaxVpl = 8;  // 16-byte weight vectors per thread

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most n of this thread's copy groups are pending (n < 8).
__device__ __forceinline__ void cp_async_wait(int n) {
  switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;\n" ::); break;
    case 1: asm volatile("cp.async.wait_group 1;\n" ::); break;
    case 2: asm volatile("cp.async.wait_group 2;\n" ::); break;
    case 3: asm volatile("cp.async.wait_group 3;\n" ::); break;
    case 4: asm volatile("cp.async.wait_group 4;\n" ::); break;
    case 5: asm volatile("cp.async.wait_group 5;\n" ::); break;
    case 6: asm volatile("cp.async.wait_group 6;\n" ::); break;
    default: asm volatile("cp.async.wait_group 7;\n" ::); break;
  }
}

// n bytes (a multiple of 16, both ends 16-byte aligned) from global to shared memory, by the whole block.
__device__ __forceinline__ void copy_async(uint8_t* dst, const uint8_t* src, int n) {
  for (int i = 16 * threadIdx.x; i < n; i += 16 * blockDim.x) cp_async16(dst + i, src + i);
}

__device__ __forceinline__ float load_f32(const uint8_t* p) {  // a global scale at any byte offset
  return __uint_as_float(uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24));
}

__device__ __forceinline__ half2 as_half2(uint32_t v) {
  half2 h;
  memcpy(&h, &v, 4);
  return h;
}

__device__ __forceinline__ uint32_t half2_bits(half2 h) {
  uint32_t v;
  memcpy(&v, &h, 4);
  return v;
}

__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Warp 0 lists the pairs whose expert is e, ascending, into s_members (their count into *s_count). The block's
// pair serves them when it is the first.
__device__ void list_members(const int32_t* __restrict__ ids, int pairs, int e, int* s_members, int* s_count) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int count = 0;
    for (int base = 0; base < pairs; base += 32) {
      const int q = base + lane;
      const bool m = q < pairs && ids[q] == e;
      const unsigned b = __ballot_sync(0xffffffffu, m);
      if (m) s_members[count + __popc(b & ((1u << lane) - 1u))] = q;
      count += __popc(b);
    }
    if (lane == 0) *s_count = count;
  }
  __syncthreads();
}

// Stage rows src[rows_of[j] / div] (len bfloat16 values each, j < tt) into xs [tt][4][len/32] (uint4 of four
// half2): each row scaled by 2^sx (its largest |value| into [2^14, 2^15)) and rounded to float16, element
// 32u + 8w + k paired with element 32u + 8w + k + 4 at xs[j][w][u].k, the order of e2m1_pair's codes.
// s_factor[j] receives 2^-sx. Ends with a barrier.
__device__ void stage(const __nv_bfloat16* __restrict__ src, int len, const int* rows_of, int tt, int div, uint4* xs,
                      float* s_factor, float* s_scale, float* s_red) {
  const int items = len / 8, U = len / 32;
  float m[kTT];
#pragma unroll
  for (int j = 0; j < kTT; ++j) m[j] = 0.0f;
  for (int i = threadIdx.x; i < items; i += blockDim.x) {
#pragma unroll
    for (int j = 0; j < kTT; ++j) {
      if (j < tt) {
        const uint4 v = *reinterpret_cast<const uint4*>(src + int64_t(rows_of[j] / div) * len + 8 * i);
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          m[j] = fmaxf(m[j], fabsf(__uint_as_float(w[t] << 16)));
          m[j] = fmaxf(m[j], fabsf(__uint_as_float(w[t] & 0xFFFF0000u)));
        }
      }
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
#pragma unroll
  for (int j = 0; j < kTT; ++j) {
    m[j] = warp_max(m[j]);
    if (lane == 0) s_red[warp * kTT + j] = m[j];
  }
  __syncthreads();
  if (threadIdx.x < tt) {
    float mm = 0.0f;
    for (int w = 0; w < nw; ++w) mm = fmaxf(mm, s_red[w * kTT + threadIdx.x]);
    const int sx = row_scale_exp(mm);
    s_factor[threadIdx.x] = exp2i(-sx);
    s_scale[threadIdx.x] = exp2i(sx);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < items; i += blockDim.x) {
    const int u = i / 4, w = i % 4;
#pragma unroll
    for (int j = 0; j < kTT; ++j) {
      if (j < tt) {
        const uint4 v = *reinterpret_cast<const uint4*>(src + int64_t(rows_of[j] / div) * len + 8 * i);
        const uint32_t b[4] = {v.x, v.y, v.z, v.w};
        float a[8];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          a[2 * t] = __uint_as_float(b[t] << 16) * s_scale[j];
          a[2 * t + 1] = __uint_as_float(b[t] & 0xFFFF0000u) * s_scale[j];
        }
        uint4 o;
        o.x = half2_bits(__floats2half2_rn(a[0], a[4]));
        o.y = half2_bits(__floats2half2_rn(a[1], a[5]));
        o.z = half2_bits(__floats2half2_rn(a[2], a[6]));
        o.w = half2_bits(__floats2half2_rn(a[3], a[7]));
        xs[(j * 4 + w) * U + u] = o;
      }
    }
  }
  __syncthreads();
}

// acc[j] = the dot product of a matrix row (codes: U 16-byte vectors; scales: two bytes per vector; both in
// shared memory) with staged row j (j < tt), before the global scale and the powers of two. This thread takes
// vectors u = lane + v * lanes; the unit's lanes then sum their parts.
template <int VPL>
__device__ __forceinline__ void dot(const uint8_t* codes, const uint8_t* scales, const uint4* __restrict__ xs, int U,
                                    int lane, int lanes, int tt, float (&acc)[kTT]) {
#pragma unroll
  for (int j = 0; j < kTT; ++j) acc[j] = 0.0f;
#pragma unroll
  for (int v = 0; v < VPL; ++v) {
    const int u = lane + v * lanes;
    if (u < U) {
      const uint4 q = reinterpret_cast<const uint4*>(codes)[u];
      const uint32_t sc = reinterpret_cast<const uint16_t*>(scales)[u];
      const uint32_t words[4] = {q.x, q.y, q.z, q.w};
      half2 w[16];
#pragma unroll
      for (int wd = 0; wd < 4; ++wd)
#pragma unroll
        for (int k = 0; k < 4; ++k) w[4 * wd + k] = as_half2(e2m1_pair(words[wd], k));
      const float s0 = __half2float(__ushort_as_half(e4m3_as_f16_bits(sc & 0xFFu)));
      const float s1 = __half2float(__ushort_as_half(e4m3_as_f16_bits(sc >> 8)));
#pragma unroll
      for (int j = 0; j < kTT; ++j) {
        if (j < tt) {
          const uint4* xr = xs + j * 4 * U + u;  // the staged inputs of words 0..3, as w is laid out
          const uint4 xv[4] = {xr[0], xr[U], xr[2 * U], xr[3 * U]};
          float2 f[2];
#pragma unroll
          for (int g = 0; g < 2; ++g) {  // scale group g: words 2g and 2g+1, eight products per accumulator
            half2 a = __hmul2(w[8 * g], as_half2(xv[2 * g].x));
            a = __hfma2(w[8 * g + 1], as_half2(xv[2 * g].y), a);
            a = __hfma2(w[8 * g + 2], as_half2(xv[2 * g].z), a);
            a = __hfma2(w[8 * g + 3], as_half2(xv[2 * g].w), a);
            a = __hfma2(w[8 * g + 4], as_half2(xv[2 * g + 1].x), a);
            a = __hfma2(w[8 * g + 5], as_half2(xv[2 * g + 1].y), a);
            a = __hfma2(w[8 * g + 6], as_half2(xv[2 * g + 1].z), a);
            a = __hfma2(w[8 * g + 7], as_half2(xv[2 * g + 1].w), a);
            f[g] = __half22float2(a);
          }
          acc[j] = fmaf(f[0].x + f[0].y, s0, acc[j]);
          acc[j] = fmaf(f[1].x + f[1].y, s1, acc[j]);
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kTT; ++j)
    for (int o = lanes / 2; o > 0; o >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
}

// Part `part` of `parts` of n bytes at p, into L2 (kept there in preference to streamed data).
__device__ void prefetch_l2(const uint8_t* p, int64_t n, int part, int parts) {
  const int64_t lines = (n + 127) / 128, per = (lines + parts - 1) / parts;
  const int64_t end = min(lines, (part + 1) * per);
  for (int64_t l = part * per + threadIdx.x; l < end; l += blockDim.x)
    asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p + 128 * l));
}

struct Shared {  // the statically sized shared memory of both kernels
  int members[kMaxPairs];
  int count;
  float factor[kTT], scale[kTT], red[32 * kTT];
};

// The ring of a block: `stages` buffers of `bytes` each in shared memory. The block's row blocks are
// rb = blockIdx.y + i * gridDim.y (i < count); fill(i, buffer) requests row block i's bytes. Every request
// commits one copy group, empty or not, so that "group i has landed" is "at most stages - 1 pending".
struct Ring {
  uint8_t* base;
  int stages, bytes, count;
  __device__ uint8_t* buffer(int i) const { return base + (i % stages) * bytes; }
};

template <int VPL>
__global__ void __launch_bounds__(512) nvfp4_moe_gate_up(Operands ops, const int32_t* __restrict__ ids,
                                                       const __nv_bfloat16* __restrict__ x,
                                                       __nv_bfloat16* __restrict__ act, int top_k, int pairs, int H,
                                                       int I, int lanes, int rows, int stages, int tmax, int prefetch) {
  // shared memory: the ring, then the staged tokens [tmax][4][H/32], then the results [2][kTT][rows]
  extern __shared__ uint4 smem[];
  __shared__ Shared sh;
  const int p = blockIdx.x, e = ids[p];
  if (e < 0 || e >= ops.num_experts) return;  // the down kernel writes this pair's zeros
  const int U = H / 32, unit = threadIdx.x / lanes, lane = threadIdx.x % lanes;
  const int mat = unit / rows, r = unit % rows;  // mat 0: gate, 1: up
  const int code_bytes = rows * (H / 2), scale_bytes = rows * (H / 16);
  const int blocks = I / rows;
  const Ring ring{reinterpret_cast<uint8_t*>(smem), stages, 2 * (code_bytes + scale_bytes),
                  (blocks - int(blockIdx.y) + int(gridDim.y) - 1) / int(gridDim.y)};
  const uint8_t* codes[2] = {ops.base[kGate] + e * ops.stride[kGate], ops.base[kUp] + e * ops.stride[kUp]};
  const uint8_t* scales[2] = {ops.base[kGateScale] + e * ops.stride[kGateScale],
                              ops.base[kUpScale] + e * ops.stride[kUpScale]};
  auto fill = [&](int i) {
    if (i < ring.count) {
      const int64_t rb = blockIdx.y + int64_t(i) * gridDim.y;
      uint8_t* b = ring.buffer(i);
      copy_async(b, codes[0] + rb * code_bytes, code_bytes);
      copy_async(b + code_bytes, codes[1] + rb * code_bytes, code_bytes);
      copy_async(b + 2 * code_bytes, scales[0] + rb * scale_bytes, scale_bytes);
      copy_async(b + 2 * code_bytes + scale_bytes, scales[1] + rb * scale_bytes, scale_bytes);
    }
    cp_async_commit();
  };
  for (int i = 0; i < stages; ++i) fill(i);
  list_members(ids, pairs, e, sh.members, &sh.count);
  if (sh.members[0] != p) {  // an earlier pair's blocks serve this expert
    cp_async_wait(0);
    return;
  }
  if (prefetch) {
    prefetch_l2(ops.base[kDown] + e * ops.stride[kDown], int64_t(H) * I / 2, blockIdx.y, gridDim.y);
    prefetch_l2(ops.base[kDownScale] + e * ops.stride[kDownScale], int64_t(H) * I / 16, blockIdx.y, gridDim.y);
  }
  const float s2 = load_f32(ops.base[kGateS2 + mat] + e * ops.stride[kGateS2 + mat]) * kDecodeFactor;
  uint4* xs = reinterpret_cast<uint4*>(ring.base + stages * ring.bytes);
  float* res = reinterpret_cast<float*>(xs + tmax * 4 * U);
  const int count = sh.count;
  if (count <= tmax) stage(x, H, sh.members, count, top_k, xs, sh.factor, sh.scale, sh.red);
  for (int i = 0; i < ring.count; ++i) {
    cp_async_wait(stages - 1);
    __syncthreads();  // row block i is in its buffer (every thread's copies)
    const uint8_t* b = ring.buffer(i);
    const int row0 = (blockIdx.y + i * gridDim.y) * rows;
    for (int c0 = 0; c0 < count; c0 += tmax) {
      const int tt = min(tmax, count - c0);
      if (count > tmax) stage(x, H, sh.members + c0, tt, top_k, xs, sh.factor, sh.scale, sh.red);
      float acc[kTT];
      dot<VPL>(b + mat * code_bytes + r * (H / 2), b + 2 * code_bytes + mat * scale_bytes + r * (H / 16), xs, U,
               lane, lanes, tt, acc);
      if (lane == 0)
        for (int j = 0; j < tt; ++j) res[(mat * kTT + j) * rows + r] = acc[j] * (s2 * sh.factor[j]);
      __syncthreads();  // results complete; the buffer is free once the last chunk is done
      if (c0 + tmax >= count) fill(i + stages);
      for (int k = threadIdx.x; k < tt * rows; k += blockDim.x) {
        const int j = k / rows, rr = k % rows;
        const float g = bf16_round(res[j * rows + rr]), u = bf16_round(res[(kTT + j) * rows + rr]);
        act[int64_t(sh.members[c0 + j]) * I + row0 + rr] = __float2bfloat16_rn(g * (1.0f / (1.0f + expf(-g))) * u);
      }
      if (count > tmax) __syncthreads();  // before the next chunk restages the tokens and rewrites the results
    }
  }
  cp_async_wait(0);
}

template <int VPL>
__global__ void __launch_bounds__(512) nvfp4_moe_down(Operands ops, const int32_t* __restrict__ ids,
                                                    const __nv_bfloat16* __restrict__ act,
                                                    __nv_bfloat16* __restrict__ y,
                                                    int pairs, int H, int I, int lanes, int rows, int stages,
                                                    int tmax) {
  extern __shared__ uint4 smem[];  // the ring, then the staged activations [tmax][4][I/32]
  __shared__ Shared sh;
  const int p = blockIdx.x, e = ids[p];
  const bool valid = e >= 0 && e < ops.num_experts;
  const int U = I / 32, unit = threadIdx.x / lanes, lane = threadIdx.x % lanes;
  const int code_bytes = rows * (I / 2), scale_bytes = rows * (I / 16);
  const int blocks = H / rows;
  const Ring ring{reinterpret_cast<uint8_t*>(smem), stages, code_bytes + scale_bytes,
                  (blocks - int(blockIdx.y) + int(gridDim.y) - 1) / int(gridDim.y)};
  const uint8_t* codes = valid ? ops.base[kDown] + e * ops.stride[kDown] : nullptr;
  const uint8_t* scales = valid ? ops.base[kDownScale] + e * ops.stride[kDownScale] : nullptr;
  auto fill = [&](int i) {
    if (valid && i < ring.count) {
      const int64_t rb = blockIdx.y + int64_t(i) * gridDim.y;
      copy_async(ring.buffer(i), codes + rb * code_bytes, code_bytes);
      copy_async(ring.buffer(i) + code_bytes, scales + rb * scale_bytes, scale_bytes);
    }
    cp_async_commit();
  };
  for (int i = 0; i < stages; ++i) fill(i);
  list_members(ids, pairs, e, sh.members, &sh.count);
  if (sh.members[0] != p) {
    cp_async_wait(0);
    return;
  }
  const int count = sh.count;
  if (!valid) {  // no such expert: its pairs contribute zeros
    for (int i = 0; i < ring.count; ++i)
      for (int k = threadIdx.x; k < count * rows; k += blockDim.x)
        y[int64_t(sh.members[k / rows]) * H + (blockIdx.y + i * gridDim.y) * rows + k % rows] =
            __float2bfloat16_rn(0.0f);
    cp_async_wait(0);
    return;
  }
  const float s2 = load_f32(ops.base[kDownS2] + e * ops.stride[kDownS2]) * kDecodeFactor;
  uint4* xs = reinterpret_cast<uint4*>(ring.base + stages * ring.bytes);
  if (count <= tmax) stage(act, I, sh.members, count, 1, xs, sh.factor, sh.scale, sh.red);
  for (int i = 0; i < ring.count; ++i) {
    cp_async_wait(stages - 1);
    __syncthreads();
    const uint8_t* b = ring.buffer(i);
    const int row = (blockIdx.y + i * gridDim.y) * rows + unit;
    for (int c0 = 0; c0 < count; c0 += tmax) {
      const int tt = min(tmax, count - c0);
      if (count > tmax) stage(act, I, sh.members + c0, tt, 1, xs, sh.factor, sh.scale, sh.red);
      float acc[kTT];
      dot<VPL>(b + unit * (I / 2), b + code_bytes + unit * (I / 16), xs, U, lane, lanes, tt, acc);
      if (lane == 0)
        for (int j = 0; j < tt; ++j)
          y[int64_t(sh.members[c0 + j]) * H + row] = __float2bfloat16_rn(acc[j] * (s2 * sh.factor[j]));
      if (count > tmax) __syncthreads();  // before the next chunk restages the activations
    }
    __syncthreads();  // the buffer is free
    fill(i + stages);
  }
  cp_async_wait(0);
}

// Lanes per row for a row of U code vectors: no idle lanes if possible, then the fewest lanes (more bytes in
// flight per thread), with at most kMaxVpl vectors per thread.
int auto_lanes(int64_t U) {
  int best = -1;
  int64_t best_waste = 0;
  for (int lanes = 1; lanes <= 32; lanes *= 2) {
    const int64_t vpl = (U + lanes - 1) / lanes;
    if (vpl > kMaxVpl) continue;
    const int64_t waste = lanes * vpl - U;
    if (best < 0 || waste < best_waste) best = lanes, best_waste = waste;
  }
  return best;
}

int64_t pow2_divisor(int64_t n, int64_t cap) {
  int64_t d = 1;
  while (d * 2 <= cap && n % (d * 2) == 0) d *= 2;
  return d;
}

struct Launch {
  int lanes = 0, vpl = 0, rows = 0, threads = 0, stages = 0, grid_y = 0;
  size_t smem = 0;
};

// Block shape of one kernel: `units_per_row` units of `lanes` threads per output row (gate_up: 2, gate and up),
// `rows` output rows per row block, a ring of `stages` row blocks (each `stage_per_row` bytes per row) plus
// `smem_fixed` + `smem_per_row` * rows bytes of shared memory.
ffi::ErrorOr<Launch> plan(const char* what, int64_t U, int64_t len, int64_t out_rows, int64_t units_per_row,
                          int64_t lanes, int64_t threads, int64_t stages, size_t smem_fixed, size_t smem_per_row) {
  auto bad = [what](std::string m) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(std::string("nvfp4_moe ") + what + ": " + m));
  };
  Launch l;
  l.lanes = int(lanes > 0 ? lanes : auto_lanes(U));
  if (l.lanes < 1 || l.lanes > 32 || (l.lanes & (l.lanes - 1)))
    return bad("lanes must be a power of two in 1..32 (and leave at most 8 vectors per thread)");
  l.vpl = int((U + l.lanes - 1) / l.lanes);
  if (l.vpl > kMaxVpl) return bad("lanes=" + std::to_string(l.lanes) + " leaves more than 8 vectors per thread");
  if (threads < 32 || threads > 512) return bad("threads must be in 32..512");
  if (stages < 1 || stages > 8) return bad("stages must be in 1..8");
  l.rows = int(pow2_divisor(out_rows, std::max<int64_t>(1, threads / (units_per_row * l.lanes))));
  l.threads = int(l.rows * units_per_row * l.lanes);
  if (l.threads % 32 || l.threads > 512)
    return bad(std::to_string(l.threads) + " threads per block is not a multiple of 32 (rows " +
               std::to_string(l.rows) + ")");
  if ((l.rows * (len / 16)) % 16)
    return bad("a row block's scales (" + std::to_string(l.rows * (len / 16)) + " bytes) are not whole 16-byte copies");
  l.stages = int(stages);
  l.smem = size_t(stages) * units_per_row * l.rows * (len / 2 + len / 16) + smem_fixed + smem_per_row * l.rows;
  return l;
}

template <typename Kernel>
ffi::Error size_grid(const char* what, Kernel k, Launch& l, int64_t pairs, int64_t row_blocks, int64_t blocks) {
  // Always raise the kernel's dynamic shared-memory limit: past 48 KB in all (static included) a launch needs it.
  if (cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(l.smem)) != cudaSuccess)
    return ffi::Error::InvalidArgument(std::string("nvfp4_moe ") + what + ": " + std::to_string(l.smem) +
                                       " bytes of shared memory per block is more than this GPU allows (" +
                                       cudaGetErrorString(cudaGetLastError()) + ")");
  if (blocks <= 0) {  // one wave: as many blocks as fit on the GPU at once, shared by the pairs
    int device = 0, sms = 0, per_sm = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, l.threads, l.smem) != cudaSuccess)
      return ffi::Error::Internal(std::string("nvfp4_moe ") + what + ": occupancy query failed (" +
                                  cudaGetErrorString(cudaGetLastError()) + ")");
    blocks = int64_t(sms) * per_sm / pairs;  // rounded down: a partial second wave would double the time
  }
  l.grid_y = int(std::min(std::max<int64_t>(blocks, 1), row_blocks));
  return ffi::Error::Success();
}

#define JAXFLASH_BY_VPL(vpl, call)  \
  switch (vpl) {                    \
    case 1: call(1); break;         \
    case 2: call(2); break;         \
    case 3: call(3); break;         \
    case 4: call(4); break;         \
    case 5: call(5); break;         \
    case 6: call(6); break;         \
    case 7: call(7); break;         \
    default: call(8); break;        \
  }

ffi::Error Nvfp4MoeCuda(cudaStream_t stream, ffi::AnyBuffer ids, ffi::AnyBuffer x, ffi::RemainingArgs operands,
                        ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> act,
                        ffi::Span<const int64_t> part_arg, ffi::Span<const int64_t> part_offset, int64_t lanes_gu,
                        int64_t lanes_down, int64_t threads_gu, int64_t threads_down, int64_t stages,
                        int64_t blocks_gu, int64_t blocks_down, int64_t prefetch) {
  g_calls[kCallNvfp4MoeCuda].fetch_add(1, std::memory_order_relaxed);
  auto shape = check_nvfp4_moe(ids, x, operands, *y, *act, part_arg, part_offset, true);
  if (shape.has_error()) return shape.error();
  const MoeShape& s = *shape;
  const int H = int(s.hidden), I = int(s.inter), pairs = int(s.pairs), top_k = int(s.top_k);
  const int tmax = int(std::min<int64_t>(kTT, s.tokens));  // an expert serves at most one row per token
  auto gu = plan("gate_up", H / 32, H, I, 2, lanes_gu, threads_gu, stages, size_t(tmax) * H * 2,
                 2 * kTT * sizeof(float));
  if (gu.has_error()) return gu.error();
  auto dn = plan("down", I / 32, I, H, 1, lanes_down, threads_down, stages, size_t(tmax) * I * 2, 0);
  if (dn.has_error()) return dn.error();
  const int32_t* id = static_cast<const int32_t*>(ids.untyped_data());
  const auto* xs = static_cast<const __nv_bfloat16*>(x.untyped_data());
  auto* a = static_cast<__nv_bfloat16*>(act->untyped_data());
  auto* yo = static_cast<__nv_bfloat16*>(y->untyped_data());
  Launch& g = *gu;
  Launch& d = *dn;
#define JAXFLASH_GATE_UP(V)                                                                                   \
  {                                                                                                           \
    if (auto err = size_grid("gate_up", nvfp4_moe_gate_up<V>, g, pairs, I / g.rows, blocks_gu); err.failure()) \
      return err;                                                                                             \
    nvfp4_moe_gate_up<V><<<dim3(pairs, g.grid_y), g.threads, g.smem, stream>>>(                               \
        s.ops, id, xs, a, top_k, pairs, H, I, g.lanes, g.rows, g.stages, tmax, int(prefetch != 0));           \
  }
#define JAXFLASH_DOWN(V)                                                                                  \
  {                                                                                                       \
    if (auto err = size_grid("down", nvfp4_moe_down<V>, d, pairs, H / d.rows, blocks_down); err.failure()) \
      return err;                                                                                         \
    nvfp4_moe_down<V><<<dim3(pairs, d.grid_y), d.threads, d.smem, stream>>>(s.ops, id, a, yo, pairs, H, I,  \
                                                                            d.lanes, d.rows, d.stages, tmax); \
  }
  JAXFLASH_BY_VPL(g.vpl, JAXFLASH_GATE_UP)
  JAXFLASH_BY_VPL(d.vpl, JAXFLASH_DOWN)
#undef JAXFLASH_GATE_UP
#undef JAXFLASH_DOWN
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("nvfp4_moe: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

}  // namespace jaxflash

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashNvfp4MoeCuda, jaxflash::Nvfp4MoeCuda,
                              JAXFLASH_NVFP4_MOE_BINDING(JAXFLASH_CUDA_BIND),
                              {xla::ffi::Traits::kCmdBufferCompatible});
