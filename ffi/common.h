// Shared declarations of the jaxflash FFI extension: the handler-call counters, the layout of the LRU state
// array, the status codes the handlers report, and the two registries (expert pools, n-gram tables).
//
// The same sources build two modules: `jaxflash_ffi` (CPU handlers only) and, where nvcc exists,
// `jaxflash_ffi_cuda` (the same plus the CUDA handlers, compiled with JAXFLASH_WITH_CUDA). Python loads exactly
// one of them, so one registry holds every pool and table.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace jaxflash {

// ----- registries -------------------------------------------------------------------------------------------
// Objects handed to Python by integer id (expert pools, n-gram tables). Ids are never reused, so a stale id
// fails instead of aliasing a newer object.
template <typename T>
class Registry {
 public:
  // Gives `obj` its id (obj->id) and holds it until release.
  void add(const std::shared_ptr<T>& obj) {
    std::lock_guard<std::mutex> lock(mu_);
    obj->id = next_id_++;
    objects_[obj->id] = obj;
  }
  std::shared_ptr<T> get(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = objects_.find(id);
    return it == objects_.end() ? nullptr : it->second;
  }
  bool release(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    return objects_.erase(id) > 0;
  }

 private:
  std::mutex mu_;
  std::unordered_map<int64_t, std::shared_ptr<T>> objects_;
  int64_t next_id_ = 1;
};

// ----- handler-body call counters ---------------------------------------------------------------------------
// Each handler body bumps its counter on entry. Inside a CUDA graph the body runs only when XLA records the
// graph, so a counter that stays put over many replays shows that the call was captured.
enum Counter : int {
  kCallResolveCpu,
  kCallGatherCpu,
  kCallPleCpu,
  kCallResolveCuda,
  kCallGatherZeroCopyCuda,
  kCallGatherMemcpyCuda,
  kCallPleCuda,
  kCallCopyCpu,
  kCallCopyCuda,
  kCallNvfp4MoeCpu,
  kCallNvfp4MoeCuda,
  kCallGatherStartCuda,
  kCallGatherWaitCuda,
  kCallGatherWaitCpu,
  kCallGatherStartMemcpyCuda,
  kNumCounters,
};
extern std::atomic<int64_t> g_calls[kNumCounters];
const char* counter_name(int counter);

// ----- status codes: info outputs carry one, CPU handlers also raise with a message ---------------------------
enum Status : int32_t {
  kOk = 0,
  kBadExpertId = 1,      // detail: the offending expert id
  kTooManyExperts = 2,   // detail: distinct experts the step needs
  kBadLruState = 3,      // detail: 0 (header does not match num_slots / num_experts)
  kBadToken = 4,         // detail: the offending token id
  kBadLength = 5,        // detail: the offending length
  kBadContext = 6,       // detail: the offending context token id
};

// ----- LRU state of one layer: one int32 array ---------------------------------------------------------------
//   [0] step       stamp of the latest resolve (0 when fresh)
//   [1] num_slots  S, [2] num_experts E  (a self-check: the handlers refuse a state of another shape)
//   [3] reserved   0
//   [4, 4+S)       slot_expert[S]   expert held by each slot, -1 when empty
//   [4+S, 4+2S)    slot_stamp[S]    step of the slot's last use, -1 when empty
//   [4+2S, 4+2S+E) expert_slot[E]   slot holding each expert, -1 when not cached
constexpr int64_t kLruHeader = 4;
inline int64_t lru_state_size(int64_t num_slots, int64_t num_experts) {
  return kLruHeader + 2 * num_slots + num_experts;
}
// Stamps are int32. Before a step whose stamp would reach 2^30, every stamp is lowered by 2^29 (clamped at 0)
// and so is the step counter: recency order among the last 2^29 steps is kept, older slots tie at 0.
constexpr int32_t kStampRebaseAt = 1 << 30;
constexpr int32_t kStampRebaseBy = 1 << 29;

// Host implementation of one resolve step on a state array (the CPU handler; the CUDA kernel matches it).
// Returns the status; info = {n_miss, n_distinct, status, detail}.
int32_t lru_resolve_host(int32_t* state, int64_t num_slots, int64_t num_experts, const int32_t* ids, int64_t n,
                         int32_t* slots_out, int32_t* misses_out, int64_t max_misses, int32_t info[4]);
std::string status_message(int32_t status, int64_t detail, int64_t num_slots = -1, int64_t num_experts = -1);

