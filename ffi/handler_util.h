// Shape checks and attribute decoding shared by the CPU and CUDA handlers. Everything here runs on the host
// from shapes and attributes alone (no device data), so it is allowed inside a captured CUDA handler.
#pragma once

#include <algorithm>
#include <string>

#include "common.h"
#include "nvfp4_moe.h"
#include "xla/ffi/api/ffi.h"

namespace jaxflash {

namespace ffi = xla::ffi;

inline std::string dims_str(ffi::Span<const int64_t> d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// Resolve: where this layer's state starts inside the (possibly stacked) state buffer.
struct ResolveShape {
  int64_t n = 0, max_misses = 0, state_offset = 0, state_elems = 0;
};

inline ffi::ErrorOr<ResolveShape> check_resolve(const ffi::AnyBuffer& ids, const ffi::AnyBuffer& state,
                                               const ffi::AnyBuffer& slots, const ffi::AnyBuffer& misses,
                                               const ffi::AnyBuffer& info, int64_t S, int64_t E, int64_t layer) {
  ResolveShape r;
  if (ids.element_type() != ffi::DataType::S32 || state.element_type() != ffi::DataType::S32 ||
      slots.element_type() != ffi::DataType::S32 || misses.element_type() != ffi::DataType::S32 ||
      info.element_type() != ffi::DataType::S32)
    return ffi::Unexpected(ffi::Error::InvalidArgument("resolve: ids, state and all outputs must be int32"));
  if (S <= 0 || E <= 0)
    return ffi::Unexpected(ffi::Error::InvalidArgument("resolve: num_slots and num_experts must be positive"));
  const int64_t per = lru_state_size(S, E);
  auto sd = state.dimensions();
  if (sd.size() == 1 && sd[0] == per) {
    r.state_offset = 0;
  } else if (sd.size() == 2 && sd[1] == per) {
    if (layer < 0 || layer >= sd[0])
      return ffi::Unexpected(ffi::Error::InvalidArgument("resolve: layer " + std::to_string(layer) +
                                                         " is outside the stacked state " + dims_str(sd)));
    r.state_offset = layer * per;
  } else {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "resolve: the LRU state has shape " + dims_str(sd) + "; expected [" + std::to_string(per) + "] or [L, " +
        std::to_string(per) + "] for num_slots=" + std::to_string(S) + ", num_experts=" + std::to_string(E)));
  }
  r.state_elems = int64_t(state.element_count());
  r.n = int64_t(ids.element_count());
  if (int64_t(slots.element_count()) != r.n)
    return ffi::Unexpected(ffi::Error::InvalidArgument("resolve: slots output must match the ids' size"));
  auto md = misses.dimensions();
  const int64_t need = std::min({r.n, S, E});
  if (md.size() != 2 || md[1] != 2 || md[0] < need)
    return ffi::Unexpected(ffi::Error::InvalidArgument("resolve: misses output has shape " + dims_str(md) +
                                                       "; expected [>= " + std::to_string(need) + ", 2]"));
  r.max_misses = md[0];
  if (info.element_count() != 4)
    return ffi::Unexpected(ffi::Error::InvalidArgument("resolve: info output must have 4 elements"));
  return r;
}

// Gather: the cache buffer is [S, R] (one layer) or [L, S, R] (stacked; `layer` picks the slice).
struct GatherShape {
  int64_t num_slots = 0, cache_offset = 0, max_misses = 0;
};

inline ffi::ErrorOr<GatherShape> check_gather(const ffi::AnyBuffer& misses, const ffi::AnyBuffer& info,
                                             const ffi::AnyBuffer& cache, const ExpertPool* pool, int64_t pool_id,
                                             int64_t layer) {
  GatherShape g;
  if (!pool)
    return ffi::Unexpected(ffi::Error::InvalidArgument("gather: no expert pool with id " + std::to_string(pool_id) +
                                                       " (it was never created or has been closed)"));
  if (layer < 0 || layer >= pool->num_layers)
    return ffi::Unexpected(ffi::Error::InvalidArgument("gather: layer " + std::to_string(layer) +
                                                       " is outside the pool's " + std::to_string(pool->num_layers) +
                                                       " layers"));
  auto cd = cache.dimensions();
  const int64_t R = pool->record_bytes;
  if (cache.element_type() != ffi::DataType::U8 || cd.size() < 2 || cd.size() > 3 || cd.back() != R)
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "gather: the cache must be uint8 [num_slots, " + std::to_string(R) + "] or [L, num_slots, " +
        std::to_string(R) + "] for this pool; got shape " + dims_str(cd)));
  g.num_slots = cd[cd.size() - 2];
  if (cd.size() == 3) {
    if (layer >= cd[0])
      return ffi::Unexpected(ffi::Error::InvalidArgument("gather: layer " + std::to_string(layer) +
                                                         " is outside the stacked cache " + dims_str(cd)));
    g.cache_offset = layer * g.num_slots * R;
  }
  auto md = misses.dimensions();
  if (misses.element_type() != ffi::DataType::S32 || info.element_type() != ffi::DataType::S32 || md.size() != 2 ||
      md[1] != 2 || info.element_count() != 4)
    return ffi::Unexpected(ffi::Error::InvalidArgument("gather: misses must be int32 [M, 2] and info int32 [4] (resolve's outputs)"));
  g.max_misses = md[0];
  return g;
}

