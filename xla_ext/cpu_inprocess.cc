// In-process collectives for the CPU: the devices of one process share memory, so a level whose
// members all live in this process (the `local` level of one process per node) can reduce-scatter
// and all-gather by reading each other's buffers, instead of going through gloo's loopback TCP
// (XLA:CPU runs every collective of a multi-process program over gloo, even between two devices
// of one process).
//
// Three layers, as in JAX's FFI examples: plain kernels that compute one member's result from
// every member's input; typed Impl functions that check the buffers and attributes, then hand
// their kernel to the group's rendezvous (cpu_rendezvous.h); one handler symbol per target.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_rendezvous.h"
#include "cpu_stream.h"
#include "handlers.h"
#include "xla/ffi/api/ffi.h"

namespace jaxring {
namespace {

using ffi::AnyBuffer;
using ffi::Result;

// ---- The kernels: one member's result, from every member's input ----

// out[i] = sum_j in[j][i], in member order (the same rounding on every member), one pass over
// the output for the first two members. Stored normally, not streamed (cpu_stream.h): the next
// level reads this shard right away (streaming it measured 10% slower on the FSDP int8 call).
void SumRows(float* out, const std::vector<const float*>& in, int64_t n) {
  if (in.size() == 1) {
    std::memcpy(out, in[0], n * sizeof(float));
    return;
  }
  const float* a = in[0];
  const float* b = in[1];
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
  for (size_t j = 2; j < in.size(); ++j) {
    const float* c = in[j];
    for (int64_t i = 0; i < n; ++i) out[i] += c[i];
  }
}

// This member's shard of a reduce-scatter: its row k is the sum over the members of row mine[k]
// of their x (rows of ``len`` values).
void ReduceScatterRows(const std::vector<const void*>& inputs, const std::vector<int64_t>& mine,
                       int64_t len, float* o) {
  std::vector<const float*> rows(inputs.size());
  for (size_t k = 0; k < mine.size(); ++k) {
    for (size_t j = 0; j < inputs.size(); ++j)
      rows[j] = static_cast<const float*>(inputs[j]) + mine[k] * len;
    SumRows(o + k * len, rows, len);
  }
}

// An all-gather's result: its row i is row order[i] of the members' concatenation (``per`` rows
// of ``row`` bytes from each member), streamed past the cache when ``stream``.
void GatherRows(const std::vector<const void*>& inputs, const std::vector<int64_t>& order,
                int64_t per, int64_t row, bool stream, char* o) {
  for (size_t i = 0; i < order.size(); ++i) {
    const int64_t src = order[i];
    const char* from = static_cast<const char*>(inputs[src / per]) + (src % per) * row;
    if (stream) {
      cpu::StreamBytes(o + i * row, from, row);
    } else {
      std::memcpy(o + i * row, from, row);
    }
  }
  if (stream) cpu::StreamFence();
}

// The last gather of a level whose payload travelled encoded, decoded as it is copied: each
// member reads the others' codes where they lie and writes f32 rows into ``order``'s places,
// instead of gathering the codes into a buffer of their own and decoding that (two more passes
// over the codes). ``x``: int8 codes with ``scales`` (f32, one per ``block_size`` values; rows
// hold whole blocks), or 16-bit floats (bf16, f16; ``scales`` unused), widened exactly.
struct Encoded {
  const void* values;
  const float* scales;
};

// The members' encoded rows: ``per`` rows of ``len`` values from each, ``width`` bytes a code.
struct EncodedRows {
  int64_t per, len;
  bool int8;
  cpu::Wire wire;
  int64_t width, block_size;
  bool stream;
};

// The decoding all-gather's result: its row i is row order[i] of the members' concatenation
// (each member's input an Encoded), decoded to f32.
void GatherDecodeRows(const std::vector<const void*>& inputs, const std::vector<int64_t>& order,
                      const EncodedRows& r, float* o) {
  const int64_t len = r.len, per = r.per, width = r.width, block_size = r.block_size;
  const bool int8 = r.int8, stream = r.stream;
  // a tile of whole blocks; decoded straight into place when not streaming
  const int64_t step =
      !stream ? len
              : (int8 ? std::max<int64_t>(1, cpu::kStreamTile / block_size) * block_size
                      : cpu::kStreamTile);
  std::vector<float> tile(stream ? step : 0);
  for (size_t i = 0; i < order.size(); ++i) {
    const int64_t src = order[i], k = src % per;
    const auto* e = static_cast<const Encoded*>(inputs[src / per]);
    float* row = o + i * len;
    for (int64_t i0 = 0; i0 < len; i0 += step) {
      const int64_t cnt = std::min(step, len - i0), at = k * len + i0;
      float* dst = stream ? tile.data() : row + i0;
      if (int8) {
        cpu::DequantizeBlocks(cpu::Wire::kF32, static_cast<const int8_t*>(e->values) + at,
                              e->scales + at / block_size, cnt, block_size, 0, cnt / block_size,
                              dst);
      } else {
        cpu::WidenRange(r.wire, static_cast<const char*>(e->values) + at * width, 0, cnt, dst);
      }
      if (stream) cpu::StreamBytes(row + i0, dst, cnt * sizeof(float));
    }
  }
  if (stream) cpu::StreamFence();
}

// ---- The typed Impl functions: buffers and attributes checked, the kernel handed over ----

// ``order`` describes the chunks as rows: x is order.size() equal rows, ``size`` members x ``R``
// rows each, and member ``rank``'s row k is row order[rank * R + k] of x (identity: 0, 1, ...).
// Reading the rows where they lie spares the caller a permuting copy of x.
ffi::Error CheckOrder(std::string_view op, ffi::Span<const int64_t> order, int64_t size,
                      int64_t units) {
  const int64_t rows = static_cast<int64_t>(order.size());
  if (size < 1 || rows < size || rows % size || units % rows)
    return ffi::Error::InvalidArgument(std::string(op) + ": " + std::to_string(units) +
                                       " units do not split into " + std::to_string(rows) +
                                       " rows of " + std::to_string(size) + " members");
  for (int64_t r : order)
    if (r < 0 || r >= rows)
      return ffi::Error::InvalidArgument(std::string(op) + ": order names row " +
                                         std::to_string(r) + " of " + std::to_string(rows));
  return ffi::Error::Success();
}

ffi::Future LocalReduceScatterImpl(ffi::RunId run, CallSite* site, AnyBuffer x, AnyBuffer member,
                                   Result<AnyBuffer> out, int64_t size, int64_t timeout_ms,
                                   ffi::Span<const int64_t> order) {
  constexpr std::string_view op = "jaxring_local_reduce_scatter";
  if (x.element_type() != ffi::DataType::F32 || out->element_type() != ffi::DataType::F32)
    return Done(ffi::Error::InvalidArgument(std::string(op) +
                                            ": x and the result must be float32"));
  const int64_t n = static_cast<int64_t>(x.element_count());
  const int64_t m = static_cast<int64_t>(out->element_count());
  if (size < 1 || m * size != n)
    return Done(ffi::Error::InvalidArgument(std::string(op) + ": x has " + std::to_string(n) +
                                            " elements, not " + std::to_string(size) + " x " +
                                            std::to_string(m)));
  if (auto e = CheckOrder(op, order, size, n); e.failure()) return Done(std::move(e));
  const int64_t per = static_cast<int64_t>(order.size()) / size, len = m / per;
  const auto* ids = reinterpret_cast<const int32_t*>(member.untyped_data());
  const int64_t rank = ids[0], group = ids[1];
  float* o = reinterpret_cast<float*>(out->untyped_data());
  // this member's rows, in the order it reads them
  std::vector<int64_t> mine(order.begin() + rank * per, order.begin() + (rank + 1) * per);
  return Rendezvous(op, run.run_id, site->serial, group, rank, size, x.untyped_data(), n * 4,
                    timeout_ms,
                    [o, len, mine = std::move(mine)](const std::vector<const void*>& inputs) {
                      ReduceScatterRows(inputs, mine, len, o);
                    });
}

// ``order``: the result is order.size() rows, member j's input being rows j * R .. j * R + R - 1
// of the members' concatenation; result row i is row order[i] of it (identity: 0, 1, ...).
ffi::Future LocalAllGatherImpl(ffi::RunId run, CallSite* site, AnyBuffer x, AnyBuffer member,
                               Result<AnyBuffer> out, int64_t size, int64_t timeout_ms,
                               ffi::Span<const int64_t> order) {
  constexpr std::string_view op = "jaxring_local_all_gather";
  const int64_t width = ffi::ByteWidth(x.element_type());
  const int64_t bytes = static_cast<int64_t>(x.element_count()) * width;
  if (out->element_type() != x.element_type() ||
      static_cast<int64_t>(out->element_count()) != size * static_cast<int64_t>(x.element_count()))
    return Done(ffi::Error::InvalidArgument(std::string(op) + ": the result must hold " +
                                            std::to_string(size) +
                                            " copies of x's elements and type"));
  if (auto e = CheckOrder(op, order, size, size * static_cast<int64_t>(x.element_count()));
      e.failure())
    return Done(std::move(e));
  const int64_t per = static_cast<int64_t>(order.size()) / size, row = bytes / per;
  const auto* ids = reinterpret_cast<const int32_t*>(member.untyped_data());
  const int64_t rank = ids[0], group = ids[1];
  char* o = reinterpret_cast<char*>(out->untyped_data());
  const bool stream = size * bytes >= cpu::kStreamMinBytes;
  return Rendezvous(op, run.run_id, site->serial, group, rank, size, x.untyped_data(), bytes,
                    timeout_ms,
                    [o, per, row, stream, order = std::vector<int64_t>(order.begin(), order.end())](
                        const std::vector<const void*>& inputs) {
                      GatherRows(inputs, order, per, row, stream, o);
                    });
}

// ``x`` and ``scales``: the members' encoded rows (see Encoded).
ffi::Future LocalAllGatherDecodeImpl(ffi::RunId run, CallSite* site, AnyBuffer x,
                                     AnyBuffer scales, AnyBuffer member, Result<AnyBuffer> out,
                                     int64_t size, int64_t timeout_ms,
                                     ffi::Span<const int64_t> order, int64_t block_size) {
  constexpr std::string_view op = "jaxring_local_all_gather_decode";
  const ffi::DataType type = x.element_type();
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (out->element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(out->element_count()) != size * n)
    return Done(ffi::Error::InvalidArgument(std::string(op) +
                                            ": the result must be float32 holding " +
                                            std::to_string(size) + " x " + std::to_string(n) +
                                            " values"));
  if (auto e = CheckOrder(op, order, size, size * n); e.failure()) return Done(std::move(e));
  const int64_t per = static_cast<int64_t>(order.size()) / size, len = n / per;
  const bool int8 = type == ffi::DataType::S8;
  if (int8 && (block_size < 1 || len % block_size ||
               static_cast<int64_t>(scales.element_count()) != n / block_size ||
               scales.element_type() != ffi::DataType::F32))
    return Done(ffi::Error::InvalidArgument(
        std::string(op) + ": int8 rows of " + std::to_string(len) + " codes need whole blocks of " +
        std::to_string(block_size) + " and one f32 scale each"));
  if (!int8 && type != ffi::DataType::BF16 && type != ffi::DataType::F16)
    return Done(ffi::Error::InvalidArgument(std::string(op) +
                                            ": x must be int8, bfloat16 or float16"));
  const cpu::Wire wire = type == ffi::DataType::BF16 ? cpu::Wire::kBf16 : cpu::Wire::kF16;
  const int64_t width = ffi::ByteWidth(type);
  const auto* ids = reinterpret_cast<const int32_t*>(member.untyped_data());
  const int64_t rank = ids[0], group = ids[1];
  // what the others read, alive while this member's part is (which ends after theirs)
  auto mine = std::make_shared<const Encoded>(
      Encoded{x.untyped_data(), reinterpret_cast<const float*>(scales.untyped_data())});
  float* o = reinterpret_cast<float*>(out->untyped_data());
  const bool stream = size * n * 4 >= cpu::kStreamMinBytes;
  const EncodedRows rows{per, len, int8, wire, width, block_size, stream};
  return Rendezvous(op, run.run_id, site->serial, group, rank, size, mine.get(), n * width,
                    timeout_ms,
                    [mine, o, rows, order = std::vector<int64_t>(order.begin(), order.end())](
                        const std::vector<const void*>& inputs) {
                      GatherDecodeRows(inputs, order, rows, o);
                    });
}

}  // namespace
}  // namespace jaxring

