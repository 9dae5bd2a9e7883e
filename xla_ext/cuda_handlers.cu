// XLA FFI handlers of jaxring's targets on the platform "CUDA": the same operand checks
// (plans.h) as the CPU handlers, then the kernel of cuda_kernels.cuh for the operands' layout,
// launched on XLA's stream.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "bindings.h"
#include "cuda_kernels.cuh"
#include "cuda_launch.h"
#include "handlers.h"
#include "plans.h"
#include "xla/ffi/api/ffi.h"

namespace jaxring {
namespace {

using ffi::AnyBuffer;
using ffi::DataType;
using ffi::Result;

// Calls f(std::integral_constant<int, I>) with I in {1, 2, 4, 8}, the fewest lane accesses of
// V elements that cover a quantization block of `block` elements (at most 32 V kMaxIters).
template <typename F>
void WithIters(int64_t block, int v, F&& f) {
  const int64_t iters = (block + 32 * v - 1) / (32 * v);
  if (iters <= 1) f(std::integral_constant<int, 1>{});
  else if (iters <= 2) f(std::integral_constant<int, 2>{});
  else if (iters <= 4) f(std::integral_constant<int, 4>{});
  else f(std::integral_constant<int, 8>{});
}

// Whether a block plan can take the vector path with accesses of v elements: every block starts
// on a multiple of v (rows and blocks of a multiple of v) and, where `cached`, fits the register
// cache.
bool VectorBlocks(const BlockPlan& p, int v, bool cached) {
  return p.layout.cols % v == 0 && p.block % v == 0 &&
         (!cached || p.block <= int64_t{32} * v * kMaxIters);
}

// Quantization blocks a warp of the vector quantize kernel loads before reducing, where a block
// is one access per lane: JAXRING_CUDA_QUANTIZE_BLOCKS = 1 (default), 2 or 4, read at each
// launch so that `jaxring bench kernels` can time the settings side by side. More than one is
// the candidate remedy for bf16/f16 quantize at 0.65 of the H200's copy bandwidth
// (docs/benchmarks.md, "GPU (one H200)"); it becomes the default once measured faster.
int QuantizeBlocksPerWarp() {
  const char* v = std::getenv("JAXRING_CUDA_QUANTIZE_BLOCKS");
  return v == nullptr ? 1 : std::atoi(v);
}

template <class C>
void LaunchQuantize(cudaStream_t st, const BlockPlan& p, const AnyBuffer& x, const AnyBuffer& seed,
                    bool stochastic, const AnyBuffer& q, const AnyBuffer& scales) {
  using T = typename C::T;
  const T* xp = In<T>(x);
  int8_t* qp = Out<int8_t>(q);
  const int64_t grid = GridFor(p.layout.rows * p.blocks, kWarpsPerBlock);
  // 16-byte loads where the shape allows (8 elements of a 2-byte type), else 4 elements.
  auto vector = [&](auto v) {
    constexpr int V = decltype(v)::value;
    if (!VectorBlocks(p, V, true) || !Aligned(xp, sizeof(T) * V) || !Aligned(qp, V)) return false;
    WithIters(p.block, V, [&](auto iters) {
      constexpr int kIters = decltype(iters)::value;
      const auto launch = [&](auto u) {
        constexpr int U = decltype(u)::value;
        QuantizeVecKernel<C, V, kIters, U>
            <<<GridFor(p.layout.rows * p.blocks, int64_t{kWarpsPerBlock} * U), kThreads, 0, st>>>(
                xp, In<uint32_t>(seed), p.layout.rows, p.layout.cols, p.block, p.blocks,
                stochastic, qp, Out<float>(scales));
      };
      // blocks of one access per lane may take several a warp (QuantizeBlocksPerWarp)
      const int u = kIters == 1 ? QuantizeBlocksPerWarp() : 1;
      if (u >= 4) launch(std::integral_constant<int, 4>{});
      else if (u == 2) launch(std::integral_constant<int, 2>{});
      else launch(std::integral_constant<int, 1>{});
    });
    return true;
  };
  if (vector(std::integral_constant<int, VecOf<C>()>{})) return;
  if (VecOf<C>() != kVec && vector(std::integral_constant<int, kVec>{})) return;
  QuantizeKernel<C><<<grid, kThreads, 0, st>>>(xp, In<uint32_t>(seed), p.layout.rows,
                                               p.layout.cols, p.block, p.blocks, stochastic, qp,
                                               Out<float>(scales));
}

ffi::Error QuantizeInt8Cuda(cudaStream_t st, AnyBuffer x, AnyBuffer seed, Result<AnyBuffer> q,
                            Result<AnyBuffer> scales, int64_t block_size, bool stochastic) {
  constexpr std::string_view op = "jaxring_quantize_int8";
  BlockPlan p;
  JR_RETURN_IF_ERROR(PlanQuantize(op, x, seed, *q, *scales, block_size, &p));
  if (p.layout.rows * p.blocks == 0) return ffi::Error::Success();
  JR_CUDA_DISPATCH_WIRE(x.element_type(), LaunchQuantize, st, p, x, seed, stochastic, *q, *scales)
  return LaunchError(op);
}

template <class C>
void LaunchDequantize(cudaStream_t st, const BlockPlan& p, const AnyBuffer& q,
                      const AnyBuffer& scales, const AnyBuffer& out) {
  using T = typename C::T;
  const int8_t* qp = In<int8_t>(q);
  T* op = Out<T>(out);
  // Flat path: 16 codes per thread, as 4 accesses of 4 (f32) or 2 of 8 (2-byte outputs), each
  // store 16 bytes.
  constexpr int kFlatV = sizeof(T) == 4 ? 4 : 8, kFlatU = 16 / kFlatV;
  const int64_t block = p.block, total = p.layout.rows * p.layout.cols;
  if ((block & (block - 1)) == 0 && block % kFlatV == 0 && total % kFlatV == 0 &&
      (p.layout.rows == 1 || p.layout.cols % block == 0) && Aligned(qp, kFlatV) &&
      Aligned(op, sizeof(T) * kFlatV)) {
    const int64_t nvec = total / kFlatV;
    DequantizeFlatKernel<C, kFlatV, kFlatU><<<GridFor(nvec, kThreads * kFlatU), kThreads, 0, st>>>(
        qp, In<float>(scales), nvec, __builtin_ctzll(block), op);
    return;
  }
  const int64_t grid = GridFor(p.layout.rows * p.blocks, kWarpsPerBlock);
  // Otherwise one warp per quantization block. 2-byte outputs: 8 codes per lane access (an 8-byte load, a 16-byte store). f32 stays at 4
  // codes (one 16-byte store): on an H100 the 8-code f32 variant measured 159 us against 124 us
  // for 64 M elements, its two stores per lane halving the warps in flight.
  if (sizeof(T) == 2 && VectorBlocks(p, 8, false) && Aligned(qp, 8) && Aligned(op, sizeof(T) * 8))
    DequantizeKernel<C, 8><<<grid, kThreads, 0, st>>>(
        qp, In<float>(scales), p.layout.rows, p.layout.cols, p.block, p.blocks, op);
  else if (VectorBlocks(p, kVec, false) && Aligned(qp, kVec) && Aligned(op, sizeof(T) * kVec))
    DequantizeKernel<C, kVec><<<grid, kThreads, 0, st>>>(
        qp, In<float>(scales), p.layout.rows, p.layout.cols, p.block, p.blocks, op);
  else
    DequantizeKernel<C, 1><<<grid, kThreads, 0, st>>>(
        qp, In<float>(scales), p.layout.rows, p.layout.cols, p.block, p.blocks, op);
}

ffi::Error DequantizeInt8Cuda(cudaStream_t st, AnyBuffer q, AnyBuffer scales,
                              Result<AnyBuffer> out, int64_t block_size) {
  constexpr std::string_view op = "jaxring_dequantize_int8";
  BlockPlan p;
  JR_RETURN_IF_ERROR(PlanDequantize(op, q, scales, *out, block_size, &p));
  if (p.layout.rows * p.layout.cols == 0) return ffi::Error::Success();
  JR_CUDA_DISPATCH_WIRE(out->element_type(), LaunchDequantize, st, p, q, scales, *out)
  return LaunchError(op);
}

ffi::Error LaunchRingHopInt8(std::string_view op, cudaStream_t st, const BlockPlan& p,
                             const AnyBuffer& q, const AnyBuffer& scales, const AnyBuffer& partial,
                             const AnyBuffer* seed, const AnyBuffer& new_partial,
                             const AnyBuffer* q_out, const AnyBuffer* scales_out, bool stochastic) {
  if (p.layout.rows * p.blocks == 0) return ffi::Error::Success();
  const int8_t* qp = In<int8_t>(q);
  const float* pp = In<float>(partial);
  float* np = Out<float>(new_partial);
  int8_t* qo = q_out ? Out<int8_t>(*q_out) : nullptr;
  const uint32_t* sp = seed ? In<uint32_t>(*seed) : nullptr;
  float* so = scales_out ? Out<float>(*scales_out) : nullptr;
  const int64_t grid = GridFor(p.layout.rows * p.blocks, kWarpsPerBlock);
  if (VectorBlocks(p, kVec, true) && Aligned(qp, kVec) && Aligned(pp, 16) && Aligned(np, 16) &&
      Aligned(qo, kVec)) {
    WithIters(p.block, kVec, [&](auto iters) {
      RingHopInt8VecKernel<decltype(iters)::value><<<grid, kThreads, 0, st>>>(
          qp, In<float>(scales), pp, sp, p.layout.rows, p.layout.cols, p.block, p.blocks,
          stochastic, np, qo, so);
    });
  } else {
    RingHopInt8Kernel<<<grid, kThreads, 0, st>>>(qp, In<float>(scales), pp, sp, p.layout.rows,
                                                  p.layout.cols, p.block, p.blocks, stochastic,
                                                  np, qo, so);
  }
  return LaunchError(op);
}

ffi::Error RingHopInt8Cuda(cudaStream_t st, AnyBuffer q, AnyBuffer scales, AnyBuffer partial,
                           AnyBuffer seed, Result<AnyBuffer> new_partial, Result<AnyBuffer> q_out,
                           Result<AnyBuffer> scales_out, int64_t block_size, bool stochastic) {
  constexpr std::string_view op = "jaxring_ring_hop_int8";
  BlockPlan p;
  JR_RETURN_IF_ERROR(PlanRingHopInt8(op, q, scales, &partial, &seed, *new_partial, &*q_out,
                                     &*scales_out, block_size, &p));
  return LaunchRingHopInt8(op, st, p, q, scales, partial, &seed, *new_partial, &*q_out,
                           &*scales_out, stochastic);
}

ffi::Error RingHopInt8LastCuda(cudaStream_t st, AnyBuffer q, AnyBuffer scales, AnyBuffer partial,
                               Result<AnyBuffer> new_partial, int64_t block_size) {
  constexpr std::string_view op = "jaxring_ring_hop_int8_last";
  BlockPlan p;
  JR_RETURN_IF_ERROR(PlanRingHopInt8(op, q, scales, &partial, nullptr, *new_partial, nullptr,
                                     nullptr, block_size, &p));
  return LaunchRingHopInt8(op, st, p, q, scales, partial, nullptr, *new_partial, nullptr, nullptr,
                           false);
}

template <class C>
void LaunchRingHopCast(cudaStream_t st, int64_t total, const AnyBuffer& recv,
                       const AnyBuffer& partial, const AnyBuffer& new_partial,
                       const AnyBuffer* out) {
  using T = typename C::T;
  const T* rp = In<T>(recv);
  const float* pp = In<float>(partial);
  float* np = Out<float>(new_partial);
  T* op = out ? Out<T>(*out) : nullptr;
  if (Aligned(rp, sizeof(T) * kVec) && Aligned(pp, 16) && Aligned(np, 16) &&
      Aligned(op, sizeof(T) * kVec)) {
    const int64_t work = std::max(total / kVec, total % kVec);
    RingHopCastKernel<C, kVec><<<GridFor(work, kThreads), kThreads, 0, st>>>(rp, pp, total, np, op);
  } else {
    RingHopCastKernel<C, 1><<<GridFor(total, kThreads), kThreads, 0, st>>>(rp, pp, total, np, op);
  }
}

ffi::Error RingHopCast(std::string_view op, cudaStream_t st, const AnyBuffer& recv,
                       const AnyBuffer& partial, const AnyBuffer& new_partial,
                       const AnyBuffer* out) {
  RowLayout l;
  JR_RETURN_IF_ERROR(PlanRingHopCast(op, recv, &partial, new_partial, out, &l));
  const int64_t total = l.rows * l.cols;
  if (total == 0) return ffi::Error::Success();
  JR_CUDA_DISPATCH_WIRE(recv.element_type(), LaunchRingHopCast, st, total, recv, partial,
                        new_partial, out)
  return LaunchError(op);
}

ffi::Error RingHopCastCuda(cudaStream_t st, AnyBuffer recv, AnyBuffer partial,
                           Result<AnyBuffer> new_partial, Result<AnyBuffer> out) {
  return RingHopCast("jaxring_ring_hop_cast", st, recv, partial, *new_partial, &*out);
}

ffi::Error RingHopCastLastCuda(cudaStream_t st, AnyBuffer recv, AnyBuffer partial,
                               Result<AnyBuffer> new_partial) {
  return RingHopCast("jaxring_ring_hop_cast_last", st, recv, partial, *new_partial, nullptr);
}

ffi::Error ChunkNormsCuda(cudaStream_t st, AnyBuffer x, Result<AnyBuffer> norms,
                          int64_t chunk_size) {
  constexpr std::string_view op = "jaxring_chunk_norms";
  ChunkPlan p;
  JR_RETURN_IF_ERROR(PlanChunkNorms(op, x, *norms, chunk_size, &p));
  if (p.layout.rows * p.chunks == 0) return ffi::Error::Success();
  const float* xp = In<float>(x);
  const int64_t grid = GridFor(p.layout.rows * p.chunks, 1);
  if (p.layout.cols % kVec == 0 && p.chunk % kVec == 0 && Aligned(xp, 16))
    ChunkNormsKernel<kVec><<<grid, ThreadsForBlock(p.chunk / kVec), 0, st>>>(
        xp, p.layout.rows, p.layout.cols, p.chunk, p.chunks, Out<float>(*norms));
  else
    ChunkNormsKernel<1><<<grid, ThreadsForBlock(p.chunk), 0, st>>>(
        xp, p.layout.rows, p.layout.cols, p.chunk, p.chunks, Out<float>(*norms));
  return LaunchError(op);
}

// The chunk kernels' grid: selected (row, chunk) pairs by segments of kSegment elements.
dim3 ChunkGrid(const ChunkPlan& p) {
  return dim3(static_cast<unsigned>(GridFor(p.layout.rows * p.k, 1)),
              static_cast<unsigned>(std::min<int64_t>((p.chunk + kSegment - 1) / kSegment, 65535)));
}

template <typename I>
void LaunchGather(cudaStream_t st, const ChunkPlan& p, const AnyBuffer& x, const AnyBuffer& idx,
                  const AnyBuffer& out) {
  const I* xp = In<I>(x);
  I* op = Out<I>(out);
  const bool vec = (p.chunk * sizeof(I)) % 16 == 0 && (p.layout.cols * sizeof(I)) % 16 == 0 &&
                   Aligned(xp, 16) && Aligned(op, 16);
  GatherChunksKernel<I><<<ChunkGrid(p), ThreadsForBlock(std::min(p.chunk, kSegment)), 0, st>>>(
      xp, In<int32_t>(idx), p.layout.rows, p.layout.cols, p.k, p.chunk, p.chunks, vec, op);
}

ffi::Error GatherChunksCuda(cudaStream_t st, AnyBuffer x, AnyBuffer idx, Result<AnyBuffer> out,
                            int64_t chunk_size) {
  constexpr std::string_view op = "jaxring_gather_chunks";
  ChunkPlan p;
  JR_RETURN_IF_ERROR(PlanGather(op, x, idx, *out, chunk_size, &p));
  if (p.layout.rows * p.k * p.chunk == 0) return ffi::Error::Success();
  switch (ffi::ByteWidth(x.element_type())) {
    case 1: LaunchGather<uint8_t>(st, p, x, idx, *out); break;
    case 2: LaunchGather<uint16_t>(st, p, x, idx, *out); break;
    default: LaunchGather<uint32_t>(st, p, x, idx, *out); break;
  }
  return LaunchError(op);
}

ffi::Error ScatterAddChunksCuda(cudaStream_t st, AnyBuffer x, AnyBuffer idx, AnyBuffer packed,
                                Result<AnyBuffer> out, int64_t chunk_size) {
  constexpr std::string_view op = "jaxring_scatter_add_chunks";
  ChunkPlan p;
  JR_RETURN_IF_ERROR(PlanScatterAdd(op, x, idx, packed, *out, chunk_size, &p));
  if (out->untyped_data() != x.untyped_data() && x.size_bytes() > 0)
    cudaMemcpyAsync(out->untyped_data(), x.untyped_data(), x.size_bytes(),
                    cudaMemcpyDeviceToDevice, st);
  if (p.layout.rows * p.k * p.chunk > 0) {
    const float* pp = In<float>(packed);
    float* op = Out<float>(*out);
    const bool vec = p.chunk % kVec == 0 && p.layout.cols % kVec == 0 && Aligned(pp, 16) &&
                     Aligned(op, 16);
    ScatterAddChunksKernel<<<ChunkGrid(p), ThreadsForBlock(std::min(p.chunk, kSegment)), 0,
                             st>>>(In<int32_t>(idx), pp, p.layout.rows, p.layout.cols, p.k,
                                   p.chunk, p.chunks, vec, op);
  }
  return LaunchError(op);
}

}  // namespace
}  // namespace jaxring

namespace ffi = xla::ffi;
using Stream = ffi::PlatformStream<cudaStream_t>;

// One symbol per target: jaxring::<name>Cuda behind its binding (bindings.h), with the stream
// as context.
#define JAXRING_CUDA_HANDLER(name)                                                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Jaxring##name##Cuda, jaxring::name##Cuda,              \
                                jaxring::bindings::name<Stream>(),                     \
                                {ffi::Traits::kCmdBufferCompatible});

JAXRING_CUDA_HANDLER(QuantizeInt8)
JAXRING_CUDA_HANDLER(DequantizeInt8)
JAXRING_CUDA_HANDLER(RingHopInt8)
JAXRING_CUDA_HANDLER(RingHopInt8Last)
JAXRING_CUDA_HANDLER(RingHopCast)
JAXRING_CUDA_HANDLER(RingHopCastLast)
JAXRING_CUDA_HANDLER(ChunkNorms)
JAXRING_CUDA_HANDLER(GatherChunks)
JAXRING_CUDA_HANDLER(ScatterAddChunks)