// Copy: operand i to result i, which must have its size.
inline ffi::Error check_copy(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets) {
  if (args.size() != rets.size())
    return ffi::Error::InvalidArgument("copy: " + std::to_string(args.size()) + " operands but " +
                                       std::to_string(rets.size()) + " results");
  for (size_t i = 0; i < args.size(); ++i) {
    auto a = args.get<ffi::AnyBuffer>(i);
    auto r = rets.get<ffi::AnyBuffer>(i);
    if (a.has_error()) return a.error();
    if (r.has_error()) return r.error();
    if (a->size_bytes() != (*r)->size_bytes())
      return ffi::Error::InvalidArgument("copy: operand " + std::to_string(i) + " has " +
                                         std::to_string(a->size_bytes()) + " bytes, its result " +
                                         std::to_string((*r)->size_bytes()));
  }
  return ffi::Error::Success();
}

// PLE: attributes to parameters, with every shape checked against the table.
inline ffi::ErrorOr<PleParams> make_ple_params(const ffi::AnyBuffer& tokens, const ffi::AnyBuffer& lengths,
                                              const ffi::AnyBuffer& reset, const ffi::AnyBuffer& ctx,
                                              const ffi::AnyBuffer& ids, const ffi::AnyBuffer& rows,
                                              const ffi::AnyBuffer& info, const NgramTable* table, int64_t table_id,
                                              int64_t eos, int64_t vocab, ffi::Span<const int64_t> mult,
                                              ffi::Span<const int64_t> sizes, ffi::Span<const int64_t> offsets) {
  auto bad = [](std::string m) { return ffi::Unexpected(ffi::Error::InvalidArgument("ple_step: " + m)); };
  PleParams p;
  for (const ffi::AnyBuffer* b : {&tokens, &lengths, &reset, &ctx, &ids, &info})
    if (b->element_type() != ffi::DataType::S32) return bad("tokens, lengths, reset, context, ids and info must be int32");
  if (!table) return bad("no n-gram table with id " + std::to_string(table_id) + " (never created, or closed)");
  auto td = tokens.dimensions();
  if (td.size() != 2) return bad("tokens must be [B, T]; got " + dims_str(td));
  p.batch = td[0];
  p.tokens = td[1];
  p.eos = eos;
  p.vocab = vocab;
  p.heads = int64_t(sizes.size());
  if (mult.size() != 3) return bad("expected 3 hash multipliers (trigram PLE)");
  if (p.heads != table->heads || int64_t(offsets.size()) != p.heads)
    return bad("head_sizes/head_offsets have " + std::to_string(sizes.size()) + "/" +
               std::to_string(offsets.size()) + " entries; the table has " + std::to_string(table->heads) +
               " heads");
  if (eos < 0 || eos >= vocab) return bad("eos id " + std::to_string(eos) + " is outside [0, vocab)");
  for (int k = 0; k < 3; ++k) p.mult[k] = uint64_t(mult[k]);
  for (int64_t j = 0; j < p.heads; ++j) {
    if (sizes[j] <= 0 || offsets[j] < 0 || offsets[j] + sizes[j] > table->rows)
      return bad("head " + std::to_string(j) + " covers rows [" + std::to_string(offsets[j]) + ", " +
                 std::to_string(offsets[j] + sizes[j]) + ") but the table has " + std::to_string(table->rows) +
                 " rows");
    p.head_size[j] = sizes[j];
    p.head_offset[j] = offsets[j];
  }
  const int64_t B = p.batch, T = p.tokens, H = p.heads;
  if (int64_t(lengths.element_count()) != B || int64_t(reset.element_count()) != B ||
      int64_t(ctx.element_count()) != 2 * B)
    return bad("lengths and reset must be [B] and the context [B, 2] for B=" + std::to_string(B));
  if (int64_t(ids.element_count()) != B * T * H) return bad("ids output must be [B, T, heads]");
  if (int64_t(rows.size_bytes()) != B * T * H * table->row_bytes)
    return bad("rows output must hold B*T*heads rows of " + std::to_string(table->row_bytes) + " bytes");
  if (info.element_count() != 2) return bad("info output must have 2 elements");
  return p;
}

