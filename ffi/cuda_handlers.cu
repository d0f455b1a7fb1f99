// CUDA handlers. All but the memcpy gather and the copy carry Traits::kCmdBufferCompatible: XLA records them into its
// command buffers (CUDA graphs), after which their C++ bodies do not run again while buffer addresses stay
// the same. So each body only enqueues work on XLA's stream (kernels, async copies, a host node), never waits
// on the device, and reads no device data on the host. Errors that depend on device data (a bad expert id,
// too many distinct experts, a bad token) come back in the info outputs; Python checks them after the step.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <climits>
#include <mutex>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "handler_util.h"

namespace jaxflash {

namespace {

constexpr int kResolveThreads = 256;
constexpr int kPickMax = 32;  // misses up to which one warp picks the victims (more: the block sorts)
constexpr int kGatherThreads = 256;
constexpr int kGatherUnroll = 4;

std::atomic<int> g_blocks_per_record{0};  // 0: pick from the SM count (see gather_blocks_per_record)

ffi::Error cuda_error(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(err));
}

int64_t next_pow2(int64_t x) {
  int64_t p = 1;
  while (p < x) p <<= 1;
  return p;
}

// ----- resolve -------------------------------------------------------------------------------------------------

// Exclusive prefix sum of one int per thread across the block; *total receives the sum. All threads must call.
__device__ int block_exclusive_scan(int v, int* s_warp, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  int x = v;
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) s_warp[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = lane < nwarps ? s_warp[lane] : 0;
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    s_warp[lane] = w;
  }
  __syncthreads();
  const int before = warp > 0 ? s_warp[warp - 1] : 0;
  *total = s_warp[nwarps - 1];
  __syncthreads();  // s_warp is reused by the next scan
  return before + x - v;
}

// The m smallest of keys[0, P2) in ascending order into out[0, m), by m rounds of a warp-wide minimum, each
// round taking its minimum out (one warp calls it). The m smallest must be distinct (resolve's candidate keys
// hold their slot index), so exactly one lane holds each round's minimum.
__device__ void pick_smallest(unsigned long long* keys, int P2, int m, unsigned long long* out) {
  const int lane = threadIdx.x & 31;
  for (int r = 0; r < m; ++r) {
    unsigned long long best = ~0ull;
    int at = -1;
    for (int i = lane; i < P2; i += 32)
      if (keys[i] < best) best = keys[i], at = i;
    unsigned long long low = best;
    for (int o = 16; o > 0; o >>= 1) {
      const unsigned long long other = __shfl_xor_sync(0xffffffffu, low, o);
      low = other < low ? other : low;
    }
    if (at >= 0 && best == low) {
      keys[at] = ~0ull;
      out[r] = low;
    }
    __syncwarp();
  }
}

__device__ __forceinline__ int32_t effective_stamp(int32_t s, bool rebase) {
  if (!rebase || s < 0) return s;
  return s >= kStampRebaseBy ? s - kStampRebaseBy : 0;
}