namespace ffi = xla::ffi;

namespace {
// What every in-process collective takes after its buffers; ``order`` places the rows
// (identity: 0 .. size - 1).
template <class Binding>
auto GroupAttrs(Binding binding) {
  return std::move(binding).template Attr<int64_t>("size")
      .template Attr<int64_t>("timeout_ms")
      .template Attr<ffi::Span<const int64_t>>("order");
}

// (x, [member, group]) -> one buffer.
auto LocalCollectiveBinding() {
  return GroupAttrs(ffi::Ffi::Bind()
                        .Ctx<ffi::RunId>()
                        .Ctx<ffi::State<jaxring::CallSite>>()
                        .Arg<ffi::AnyBuffer>()
                        .Arg<ffi::AnyBuffer>()
                        .Ret<ffi::AnyBuffer>());
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringLocalReduceScatterCpu, jaxring::LocalReduceScatterImpl,
                              LocalCollectiveBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringLocalAllGatherCpu, jaxring::LocalAllGatherImpl,
                              LocalCollectiveBinding());
// (codes, scales, [member, group]) -> decoded f32.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringLocalAllGatherDecodeCpu, jaxring::LocalAllGatherDecodeImpl,
                              GroupAttrs(ffi::Ffi::Bind()
                                             .Ctx<ffi::RunId>()
                                             .Ctx<ffi::State<jaxring::CallSite>>()
                                             .Arg<ffi::AnyBuffer>()
                                             .Arg<ffi::AnyBuffer>()
                                             .Arg<ffi::AnyBuffer>()
                                             .Ret<ffi::AnyBuffer>())
                                  .Attr<int64_t>("block_size"));