// A CUDA handler's binding starts with its stream (expanded in .cu files only).
#define JAXFLASH_CUDA_BIND xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()

// The operands and attributes of the cache's and the PLE step's calls, bound alike by their CPU and CUDA handlers
// (the CUDA ones after their stream; traits stay with each handler). resolve: ids, LRU state -> slots, misses,
// info, LRU state (jaxflash/ffi/cache.py).
#define JAXFLASH_RESOLVE_BINDING(bind) \
  (bind).Arg<xla::ffi::AnyBuffer>()     \
      .Arg<xla::ffi::AnyBuffer>()       \
      .Ret<xla::ffi::AnyBuffer>()       \
      .Ret<xla::ffi::AnyBuffer>()       \
      .Ret<xla::ffi::AnyBuffer>()       \
      .Ret<xla::ffi::AnyBuffer>()       \
      .Attr<int64_t>("num_slots")       \
      .Attr<int64_t>("num_experts")     \
      .Attr<int64_t>("layer")

// gather, gather_start: misses, info, cache -> cache.
#define JAXFLASH_GATHER_BINDING(bind) \
  (bind).Arg<xla::ffi::AnyBuffer>()    \
      .Arg<xla::ffi::AnyBuffer>()      \
      .Arg<xla::ffi::AnyBuffer>()      \
      .Ret<xla::ffi::AnyBuffer>()      \
      .Attr<int64_t>("pool_id")        \
      .Attr<int64_t>("layer")

// gather_wait: cache, after, misses, info -> cache, after.
#define JAXFLASH_GATHER_WAIT_BINDING(bind) \
  (bind).Arg<xla::ffi::AnyBuffer>()         \
      .Arg<xla::ffi::AnyBuffer>()           \
      .Arg<xla::ffi::AnyBuffer>()           \
      .Arg<xla::ffi::AnyBuffer>()           \
      .Ret<xla::ffi::AnyBuffer>()           \
      .Ret<xla::ffi::AnyBuffer>()

// the PLE host step: tokens, lengths, reset, context -> ids, rows, context, info (jaxflash/ffi/ple.py).
#define JAXFLASH_PLE_BINDING(bind)                          \
  (bind).Arg<xla::ffi::AnyBuffer>()                          \
      .Arg<xla::ffi::AnyBuffer>()                            \
      .Arg<xla::ffi::AnyBuffer>()                            \
      .Arg<xla::ffi::AnyBuffer>()                            \
      .Ret<xla::ffi::AnyBuffer>()                            \
      .Ret<xla::ffi::AnyBuffer>()                            \
      .Ret<xla::ffi::AnyBuffer>()                            \
      .Ret<xla::ffi::AnyBuffer>()                            \
      .Attr<int64_t>("table_id")                             \
      .Attr<int64_t>("eos")                                  \
      .Attr<int64_t>("vocab")                                \
      .Attr<xla::ffi::Span<const int64_t>>("multipliers")    \
      .Attr<xla::ffi::Span<const int64_t>>("head_sizes")     \
      .Attr<xla::ffi::Span<const int64_t>>("head_offsets")

// The operands and attributes of jaxflash_nvfp4_moe, bound alike by its CPU and CUDA handlers (after the CUDA
// one's stream): ids, x, the operands' arrays, and its two outputs (jaxflash/ffi/nvfp4_moe.py).
#define JAXFLASH_NVFP4_MOE_BINDING(bind)                   \
  (bind).Arg<xla::ffi::AnyBuffer>()                         \
      .Arg<xla::ffi::AnyBuffer>()                           \
      .RemainingArgs()                                      \
      .Ret<xla::ffi::AnyBuffer>()                           \
      .Ret<xla::ffi::AnyBuffer>()                           \
      .Attr<xla::ffi::Span<const int64_t>>("part_arg")      \
      .Attr<xla::ffi::Span<const int64_t>>("part_offset")   \
      .Attr<int64_t>("lanes_gu")                            \
      .Attr<int64_t>("lanes_down")                          \
      .Attr<int64_t>("threads_gu")                          \
      .Attr<int64_t>("threads_down")                        \
      .Attr<int64_t>("stages")                              \
      .Attr<int64_t>("blocks_gu")                           \
      .Attr<int64_t>("blocks_down")                         \
      .Attr<int64_t>("prefetch")