// One block does the whole step (see lru.cc for the rules). Shared memory: a bitmap of the experts this step
// needs (ceil(E/32) words, so any expert count works and the distinct experts come out in ascending order),
// the misses, a needed-flag per slot and the (stamp, slot) sort keys of the victim candidates.
__global__ void resolve_kernel(const int32_t* __restrict__ ids, int64_t n, int32_t* __restrict__ state, int S, int E,
                               int P2, int32_t* __restrict__ slots_out, int32_t* __restrict__ misses_out, int M,
                               int32_t* __restrict__ info) {
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned long long* s_keys = reinterpret_cast<unsigned long long*>(smem);  // [P2]
  const int W = (E + 31) / 32;
  unsigned int* s_bits = reinterpret_cast<unsigned int*>(s_keys + P2);  // [W]
  int32_t* s_missing = reinterpret_cast<int32_t*>(s_bits + W);         // [S]
  unsigned char* s_need = reinterpret_cast<unsigned char*>(s_missing + S);  // [S]
  __shared__ int s_warp[32];
  __shared__ int s_err, s_detail, s_badpos, s_state_bad;
  __shared__ unsigned long long s_pick[kPickMax];

  const int tid = threadIdx.x, nt = blockDim.x;
  int32_t* slot_expert = state + kLruHeader;
  int32_t* stamp = slot_expert + S;
  int32_t* expert_slot = stamp + S;

  // Error precedence matches lru.cc: header, expert ids, too many experts, inconsistent state.
  if (tid == 0) {
    s_err = (state[1] != S || state[2] != E) ? kBadLruState : kOk;
    s_detail = 0;
    s_badpos = INT_MAX;
    s_state_bad = 0;
  }
  for (int w = tid; w < W; w += nt) s_bits[w] = 0u;
  for (int v = tid; v < S; v += nt) s_need[v] = 0;
  __syncthreads();
  const bool header_ok = s_err == kOk;

  if (header_ok) {
    for (int64_t i = tid; i < n; i += nt) {
      const int32_t e = ids[i];
      if (static_cast<uint32_t>(e) >= static_cast<uint32_t>(E))
        atomicMin(&s_badpos, static_cast<int>(i));
      else
        atomicOr(&s_bits[e >> 5], 1u << (e & 31));
    }
  }
  __syncthreads();
  const bool ids_ok = header_ok && s_badpos == INT_MAX;

  // Each thread owns a contiguous run of bitmap words, so per-thread order plus a scan gives ascending order.
  const int per = (W + nt - 1) / nt;
  const int w0 = min(W, tid * per), w1 = min(W, w0 + per);
  int my_distinct = 0, my_miss = 0;
  if (ids_ok) {
    for (int w = w0; w < w1; ++w) {
      unsigned int bits = s_bits[w];
      my_distinct += __popc(bits);
      while (bits) {
        const int e = w * 32 + __ffs(bits) - 1;
        bits &= bits - 1;
        const int32_t v = expert_slot[e];
        if (v < 0) {
          ++my_miss;
        } else if (v >= S || slot_expert[v] != e) {
          s_state_bad = 1;
        } else {
          s_need[v] = 1;
        }
      }
    }
  }
  int distinct, m;
  block_exclusive_scan(my_distinct, s_warp, &distinct);
  int miss_base = block_exclusive_scan(my_miss, s_warp, &m);  // ends with a barrier
  if (tid == 0) {
    if (!header_ok) {
      // s_err already says so
    } else if (!ids_ok) {
      s_err = kBadExpertId;
      s_detail = ids[s_badpos];
    } else if (distinct > S) {
      s_err = kTooManyExperts;
      s_detail = distinct;
    } else if (s_state_bad) {
      s_err = kBadLruState;
    }
  }
  __syncthreads();

  const int32_t step0 = state[0] + 1;
  const bool rebase = step0 >= kStampRebaseAt;
  const int32_t step = rebase ? step0 - kStampRebaseBy : step0;
  const bool go = s_err == kOk;  // uniform: nothing writes s_err until after the next barrier

  if (go) {
    for (int w = w0; w < w1; ++w) {
      unsigned int bits = s_bits[w];
      while (bits) {
        const int e = w * 32 + __ffs(bits) - 1;
        bits &= bits - 1;
        if (expert_slot[e] < 0) s_missing[miss_base++] = e;
      }
    }
    // Candidates: slots no needed expert occupies, keyed by (effective stamp, slot index).
    for (int v = tid; v < P2; v += nt) {
      unsigned long long key = ~0ull;
      if (v < S && !s_need[v])
        key = (static_cast<unsigned long long>(effective_stamp(stamp[v], rebase) + 1) << 32) |
              static_cast<unsigned int>(v);
      s_keys[v] = key;
    }
  }
  __syncthreads();
  // The victims: the m candidates of lowest (stamp, slot), ascending. A decode step's few misses take m rounds
  // of one warp; more (a prefill block's) a bitonic sort of all P2 keys by the block.
  const unsigned long long* victims = s_keys;
  if (go && m <= kPickMax) {
    if (tid < 32) pick_smallest(s_keys, P2, m, s_pick);
    victims = s_pick;
  } else if (go) {
    for (int k = 2; k <= P2; k <<= 1) {
      for (int j = k >> 1; j > 0; j >>= 1) {
        for (int i = tid; i < P2; i += nt) {
          const int x = i ^ j;
          if (x > i) {
            const unsigned long long a = s_keys[i], b = s_keys[x];
            if ((a > b) == ((i & k) == 0)) {
              s_keys[i] = b;
              s_keys[x] = a;
            }
          }
        }
        __syncthreads();
      }
    }
  }
  __syncthreads();
  if (go) {
    for (int r = tid; r < m; r += nt) {
      const int v = static_cast<int>(victims[r] & 0xffffffffu);
      const int32_t old = slot_expert[v];
      if (old >= E || (old >= 0 && expert_slot[old] != v)) s_err = kBadLruState;
    }
  }
  __syncthreads();

  if (s_err != kOk) {  // leave the state untouched; outputs are safe placeholders
    for (int64_t i = tid; i < n; i += nt) slots_out[i] = 0;
    for (int r = tid; r < 2 * M; r += nt) misses_out[r] = -1;
    if (tid == 0) {
      info[0] = 0;
      info[1] = (!header_ok || !ids_ok) ? 0 : distinct;
      info[2] = s_err;
      info[3] = s_detail;
    }
    return;
  }

  if (rebase) {
    for (int v = tid; v < S; v += nt) stamp[v] = effective_stamp(stamp[v], true);
    __syncthreads();
  }
  for (int r = tid; r < m; r += nt) {
    const int v = static_cast<int>(victims[r] & 0xffffffffu);
    const int32_t e = s_missing[r];
    const int32_t old = slot_expert[v];
    // Evicted experts are cached and not needed; new ones are not cached: the two sets never overlap.
    if (old >= 0) expert_slot[old] = -1;
    slot_expert[v] = e;
    expert_slot[e] = v;
    stamp[v] = step;
    misses_out[2 * r] = e;
    misses_out[2 * r + 1] = v;
  }
  for (int v = tid; v < S; v += nt)
    if (s_need[v]) stamp[v] = step;
  for (int r = m + tid; r < M; r += nt) misses_out[2 * r] = misses_out[2 * r + 1] = -1;
  __syncthreads();  // makes this block's global writes visible to all its threads
  for (int64_t i = tid; i < n; i += nt) slots_out[i] = expert_slot[ids[i]];
  if (tid == 0) {
    state[0] = step;
    info[0] = m;
    info[1] = distinct;
    info[2] = kOk;
    info[3] = 0;
  }
}

