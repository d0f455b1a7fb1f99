// The Python module: handler capsules for jax.ffi.register_ffi_target, the pool and table registries, the
// handler-call counters, and (CUDA build) the benchmark helpers. Built twice: as jaxflash_ffi and, with
// JAXFLASH_WITH_CUDA, as jaxflash_ffi_cuda.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <tuple>

#include "common.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;
using namespace jaxflash;

extern "C" {
XLA_FFI_Error* JaxflashResolveCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxflashGatherCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxflashGatherWaitCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxflashPleCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxflashCopyCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxflashNvfp4MoeCpu(XLA_FFI_CallFrame*);
#ifdef JAXFLASH_WITH_CUDA
XLA_FFI_Error* JaxflashResolveCuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxflashGatherZeroCopyCuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxflashGatherMemcpyCuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxflashGatherStartCuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxflashGatherStartMemcpyCuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxflashGatherWaitCuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxflashPleCuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxflashCopyCuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxflashNvfp4MoeCuda(XLA_FFI_CallFrame*);
#endif
}

#ifdef JAXFLASH_WITH_CUDA
namespace jaxflash {
void set_gather_blocks_per_record(int n);
std::pair<double, bool> bench_gather(int64_t pool_id, int64_t layer, const int32_t* lists, int64_t K, int64_t M,
                                     int64_t num_slots, bool zero_copy, int iters);
}  // namespace jaxflash
#endif

namespace {

template <typename Fn>
nb::capsule capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

nb::dict pool_dict(const ExpertPool& p) {
  nb::dict d;
  d["id"] = p.id;
  d["num_layers"] = p.num_layers;
  d["num_experts"] = p.num_experts;
  d["record_bytes"] = p.record_bytes;
  d["bytes"] = p.bytes;
  d["pinned"] = p.pinned;
  d["note"] = p.note;
  return d;
}

std::shared_ptr<ExpertPool> must_pool(int64_t id) {
  auto p = pool_get(id);
  if (!p) throw nb::value_error(("no expert pool with id " + std::to_string(id)).c_str());
  return p;
}

std::shared_ptr<NgramTable> must_table(int64_t id) {
  auto t = table_get(id);
  if (!t) throw nb::value_error(("no n-gram table with id " + std::to_string(id)).c_str());
  return t;
}

}  // namespace

#define JAXFLASH_NB_MODULE(name, m) NB_MODULE(name, m)

