// The expert pool: allocation (pinned and device-mapped where CUDA is present), the registry, and the
// multi-threaded loader that preads checkpoint bytes straight into it.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>
#include <stdexcept>
#include <thread>
#include <unordered_map>

#include "common.h"

#ifdef JAXFLASH_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace jaxflash {

namespace {

Registry<ExpertPool> g_pools;

// Page-aligned, lazily committed memory; transparent huge pages keep TLB misses low on large pools.
uint8_t* map_plain(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  madvise(p, bytes, MADV_HUGEPAGE);
#endif
  return static_cast<uint8_t*>(p);
}

}  // namespace

bool cuda_available() { return cuda_device_count() > 0; }

int cuda_device_count() {
#ifdef JAXFLASH_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear it, so later runtime calls do not report it
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

ExpertPool::~ExpertPool() {
  if (!host) return;
#ifdef JAXFLASH_WITH_CUDA
  if (pinned) {
    cudaFreeHost(host);
    return;
  }
#endif
  munmap(host, bytes);
}

std::shared_ptr<ExpertPool> pool_create(int64_t num_layers, int64_t num_experts, int64_t record_bytes, bool pin) {
  if (num_layers <= 0 || num_experts <= 0 || record_bytes <= 0)
    throw std::invalid_argument("expert pool dimensions must be positive (layers=" + std::to_string(num_layers) +
                                ", experts=" + std::to_string(num_experts) +
                                ", record_bytes=" + std::to_string(record_bytes) + ")");
  auto pool = std::make_shared<ExpertPool>();
  pool->num_layers = num_layers;
  pool->num_experts = num_experts;
  pool->record_bytes = record_bytes;
  pool->bytes = size_t(num_layers) * size_t(num_experts) * size_t(record_bytes);
  if (pin) {
#ifdef JAXFLASH_WITH_CUDA
    if (!cuda_available()) {
      pool->note = "no CUDA device is visible";
    } else {
      void* p = nullptr;
      cudaError_t err = cudaHostAlloc(&p, pool->bytes, cudaHostAllocMapped | cudaHostAllocPortable);
      if (err == cudaSuccess) {
        void* d = nullptr;
        err = cudaHostGetDevicePointer(&d, p, 0);
        if (err == cudaSuccess) {
          pool->host = static_cast<uint8_t*>(p);
          pool->device = static_cast<uint8_t*>(d);
          pool->pinned = true;
        } else {
          cudaFreeHost(p);
        }
      }
      if (!pool->pinned) {
        pool->note = std::string("pinning failed: ") + cudaGetErrorString(err);
        cudaGetLastError();
      }
    }
#else
    pool->note = "this build has no CUDA support (jaxflash_ffi without jaxflash_ffi_cuda)";
#endif
  }
  if (!pool->host) pool->host = map_plain(pool->bytes);
  g_pools.add(pool);
  return pool;
}

std::shared_ptr<ExpertPool> pool_get(int64_t id) { return g_pools.get(id); }

bool pool_release(int64_t id) { return g_pools.release(id); }

int64_t pool_load(ExpertPool& pool, const std::vector<PlanEntry>& plan, int threads) {
  // Validate the whole plan before touching the pool.
  std::unordered_map<std::string, int> fd_of;
  std::vector<int> fds;
  auto close_all = [&] {
    for (int fd : fds) close(fd);
  };
  struct Chunk {
    int fd;
    int64_t file_offset, nbytes, dest;
    size_t entry;
  };
  std::vector<Chunk> chunks;
  constexpr int64_t kChunk = 8 << 20;  // small enough to spread a few large tensors over all threads
  int64_t total = 0;
  for (size_t i = 0; i < plan.size(); ++i) {
    const PlanEntry& e = plan[i];
    if (e.nbytes < 0 || e.file_offset < 0 || e.dest < 0 || size_t(e.dest + e.nbytes) > pool.bytes) {
      close_all();
      throw std::out_of_range("plan entry " + std::to_string(i) + " (" + e.path + "): destination [" +
                              std::to_string(e.dest) + ", " + std::to_string(e.dest + e.nbytes) +
                              ") lies outside the pool of " + std::to_string(pool.bytes) + " bytes");
    }
    auto it = fd_of.find(e.path);
    int fd;
    if (it == fd_of.end()) {
      fd = open(e.path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) {
        const int err = errno;
        close_all();
        throw std::runtime_error("cannot open " + e.path + ": " + std::strerror(err));
      }
      fds.push_back(fd);
      fd_of[e.path] = fd;
    } else {
      fd = it->second;
    }
    struct stat st;
    if (fstat(fd, &st) == 0 && e.file_offset + e.nbytes > st.st_size) {
      close_all();
      throw std::out_of_range(e.path + " has " + std::to_string(st.st_size) + " bytes but plan entry " +
                              std::to_string(i) + " reads [" + std::to_string(e.file_offset) + ", " +
                              std::to_string(e.file_offset + e.nbytes) + ")");
    }
    for (int64_t off = 0; off < e.nbytes; off += kChunk)
      chunks.push_back({fd, e.file_offset + off, std::min(kChunk, e.nbytes - off), e.dest + off, i});
    total += e.nbytes;
  }

  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex err_mu;
  std::string error;
  auto worker = [&] {
    for (;;) {
      if (failed.load(std::memory_order_relaxed)) return;
      const size_t k = next.fetch_add(1);
      if (k >= chunks.size()) return;
      const Chunk& c = chunks[k];
      int64_t done = 0;
      while (done < c.nbytes) {
        const ssize_t r = pread(c.fd, pool.host + c.dest + done, size_t(c.nbytes - done), c.file_offset + done);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
          std::lock_guard<std::mutex> lock(err_mu);
          if (error.empty())
            error = "reading " + plan[c.entry].path + " at byte " + std::to_string(c.file_offset + done) + ": " +
                    (r < 0 ? std::strerror(errno) : "unexpected end of file");
          failed = true;
          return;
        }
        done += r;
      }
    }
  };
  const int n = std::max(1, std::min<int>(threads, static_cast<int>(chunks.size())));
  std::vector<std::thread> pool_threads;
  for (int t = 1; t < n; ++t) pool_threads.emplace_back(worker);
  worker();
  for (auto& t : pool_threads) t.join();
  close_all();
  if (failed) throw std::runtime_error(error);
  return total;
}

}  // namespace jaxflash
