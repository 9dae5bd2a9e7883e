// XLA FFI handlers for the CPU: typed Impl functions that check operands (plans.h), then run
// the plain kernels (cpu_kernels.h) over every row, splitting large buffers over XLA's intra-op
// thread pool.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_rows.h"
#include "cpu_stream.h"
#include "bindings.h"
#include "handlers.h"
#include "numerics.h"
#include "plans.h"
#include "xla/ffi/api/ffi.h"

namespace jaxring {
namespace {

using ffi::AnyBuffer;
using ffi::DataType;
using ffi::Result;

// `x`: the rows' values of type `type`, contiguous (a buffer's, or a windowed call's chunk).
void QuantizeRows(ffi::ThreadPool& pool, const BlockPlan& p, DataType type, const void* x,
                  const AnyBuffer& seed, const AnyBuffer& q, const AnyBuffer& scales,
                  bool stochastic) {
  const cpu::Wire wire = WireOf(type);
  const int64_t n = p.layout.cols, width = ffi::ByteWidth(type);
  for (int64_t r = 0; r < p.layout.rows; ++r) {
    const uint32_t key = RowKey(seed, r);
    ParallelFor(pool, p.blocks, n * (width + 1), [&](int64_t b0, int64_t b1) {
      cpu::QuantizeBlocks(wire, static_cast<const char*>(x) + r * n * width, n, p.block, b0, b1,
                          stochastic, key, Data<int8_t>(q) + r * n,
                          Data<float>(scales) + r * p.blocks);
    });
  }
}

ffi::Error QuantizeInt8Impl(ffi::ThreadPool pool, AnyBuffer x, AnyBuffer seed,
                            Result<AnyBuffer> q, Result<AnyBuffer> scales, int64_t block_size,
                            bool stochastic) {
  BlockPlan p;
  JR_RETURN_IF_ERROR(PlanQuantize("jaxring_quantize_int8", x, seed, *q, *scales, block_size, &p));
  QuantizeRows(pool, p, x.element_type(), x.untyped_data(), seed, *q, *scales, stochastic);
  return ffi::Error::Success();
}

// Blocks [b0, b1) of a row of n codes decoded to f32 through an L1 tile streamed to ``out``
// (cpu_stream.h): for outputs too large to stay in the cache.
void DequantizeF32Streamed(const int8_t* q, const float* scales, int64_t n, int64_t bs,
                           int64_t b0, int64_t b1, float* out) {
  const int64_t per = std::max<int64_t>(1, cpu::kStreamTile / bs);
  std::vector<float> tile(per * bs);
  for (int64_t b = b0; b < b1; b += per) {
    const int64_t be = std::min(b1, b + per), start = b * bs;
    const int64_t cnt = std::min(n, be * bs) - start;
    cpu::DequantizeBlocks(cpu::Wire::kF32, q + start, scales + b, cnt, bs, 0, be - b,
                          tile.data());
    cpu::StreamBytes(out + start, tile.data(), cnt * static_cast<int64_t>(sizeof(float)));
  }
}

ffi::Error DequantizeInt8Impl(ffi::ThreadPool pool, AnyBuffer q, AnyBuffer scales,
                              Result<AnyBuffer> out, int64_t block_size) {
  BlockPlan p;
  JR_RETURN_IF_ERROR(PlanDequantize("jaxring_dequantize_int8", q, scales, *out, block_size, &p));
  const cpu::Wire wire = WireOf(out->element_type());
  const int64_t n = p.layout.cols, width = ffi::ByteWidth(out->element_type());
  const bool stream = wire == cpu::Wire::kF32 && p.layout.rows * n * 4 >= cpu::kStreamMinBytes;
  for (int64_t r = 0; r < p.layout.rows; ++r)
    ParallelFor(pool, p.blocks, n * (width + 1), [&](int64_t b0, int64_t b1) {
      const int8_t* qr = Data<const int8_t>(q) + r * n;
      const float* sr = Data<const float>(scales) + r * p.blocks;
      if (stream) {
        DequantizeF32Streamed(qr, sr, n, p.block, b0, b1, Data<float>(*out) + r * n);
      } else {
        cpu::DequantizeBlocks(wire, qr, sr, n, p.block, b0, b1,
                              Data<char>(*out) + r * n * width);
      }
    });
  if (stream) cpu::StreamFence();
  return ffi::Error::Success();
}

// `partial`: the rows' f32 partials, contiguous (a buffer's, or a windowed call's chunk).
void RingHopInt8Rows(ffi::ThreadPool& pool, const BlockPlan& p, const AnyBuffer& q,
                     const AnyBuffer& scales, const float* partial, const AnyBuffer* seed,
                     const AnyBuffer& new_partial, const AnyBuffer* q_out,
                     const AnyBuffer* scales_out, bool stochastic) {
  const int64_t n = p.layout.cols, nb = p.blocks;
  for (int64_t r = 0; r < p.layout.rows; ++r) {
    const uint32_t key = seed ? RowKey(*seed, r) : 0;
    ParallelFor(pool, nb, n * (q_out ? 10 : 9), [&](int64_t b0, int64_t b1) {
      cpu::RingHopInt8Blocks(Data<const int8_t>(q) + r * n, Data<const float>(scales) + r * nb,
                             partial + r * n, n, p.block, b0, b1, stochastic,
                             key, Data<float>(new_partial) + r * n,
                             q_out ? Data<int8_t>(*q_out) + r * n : nullptr,
                             scales_out ? Data<float>(*scales_out) + r * nb : nullptr);
    });
  }
}

ffi::Error RingHopInt8Impl(ffi::ThreadPool pool, AnyBuffer q, AnyBuffer scales, AnyBuffer partial,
                           AnyBuffer seed, Result<AnyBuffer> new_partial,
                           Result<AnyBuffer> q_out, Result<AnyBuffer> scales_out,
                           int64_t block_size, bool stochastic) {
  BlockPlan p;
  JR_RETURN_IF_ERROR(PlanRingHopInt8("jaxring_ring_hop_int8", q, scales, &partial, &seed,
                                     *new_partial, &*q_out, &*scales_out, block_size, &p));
  RingHopInt8Rows(pool, p, q, scales, Data<const float>(partial), &seed, *new_partial, &*q_out,
                  &*scales_out, stochastic);
  return ffi::Error::Success();
}

ffi::Error RingHopInt8LastImpl(ffi::ThreadPool pool, AnyBuffer q, AnyBuffer scales,
                               AnyBuffer partial, Result<AnyBuffer> new_partial,
                               int64_t block_size) {
  BlockPlan p;
  JR_RETURN_IF_ERROR(PlanRingHopInt8("jaxring_ring_hop_int8_last", q, scales, &partial, nullptr,
                                     *new_partial, nullptr, nullptr, block_size, &p));
  RingHopInt8Rows(pool, p, q, scales, Data<const float>(partial), nullptr, *new_partial, nullptr,
                  nullptr, false);
  return ffi::Error::Success();
}

// Rows are contiguous and the op is elementwise: all rows are one range of `total` elements.
void RingHopCastRows(ffi::ThreadPool& pool, const AnyBuffer& recv, const float* partial,
                     int64_t total, const AnyBuffer& new_partial, const AnyBuffer* out) {
  const int64_t width = ffi::ByteWidth(recv.element_type());
  ParallelFor(pool, total, total * (8 + (out ? 2 : 1) * width), [&](int64_t i0, int64_t i1) {
    cpu::RingHopCastRange(WireOf(recv.element_type()), recv.untyped_data(), partial, i0, i1,
                          Data<float>(new_partial), out ? out->untyped_data() : nullptr);
  });
}

ffi::Error RingHopCast(std::string_view op, ffi::ThreadPool& pool, const AnyBuffer& recv,
                       const AnyBuffer& partial, const AnyBuffer& new_partial,
                       const AnyBuffer* out) {
  RowLayout l;
  JR_RETURN_IF_ERROR(PlanRingHopCast(op, recv, &partial, new_partial, out, &l));
  RingHopCastRows(pool, recv, Data<const float>(partial), l.rows * l.cols, new_partial, out);
  return ffi::Error::Success();
}

ffi::Error RingHopCastImpl(ffi::ThreadPool pool, AnyBuffer recv, AnyBuffer partial,
                           Result<AnyBuffer> new_partial, Result<AnyBuffer> out) {
  return RingHopCast("jaxring_ring_hop_cast", pool, recv, partial, *new_partial, &*out);
}

ffi::Error RingHopCastLastImpl(ffi::ThreadPool pool, AnyBuffer recv, AnyBuffer partial,
                               Result<AnyBuffer> new_partial) {
  return RingHopCast("jaxring_ring_hop_cast_last", pool, recv, partial, *new_partial, nullptr);
}

// --- Windowed operands: the ring's local chunk read where it lies ----------------------------
// The ring hands its whole f32 buffer and the chunk's first element (an int32 scalar operand,
// traced in SPMD programs, where it depends on the device's rank); a sliced operand would be
// copied by XLA before the call (docs/design.md, "The ring's chunks are read in place").

ffi::Error QuantizeInt8AtImpl(ffi::ThreadPool pool, AnyBuffer base, AnyBuffer offset,
                              AnyBuffer seed, Result<AnyBuffer> q, Result<AnyBuffer> scales,
                              int64_t block_size, bool stochastic) {
  constexpr std::string_view op = "jaxring_quantize_int8_at";
  BlockPlan p;
  JR_RETURN_IF_ERROR(PlanBlocks(op, "q (result)", *q, {DataType::S8}, block_size, &p));
  if (p.layout.rows != 1)
    return InvalidArgument(op, "q (result) must be flat, got shape ", DimsString(q->dimensions()));
  JR_RETURN_IF_ERROR(
      CheckOperand(op, "scales (result)", *scales, DataType::F32, "q (result)", *q, p.blocks));
  JR_RETURN_IF_ERROR(CheckOperand(op, "seed", seed, DataType::U32, "q (result)", *q, -1));
  const float* x;
  JR_RETURN_IF_ERROR(Window(op, base, offset, p.layout.cols, &x));
  QuantizeRows(pool, p, DataType::F32, x, seed, *q, *scales, stochastic);
  return ffi::Error::Success();
}

ffi::Error RingHopInt8At(std::string_view op, ffi::ThreadPool& pool, const AnyBuffer& q,
                         const AnyBuffer& scales, const AnyBuffer& base, const AnyBuffer& offset,
                         const AnyBuffer* seed, const AnyBuffer& new_partial,
                         const AnyBuffer* q_out, const AnyBuffer* scales_out,
                         int64_t block_size, bool stochastic) {
  BlockPlan p;
  JR_RETURN_IF_ERROR(PlanRingHopInt8(op, q, scales, nullptr, seed, new_partial, q_out,
                                     scales_out, block_size, &p));
  if (p.layout.rows != 1)
    return InvalidArgument(op, "q must be flat, got shape ", DimsString(q.dimensions()));
  const float* partial;
  JR_RETURN_IF_ERROR(Window(op, base, offset, p.layout.cols, &partial));
  RingHopInt8Rows(pool, p, q, scales, partial, seed, new_partial, q_out, scales_out, stochastic);
  return ffi::Error::Success();
}

ffi::Error RingHopInt8AtImpl(ffi::ThreadPool pool, AnyBuffer q, AnyBuffer scales, AnyBuffer base,
                             AnyBuffer offset, AnyBuffer seed, Result<AnyBuffer> new_partial,
                             Result<AnyBuffer> q_out, Result<AnyBuffer> scales_out,
                             int64_t block_size, bool stochastic) {
  return RingHopInt8At("jaxring_ring_hop_int8_at", pool, q, scales, base, offset, &seed,
                       *new_partial, &*q_out, &*scales_out, block_size, stochastic);
}

ffi::Error RingHopInt8LastAtImpl(ffi::ThreadPool pool, AnyBuffer q, AnyBuffer scales,
                                 AnyBuffer base, AnyBuffer offset, Result<AnyBuffer> new_partial,
                                 int64_t block_size) {
  return RingHopInt8At("jaxring_ring_hop_int8_last_at", pool, q, scales, base, offset, nullptr,
                       *new_partial, nullptr, nullptr, block_size, false);
}

ffi::Error RingHopCastAt(std::string_view op, ffi::ThreadPool& pool, const AnyBuffer& recv,
                         const AnyBuffer& base, const AnyBuffer& offset,
                         const AnyBuffer& new_partial, const AnyBuffer* out) {
  RowLayout l;
  JR_RETURN_IF_ERROR(PlanRingHopCast(op, recv, nullptr, new_partial, out, &l));
  if (l.rows != 1)
    return InvalidArgument(op, "recv must be flat, got shape ", DimsString(recv.dimensions()));
  const float* partial;
  JR_RETURN_IF_ERROR(Window(op, base, offset, l.cols, &partial));
  RingHopCastRows(pool, recv, partial, l.cols, new_partial, out);
  return ffi::Error::Success();
}

ffi::Error RingHopCastAtImpl(ffi::ThreadPool pool, AnyBuffer recv, AnyBuffer base,
                             AnyBuffer offset, Result<AnyBuffer> new_partial,
                             Result<AnyBuffer> out) {
  return RingHopCastAt("jaxring_ring_hop_cast_at", pool, recv, base, offset, *new_partial, &*out);
}

ffi::Error RingHopCastLastAtImpl(ffi::ThreadPool pool, AnyBuffer recv, AnyBuffer base,
                                 AnyBuffer offset, Result<AnyBuffer> new_partial) {
  return RingHopCastAt("jaxring_ring_hop_cast_last_at", pool, recv, base, offset, *new_partial,
                       nullptr);
}

ffi::Error ChunkNormsImpl(ffi::ThreadPool pool, AnyBuffer x, Result<AnyBuffer> norms,
                          int64_t chunk_size) {
  ChunkPlan p;
  JR_RETURN_IF_ERROR(PlanChunkNorms("jaxring_chunk_norms", x, *norms, chunk_size, &p));
  const auto* xd = reinterpret_cast<const float*>(x.untyped_data());
  auto* nd = reinterpret_cast<float*>(norms->untyped_data());
  const int64_t n = p.layout.cols;
  for (int64_t r = 0; r < p.layout.rows; ++r)
    ParallelFor(pool, p.chunks, n * 4, [&](int64_t c0, int64_t c1) {
      cpu::ChunkNormsRange(xd + r * n, n, p.chunk, c0, c1, nd + r * p.chunks);
    });
  return ffi::Error::Success();
}

ffi::Error CheckIndices(std::string_view op, const ChunkPlan& p, const int32_t* idx) {
  for (int64_t i = 0; i < p.layout.rows * p.k; ++i)
    if (idx[i] < 0 || idx[i] >= p.chunks)
      return InvalidArgument(op, "idx[", i, "] = ", idx[i], " is out of range: x has ", p.chunks,
                             " chunks of ", p.chunk, " elements");
  return ffi::Error::Success();
}

ffi::Error GatherChunksImpl(ffi::ThreadPool pool, AnyBuffer x, AnyBuffer idx,
                            Result<AnyBuffer> out, int64_t chunk_size) {
  constexpr std::string_view op = "jaxring_gather_chunks";
  ChunkPlan p;
  JR_RETURN_IF_ERROR(PlanGather(op, x, idx, *out, chunk_size, &p));
  const auto* id = reinterpret_cast<const int32_t*>(idx.untyped_data());
  JR_RETURN_IF_ERROR(CheckIndices(op, p, id));
  const size_t w = ffi::ByteWidth(x.element_type());
  const auto* xd = reinterpret_cast<const char*>(x.untyped_data());
  auto* od = reinterpret_cast<char*>(out->untyped_data());
  const int64_t n = p.layout.cols, packed = p.k * p.chunk;
  for (int64_t r = 0; r < p.layout.rows; ++r)
    ParallelFor(pool, p.k, 2 * packed * static_cast<int64_t>(w), [&](int64_t j0, int64_t j1) {
      cpu::GatherChunksRange(xd + r * n * w, n, id + r * p.k, p.chunk, w, j0, j1,
                             od + r * packed * w);
    });
  return ffi::Error::Success();
}

// The result aliases x (input_output_aliases={0: 0}), so normally no copy is made; XLA inserts
// one itself when x is still live.
ffi::Error ScatterAddChunksImpl(AnyBuffer x, AnyBuffer idx, AnyBuffer packed,
                                Result<AnyBuffer> out, int64_t chunk_size) {
  constexpr std::string_view op = "jaxring_scatter_add_chunks";
  ChunkPlan p;
  JR_RETURN_IF_ERROR(PlanScatterAdd(op, x, idx, packed, *out, chunk_size, &p));
  const auto* id = reinterpret_cast<const int32_t*>(idx.untyped_data());
  JR_RETURN_IF_ERROR(CheckIndices(op, p, id));
  auto* od = reinterpret_cast<float*>(out->untyped_data());
  if (out->untyped_data() != x.untyped_data())
    std::memcpy(od, x.untyped_data(), x.size_bytes());
  const auto* pd = reinterpret_cast<const float*>(packed.untyped_data());
  const int64_t n = p.layout.cols, np = p.k * p.chunk;
  for (int64_t r = 0; r < p.layout.rows; ++r)
    cpu::ScatterAddChunks(id + r * p.k, p.k, pd + r * np, n, p.chunk, od + r * n);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxring

namespace ffi = xla::ffi;

// One symbol per target: jaxring::<name>Impl behind its binding (bindings.h), with XLA's intra-op
// thread pool as context (scatter_add_chunks runs on the calling thread and takes none).
#define JAXRING_CPU_HANDLER(name, ctx)                                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Jaxring##name##Cpu, jaxring::name##Impl,        \
                                jaxring::bindings::name<ctx>());

JAXRING_CPU_HANDLER(QuantizeInt8, ffi::ThreadPool)
JAXRING_CPU_HANDLER(DequantizeInt8, ffi::ThreadPool)
JAXRING_CPU_HANDLER(RingHopInt8, ffi::ThreadPool)
JAXRING_CPU_HANDLER(RingHopInt8Last, ffi::ThreadPool)
JAXRING_CPU_HANDLER(RingHopCast, ffi::ThreadPool)
JAXRING_CPU_HANDLER(RingHopCastLast, ffi::ThreadPool)
JAXRING_CPU_HANDLER(ChunkNorms, ffi::ThreadPool)
JAXRING_CPU_HANDLER(GatherChunks, ffi::ThreadPool)
JAXRING_CPU_HANDLER(ScatterAddChunks, void)
JAXRING_CPU_HANDLER(QuantizeInt8At, ffi::ThreadPool)
JAXRING_CPU_HANDLER(RingHopInt8At, ffi::ThreadPool)
JAXRING_CPU_HANDLER(RingHopInt8LastAt, ffi::ThreadPool)
JAXRING_CPU_HANDLER(RingHopCastAt, ffi::ThreadPool)
JAXRING_CPU_HANDLER(RingHopCastLastAt, ffi::ThreadPool)