size_t resolve_smem_bytes(int64_t S, int64_t E, int64_t P2) {
  return size_t(P2) * 8 + size_t((E + 31) / 32) * 4 + size_t(S) * 4 + size_t(S);
}

ffi::Error launch_resolve(cudaStream_t stream, const int32_t* ids, int64_t n, int32_t* state, int64_t S, int64_t E,
                          int32_t* slots, int32_t* misses, int64_t M, int32_t* info) {
  const int64_t P2 = next_pow2(S);
  const size_t smem = resolve_smem_bytes(S, E, P2);
  if (smem > 48 * 1024) {
    // A function attribute, not stream work: allowed while XLA captures.
    if (cudaFuncSetAttribute(resolve_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) != cudaSuccess)
      return cuda_error(("resolve: num_slots=" + std::to_string(S) + ", num_experts=" + std::to_string(E) +
                         " need " + std::to_string(smem) + " bytes of shared memory").c_str());
  }
  resolve_kernel<<<1, kResolveThreads, smem, stream>>>(ids, n, state, int(S), int(E), int(P2), slots, misses, int(M),
                                                       info);
  return cuda_error("resolve kernel launch");
}

ffi::Error ResolveCuda(cudaStream_t stream, ffi::AnyBuffer ids, ffi::AnyBuffer state_in,
                       ffi::Result<ffi::AnyBuffer> slots, ffi::Result<ffi::AnyBuffer> misses,
                       ffi::Result<ffi::AnyBuffer> info, ffi::Result<ffi::AnyBuffer> state_out, int64_t num_slots,
                       int64_t num_experts, int64_t layer) {
  g_calls[kCallResolveCuda].fetch_add(1, std::memory_order_relaxed);
  auto shape = check_resolve(ids, state_in, *slots, *misses, *info, num_slots, num_experts, layer);
  if (shape.has_error()) return shape.error();
  int32_t* state = static_cast<int32_t*>(state_out->untyped_data());
  if (state != state_in.untyped_data()) {
    cudaMemcpyAsync(state, state_in.untyped_data(), state_in.size_bytes(), cudaMemcpyDeviceToDevice, stream);
  }
  return launch_resolve(stream, static_cast<const int32_t*>(ids.untyped_data()), shape->n,
                        state + shape->state_offset, num_slots, num_experts,
                        static_cast<int32_t*>(slots->untyped_data()), static_cast<int32_t*>(misses->untyped_data()),
                        shape->max_misses, static_cast<int32_t*>(info->untyped_data()));
}

// ----- gather --------------------------------------------------------------------------------------------------

// Zero-copy: blockIdx.y picks a miss, blockIdx.x a stretch of its record; threads read the mapped host pool
// with 16-byte loads, kGatherUnroll in flight each, so enough PCIe reads are outstanding to fill the link.
// (On the H200, plain loads and loads with a 256-byte L2 prefetch hint measured the same; so did 8 to 128
// blocks per record: about 49.5 GB/s, bounded by the link's efficiency for SM-issued reads.)
__global__ void gather_zero_copy_kernel(const int32_t* __restrict__ misses, const int32_t* __restrict__ info,
                                        const uint8_t* __restrict__ pool, int64_t layer_first_record, int E,
                                        int64_t R, uint8_t* __restrict__ cache, int S) {
  const int r = blockIdx.y;
  if (info[2] != kOk || r >= info[0]) return;
  const int e = misses[2 * r], v = misses[2 * r + 1];
  if (e < 0 || e >= E || v < 0 || v >= S) return;
  const uint4* src = reinterpret_cast<const uint4*>(pool + (layer_first_record + e) * R);
  uint4* dst = reinterpret_cast<uint4*>(cache + int64_t(v) * R);
  const int64_t n16 = R / 16;
  const int64_t chunk = (n16 + gridDim.x - 1) / gridDim.x;
  const int64_t lo = blockIdx.x * chunk, hi = min(n16, lo + chunk);
  for (int64_t base = lo + threadIdx.x; base < hi; base += int64_t(blockDim.x) * kGatherUnroll) {
    uint4 buf[kGatherUnroll];
#pragma unroll
    for (int u = 0; u < kGatherUnroll; ++u) {
      const int64_t i = base + int64_t(u) * blockDim.x;
      if (i < hi) buf[u] = __ldcs(src + i);  // streaming: host bytes are read once
    }
#pragma unroll
    for (int u = 0; u < kGatherUnroll; ++u) {
      const int64_t i = base + int64_t(u) * blockDim.x;
      if (i < hi) dst[i] = buf[u];
    }
  }
}

int gather_blocks_per_record(int64_t max_misses) {
  const int forced = g_blocks_per_record.load();
  if (forced > 0) return forced;
  static int sms = [] {
    int dev = 0, n = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return n > 0 ? n : 100;
  }();
  // Enough blocks that even a handful of misses keeps every SM issuing reads.
  const int64_t spread = std::max<int64_t>(1, std::min<int64_t>(max_misses, 32));
  return int(std::clamp<int64_t>((4 * sms + spread - 1) / spread, 4, 64));
}

