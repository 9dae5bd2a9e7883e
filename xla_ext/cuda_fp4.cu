// XLA FFI handlers of the fp4 codec on the platform "CUDA": the CPU handlers' operand checks
// (plans.h), then the kernel of cuda_fp4.cuh for the operands' layout, on XLA's stream.
#include <cuda_runtime.h>

#include <cstdint>

#include "bindings.h"
#include "cuda_fp4.cuh"
#include "cuda_launch.h"
#include "handlers.h"
#include "plans.h"
#include "xla/ffi/api/ffi.h"

namespace jaxring {
namespace {

using ffi::AnyBuffer;
using ffi::Result;

constexpr int kFp4Vec = 8;  // elements per lane access on the vector path: 4 bytes of codes

// Whether a plan takes the vector path: every block of every row starts on a multiple of 8
// elements, and the buffers are aligned for the accesses.
bool Fp4Vector(const BlockPlan& p, const void* values, size_t width, const void* codes) {
  return p.layout.cols % kFp4Vec == 0 && p.block % kFp4Vec == 0 &&
         Aligned(values, width * kFp4Vec) && Aligned(codes, kFp4Vec / 2);
}

template <class C>
void LaunchQuantizeFp4(cudaStream_t st, const BlockPlan& p, const AnyBuffer& x,
                       const AnyBuffer& seed, bool stochastic, const AnyBuffer& q,
                       const AnyBuffer& scales) {
  using T = typename C::T;
  const T* xp = In<T>(x);
  uint8_t* qp = Out<uint8_t>(q);
  const int64_t grid = GridFor(p.layout.rows * p.blocks, kWarpsPerBlock);
  if (Fp4Vector(p, xp, sizeof(T), qp))
    QuantizeFp4Kernel<C, kFp4Vec><<<grid, kThreads, 0, st>>>(
        xp, In<uint32_t>(seed), p.layout.rows, p.layout.cols, p.block, p.blocks, stochastic, qp,
        Out<float>(scales));
  else
    QuantizeFp4Kernel<C, 2><<<grid, kThreads, 0, st>>>(
        xp, In<uint32_t>(seed), p.layout.rows, p.layout.cols, p.block, p.blocks, stochastic, qp,
        Out<float>(scales));
}

ffi::Error QuantizeFp4Cuda(cudaStream_t st, AnyBuffer x, AnyBuffer seed, Result<AnyBuffer> q,
                           Result<AnyBuffer> scales, int64_t block_size, bool stochastic) {
  constexpr std::string_view op = "jaxring_quantize_fp4";
  BlockPlan p;
  JR_RETURN_IF_ERROR(PlanQuantizeFp4(op, x, seed, *q, *scales, block_size, &p));
  if (p.layout.rows * p.blocks == 0) return ffi::Error::Success();
  JR_CUDA_DISPATCH_WIRE(x.element_type(), LaunchQuantizeFp4, st, p, x, seed, stochastic, *q,
                        *scales)
  return LaunchError(op);
}

template <class C>
void LaunchDequantizeFp4(cudaStream_t st, const BlockPlan& p, const AnyBuffer& q,
                         const AnyBuffer& scales, const AnyBuffer& out) {
  using T = typename C::T;
  const uint8_t* qp = In<uint8_t>(q);
  T* op = Out<T>(out);
  const int64_t grid = GridFor(p.layout.rows * p.blocks, kWarpsPerBlock);
  if (Fp4Vector(p, op, sizeof(T), qp))
    DequantizeFp4Kernel<C, kFp4Vec><<<grid, kThreads, 0, st>>>(
        qp, In<float>(scales), p.layout.rows, p.layout.cols, p.block, p.blocks, op);
  else
    DequantizeFp4Kernel<C, 2><<<grid, kThreads, 0, st>>>(
        qp, In<float>(scales), p.layout.rows, p.layout.cols, p.block, p.blocks, op);
}

ffi::Error DequantizeFp4Cuda(cudaStream_t st, AnyBuffer q, AnyBuffer scales,
                             Result<AnyBuffer> out, int64_t block_size) {
  constexpr std::string_view op = "jaxring_dequantize_fp4";
  BlockPlan p;
  JR_RETURN_IF_ERROR(PlanDequantizeFp4(op, q, scales, *out, block_size, &p));
  if (p.layout.rows * p.layout.cols == 0) return ffi::Error::Success();
  JR_CUDA_DISPATCH_WIRE(out->element_type(), LaunchDequantizeFp4, st, p, q, scales, *out)
  return LaunchError(op);
}

ffi::Error LaunchRingHopFp4(std::string_view op, cudaStream_t st, const BlockPlan& p,
                            const AnyBuffer& q, const AnyBuffer& scales, const AnyBuffer& partial,
                            const AnyBuffer* seed, const AnyBuffer& new_partial,
                            const AnyBuffer* q_out, const AnyBuffer* scales_out,
                            bool stochastic) {
  if (p.layout.rows * p.blocks == 0) return ffi::Error::Success();
  const uint8_t* qp = In<uint8_t>(q);
  const float* pp = In<float>(partial);
  float* np = Out<float>(new_partial);
  uint8_t* qo = q_out ? Out<uint8_t>(*q_out) : nullptr;
  const uint32_t* sp = seed ? In<uint32_t>(*seed) : nullptr;
  float* so = scales_out ? Out<float>(*scales_out) : nullptr;
  const int64_t grid = GridFor(p.layout.rows * p.blocks, kWarpsPerBlock);
  if (Fp4Vector(p, pp, sizeof(float), qp) && Aligned(np, sizeof(float) * kFp4Vec) &&
      Aligned(qo, kFp4Vec / 2))
    RingHopFp4Kernel<kFp4Vec><<<grid, kThreads, 0, st>>>(
        qp, In<float>(scales), pp, sp, p.layout.rows, p.layout.cols, p.block, p.blocks,
        stochastic, np, qo, so);
  else
    RingHopFp4Kernel<2><<<grid, kThreads, 0, st>>>(qp, In<float>(scales), pp, sp, p.layout.rows,
                                                   p.layout.cols, p.block, p.blocks, stochastic,
                                                   np, qo, so);
  return LaunchError(op);
}

ffi::Error RingHopFp4Cuda(cudaStream_t st, AnyBuffer q, AnyBuffer scales, AnyBuffer partial,
                          AnyBuffer seed, Result<AnyBuffer> new_partial, Result<AnyBuffer> q_out,
                          Result<AnyBuffer> scales_out, int64_t block_size, bool stochastic) {
  constexpr std::string_view op = "jaxring_ring_hop_fp4";
  BlockPlan p;
  JR_RETURN_IF_ERROR(PlanRingHopFp4(op, q, scales, &partial, &seed, *new_partial, &*q_out,
                                    &*scales_out, block_size, &p));
  return LaunchRingHopFp4(op, st, p, q, scales, partial, &seed, *new_partial, &*q_out,
                          &*scales_out, stochastic);
}

ffi::Error RingHopFp4LastCuda(cudaStream_t st, AnyBuffer q, AnyBuffer scales, AnyBuffer partial,
                              Result<AnyBuffer> new_partial, int64_t block_size) {
  constexpr std::string_view op = "jaxring_ring_hop_fp4_last";
  BlockPlan p;
  JR_RETURN_IF_ERROR(PlanRingHopFp4(op, q, scales, &partial, nullptr, *new_partial, nullptr,
                                    nullptr, block_size, &p));
  return LaunchRingHopFp4(op, st, p, q, scales, partial, nullptr, *new_partial, nullptr, nullptr,
                          false);
}

}  // namespace
}  // namespace jaxring

namespace ffi = xla::ffi;
using Stream = ffi::PlatformStream<cudaStream_t>;

#define JAXRING_CUDA_HANDLER(name)                                                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Jaxring##name##Cuda, jaxring::name##Cuda,              \
                                jaxring::bindings::name<Stream>(),                     \
                                {ffi::Traits::kCmdBufferCompatible});

JAXRING_CUDA_HANDLER(QuantizeFp4)
JAXRING_CUDA_HANDLER(DequantizeFp4)
JAXRING_CUDA_HANDLER(RingHopFp4)
JAXRING_CUDA_HANDLER(RingHopFp4Last)
