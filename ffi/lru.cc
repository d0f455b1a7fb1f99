// The LRU resolve step on the host (the CPU handler), and the status messages shared by both backends.
//
// One step, for the routed expert ids of a step (any count n; the distinct ones must fit in the slots):
//   1. the distinct experts are taken in ascending id order;
//   2. a cached expert is a hit: its slot's stamp becomes this step's stamp;
//   3. the misses (ascending expert id) take the victims in ascending (stamp, slot index) order, where the
//      candidates are the slots holding no expert this step needs (empty slots have stamp -1, so they go
//      first, lowest index first); the victim's old expert is evicted;
//   4. every (token, k) gets the slot of its expert; misses come out as (expert, slot) pairs in step-3 order,
//      padded with (-1, -1).
// The CUDA kernel (cuda_handlers.cu) implements exactly these rules, so results are byte-identical.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"

namespace jaxflash {

std::atomic<int64_t> g_calls[kNumCounters];

const char* counter_name(int counter) {
  switch (counter) {
    case kCallResolveCpu: return "resolve_cpu";
    case kCallGatherCpu: return "gather_cpu";
    case kCallPleCpu: return "ple_step_cpu";
    case kCallResolveCuda: return "resolve_cuda";
    case kCallGatherZeroCopyCuda: return "gather_zero_copy_cuda";
    case kCallGatherMemcpyCuda: return "gather_memcpy_cuda";
    case kCallPleCuda: return "ple_step_cuda";
    case kCallCopyCpu: return "copy_cpu";
    case kCallCopyCuda: return "copy_cuda";
    case kCallNvfp4MoeCpu: return "nvfp4_moe_cpu";
    case kCallNvfp4MoeCuda: return "nvfp4_moe_cuda";
    case kCallGatherStartCuda: return "gather_start_cuda";
    case kCallGatherWaitCuda: return "gather_wait_cuda";
    case kCallGatherWaitCpu: return "gather_wait_cpu";
    case kCallGatherStartMemcpyCuda: return "gather_start_memcpy_cuda";
    default: return "unknown";
  }
}

std::string status_message(int32_t status, int64_t detail, int64_t num_slots, int64_t num_experts) {
  switch (status) {
    case kOk: return "ok";
    case kBadExpertId:
      return "routed expert id " + std::to_string(detail) + " is out of range [0, num_experts" +
             (num_experts >= 0 ? "=" + std::to_string(num_experts) : std::string()) + ")";
    case kTooManyExperts:
      return "the step needs " + std::to_string(detail) + " distinct experts but the layer has only " +
             (num_slots >= 0 ? std::to_string(num_slots) : std::string("num_slots")) +
             " cache slots; split the step (fewer tokens per call) or give the cache more slots";
    case kBadLruState:
      return "the LRU state array does not belong to a cache of this shape or is corrupt (build it with "
             "jaxflash.ffi.lru_state_init and pass it back unchanged)";
    case kBadToken:
      return "token id " + std::to_string(detail) + " is out of range [0, vocab_size)";
    case kBadLength:
      return "sequence length " + std::to_string(detail) + " is out of range [0, T]";
    case kBadContext:
      return "the n-gram context holds token id " + std::to_string(detail) +
             ", outside [0, vocab_size): pass back the context this call returned, or reset the sequence";
    default: return "unknown status " + std::to_string(status);
  }
}

int32_t lru_resolve_host(int32_t* state, int64_t S, int64_t E, const int32_t* ids, int64_t n, int32_t* slots_out,
                         int32_t* misses_out, int64_t max_misses, int32_t info[4]) {
  auto fail = [&](int32_t code, int64_t distinct, int64_t detail) {
    std::fill(slots_out, slots_out + n, 0);  // slot 0 is a safe index for a consumer that runs anyway
    std::fill(misses_out, misses_out + 2 * max_misses, -1);
    info[0] = 0;
    info[1] = static_cast<int32_t>(distinct);
    info[2] = code;
    info[3] = static_cast<int32_t>(detail);
    return code;
  };
  if (state[1] != S || state[2] != E) return fail(kBadLruState, 0, 0);
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= E) return fail(kBadExpertId, 0, ids[i]);

  std::vector<int32_t> uniq(ids, ids + n);
  std::sort(uniq.begin(), uniq.end());
  uniq.erase(std::unique(uniq.begin(), uniq.end()), uniq.end());
  const int64_t U = static_cast<int64_t>(uniq.size());
  if (U > S) return fail(kTooManyExperts, U, U);

  int32_t* slot_expert = state + kLruHeader;
  int32_t* stamp = slot_expert + S;
  int32_t* expert_slot = stamp + S;

  int64_t step = int64_t(state[0]) + 1;
  const bool rebase = step >= kStampRebaseAt;
  auto effective = [&](int32_t s) -> int32_t {
    if (!rebase || s < 0) return s;
    return s >= kStampRebaseBy ? s - kStampRebaseBy : 0;
  };
  if (rebase) step -= kStampRebaseBy;

  std::vector<char> needed(S, 0);
  std::vector<int32_t> missing;
  for (int32_t e : uniq) {
    const int32_t v = expert_slot[e];
    if (v >= 0) {
      if (v >= S || slot_expert[v] != e) return fail(kBadLruState, U, 0);
      needed[v] = 1;
    } else {
      missing.push_back(e);
    }
  }
  const int64_t m = static_cast<int64_t>(missing.size());

  // Candidates ordered by (effective stamp, slot index); only the first m are needed.
  std::vector<int64_t> keys;
  keys.reserve(S);
  for (int64_t v = 0; v < S; ++v)
    if (!needed[v]) keys.push_back((int64_t(effective(stamp[v])) + 1) << 32 | v);
  std::partial_sort(keys.begin(), keys.begin() + m, keys.end());
  for (int64_t r = 0; r < m; ++r) {
    const int32_t v = static_cast<int32_t>(keys[r] & 0xffffffff);
    const int32_t old = slot_expert[v];
    if (old >= E || (old >= 0 && expert_slot[old] != v)) return fail(kBadLruState, U, 0);
  }

  // All checks passed: write.
  if (rebase)
    for (int64_t v = 0; v < S; ++v) stamp[v] = effective(stamp[v]);
  for (int64_t r = 0; r < m; ++r) {
    const int32_t v = static_cast<int32_t>(keys[r] & 0xffffffff);
    const int32_t e = missing[r];
    const int32_t old = slot_expert[v];
    if (old >= 0) expert_slot[old] = -1;
    slot_expert[v] = e;
    expert_slot[e] = v;
    stamp[v] = static_cast<int32_t>(step);
    misses_out[2 * r] = e;
    misses_out[2 * r + 1] = v;
  }
  for (int64_t v = 0; v < S; ++v)
    if (needed[v]) stamp[v] = static_cast<int32_t>(step);
  for (int64_t r = m; r < max_misses; ++r) misses_out[2 * r] = misses_out[2 * r + 1] = -1;
  for (int64_t i = 0; i < n; ++i) slots_out[i] = expert_slot[ids[i]];
  state[0] = static_cast<int32_t>(step);
  info[0] = static_cast<int32_t>(m);
  info[1] = static_cast<int32_t>(U);
  info[2] = kOk;
  info[3] = 0;
  return kOk;
}

}  // namespace jaxflash