ffi::Error launch_gather_zero_copy(cudaStream_t stream, const int32_t* misses, const int32_t* info,
                                   const ExpertPool& pool, int64_t layer, uint8_t* cache, int64_t S, int64_t M) {
  if (M == 0) return ffi::Error::Success();
  const dim3 grid(gather_blocks_per_record(M), unsigned(M));
  const int64_t first = layer * pool.num_experts;
  const int E = int(pool.num_experts);
  gather_zero_copy_kernel<<<grid, kGatherThreads, 0, stream>>>(misses, info, pool.device, first, E,
                                                               pool.record_bytes, cache, int(S));
  return cuda_error("gather kernel launch");
}

// XLA's output buffer holds the input's bytes: when XLA did not alias the two, copy them over (on `stream`).
void keep_contents(cudaStream_t stream, void* out, const ffi::AnyBuffer& in) {
  if (out != in.untyped_data()) cudaMemcpyAsync(out, in.untyped_data(), in.size_bytes(), cudaMemcpyDeviceToDevice, stream);
}

// What every gather needs, checked: the pool, the cache's geometry, and the output cache, holding the input's
// contents (a copy on XLA's stream when the two are not aliased).
struct Gather {
  std::shared_ptr<ExpertPool> pool;
  GatherShape shape;
  uint8_t* cache;
};

ffi::ErrorOr<Gather> checked_gather(cudaStream_t stream, const ffi::AnyBuffer& misses, const ffi::AnyBuffer& info,
                                    const ffi::AnyBuffer& cache_in, ffi::Result<ffi::AnyBuffer>& cache_out,
                                    int64_t pool_id, int64_t layer) {
  auto pool = pool_get(pool_id);
  auto shape = check_gather(misses, info, cache_in, pool.get(), pool_id, layer);
  if (shape.has_error()) return ffi::Unexpected(shape.error());
  uint8_t* cache = static_cast<uint8_t*>(cache_out->untyped_data());
  keep_contents(stream, cache, cache_in);
  return Gather{std::move(pool), *shape, cache};
}

// The zero-copy kernel also needs a pinned pool and records of whole 16-byte words (`who` names the call).
ffi::ErrorOr<Gather> zero_copy_gather(cudaStream_t stream, const char* who, const ffi::AnyBuffer& misses,
                                      const ffi::AnyBuffer& info, const ffi::AnyBuffer& cache_in,
                                      ffi::Result<ffi::AnyBuffer>& cache_out, int64_t pool_id, int64_t layer) {
  auto g = checked_gather(stream, misses, info, cache_in, cache_out, pool_id, layer);
  if (g.has_error()) return g;
  const ExpertPool& pool = *g->pool;
  if (!pool.pinned || pool.record_bytes % 16)
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        std::string(who) + ": pool " + std::to_string(pool_id) + " needs the zero-copy kernel: pinned (" +
        (pool.pinned ? "yes" : "no: " + pool.note + "; use mode='memcpy'") + ") and records a multiple of 16 bytes (" +
        std::to_string(pool.record_bytes) + ")"));
  return g;
}

ffi::Error GatherZeroCopyCuda(cudaStream_t stream, ffi::AnyBuffer misses, ffi::AnyBuffer info, ffi::AnyBuffer cache_in,
                              ffi::Result<ffi::AnyBuffer> cache_out, int64_t pool_id, int64_t layer) {
  g_calls[kCallGatherZeroCopyCuda].fetch_add(1, std::memory_order_relaxed);
  auto g = zero_copy_gather(stream, "gather", misses, info, cache_in, cache_out, pool_id, layer);
  if (g.has_error()) return g.error();
  return launch_gather_zero_copy(stream, static_cast<const int32_t*>(misses.untyped_data()),
                                 static_cast<const int32_t*>(info.untyped_data()), *g->pool, layer,
                                 g->cache + g->shape.cache_offset, g->shape.num_slots, g->shape.max_misses);
}

// Batched copies. The miss list lives on the device, so this handler must wait for it (one small D2H copy and
// a stream sync) before it can issue one cudaMemcpyAsync per run of adjacent records: it is NOT command-buffer
// compatible, and XLA runs it outside any graph. It also serves pools that could not be pinned.
void issue_memcpy_gather(cudaStream_t stream, const int32_t* m, int64_t n, const ExpertPool& pool, int64_t layer,
                         uint8_t* cache) {
  const int64_t R = pool.record_bytes;
  for (int64_t r = 0; r < n;) {
    int64_t run = 1;  // coalesce (e, v), (e+1, v+1), ...: one copy instead of several
    while (r + run < n && m[2 * (r + run)] == m[2 * r] + run && m[2 * (r + run) + 1] == m[2 * r + 1] + run) ++run;
    cudaMemcpyAsync(cache + int64_t(m[2 * r + 1]) * R, pool.record(layer, m[2 * r]), size_t(run * R),
                    cudaMemcpyHostToDevice, stream);
    r += run;
  }
}