// NVFP4 routed experts (jaxflash_nvfp4_moe): the operands' parts checked against the shapes, as addresses.
struct MoeShape {
  int64_t tokens = 0, top_k = 0, pairs = 0, hidden = 0, inter = 0;
  nvfp4::Operands ops{};
};

inline ffi::ErrorOr<MoeShape> check_nvfp4_moe(const ffi::AnyBuffer& ids, const ffi::AnyBuffer& x,
                                             const ffi::RemainingArgs& operands, const ffi::AnyBuffer& y,
                                             const ffi::AnyBuffer& act, ffi::Span<const int64_t> part_arg,
                                             ffi::Span<const int64_t> part_offset, bool device_alignment) {
  auto bad = [](std::string m) { return ffi::Unexpected(ffi::Error::InvalidArgument("nvfp4_moe: " + m)); };
  MoeShape s;
  auto id = ids.dimensions(), xd = x.dimensions(), yd = y.dimensions(), ad = act.dimensions();
  if (ids.element_type() != ffi::DataType::S32 || id.size() != 2) return bad("ids must be int32 [N, k]");
  if (x.element_type() != ffi::DataType::BF16 || xd.size() != 2 || xd[0] != id[0])
    return bad("x must be bfloat16 [N, H] with the ids' N; got " + dims_str(xd));
  s.tokens = id[0];
  s.top_k = id[1];
  s.pairs = s.tokens * s.top_k;
  s.hidden = xd[1];
  if (s.tokens < 1 || s.tokens > nvfp4::kMaxTokens || s.top_k < 1 || s.pairs > nvfp4::kMaxPairs)
    return bad("takes 1.." + std::to_string(nvfp4::kMaxTokens) + " tokens and at most " +
               std::to_string(nvfp4::kMaxPairs) + " (token, expert) pairs; got ids " + dims_str(id));
  if (ad.size() != 2 || ad[0] != s.pairs || act.element_type() != ffi::DataType::BF16)
    return bad("act must be bfloat16 [N*k, I]; got " + dims_str(ad));
  s.inter = ad[1];
  if (yd.size() != 2 || yd[0] != s.pairs || yd[1] != s.hidden || y.element_type() != ffi::DataType::BF16)
    return bad("y must be bfloat16 [N*k, H]; got " + dims_str(yd));
  if (s.hidden % 32 || s.inter % 32 || s.hidden <= 0 || s.inter <= 0)
    return bad("H=" + std::to_string(s.hidden) + " and I=" + std::to_string(s.inter) + " must be multiples of 32");
  if (part_arg.size() != nvfp4::kNumParts || part_offset.size() != nvfp4::kNumParts)
    return bad("part_arg and part_offset need 9 entries (gate, up, down codes, scales, global scales)");
  const int64_t H = s.hidden, I = s.inter;
  const int64_t need[nvfp4::kNumParts] = {I * H / 2, I * H / 2, H * I / 2, I * H / 16, I * H / 16, H * I / 16, 4, 4, 4};
  s.ops.num_experts = -1;
  for (int p = 0; p < nvfp4::kNumParts; ++p) {
    const int64_t a = part_arg[p];
    if (a < 0 || a >= int64_t(operands.size()))
      return bad("part " + std::to_string(p) + " names operand " + std::to_string(a) + " of " +
                 std::to_string(operands.size()));
    auto buf = operands.get<ffi::AnyBuffer>(size_t(a));
    if (buf.has_error()) return ffi::Unexpected(buf.error());
    auto dims = buf->dimensions();
    if (dims.size() < 1 || dims[0] < 1) return bad("operand " + std::to_string(a) + " has no expert rows");
    if (s.ops.num_experts >= 0 && dims[0] != s.ops.num_experts)
      return bad("the operands disagree on the number of experts");
    s.ops.num_experts = dims[0];
    const int64_t row = int64_t(buf->size_bytes()) / dims[0];
    if (part_offset[p] < 0 || part_offset[p] + need[p] > row)
      return bad("part " + std::to_string(p) + " (" + std::to_string(need[p]) + " bytes at offset " +
                 std::to_string(part_offset[p]) + ") does not fit an expert row of " + std::to_string(row) + " bytes");
    s.ops.base[p] = static_cast<const uint8_t*>(buf->untyped_data()) + part_offset[p];
    s.ops.stride[p] = row;
    if (device_alignment) {  // 16-byte asynchronous copies of codes and scales
      const int64_t align = p < 6 ? 16 : 1;
      if (reinterpret_cast<uintptr_t>(s.ops.base[p]) % align || row % align)
        return bad("part " + std::to_string(p) + " is not " + std::to_string(align) + "-byte aligned");
    }
  }
  return s;
}

}  // namespace jaxflash