JAXFLASH_NB_MODULE(JAXFLASH_MODULE_NAME, m) {
  m.doc() = "jaxflash XLA FFI handlers: expert pool, expert-cache resolve/gather, PLE host step";
#ifdef JAXFLASH_WITH_CUDA
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
  m.attr("lru_header") = kLruHeader;
  m.attr("stamp_rebase_at") = kStampRebaseAt;
  m.attr("stamp_rebase_by") = kStampRebaseBy;

  m.def("cpu_targets", [] {
    nb::dict d;
    d["jaxflash_resolve"] = capsule(JaxflashResolveCpu);
    d["jaxflash_gather"] = capsule(JaxflashGatherCpu);
    d["jaxflash_gather_memcpy"] = capsule(JaxflashGatherCpu);  // one copy path on the CPU
    d["jaxflash_gather_start"] = capsule(JaxflashGatherCpu);   // done when it returns: waiting is a no-op
    d["jaxflash_gather_start_memcpy"] = capsule(JaxflashGatherCpu);
    d["jaxflash_gather_wait"] = capsule(JaxflashGatherWaitCpu);
    d["jaxflash_ple_step"] = capsule(JaxflashPleCpu);
    d["jaxflash_copy"] = capsule(JaxflashCopyCpu);
    d["jaxflash_nvfp4_moe"] = capsule(JaxflashNvfp4MoeCpu);
    return d;
  });
  m.def("cuda_targets", [] {
    nb::dict d;
#ifdef JAXFLASH_WITH_CUDA
    d["jaxflash_resolve"] = capsule(JaxflashResolveCuda);
    d["jaxflash_gather"] = capsule(JaxflashGatherZeroCopyCuda);
    d["jaxflash_gather_memcpy"] = capsule(JaxflashGatherMemcpyCuda);
    d["jaxflash_gather_start"] = capsule(JaxflashGatherStartCuda);
    d["jaxflash_gather_start_memcpy"] = capsule(JaxflashGatherStartMemcpyCuda);
    d["jaxflash_gather_wait"] = capsule(JaxflashGatherWaitCuda);
    d["jaxflash_ple_step"] = capsule(JaxflashPleCuda);
    d["jaxflash_copy"] = capsule(JaxflashCopyCuda);
    d["jaxflash_nvfp4_moe"] = capsule(JaxflashNvfp4MoeCuda);
#endif
    return d;
  });
  m.def("cuda_device_count", &cuda_device_count);

  m.def("handler_calls", [] {
    nb::dict d;
    for (int i = 0; i < kNumCounters; ++i) d[counter_name(i)] = g_calls[i].load();
    return d;
  });
  m.def("reset_handler_calls", [] {
    for (auto& c : g_calls) c = 0;
  });
  m.def("status_message", &status_message, nb::arg("status"), nb::arg("detail"), nb::arg("num_slots") = -1,
        nb::arg("num_experts") = -1);

  // ----- expert pool
  m.def(
      "pool_create",
      [](int64_t num_layers, int64_t num_experts, int64_t record_bytes, bool pin) {
        return pool_dict(*pool_create(num_layers, num_experts, record_bytes, pin));
      },
      nb::arg("num_layers"), nb::arg("num_experts"), nb::arg("record_bytes"), nb::arg("pin"));
  m.def("pool_info", [](int64_t id) { return pool_dict(*must_pool(id)); });
  m.def("pool_release", &pool_release);
  m.def(
      "pool_load",
      [](int64_t id, const std::vector<std::tuple<std::string, int64_t, int64_t, int64_t>>& plan, int threads) {
        auto pool = must_pool(id);
        std::vector<PlanEntry> entries;
        entries.reserve(plan.size());
        for (const auto& [path, off, n, dest] : plan) entries.push_back({path, off, n, dest});
        nb::gil_scoped_release release;
        return pool_load(*pool, entries, threads);
      },
      nb::arg("id"), nb::arg("plan"), nb::arg("threads"));
  m.def("pool_array", [](int64_t id) {
    // A writable numpy view; the capsule keeps the pool alive as long as the view lives.
    auto pool = must_pool(id);
    auto* keep = new std::shared_ptr<ExpertPool>(pool);
    nb::capsule owner(keep, [](void* p) noexcept { delete static_cast<std::shared_ptr<ExpertPool>*>(p); });
    size_t shape[3] = {size_t(pool->num_layers), size_t(pool->num_experts), size_t(pool->record_bytes)};
    return nb::ndarray<nb::numpy, uint8_t, nb::ndim<3>>(pool->host, 3, shape, owner);
  });

  // ----- n-gram table
  m.def(
      "table_create",
      [](const std::vector<std::tuple<std::string, int64_t, int64_t>>& segments, int64_t row_bytes, int64_t heads,
         int64_t max_tokens) {
        std::vector<NgramSegment> segs;
        for (const auto& [path, off, rows] : segments) segs.push_back({path, off, rows});
        auto t = table_create(segs, row_bytes, heads, max_tokens);
        nb::dict d;
        d["id"] = t->id;
        d["rows"] = t->rows;
        d["staging_pinned"] = t->staging != nullptr;
        d["staging_bytes"] = t->staging_bytes;
        d["note"] = t->staging_note;
        return d;
      },
      nb::arg("segments"), nb::arg("row_bytes"), nb::arg("heads"), nb::arg("max_tokens"));
  m.def("table_release", &table_release);
  m.def("table_rows", [](int64_t id, nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> rows) {
    auto t = must_table(id);
    const size_t n = rows.shape(0), rb = size_t(t->row_bytes);
    for (size_t i = 0; i < n; ++i)
      if (rows(i) < 0 || rows(i) >= t->rows)
        throw nb::index_error(("row " + std::to_string(rows(i)) + " outside the table of " +
                               std::to_string(t->rows) + " rows").c_str());
    auto* out = new uint8_t[n * rb];
    nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<uint8_t*>(p); });
    for (size_t i = 0; i < n; ++i) std::memcpy(out + i * rb, t->row(rows(i)), rb);
    size_t shape[2] = {n, rb};
    return nb::ndarray<nb::numpy, uint8_t, nb::ndim<2>>(out, 2, shape, owner);
  });

#ifdef JAXFLASH_WITH_CUDA
  m.def("set_gather_blocks_per_record", &set_gather_blocks_per_record,
        "Blocks per missed record in the zero-copy gather kernel; 0 picks from the SM count.");
  m.def(
      "bench_gather",
      [](int64_t pool_id, int64_t layer, nb::ndarray<const int32_t, nb::ndim<3>, nb::c_contig, nb::device::cpu> lists,
         int64_t num_slots, bool zero_copy, int iters) {
        if (lists.shape(2) != 2) throw nb::value_error("lists must be [K, M, 2] (expert, slot)");
        nb::gil_scoped_release release;
        return bench_gather(pool_id, layer, lists.data(), int64_t(lists.shape(0)), int64_t(lists.shape(1)), num_slots,
                            zero_copy, iters);
      },
      nb::arg("pool_id"), nb::arg("layer"), nb::arg("lists"), nb::arg("num_slots"), nb::arg("zero_copy"),
      nb::arg("iters"));
#endif
}