// The miss list of a resolve, read back to pinned scratch (grown on demand; these handlers never run under
// capture) once `stream` has produced it, and checked against the pool and the cache. Returns the count.
ffi::ErrorOr<int64_t> read_misses(cudaStream_t stream, const char* who, const ffi::AnyBuffer& misses,
                                  const ffi::AnyBuffer& info, const GatherShape& shape, const ExpertPool& pool,
                                  const int32_t** list) {
  auto fail = [who](const char* what) {
    const std::string msg = std::string(who) + ": " + what;
    ffi::Error err = cuda_error(msg.c_str());
    return ffi::Unexpected(err.failure() ? std::move(err) : ffi::Error::Internal(msg));
  };
  static thread_local int32_t* scratch = nullptr;
  static thread_local size_t scratch_bytes = 0;
  const size_t need = size_t(4 + 2 * shape.max_misses) * sizeof(int32_t);
  if (need > scratch_bytes) {
    if (scratch) cudaFreeHost(scratch);
    scratch = nullptr;
    scratch_bytes = 0;
    if (cudaHostAlloc(reinterpret_cast<void**>(&scratch), need, cudaHostAllocDefault) != cudaSuccess)
      return fail("pinned scratch allocation");
    scratch_bytes = need;
  }
  cudaMemcpyAsync(scratch, info.untyped_data(), 16, cudaMemcpyDeviceToHost, stream);
  cudaMemcpyAsync(scratch + 4, misses.untyped_data(), size_t(2 * shape.max_misses) * sizeof(int32_t),
                  cudaMemcpyDeviceToHost, stream);
  if (cudaStreamSynchronize(stream) != cudaSuccess)
    return fail("reading the miss list");
  const int64_t n = scratch[2] == kOk ? std::min<int64_t>(scratch[0], shape.max_misses) : 0;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t e = scratch[4 + 2 * r], v = scratch[5 + 2 * r];
    if (e < 0 || e >= pool.num_experts || v < 0 || v >= shape.num_slots)
      return ffi::Unexpected(ffi::Error::InvalidArgument(
          std::string(who) + ": miss " + std::to_string(r) + " = (expert " + std::to_string(e) + ", slot " +
          std::to_string(v) + ") is out of range"));
  }
  *list = scratch + 4;
  return n;
}

// The copy engines take host addresses: the miss list is read back first (n records at `list`).
struct MemcpyGather {
  Gather g;
  const int32_t* list;
  int64_t n;
};

ffi::ErrorOr<MemcpyGather> memcpy_gather(cudaStream_t stream, const char* who, const ffi::AnyBuffer& misses,
                                         const ffi::AnyBuffer& info, const ffi::AnyBuffer& cache_in,
                                         ffi::Result<ffi::AnyBuffer>& cache_out, int64_t pool_id, int64_t layer) {
  auto g = checked_gather(stream, misses, info, cache_in, cache_out, pool_id, layer);
  if (g.has_error()) return ffi::Unexpected(g.error());
  const int32_t* list = nullptr;
  auto n = read_misses(stream, who, misses, info, g->shape, *g->pool, &list);
  if (n.has_error()) return ffi::Unexpected(n.error());
  return MemcpyGather{std::move(*g), list, *n};
}

ffi::Error GatherMemcpyCuda(cudaStream_t stream, ffi::AnyBuffer misses, ffi::AnyBuffer info, ffi::AnyBuffer cache_in,
                            ffi::Result<ffi::AnyBuffer> cache_out, int64_t pool_id, int64_t layer) {
  g_calls[kCallGatherMemcpyCuda].fetch_add(1, std::memory_order_relaxed);
  auto g = memcpy_gather(stream, "gather", misses, info, cache_in, cache_out, pool_id, layer);
  if (g.has_error()) return g.error();
  issue_memcpy_gather(stream, g->list, g->n, *g->g.pool, layer, g->g.cache + g->g.shape.cache_offset);
  return cuda_error("gather: memcpy");
}

// ----- gather beside the kernels (prefill blocks) ------------------------------------------------------------
// A prefill chunk goes through the cache in blocks of experts (engine/experts.py). While block b's expert kernels
// run on XLA's stream, block b+1's misses are copied in on a side stream. gather_start forks: the side stream
// waits for everything XLA enqueued before it (resolve's miss list, the kernels that last read the victim slots),
// then runs the zero-copy kernel. gather_wait joins: XLA's stream waits for all the side stream's work so far.
// The side stream has the highest priority: the copy over PCIe is the longer of the two, so its blocks go first
// whenever SMs free up. A fork must be joined within one stream capture, so neither call may be captured: neither
// carries the command-buffer trait (prefill programs run their block loops outside CUDA graphs anyway).

struct SideStream {
  std::mutex mu;  // one fork or join at a time: the events are shared
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
};

constexpr int kMaxDevices = 64;