// ----- expert pool -----------------------------------------------------------------------------------------
// [num_layers, num_experts, record_bytes] bytes in host memory: pinned and device-mapped where CUDA is
// present (and pinning was asked for and succeeded), plain page-aligned memory otherwise.
struct ExpertPool {
  int64_t id = 0;
  int64_t num_layers = 0, num_experts = 0, record_bytes = 0;
  size_t bytes = 0;
  uint8_t* host = nullptr;
  uint8_t* device = nullptr;  // device address of the mapped pool; null unless pinned
  bool pinned = false;
  std::string note;  // why the pool is not pinned, when it was asked to be
  ~ExpertPool();
  uint8_t* record(int64_t layer, int64_t expert) const {
    return host + (layer * num_experts + expert) * record_bytes;
  }
};

struct PlanEntry {
  std::string path;
  int64_t file_offset, nbytes, dest;
};

std::shared_ptr<ExpertPool> pool_create(int64_t num_layers, int64_t num_experts, int64_t record_bytes, bool pin);
std::shared_ptr<ExpertPool> pool_get(int64_t id);
bool pool_release(int64_t id);
// Reads every entry with `threads` threads; throws std::runtime_error naming the file on failure.
// Returns the bytes read.
int64_t pool_load(ExpertPool& pool, const std::vector<PlanEntry>& plan, int threads);

// ----- n-gram table -----------------------------------------------------------------------------------------
struct NgramSegment {
  std::string path;
  int64_t offset, rows;  // byte offset of the segment's first row in the file; rows in the segment
};

constexpr int kMaxNgramHeads = 64;

// The hash constants and shapes of one PLE call (docs/model.md §6). Plain data: the CUDA host step keeps a copy.
struct PleParams {
  int64_t batch = 0, tokens = 0;  // B, T
  int64_t eos = 0, vocab = 0;
  int64_t heads = 0;              // n-gram heads: the first half bigrams, the second trigrams
  uint64_t mult[3] = {0, 0, 0};
  int64_t head_size[kMaxNgramHeads] = {};
  int64_t head_offset[kMaxNgramHeads] = {};
};

struct NgramTable {
  struct Map {
    void* base = nullptr;
    size_t length = 0;
    const uint8_t* rows = nullptr;  // first row of the segment inside the mapping
  };
  int64_t id = 0;
  int64_t rows = 0, row_bytes = 0, heads = 0;
  std::vector<Map> maps;
  std::vector<int64_t> starts;  // first global row of each segment, ascending; plus the total at the end
  // GPU host step (CUDA module only): pinned staging for max_tokens tokens, and one argument block per
  // distinct call shape so a captured host node always sees its own, never-moving parameters.
  int64_t max_tokens = 0;
  uint8_t* staging = nullptr;
  size_t staging_bytes = 0;
  std::string staging_note;
  std::mutex mu;
  std::map<std::string, std::unique_ptr<uint8_t[]>> host_args;

  ~NgramTable();
  const uint8_t* row(int64_t r) const;
};

// Byte offsets of the GPU host step's pinned staging area for a table (each part 256-byte aligned).
struct PleStaging {
  size_t tokens, lengths, reset, ctx_in, ids, rows, ctx_out, info, total;
  PleStaging(int64_t max_tokens, int64_t heads, int64_t row_bytes) {
    size_t at = 0;
    auto take = [&](size_t n) {
      const size_t here = at;
      at += (n + 255) / 256 * 256;
      return here;
    };
    const size_t n = size_t(max_tokens);
    tokens = take(4 * n);
    lengths = take(4 * n);
    reset = take(4 * n);
    ctx_in = take(8 * n);
    ids = take(4 * n * size_t(heads));
    rows = take(n * size_t(heads) * size_t(row_bytes));
    ctx_out = take(8 * n);
    info = take(16);
    total = at;
  }
};

std::shared_ptr<NgramTable> table_create(const std::vector<NgramSegment>& segments, int64_t row_bytes,
                                         int64_t heads, int64_t max_tokens);
std::shared_ptr<NgramTable> table_get(int64_t id);
bool table_release(int64_t id);

// One PLE step on host memory (docs/model.md §6.2). ctx_in and ctx_out may be the same buffer. table may be null (then
// rows is not written). Returns the status and writes the detail.
int32_t ple_compute(const PleParams& p, const int32_t* tokens, const int32_t* lengths, const int32_t* reset,
                    const int32_t* ctx_in, int32_t* ctx_out, int32_t* ids, const NgramTable* table, uint8_t* rows,
                    int64_t* detail);

// True where this build can pin memory and a CUDA device is visible.
bool cuda_available();
int cuda_device_count();

}  // namespace jaxflash
