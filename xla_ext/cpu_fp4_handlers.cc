// XLA FFI handlers of the fp4 codec on the CPU, as cpu_handlers.cc's int8 ones: operand checks
// (plans.h), then the plain kernels (cpu_fp4.h) over every row, the windowed targets reading the
// ring's local chunk in place.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "bindings.h"
#include "cpu_fp4.h"
#include "cpu_rows.h"
#include "cpu_stream.h"
#include "handlers.h"
#include "plans.h"
#include "xla/ffi/api/ffi.h"

namespace jaxring {
namespace {

using ffi::AnyBuffer;
using ffi::DataType;
using ffi::Result;

// Bytes one element moves through a kernel: its value of `width` bytes and half a byte of code.
int64_t PassBytes(int64_t n, int64_t width) { return n * width + Fp4Bytes(n); }

// `x`: the rows' values of type `type`, contiguous (a buffer's, or a windowed call's chunk).
void QuantizeFp4Rows(ffi::ThreadPool& pool, const BlockPlan& p, DataType type, const void* x,
                     const AnyBuffer& seed, const AnyBuffer& q, const AnyBuffer& scales,
                     bool stochastic) {
  const cpu::Wire wire = WireOf(type);
  const int64_t n = p.layout.cols, width = ffi::ByteWidth(type), bytes = Fp4Bytes(n);
  for (int64_t r = 0; r < p.layout.rows; ++r) {
    const uint32_t key = RowKey(seed, r);
    ParallelFor(pool, p.blocks, PassBytes(n, width), [&](int64_t b0, int64_t b1) {
      cpu::QuantizeFp4Blocks(wire, static_cast<const char*>(x) + r * n * width, n, p.block, b0,
                             b1, stochastic, key, Data<uint8_t>(q) + r * bytes,
                             Data<float>(scales) + r * p.blocks);
    });
  }
}

ffi::Error QuantizeFp4Impl(ffi::ThreadPool pool, AnyBuffer x, AnyBuffer seed, Result<AnyBuffer> q,
                           Result<AnyBuffer> scales, int64_t block_size, bool stochastic) {
  BlockPlan p;
  JR_RETURN_IF_ERROR(PlanQuantizeFp4("jaxring_quantize_fp4", x, seed, *q, *scales, block_size, &p));
  QuantizeFp4Rows(pool, p, x.element_type(), x.untyped_data(), seed, *q, *scales, stochastic);
  return ffi::Error::Success();
}

// Blocks [b0, b1) of a row decoded to f32 through an L1 tile streamed to `out` (cpu_stream.h).
void DequantizeFp4Streamed(const uint8_t* q, const float* scales, int64_t n, int64_t bs,
                           int64_t b0, int64_t b1, float* out) {
  const int64_t per = std::max<int64_t>(1, cpu::kStreamTile / bs);
  std::vector<float> tile(per * bs);
  for (int64_t b = b0; b < b1; b += per) {
    const int64_t be = std::min(b1, b + per), start = b * bs;
    const int64_t cnt = std::min(n, be * bs) - start;
    cpu::DequantizeFp4Blocks(cpu::Wire::kF32, q + start / 2, scales + b, cnt, bs, 0, be - b,
                             tile.data());
    cpu::StreamBytes(out + start, tile.data(), cnt * static_cast<int64_t>(sizeof(float)));
  }
}

ffi::Error DequantizeFp4Impl(ffi::ThreadPool pool, AnyBuffer q, AnyBuffer scales,
                             Result<AnyBuffer> out, int64_t block_size) {
  BlockPlan p;
  JR_RETURN_IF_ERROR(PlanDequantizeFp4("jaxring_dequantize_fp4", q, scales, *out, block_size, &p));
  const cpu::Wire wire = WireOf(out->element_type());
  const int64_t n = p.layout.cols, width = ffi::ByteWidth(out->element_type());
  const int64_t bytes = Fp4Bytes(n);
  const bool stream = wire == cpu::Wire::kF32 && p.layout.rows * n * 4 >= cpu::kStreamMinBytes;
  for (int64_t r = 0; r < p.layout.rows; ++r)
    ParallelFor(pool, p.blocks, PassBytes(n, width), [&](int64_t b0, int64_t b1) {
      const uint8_t* qr = Data<const uint8_t>(q) + r * bytes;
      const float* sr = Data<const float>(scales) + r * p.blocks;
      if (stream) {
        DequantizeFp4Streamed(qr, sr, n, p.block, b0, b1, Data<float>(*out) + r * n);
      } else {
        cpu::DequantizeFp4Blocks(wire, qr, sr, n, p.block, b0, b1,
                                 Data<char>(*out) + r * n * width);
      }
    });
  if (stream) cpu::StreamFence();
  return ffi::Error::Success();
}

// `partial`: the rows' f32 partials, contiguous (a buffer's, or a windowed call's chunk).
void RingHopFp4Rows(ffi::ThreadPool& pool, const BlockPlan& p, const AnyBuffer& q,
                    const AnyBuffer& scales, const float* partial, const AnyBuffer* seed,
                    const AnyBuffer& new_partial, const AnyBuffer* q_out,
                    const AnyBuffer* scales_out, bool stochastic) {
  const int64_t n = p.layout.cols, nb = p.blocks, bytes = Fp4Bytes(n);
  for (int64_t r = 0; r < p.layout.rows; ++r) {
    const uint32_t key = seed ? RowKey(*seed, r) : 0;
    ParallelFor(pool, nb, PassBytes(n, 8) + (q_out ? PassBytes(n, 0) : 0),
                [&](int64_t b0, int64_t b1) {
      cpu::RingHopFp4Blocks(Data<const uint8_t>(q) + r * bytes,
                            Data<const float>(scales) + r * nb, partial + r * n, n, p.block, b0,
                            b1, stochastic, key, Data<float>(new_partial) + r * n,
                            q_out ? Data<uint8_t>(*q_out) + r * bytes : nullptr,
                            scales_out ? Data<float>(*scales_out) + r * nb : nullptr);
    });
  }
}

ffi::Error RingHopFp4Impl(ffi::ThreadPool pool, AnyBuffer q, AnyBuffer scales, AnyBuffer partial,
                          AnyBuffer seed, Result<AnyBuffer> new_partial, Result<AnyBuffer> q_out,
                          Result<AnyBuffer> scales_out, int64_t block_size, bool stochastic) {
  BlockPlan p;
  JR_RETURN_IF_ERROR(PlanRingHopFp4("jaxring_ring_hop_fp4", q, scales, &partial, &seed,
                                    *new_partial, &*q_out, &*scales_out, block_size, &p));
  RingHopFp4Rows(pool, p, q, scales, Data<const float>(partial), &seed, *new_partial, &*q_out,
                 &*scales_out, stochastic);
  return ffi::Error::Success();
}

ffi::Error RingHopFp4LastImpl(ffi::ThreadPool pool, AnyBuffer q, AnyBuffer scales,
                              AnyBuffer partial, Result<AnyBuffer> new_partial,
                              int64_t block_size) {
  BlockPlan p;
  JR_RETURN_IF_ERROR(PlanRingHopFp4("jaxring_ring_hop_fp4_last", q, scales, &partial, nullptr,
                                    *new_partial, nullptr, nullptr, block_size, &p));
  RingHopFp4Rows(pool, p, q, scales, Data<const float>(partial), nullptr, *new_partial, nullptr,
                 nullptr, false);
  return ffi::Error::Success();
}

// --- Windowed operands: the ring's local chunk read where it lies (cpu_rows.h, Window) ------

ffi::Error QuantizeFp4AtImpl(ffi::ThreadPool pool, AnyBuffer base, AnyBuffer offset,
                             AnyBuffer seed, Result<AnyBuffer> q, Result<AnyBuffer> scales,
                             int64_t block_size, bool stochastic) {
  constexpr std::string_view op = "jaxring_quantize_fp4_at";
  BlockPlan p;
  // The chunk's length is the scales' blocks and the codes' bytes: n = 2 bytes, or one less
  // when the last block is odd. The windowed targets serve the ring, whose chunks are whole
  // blocks of even size: n = 2 bytes.
  JR_RETURN_IF_ERROR(PlanFp4Blocks(op, "q (result)", *q, {DataType::U8}, block_size, &p));
  if (p.layout.rows != 1)
    return InvalidArgument(op, "q (result) must be flat, got shape ", DimsString(q->dimensions()));
  const int64_t n = 2 * p.layout.cols;
  p.layout.cols = n;
  p.blocks = CeilDiv(n, block_size);
  JR_RETURN_IF_ERROR(
      CheckOperand(op, "scales (result)", *scales, DataType::F32, "q (result)", *q, p.blocks));
  JR_RETURN_IF_ERROR(CheckOperand(op, "seed", seed, DataType::U32, "q (result)", *q, -1));
  const float* x;
  JR_RETURN_IF_ERROR(Window(op, base, offset, n, &x));
  QuantizeFp4Rows(pool, p, DataType::F32, x, seed, *q, *scales, stochastic);
  return ffi::Error::Success();
}

ffi::Error RingHopFp4At(std::string_view op, ffi::ThreadPool& pool, const AnyBuffer& q,
                        const AnyBuffer& scales, const AnyBuffer& base, const AnyBuffer& offset,
                        const AnyBuffer* seed, const AnyBuffer& new_partial,
                        const AnyBuffer* q_out, const AnyBuffer* scales_out, int64_t block_size,
                        bool stochastic) {
  BlockPlan p;
  JR_RETURN_IF_ERROR(PlanRingHopFp4(op, q, scales, nullptr, seed, new_partial, q_out, scales_out,
                                    block_size, &p));
  if (p.layout.rows != 1)
    return InvalidArgument(op, "new_partial (result) must be flat, got shape ",
                           DimsString(new_partial.dimensions()));
  const float* partial;
  JR_RETURN_IF_ERROR(Window(op, base, offset, p.layout.cols, &partial));
  RingHopFp4Rows(pool, p, q, scales, partial, seed, new_partial, q_out, scales_out, stochastic);
  return ffi::Error::Success();
}

ffi::Error RingHopFp4AtImpl(ffi::ThreadPool pool, AnyBuffer q, AnyBuffer scales, AnyBuffer base,
                            AnyBuffer offset, AnyBuffer seed, Result<AnyBuffer> new_partial,
                            Result<AnyBuffer> q_out, Result<AnyBuffer> scales_out,
                            int64_t block_size, bool stochastic) {
  return RingHopFp4At("jaxring_ring_hop_fp4_at", pool, q, scales, base, offset, &seed,
                      *new_partial, &*q_out, &*scales_out, block_size, stochastic);
}

ffi::Error RingHopFp4LastAtImpl(ffi::ThreadPool pool, AnyBuffer q, AnyBuffer scales,
                                AnyBuffer base, AnyBuffer offset, Result<AnyBuffer> new_partial,
                                int64_t block_size) {
  return RingHopFp4At("jaxring_ring_hop_fp4_last_at", pool, q, scales, base, offset, nullptr,
                      *new_partial, nullptr, nullptr, block_size, false);
}

}  // namespace
}  // namespace jaxring

namespace ffi = xla::ffi;

#define JAXRING_CPU_HANDLER(name)                                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Jaxring##name##Cpu, jaxring::name##Impl,       \
                                jaxring::bindings::name<ffi::ThreadPool>());

JAXRING_CPU_HANDLER(QuantizeFp4)
JAXRING_CPU_HANDLER(DequantizeFp4)
JAXRING_CPU_HANDLER(RingHopFp4)
JAXRING_CPU_HANDLER(RingHopFp4Last)
JAXRING_CPU_HANDLER(QuantizeFp4At)
JAXRING_CPU_HANDLER(RingHopFp4At)
JAXRING_CPU_HANDLER(RingHopFp4LastAt)