ffi::ErrorOr<SideStream*> side_stream(cudaStream_t xla_stream) {
  static SideStream sides[kMaxDevices];
  int dev = 0;
  if (cudaStreamGetDevice(xla_stream, &dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices)
    return ffi::Unexpected(ffi::Error::Internal("gather_start: the stream's device is unknown"));
  SideStream* side = &sides[dev];
  std::lock_guard<std::mutex> lock(side->mu);
  if (!side->stream) {
    int prev = 0, least = 0, greatest = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(dev);
    cudaDeviceGetStreamPriorityRange(&least, &greatest);
    const bool ok = cudaStreamCreateWithPriority(&side->stream, cudaStreamNonBlocking, greatest) == cudaSuccess &&
                    cudaEventCreateWithFlags(&side->fork, cudaEventDisableTiming) == cudaSuccess &&
                    cudaEventCreateWithFlags(&side->join, cudaEventDisableTiming) == cudaSuccess;
    cudaSetDevice(prev);
    if (!ok) {
      side->stream = nullptr;
      return ffi::Unexpected(ffi::Error::Internal(std::string("gather_start: side stream: ") +
                                                  cudaGetErrorString(cudaGetLastError())));
    }
  }
  return side;
}

ffi::Error GatherStartCuda(cudaStream_t stream, ffi::AnyBuffer misses, ffi::AnyBuffer info, ffi::AnyBuffer cache_in,
                           ffi::Result<ffi::AnyBuffer> cache_out, int64_t pool_id, int64_t layer) {
  g_calls[kCallGatherStartCuda].fetch_add(1, std::memory_order_relaxed);
  auto side = side_stream(stream);
  if (side.has_error()) return side.error();
  // a cache copy (not aliased) is enqueued on XLA's stream, before the fork
  auto g = zero_copy_gather(stream, "gather_start", misses, info, cache_in, cache_out, pool_id, layer);
  if (g.has_error()) return g.error();
  std::lock_guard<std::mutex> lock((*side)->mu);
  cudaEventRecord((*side)->fork, stream);
  cudaStreamWaitEvent((*side)->stream, (*side)->fork, 0);
  return launch_gather_zero_copy((*side)->stream, static_cast<const int32_t*>(misses.untyped_data()),
                                 static_cast<const int32_t*>(info.untyped_data()), *g->pool, layer,
                                 g->cache + g->shape.cache_offset, g->shape.num_slots, g->shape.max_misses);
}

// The same beside XLA's stream, by the copy engines: the miss list is read back first (a sync of XLA's stream,
// which inside a prefill block loop only waits for the resolve just enqueued: the loop's condition has already
// waited for the previous block), then the side stream copies with cudaMemcpyAsync and the SMs stay free for
// the kernels that run meanwhile. Needs a pinned pool for the copies to be asynchronous.
ffi::Error GatherStartMemcpyCuda(cudaStream_t stream, ffi::AnyBuffer misses, ffi::AnyBuffer info,
                                 ffi::AnyBuffer cache_in, ffi::Result<ffi::AnyBuffer> cache_out, int64_t pool_id,
                                 int64_t layer) {
  g_calls[kCallGatherStartMemcpyCuda].fetch_add(1, std::memory_order_relaxed);
  auto side = side_stream(stream);
  if (side.has_error()) return side.error();
  auto g = memcpy_gather(stream, "gather_start", misses, info, cache_in, cache_out, pool_id, layer);
  if (g.has_error()) return g.error();
  std::lock_guard<std::mutex> lock((*side)->mu);
  cudaEventRecord((*side)->fork, stream);  // the copies land after everything before them (the cache copy above)
  cudaStreamWaitEvent((*side)->stream, (*side)->fork, 0);
  issue_memcpy_gather((*side)->stream, g->list, g->n, *g->g.pool, layer, g->g.cache + g->g.shape.cache_offset);
  return cuda_error("gather_start: memcpy");
}

// misses and info come in only to stay alive (XLA must not reuse their memory) until the side stream has read them.
ffi::Error GatherWaitCuda(cudaStream_t stream, ffi::AnyBuffer cache_in, ffi::AnyBuffer after_in, ffi::AnyBuffer,
                          ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> cache_out,
                          ffi::Result<ffi::AnyBuffer> after_out) {
  g_calls[kCallGatherWaitCuda].fetch_add(1, std::memory_order_relaxed);
  auto side = side_stream(stream);
  if (side.has_error()) return side.error();
  {
    std::lock_guard<std::mutex> lock((*side)->mu);
    cudaEventRecord((*side)->join, (*side)->stream);
    cudaStreamWaitEvent(stream, (*side)->join, 0);
  }
  keep_contents(stream, cache_out->untyped_data(), cache_in);
  keep_contents(stream, after_out->untyped_data(), after_in);
  return cuda_error("gather_wait");
}

// ----- PLE host step -------------------------------------------------------------------------------------------
// Inside the captured step this becomes: D2H copies of tokens/lengths/reset/context into the table's pinned
// staging -> a host node (cudaLaunchHostFunc) that hashes and gathers rows from the memory-mapped table into
// staging -> H2D copies of ids, rows, context and info. Stream order makes each replay see the current tokens.

struct HostStepArgs {
  PleParams params;
  const NgramTable* table;
  uint8_t* staging;
};

void CUDART_CB ple_host_fn(void* user) {
  const HostStepArgs& a = *static_cast<const HostStepArgs*>(user);
  const PleParams& p = a.params;
  const PleStaging L(a.table->max_tokens, p.heads, a.table->row_bytes);
  uint8_t* s = a.staging;
  const int32_t* ctx_in = reinterpret_cast<const int32_t*>(s + L.ctx_in);
  int32_t* ctx_out = reinterpret_cast<int32_t*>(s + L.ctx_out);
  int32_t* info = reinterpret_cast<int32_t*>(s + L.info);
  int64_t detail = 0;
  const int32_t st = ple_compute(p, reinterpret_cast<const int32_t*>(s + L.tokens),
                                 reinterpret_cast<const int32_t*>(s + L.lengths),
                                 reinterpret_cast<const int32_t*>(s + L.reset), ctx_in, ctx_out,
                                 reinterpret_cast<int32_t*>(s + L.ids), a.table, s + L.rows, &detail);
  if (st != kOk) {  // keep the context; ids point at row 0 so a consumer that runs anyway stays in bounds
    std::memcpy(ctx_out, ctx_in, size_t(2 * p.batch) * sizeof(int32_t));
    std::memset(s + L.ids, 0, size_t(p.batch * p.tokens * p.heads) * sizeof(int32_t));
  }
  info[0] = st;
  info[1] = static_cast<int32_t>(detail);
}

ffi::Error PleCuda(cudaStream_t stream, ffi::AnyBuffer tokens, ffi::AnyBuffer lengths, ffi::AnyBuffer reset,
                   ffi::AnyBuffer ctx_in, ffi::Result<ffi::AnyBuffer> ids, ffi::Result<ffi::AnyBuffer> rows,
                   ffi::Result<ffi::AnyBuffer> info, ffi::Result<ffi::AnyBuffer> ctx_out, int64_t table_id,
                   int64_t eos, int64_t vocab, ffi::Span<const int64_t> multipliers,
                   ffi::Span<const int64_t> head_sizes, ffi::Span<const int64_t> head_offsets) {
  g_calls[kCallPleCuda].fetch_add(1, std::memory_order_relaxed);
  auto table = table_get(table_id);
  auto p = make_ple_params(tokens, lengths, reset, ctx_in, *ids, *rows, *info, table.get(), table_id, eos, vocab,
                           multipliers, head_sizes, head_offsets);
  if (p.has_error()) return p.error();
  if (!table->staging)
    return ffi::Error::InvalidArgument("ple_step: n-gram table " + std::to_string(table_id) +
                                       " has no pinned staging area (" + table->staging_note + ")");
  if (p->batch * p->tokens > table->max_tokens)
    return ffi::Error::InvalidArgument("ple_step: a step of " + std::to_string(p->batch * p->tokens) +
                                       " tokens exceeds the table's max_tokens=" + std::to_string(table->max_tokens));
  // One never-moving argument block per distinct call: a recorded host node keeps pointing at it.
  HostStepArgs args{*p, table.get(), table->staging};
  std::string key(reinterpret_cast<const char*>(&args), sizeof(args));
  HostStepArgs* stable;
  {
    std::lock_guard<std::mutex> lock(table->mu);
    auto& slot = table->host_args[key];
    if (!slot) {
      slot.reset(new uint8_t[sizeof(HostStepArgs)]);
      std::memcpy(slot.get(), &args, sizeof(args));
    }
    stable = reinterpret_cast<HostStepArgs*>(slot.get());
  }
  const PleStaging L(table->max_tokens, p->heads, table->row_bytes);
  uint8_t* s = table->staging;
  const int64_t B = p->batch, BT = p->batch * p->tokens, H = p->heads;
  cudaMemcpyAsync(s + L.tokens, tokens.untyped_data(), size_t(BT) * 4, cudaMemcpyDeviceToHost, stream);
  cudaMemcpyAsync(s + L.lengths, lengths.untyped_data(), size_t(B) * 4, cudaMemcpyDeviceToHost, stream);
  cudaMemcpyAsync(s + L.reset, reset.untyped_data(), size_t(B) * 4, cudaMemcpyDeviceToHost, stream);
  cudaMemcpyAsync(s + L.ctx_in, ctx_in.untyped_data(), size_t(B) * 8, cudaMemcpyDeviceToHost, stream);
  cudaLaunchHostFunc(stream, ple_host_fn, stable);
  cudaMemcpyAsync(ids->untyped_data(), s + L.ids, size_t(BT * H) * 4, cudaMemcpyHostToDevice, stream);
  cudaMemcpyAsync(rows->untyped_data(), s + L.rows, size_t(BT * H * table->row_bytes), cudaMemcpyHostToDevice,
                  stream);
  cudaMemcpyAsync(ctx_out->untyped_data(), s + L.ctx_out, size_t(B) * 8, cudaMemcpyHostToDevice, stream);
  cudaMemcpyAsync(info->untyped_data(), s + L.info, 8, cudaMemcpyHostToDevice, stream);
  return cuda_error("ple_step: enqueueing the host step");
}

// Operand i to result i with async device-to-device copies. Deliberately NOT command-buffer compatible: XLA
// runs it outside its CUDA graphs, so a program's graph never reads per-call inputs or writes per-call output
// buffers, whose addresses change from call to call (each change makes XLA update the whole graph).
ffi::Error CopyCuda(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  g_calls[kCallCopyCuda].fetch_add(1, std::memory_order_relaxed);
  if (auto err = check_copy(args, rets); err.failure()) return err;
  for (size_t i = 0; i < args.size(); ++i) {
    auto a = *args.get<ffi::AnyBuffer>(i);
    auto r = *rets.get<ffi::AnyBuffer>(i);
    if (a.size_bytes()) keep_contents(stream, r->untyped_data(), a);
  }
  return cuda_error("copy");
}

}  // namespace

