// Per-target operand checks, shared by the CPU and CUDA handlers so that both reject the same
// inputs with the same messages. Each returns the loop bounds the kernels need.
#ifndef JAXRING_XLA_EXT_PLANS_H_
#define JAXRING_XLA_EXT_PLANS_H_

#include <cstdint>

#include "checks.h"

namespace jaxring {

inline ffi::Error PlanQuantize(std::string_view op, const ffi::AnyBuffer& x,
                               const ffi::AnyBuffer& seed, const ffi::AnyBuffer& q,
                               const ffi::AnyBuffer& scales, int64_t block_size, BlockPlan* p) {
  JR_RETURN_IF_ERROR(PlanBlocks(op, "x", x, kFloatTypes, block_size, p));
  JR_RETURN_IF_ERROR(CheckOperand(op, "seed", seed, ffi::DataType::U32, "x", x, -1));
  JR_RETURN_IF_ERROR(CheckOperand(op, "q (result)", q, ffi::DataType::S8, "x", x, p->layout.cols));
  return CheckOperand(op, "scales (result)", scales, ffi::DataType::F32, "x", x, p->blocks);
}

inline ffi::Error PlanDequantize(std::string_view op, const ffi::AnyBuffer& q,
                                 const ffi::AnyBuffer& scales, const ffi::AnyBuffer& out,
                                 int64_t block_size, BlockPlan* p) {
  JR_RETURN_IF_ERROR(PlanBlocks(op, "q", q, {ffi::DataType::S8}, block_size, p));
  JR_RETURN_IF_ERROR(CheckOperand(op, "scales", scales, ffi::DataType::F32, "q", q, p->blocks));
  JR_RETURN_IF_ERROR(CheckDType(op, "the result", out.element_type(), kFloatTypes));
  return CheckShapeLike(op, "the result", out.dimensions(), "q", q.dimensions(), p->layout.cols);
}

// Encoded outputs (q_out, scales_out) are null for the last hop, which only accumulates;
// partial is null for a windowed call (cpu_handlers.cc), which checks its window instead.
inline ffi::Error PlanRingHopInt8(std::string_view op, const ffi::AnyBuffer& q,
                                  const ffi::AnyBuffer& scales, const ffi::AnyBuffer* partial,
                                  const ffi::AnyBuffer* seed, const ffi::AnyBuffer& new_partial,
                                  const ffi::AnyBuffer* q_out, const ffi::AnyBuffer* scales_out,
                                  int64_t block_size, BlockPlan* p) {
  JR_RETURN_IF_ERROR(PlanBlocks(op, "q", q, {ffi::DataType::S8}, block_size, p));
  const int64_t n = p->layout.cols;
  JR_RETURN_IF_ERROR(CheckOperand(op, "scales", scales, ffi::DataType::F32, "q", q, p->blocks));
  if (partial)
    JR_RETURN_IF_ERROR(CheckOperand(op, "partial", *partial, ffi::DataType::F32, "q", q, n));
  JR_RETURN_IF_ERROR(
      CheckOperand(op, "new_partial (result)", new_partial, ffi::DataType::F32, "q", q, n));
  if (seed) JR_RETURN_IF_ERROR(CheckOperand(op, "seed", *seed, ffi::DataType::U32, "q", q, -1));
  if (q_out)
    JR_RETURN_IF_ERROR(CheckOperand(op, "q_out (result)", *q_out, ffi::DataType::S8, "q", q, n));
  if (scales_out)
    JR_RETURN_IF_ERROR(CheckOperand(op, "scales_out (result)", *scales_out, ffi::DataType::F32,
                                    "q", q, p->blocks));
  return ffi::Error::Success();
}

inline ffi::Error PlanRingHopCast(std::string_view op, const ffi::AnyBuffer& recv,
                                  const ffi::AnyBuffer* partial, const ffi::AnyBuffer& new_partial,
                                  const ffi::AnyBuffer* out, RowLayout* layout) {
  JR_RETURN_IF_ERROR(CheckDType(op, "recv", recv.element_type(), kFloatTypes));
  JR_RETURN_IF_ERROR(CheckRows(op, "recv", recv.dimensions(), layout));
  const int64_t n = layout->cols;
  if (partial)
    JR_RETURN_IF_ERROR(
        CheckOperand(op, "partial", *partial, ffi::DataType::F32, "recv", recv, n));
  JR_RETURN_IF_ERROR(
      CheckOperand(op, "new_partial (result)", new_partial, ffi::DataType::F32, "recv", recv, n));
  if (out)
    JR_RETURN_IF_ERROR(
        CheckOperand(op, "out (result)", *out, recv.element_type(), "recv", recv, n));
  return ffi::Error::Success();
}

// --- fp4: packed codes (uint8, ceil(n / 2) a row), even block sizes ---------------------------

inline int64_t Fp4Bytes(int64_t n) { return (n + 1) / 2; }

// Blocks of the fp4 codec start on a byte: a block of odd size would share one with the next.
inline ffi::Error PlanFp4Blocks(std::string_view op, const char* data_arg,
                                const ffi::AnyBuffer& data,
                                std::initializer_list<ffi::DataType> data_types,
                                int64_t block_size, BlockPlan* p) {
  JR_RETURN_IF_ERROR(PlanBlocks(op, data_arg, data, data_types, block_size, p));
  if (block_size % 2 != 0)
    return InvalidArgument(op, "block_size must be even (two codes a byte), got ", block_size);
  return ffi::Error::Success();
}

inline ffi::Error PlanQuantizeFp4(std::string_view op, const ffi::AnyBuffer& x,
                                  const ffi::AnyBuffer& seed, const ffi::AnyBuffer& q,
                                  const ffi::AnyBuffer& scales, int64_t block_size, BlockPlan* p) {
  JR_RETURN_IF_ERROR(PlanFp4Blocks(op, "x", x, kFloatTypes, block_size, p));
  JR_RETURN_IF_ERROR(CheckOperand(op, "seed", seed, ffi::DataType::U32, "x", x, -1));
  JR_RETURN_IF_ERROR(
      CheckOperand(op, "q (result)", q, ffi::DataType::U8, "x", x, Fp4Bytes(p->layout.cols)));
  return CheckOperand(op, "scales (result)", scales, ffi::DataType::F32, "x", x, p->blocks);
}

// The values' count is the result's (the packed codes hold a padding nibble after an odd count).
inline ffi::Error PlanDequantizeFp4(std::string_view op, const ffi::AnyBuffer& q,
                                    const ffi::AnyBuffer& scales, const ffi::AnyBuffer& out,
                                    int64_t block_size, BlockPlan* p) {
  JR_RETURN_IF_ERROR(PlanFp4Blocks(op, "the result", out, kFloatTypes, block_size, p));
  JR_RETURN_IF_ERROR(
      CheckOperand(op, "q", q, ffi::DataType::U8, "the result", out, Fp4Bytes(p->layout.cols)));
  return CheckOperand(op, "scales", scales, ffi::DataType::F32, "the result", out, p->blocks);
}

// As PlanRingHopInt8, the values' count read from new_partial.
inline ffi::Error PlanRingHopFp4(std::string_view op, const ffi::AnyBuffer& q,
                                 const ffi::AnyBuffer& scales, const ffi::AnyBuffer* partial,
                                 const ffi::AnyBuffer* seed, const ffi::AnyBuffer& new_partial,
                                 const ffi::AnyBuffer* q_out, const ffi::AnyBuffer* scales_out,
                                 int64_t block_size, BlockPlan* p) {
  constexpr const char* ref = "new_partial (result)";
  JR_RETURN_IF_ERROR(PlanFp4Blocks(op, ref, new_partial, {ffi::DataType::F32}, block_size, p));
  const int64_t n = p->layout.cols, bytes = Fp4Bytes(n);
  JR_RETURN_IF_ERROR(CheckOperand(op, "q", q, ffi::DataType::U8, ref, new_partial, bytes));
  JR_RETURN_IF_ERROR(
      CheckOperand(op, "scales", scales, ffi::DataType::F32, ref, new_partial, p->blocks));
  if (partial)
    JR_RETURN_IF_ERROR(
        CheckOperand(op, "partial", *partial, ffi::DataType::F32, ref, new_partial, n));
  if (seed)
    JR_RETURN_IF_ERROR(CheckOperand(op, "seed", *seed, ffi::DataType::U32, ref, new_partial, -1));
  if (q_out)
    JR_RETURN_IF_ERROR(
        CheckOperand(op, "q_out (result)", *q_out, ffi::DataType::U8, ref, new_partial, bytes));
  if (scales_out)
    JR_RETURN_IF_ERROR(CheckOperand(op, "scales_out (result)", *scales_out, ffi::DataType::F32,
                                    ref, new_partial, p->blocks));
  return ffi::Error::Success();
}

struct ChunkPlan {
  RowLayout layout;    // rows x n of the flat buffer
  int64_t chunk = 0;   // chunk size
  int64_t chunks = 0;  // chunks per row, ceil(n / chunk)
  int64_t k = 0;       // selected chunks per row (gather / scatter-add)
};

inline ffi::Error PlanChunkNorms(std::string_view op, const ffi::AnyBuffer& x,
                                 const ffi::AnyBuffer& norms, int64_t chunk_size, ChunkPlan* p) {
  JR_RETURN_IF_ERROR(CheckPositive(op, "chunk_size", chunk_size));
  JR_RETURN_IF_ERROR(CheckDType(op, "x", x.element_type(), {ffi::DataType::F32}));
  JR_RETURN_IF_ERROR(CheckRows(op, "x", x.dimensions(), &p->layout));
  p->chunk = chunk_size;
  p->chunks = CeilDiv(p->layout.cols, chunk_size);
  return CheckOperand(op, "norms (result)", norms, ffi::DataType::F32, "x", x, p->chunks);
}

inline ffi::Error PlanChunkIndex(std::string_view op, const ffi::AnyBuffer& x,
                                 const ffi::AnyBuffer& idx, int64_t chunk_size, ChunkPlan* p) {
  JR_RETURN_IF_ERROR(CheckPositive(op, "chunk_size", chunk_size));
  JR_RETURN_IF_ERROR(CheckRows(op, "x", x.dimensions(), &p->layout));
  JR_RETURN_IF_ERROR(CheckDType(op, "idx", idx.element_type(), {ffi::DataType::S32}));
  RowLayout idx_layout;
  JR_RETURN_IF_ERROR(CheckRows(op, "idx", idx.dimensions(), &idx_layout));
  JR_RETURN_IF_ERROR(
      CheckShapeLike(op, "idx", idx.dimensions(), "x", x.dimensions(), idx_layout.cols));
  p->chunk = chunk_size;
  p->chunks = CeilDiv(p->layout.cols, chunk_size);
  p->k = idx_layout.cols;
  return ffi::Error::Success();
}

inline ffi::Error PlanGather(std::string_view op, const ffi::AnyBuffer& x,
                             const ffi::AnyBuffer& idx,
                             const ffi::AnyBuffer& out, int64_t chunk_size, ChunkPlan* p) {
  JR_RETURN_IF_ERROR(CheckDType(op, "x", x.element_type(),
                                {ffi::DataType::F32, ffi::DataType::BF16, ffi::DataType::F16,
                                 ffi::DataType::S8}));
  JR_RETURN_IF_ERROR(PlanChunkIndex(op, x, idx, chunk_size, p));
  return CheckOperand(op, "the result", out, x.element_type(), "x", x, p->k * p->chunk);
}

inline ffi::Error PlanScatterAdd(std::string_view op, const ffi::AnyBuffer& x,
                                 const ffi::AnyBuffer& idx, const ffi::AnyBuffer& packed,
                                 const ffi::AnyBuffer& out, int64_t chunk_size, ChunkPlan* p) {
  JR_RETURN_IF_ERROR(CheckDType(op, "x", x.element_type(), {ffi::DataType::F32}));
  JR_RETURN_IF_ERROR(PlanChunkIndex(op, x, idx, chunk_size, p));
  JR_RETURN_IF_ERROR(
      CheckOperand(op, "packed", packed, ffi::DataType::F32, "x", x, p->k * p->chunk));
  return CheckOperand(op, "the result", out, ffi::DataType::F32, "x", x, p->layout.cols);
}

}  // namespace jaxring

#endif  // JAXRING_XLA_EXT_PLANS_H_
