// The PLE n-gram table (memory-mapped shard files) and the host PLE step: n-gram ids (docs/model.md §6.2)
// and row gather.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "common.h"

#ifdef JAXFLASH_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace jaxflash {

namespace {
Registry<NgramTable> g_tables;
}  // namespace

NgramTable::~NgramTable() {
  for (Map& m : maps)
    if (m.base) munmap(m.base, m.length);
#ifdef JAXFLASH_WITH_CUDA
  if (staging) cudaFreeHost(staging);
#endif
}

const uint8_t* NgramTable::row(int64_t r) const {
  // starts has one entry per segment plus the total; the segment is the last start <= r.
  const size_t seg = size_t(std::upper_bound(starts.begin(), starts.end() - 1, r) - starts.begin()) - 1;
  return maps[seg].rows + (r - starts[seg]) * row_bytes;
}

std::shared_ptr<NgramTable> table_create(const std::vector<NgramSegment>& segments, int64_t row_bytes,
                                         int64_t heads, int64_t max_tokens) {
  if (segments.empty()) throw std::invalid_argument("an n-gram table needs at least one segment");
  if (row_bytes <= 0) throw std::invalid_argument("row_bytes must be positive");
  if (heads <= 0 || heads > kMaxNgramHeads || heads % 2)
    throw std::invalid_argument("heads must be even and in [2, " + std::to_string(kMaxNgramHeads) + "]");
  auto table = std::make_shared<NgramTable>();
  table->row_bytes = row_bytes;
  table->heads = heads;
  const int64_t page = sysconf(_SC_PAGESIZE);
  int64_t total = 0;
  for (const NgramSegment& s : segments) {
    if (s.rows <= 0 || s.offset < 0) throw std::invalid_argument("segment of " + s.path + " is empty or negative");
    const int fd = open(s.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw std::runtime_error("cannot open " + s.path + ": " + std::strerror(errno));
    struct stat st;
    const int64_t nbytes = s.rows * row_bytes;
    if (fstat(fd, &st) != 0 || s.offset + nbytes > st.st_size) {
      close(fd);
      throw std::out_of_range(s.path + " is too short for " + std::to_string(s.rows) + " rows of " +
                              std::to_string(row_bytes) + " bytes at byte " + std::to_string(s.offset));
    }
    const int64_t aligned = s.offset / page * page;
    const size_t length = size_t(s.offset - aligned + nbytes);
    void* base = mmap(nullptr, length, PROT_READ, MAP_SHARED, fd, aligned);
    const int err = errno;
    close(fd);  // the mapping keeps the file
    if (base == MAP_FAILED) throw std::runtime_error("cannot map " + s.path + ": " + std::strerror(err));
    // Lookups hit scattered rows: read-ahead would only pull in pages nobody asked for.
    madvise(base, length, MADV_RANDOM);
    table->maps.push_back({base, length, static_cast<const uint8_t*>(base) + (s.offset - aligned)});
    table->starts.push_back(total);
    total += s.rows;
  }
  table->starts.push_back(total);
  table->rows = total;
  table->max_tokens = max_tokens;
#ifdef JAXFLASH_WITH_CUDA
  if (max_tokens > 0) {
    if (!cuda_available()) {
      table->staging_note = "no CUDA device is visible";
    } else {
      const PleStaging layout(max_tokens, heads, row_bytes);
      void* p = nullptr;
      const cudaError_t err = cudaHostAlloc(&p, layout.total, cudaHostAllocPortable);
      if (err == cudaSuccess) {
        table->staging = static_cast<uint8_t*>(p);
        table->staging_bytes = layout.total;
      } else {
        table->staging_note = std::string("pinning the staging area failed: ") + cudaGetErrorString(err);
        cudaGetLastError();
      }
    }
  }
#endif
  g_tables.add(table);
  return table;
}

std::shared_ptr<NgramTable> table_get(int64_t id) { return g_tables.get(id); }

bool table_release(int64_t id) { return g_tables.release(id); }

int32_t ple_compute(const PleParams& p, const int32_t* tokens, const int32_t* lengths, const int32_t* reset,
                    const int32_t* ctx_in, int32_t* ctx_out, int32_t* ids, const NgramTable* table, uint8_t* rows,
                    int64_t* detail) {
  const int64_t B = p.batch, T = p.tokens, H = p.heads, half = p.heads / 2;
  const int32_t eos = static_cast<int32_t>(p.eos);
  // Validate everything first, so a failed call leaves the context as it was.
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lengths[b];
    if (len < 0 || len > T) {
      *detail = len;
      return kBadLength;
    }
    for (int64_t t = 0; t < len; ++t) {
      const int32_t x = tokens[b * T + t];
      if (x < 0 || x >= p.vocab) {
        *detail = x;
        return kBadToken;
      }
    }
    if (!reset[b])
      for (int k = 0; k < 2; ++k) {
        const int32_t x = ctx_in[2 * b + k];
        if (x < 0 || x >= p.vocab) {
          *detail = x;
          return kBadContext;
        }
      }
  }

  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lengths[b];
    const int32_t c0 = reset[b] ? eos : ctx_in[2 * b];
    const int32_t c1 = reset[b] ? eos : ctx_in[2 * b + 1];
    // hist = [c0, c1, tokens...]; at each position, h1 = hist[p-1] and h2 = hist[p-2].
    int32_t h2 = c0, h1 = c1;
    for (int64_t t = 0; t < T; ++t) {
      const int32_t x0 = t < len ? tokens[b * T + t] : eos;  // padding reads as EOS
      // shift k is valid iff no EOS lies in [p-k, p-1]; an invalid shift reads as EOS
      const bool ok1 = h1 != eos;
      const int32_t x1 = ok1 ? h1 : eos;
      const int32_t x2 = (ok1 && h2 != eos) ? h2 : eos;
      // products stay below 2^63 (m_k < 2^63 / vocab), so unsigned arithmetic equals the reference's int64
      const uint64_t mix2 = (uint64_t(x0) * p.mult[0]) ^ (uint64_t(x1) * p.mult[1]);
      const uint64_t mix3 = mix2 ^ (uint64_t(x2) * p.mult[2]);
      int32_t* out = ids + (b * T + t) * H;
      for (int64_t j = 0; j < half; ++j)
        out[j] = static_cast<int32_t>(mix2 % uint64_t(p.head_size[j]) + uint64_t(p.head_offset[j]));
      for (int64_t j = half; j < H; ++j)
        out[j] = static_cast<int32_t>(mix3 % uint64_t(p.head_size[j]) + uint64_t(p.head_offset[j]));
      h2 = h1;
      h1 = x0;
    }
    // The new context is the last two entries of [c0, c1, tokens[:len]].
    int32_t n0, n1;
    if (len >= 2) {
      n0 = tokens[b * T + len - 2];
      n1 = tokens[b * T + len - 1];
    } else if (len == 1) {
      n0 = c1;
      n1 = tokens[b * T];
    } else {
      n0 = c0;
      n1 = c1;
    }
    ctx_out[2 * b] = n0;
    ctx_out[2 * b + 1] = n1;
  }

  if (table && rows) {
    const int64_t count = B * T * H, rb = table->row_bytes;
    auto copy = [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) std::memcpy(rows + i * rb, table->row(ids[i]), size_t(rb));
    };
    // Prefill-sized gathers fault in many pages: spread them over a few threads.
    const int64_t kPerThread = 1 << 15;
    const int64_t nt = std::min<int64_t>(8, std::max<int64_t>(1, count / kPerThread));
    if (nt == 1) {
      copy(0, count);
    } else {
      std::vector<std::thread> workers;
      const int64_t step = (count + nt - 1) / nt;
      for (int64_t k = 1; k < nt; ++k) workers.emplace_back(copy, k * step, std::min(count, (k + 1) * step));
      copy(0, std::min(count, step));
      for (auto& w : workers) w.join();
    }
  }
  *detail = 0;
  return kOk;
}

}  // namespace jaxflash