// ----- benchmark helpers (called from Python directly, outside XLA) -------------------------------------------

void set_gather_blocks_per_record(int n) { g_blocks_per_record = n; }

// Times `iters` gathers of M records each into a scratch cache of num_slots slots, cycling through the K miss
// lists (so host bytes are not re-read from the GPU's L2). Returns seconds per gather, and whether the last
// list's slots hold the pool's bytes afterwards.
std::pair<double, bool> bench_gather(int64_t pool_id, int64_t layer, const int32_t* lists, int64_t K, int64_t M,
                                     int64_t num_slots, bool zero_copy, int iters) {
  auto pool = pool_get(pool_id);
  if (!pool) throw std::invalid_argument("no pool " + std::to_string(pool_id));
  if (zero_copy && !pool->pinned) throw std::invalid_argument("zero-copy needs a pinned pool");
  const int64_t R = pool->record_bytes;
  uint8_t* cache = nullptr;
  int32_t *d_lists = nullptr, *d_info = nullptr;
  cudaStream_t stream;
  cudaEvent_t t0, t1;
  auto check = [](cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
  };
  check(cudaMalloc(&cache, size_t(num_slots * R)), "cudaMalloc cache");
  check(cudaMalloc(&d_lists, size_t(K * M * 2) * 4), "cudaMalloc lists");
  check(cudaMalloc(&d_info, 16), "cudaMalloc info");
  const int32_t host_info[4] = {int32_t(M), int32_t(M), kOk, 0};
  check(cudaMemcpy(d_lists, lists, size_t(K * M * 2) * 4, cudaMemcpyHostToDevice), "copy lists");
  check(cudaMemcpy(d_info, host_info, 16, cudaMemcpyHostToDevice), "copy info");
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  check(cudaEventCreate(&t0), "event");
  check(cudaEventCreate(&t1), "event");
  auto one = [&](int it) {
    const int64_t k = it % K;
    if (zero_copy) {
      auto err = launch_gather_zero_copy(stream, d_lists + k * M * 2, d_info, *pool, layer, cache, num_slots, M);
      if (err.failure()) throw std::runtime_error(err.message());
    } else {
      issue_memcpy_gather(stream, lists + k * M * 2, M, *pool, layer, cache);
    }
  };
  for (int it = 0; it < 3; ++it) one(it);
  check(cudaEventRecord(t0, stream), "record");
  for (int it = 0; it < iters; ++it) one(it);
  check(cudaEventRecord(t1, stream), "record");
  check(cudaEventSynchronize(t1), "sync");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, t0, t1), "elapsed");
  // The last list issued was (iters - 1) % K.
  const int64_t k = (iters - 1) % K;
  bool ok = true;
  std::vector<uint8_t> back(static_cast<size_t>(R));
  for (int64_t r = 0; r < M && ok; ++r) {
    const int32_t e = lists[(k * M + r) * 2], v = lists[(k * M + r) * 2 + 1];
    check(cudaMemcpy(back.data(), cache + int64_t(v) * R, size_t(R), cudaMemcpyDeviceToHost), "read back");
    ok = std::memcmp(back.data(), pool->record(layer, e), size_t(R)) == 0;
  }
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  cudaStreamDestroy(stream);
  cudaFree(cache);
  cudaFree(d_lists);
  cudaFree(d_info);
  return {ms * 1e-3 / iters, ok};
}

}  // namespace jaxflash

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashResolveCuda, jaxflash::ResolveCuda, JAXFLASH_RESOLVE_BINDING(JAXFLASH_CUDA_BIND),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashGatherZeroCopyCuda, jaxflash::GatherZeroCopyCuda,
                              JAXFLASH_GATHER_BINDING(JAXFLASH_CUDA_BIND), {xla::ffi::Traits::kCmdBufferCompatible});

// No command-buffer trait: this one synchronizes the stream to read the miss list.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashGatherMemcpyCuda, jaxflash::GatherMemcpyCuda,
                              JAXFLASH_GATHER_BINDING(JAXFLASH_CUDA_BIND));

// No command-buffer trait for these two: see "gather beside the kernels".
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashGatherStartCuda, jaxflash::GatherStartCuda,
                              JAXFLASH_GATHER_BINDING(JAXFLASH_CUDA_BIND));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashGatherStartMemcpyCuda, jaxflash::GatherStartMemcpyCuda,
                              JAXFLASH_GATHER_BINDING(JAXFLASH_CUDA_BIND));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashGatherWaitCuda, jaxflash::GatherWaitCuda,
                              JAXFLASH_GATHER_WAIT_BINDING(JAXFLASH_CUDA_BIND));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashPleCuda, jaxflash::PleCuda, JAXFLASH_PLE_BINDING(JAXFLASH_CUDA_BIND),
                              {xla::ffi::Traits::kCmdBufferCompatible});

// No command-buffer trait, on purpose (see CopyCuda).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCopyCuda, jaxflash::CopyCuda,
                              JAXFLASH_CUDA_BIND.RemainingArgs().RemainingRets());
