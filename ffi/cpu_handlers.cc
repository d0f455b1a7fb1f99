// CPU handlers: resolve, gather and the PLE step on host buffers. They raise (return an ffi::Error with a
// message) on bad input; the CUDA handlers report the same conditions through their info outputs instead.
#include <cstring>

#include "common.h"
#include "handler_util.h"

namespace jaxflash {

namespace {

ffi::Error ResolveCpu(ffi::AnyBuffer ids, ffi::AnyBuffer state_in, ffi::Result<ffi::AnyBuffer> slots,
                      ffi::Result<ffi::AnyBuffer> misses, ffi::Result<ffi::AnyBuffer> info,
                      ffi::Result<ffi::AnyBuffer> state_out, int64_t num_slots, int64_t num_experts, int64_t layer) {
  g_calls[kCallResolveCpu].fetch_add(1, std::memory_order_relaxed);
  auto shape = check_resolve(ids, state_in, *slots, *misses, *info, num_slots, num_experts, layer);
  if (shape.has_error()) return shape.error();
  int32_t* state = static_cast<int32_t*>(state_out->untyped_data());
  if (state != state_in.untyped_data())  // not aliased (caller did not donate): start from the input
    std::memcpy(state, state_in.untyped_data(), state_in.size_bytes());
  int32_t* out_info = static_cast<int32_t*>(info->untyped_data());
  const int32_t st = lru_resolve_host(state + shape->state_offset, num_slots, num_experts,
                                      static_cast<const int32_t*>(ids.untyped_data()), shape->n,
                                      static_cast<int32_t*>(slots->untyped_data()),
                                      static_cast<int32_t*>(misses->untyped_data()), shape->max_misses, out_info);
  if (st != kOk)
    return ffi::Error::InvalidArgument("expert cache resolve (layer " + std::to_string(layer) +
                                       "): " + status_message(st, out_info[3], num_slots, num_experts));
  return ffi::Error::Success();
}

ffi::Error GatherCpu(ffi::AnyBuffer misses, ffi::AnyBuffer info, ffi::AnyBuffer cache_in,
                     ffi::Result<ffi::AnyBuffer> cache_out, int64_t pool_id, int64_t layer) {
  g_calls[kCallGatherCpu].fetch_add(1, std::memory_order_relaxed);
  auto pool = pool_get(pool_id);
  auto shape = check_gather(misses, info, cache_in, pool.get(), pool_id, layer);
  if (shape.has_error()) return shape.error();
  uint8_t* cache = static_cast<uint8_t*>(cache_out->untyped_data());
  if (cache != cache_in.untyped_data()) std::memcpy(cache, cache_in.untyped_data(), cache_in.size_bytes());
  const int32_t* inf = static_cast<const int32_t*>(info.untyped_data());
  if (inf[2] != kOk) return ffi::Error::Success();  // resolve failed: nothing to copy
  const int32_t* m = static_cast<const int32_t*>(misses.untyped_data());
  const int64_t n = inf[0], R = pool->record_bytes;
  if (n < 0 || n > shape->max_misses)
    return ffi::Error::InvalidArgument("gather: info reports " + std::to_string(n) + " misses but misses holds " +
                                       std::to_string(shape->max_misses));
  for (int64_t r = 0; r < n; ++r) {
    const int64_t e = m[2 * r], v = m[2 * r + 1];
    if (e < 0 || e >= pool->num_experts || v < 0 || v >= shape->num_slots)
      return ffi::Error::InvalidArgument("gather: miss " + std::to_string(r) + " = (expert " + std::to_string(e) +
                                         ", slot " + std::to_string(v) + ") is out of range");
    std::memcpy(cache + shape->cache_offset + v * R, pool->record(layer, e), size_t(R));
  }
  return ffi::Error::Success();
}

// The CPU backend runs calls in order: the copy (GatherCpu, registered as gather_start too) is already done, so
// waiting only hands the buffers through.
ffi::Error GatherWaitCpu(ffi::AnyBuffer cache_in, ffi::AnyBuffer after_in, ffi::AnyBuffer, ffi::AnyBuffer,
                         ffi::Result<ffi::AnyBuffer> cache_out, ffi::Result<ffi::AnyBuffer> after_out) {
  g_calls[kCallGatherWaitCpu].fetch_add(1, std::memory_order_relaxed);
  if (cache_out->untyped_data() != cache_in.untyped_data())
    std::memcpy(cache_out->untyped_data(), cache_in.untyped_data(), cache_in.size_bytes());
  if (after_out->untyped_data() != after_in.untyped_data())
    std::memcpy(after_out->untyped_data(), after_in.untyped_data(), after_in.size_bytes());
  return ffi::Error::Success();
}

ffi::Error PleCpu(ffi::AnyBuffer tokens, ffi::AnyBuffer lengths, ffi::AnyBuffer reset, ffi::AnyBuffer ctx_in,
                  ffi::Result<ffi::AnyBuffer> ids, ffi::Result<ffi::AnyBuffer> rows, ffi::Result<ffi::AnyBuffer> info,
                  ffi::Result<ffi::AnyBuffer> ctx_out, int64_t table_id, int64_t eos, int64_t vocab,
                  ffi::Span<const int64_t> multipliers, ffi::Span<const int64_t> head_sizes,
                  ffi::Span<const int64_t> head_offsets) {
  g_calls[kCallPleCpu].fetch_add(1, std::memory_order_relaxed);
  auto table = table_get(table_id);
  auto p = make_ple_params(tokens, lengths, reset, ctx_in, *ids, *rows, *info, table.get(), table_id, eos, vocab,
                           multipliers, head_sizes, head_offsets);
  if (p.has_error()) return p.error();
  int32_t* out_info = static_cast<int32_t*>(info->untyped_data());
  int64_t detail = 0;
  const int32_t st = ple_compute(*p, static_cast<const int32_t*>(tokens.untyped_data()),
                                 static_cast<const int32_t*>(lengths.untyped_data()),
                                 static_cast<const int32_t*>(reset.untyped_data()),
                                 static_cast<const int32_t*>(ctx_in.untyped_data()),
                                 static_cast<int32_t*>(ctx_out->untyped_data()),
                                 static_cast<int32_t*>(ids->untyped_data()), table.get(),
                                 static_cast<uint8_t*>(rows->untyped_data()), &detail);
  out_info[0] = st;
  out_info[1] = static_cast<int32_t>(detail);
  if (st != kOk) return ffi::Error::InvalidArgument("ple_step: " + status_message(st, detail));
  return ffi::Error::Success();
}

ffi::Error CopyCpu(ffi::RemainingArgs args, ffi::RemainingRets rets) {
  g_calls[kCallCopyCpu].fetch_add(1, std::memory_order_relaxed);
  if (auto err = check_copy(args, rets); err.failure()) return err;
  for (size_t i = 0; i < args.size(); ++i) {
    auto a = *args.get<ffi::AnyBuffer>(i);
    auto r = *rets.get<ffi::AnyBuffer>(i);
    if (r->untyped_data() != a.untyped_data()) std::memcpy(r->untyped_data(), a.untyped_data(), a.size_bytes());
  }
  return ffi::Error::Success();
}

}  // namespace

}  // namespace jaxflash

// The exported handler symbols (C linkage, so the module can hand out their addresses as capsules).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashResolveCpu, jaxflash::ResolveCpu, JAXFLASH_RESOLVE_BINDING(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashGatherCpu, jaxflash::GatherCpu, JAXFLASH_GATHER_BINDING(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashGatherWaitCpu, jaxflash::GatherWaitCpu,
                              JAXFLASH_GATHER_WAIT_BINDING(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashPleCpu, jaxflash::PleCpu, JAXFLASH_PLE_BINDING(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxflashCopyCpu, jaxflash::CopyCpu,
                              xla::ffi::Ffi::Bind().RemainingArgs().RemainingRets());
