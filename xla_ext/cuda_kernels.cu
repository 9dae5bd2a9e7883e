// CUDA kernels and their XLA FFI handlers (platform "CUDA"). Same targets, operand checks
// (plans.h) and numerics (numerics.h) as the CPU handlers; built with --fmad=false so that every
// product is rounded before it is added, as on the CPU and in the jnp references.
//
// Differences from the CPU handlers, because a kernel cannot return an error without a
// device-to-host synchronization: out-of-range chunk indices are not reported; gather_chunks reads
// such a chunk as zeros and scatter_add_chunks skips it. Duplicate indices in scatter_add_chunks
// add up in an unspecified order (atomics).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

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

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = int64_t{1} << 20;  // grid-stride loops cover the rest

struct DF32 {
  using T = float;
  static __device__ __forceinline__ float Load(float v) { return v; }
  static __device__ __forceinline__ float Store(float v) { return v; }
};
struct DBf16 {
  using T = __nv_bfloat16;
  static __device__ __forceinline__ float Load(T v) { return __bfloat162float(v); }
  static __device__ __forceinline__ T Store(float v) { return __float2bfloat16_rn(v); }
};
struct DF16 {
  using T = __half;
  static __device__ __forceinline__ float Load(T v) { return __half2float(v); }
  static __device__ __forceinline__ T Store(float v) { return __float2half_rn(v); }
};

#define JR_CUDA_DISPATCH_WIRE(dtype, KERNEL, ...)                  \
  switch (dtype) {                                                 \
    case DataType::F32: KERNEL<DF32>(__VA_ARGS__); break;          \
    case DataType::BF16: KERNEL<DBf16>(__VA_ARGS__); break;        \
    default: KERNEL<DF16>(__VA_ARGS__); break;                     \
  }

int64_t GridFor(int64_t work, int64_t per_block) {
  return std::max<int64_t>(1, std::min<int64_t>((work + per_block - 1) / per_block, kMaxGrid));
}

int ThreadsForBlock(int64_t block) {
  return static_cast<int>(std::min<int64_t>(kThreads, (block + 31) / 32 * 32));
}

ffi::Error LaunchError(std::string_view op) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(op) + ": CUDA error: " + cudaGetErrorString(e));
}

__device__ double BlockSum(double v, double* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  double s = 0.0;
  for (int w = 0; w < (blockDim.x + 31) / 32; ++w) s += smem[w];
  __syncthreads();
  return s;
}

// The int8 family works one warp per quantization block: lanes read the block coalesced (lane
// l takes elements l, l + 32, ...), the block's abs-max is one warp reduction, and a thread block
// of kThreads covers kThreads / 32 quantization blocks. (One thread block per quantization block,
// with two __syncthreads per block, reached a quarter of an H100's DRAM bandwidth; XLA's fusion
// of the reference was twice as fast. docs/benchmarks.md.) Every lane reads back only elements it
// wrote itself, so no barrier is needed between a hop's decode and its encode.
constexpr int kWarpsPerBlock = kThreads / 32;

struct WarpSlot {
  int64_t index, count;  // this warp's first quantization block and the grid's warps
  int lane;
};

__device__ __forceinline__ WarpSlot Warp() {
  return {blockIdx.x * int64_t{kWarpsPerBlock} + (threadIdx.x >> 5),
          int64_t{gridDim.x} * kWarpsPerBlock, static_cast<int>(threadIdx.x & 31)};
}

// Encodes v[0..len) of one quantization block with the calling warp; returns the block's scale.
template <class C>
__device__ float WarpEncodeBlock(const typename C::T* v, int64_t len, int8_t* q, bool stochastic,
                                 uint32_t key, int64_t base, int lane) {
  uint32_t amax = 0;
  for (int64_t i = lane; i < len; i += 32) amax = max(amax, AbsBits(C::Load(v[i])));
  const BlockScale s = ScaleFromAmaxBits(__reduce_max_sync(0xffffffffu, amax));
  for (int64_t i = lane; i < len; i += 32) {
    int8_t code = 0;
    if (s.inv != 0.0f) {
      code = stochastic
                 ? StochasticCode(__fmul_rn(C::Load(v[i]), s.inv * 65536.0f),
                                  RandomBits16(WeylState(key, static_cast<uint32_t>(base + i))))
                 : RoundToCode(__fmul_rn(C::Load(v[i]), s.inv));
    }
    q[i] = code;
  }
  return s.scale;
}

template <class C>
__global__ void QuantizeKernel(const typename C::T* x, const uint32_t* seed, int64_t rows,
                               int64_t n, int64_t bs, int64_t nb, bool stochastic, int8_t* q,
                               float* scales) {
  const WarpSlot w = Warp();
  for (int64_t g = w.index; g < rows * nb; g += w.count) {
    const int64_t r = g / nb, start = (g % nb) * bs, len = min(bs, n - start);
    const float s = WarpEncodeBlock<C>(x + r * n + start, len, q + r * n + start, stochastic,
                                       SeedKey(seed[r]), start, w.lane);
    if (w.lane == 0) scales[g] = s;
  }
}

template <class C>
__global__ void DequantizeKernel(const int8_t* q, const float* scales, int64_t rows, int64_t n,
                                 int64_t bs, int64_t nb, typename C::T* out) {
  const WarpSlot w = Warp();
  for (int64_t g = w.index; g < rows * nb; g += w.count) {
    const int64_t r = g / nb, start = r * n + (g % nb) * bs, len = min(bs, n - (g % nb) * bs);
    const float s = scales[g];
    for (int64_t i = w.lane; i < len; i += 32)
      out[start + i] = C::Store(__fmul_rn(static_cast<float>(q[start + i]), s));
  }
}

// new_partial = decode(q) + partial for one quantization block per warp; then the block is
// encoded again from new_partial (the lane's own writes, read back from L1).
__global__ void RingHopInt8Kernel(const int8_t* q, const float* scales, const float* partial,
                                  const uint32_t* seed, int64_t rows, int64_t n, int64_t bs,
                                  int64_t nb, bool stochastic, float* new_partial, int8_t* q_out,
                                  float* scales_out) {
  const WarpSlot w = Warp();
  for (int64_t g = w.index; g < rows * nb; g += w.count) {
    const int64_t r = g / nb, start = r * n + (g % nb) * bs, len = min(bs, n - (g % nb) * bs);
    const float s = scales[g];
    for (int64_t i = w.lane; i < len; i += 32)
      new_partial[start + i] =
          __fadd_rn(__fmul_rn(static_cast<float>(q[start + i]), s), partial[start + i]);
    if (q_out == nullptr) continue;
    const float so = WarpEncodeBlock<DF32>(new_partial + start, len, q_out + start, stochastic,
                                           SeedKey(seed[r]), (g % nb) * bs, w.lane);
    if (w.lane == 0) scales_out[g] = so;
  }
}

template <class C>
__global__ void RingHopCastKernel(const typename C::T* recv, const float* partial, int64_t total,
                                  float* new_partial, typename C::T* out) {
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total;
       e += int64_t{gridDim.x} * blockDim.x) {
    const float v = __fadd_rn(C::Load(recv[e]), partial[e]);
    new_partial[e] = v;
    if (out) out[e] = C::Store(v);
  }
}

__global__ void ChunkNormsKernel(const float* x, int64_t rows, int64_t n, int64_t cs, int64_t nc,
                                 float* norms) {
  __shared__ double smem[32];
  for (int64_t g = blockIdx.x; g < rows * nc; g += gridDim.x) {
    const int64_t r = g / nc, start = (g % nc) * cs, len = min(cs, n - start);
    const float* xc = x + r * n + start;
    double acc = 0.0;
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      const double v = xc[i];
      acc = __dadd_rn(acc, __dmul_rn(v, v));
    }
    const double total = BlockSum(acc, smem);
    if (threadIdx.x == 0) norms[g] = static_cast<float>(sqrt(total));
  }
}

template <typename T>
__global__ void GatherChunksKernel(const T* x, const int32_t* idx, int64_t rows, int64_t n,
                                   int64_t k, int64_t cs, int64_t nc, T* out) {
  const int64_t total = rows * k * cs;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = e / (k * cs), j = (e / cs) % k, t = e % cs;
    const int64_t c = idx[r * k + j], i = c * cs + t;
    out[e] = (c >= 0 && c < nc && i < n) ? x[r * n + i] : T(0);
  }
}

__global__ void ScatterAddChunksKernel(const int32_t* idx, const float* packed, int64_t rows,
                                       int64_t n, int64_t k, int64_t cs, int64_t nc, float* out) {
  const int64_t total = rows * k * cs;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = e / (k * cs), j = (e / cs) % k, t = e % cs;
    const int64_t c = idx[r * k + j], i = c * cs + t;
    if (c >= 0 && c < nc && i < n) atomicAdd(out + r * n + i, packed[e]);
  }
}

template <typename T>
const T* In(const AnyBuffer& b) {
  return reinterpret_cast<const T*>(b.untyped_data());
}
template <typename T>
T* Out(const AnyBuffer& b) {
  return reinterpret_cast<T*>(b.untyped_data());
}

// --- handlers --------------------------------------------------------------------------------

template <class C>
void LaunchQuantize(cudaStream_t st, const BlockPlan& p, const AnyBuffer& x, const AnyBuffer& seed,
                    bool stochastic, const AnyBuffer& q, const AnyBuffer& scales) {
  QuantizeKernel<C><<<GridFor(p.layout.rows * p.blocks, kWarpsPerBlock), kThreads, 0, st>>>(
      In<typename C::T>(x), In<uint32_t>(seed), p.layout.rows, p.layout.cols, p.block, p.blocks,
      stochastic, Out<int8_t>(q), Out<float>(scales));
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
  DequantizeKernel<C><<<GridFor(p.layout.rows * p.blocks, kWarpsPerBlock), kThreads, 0, st>>>(
      In<int8_t>(q), In<float>(scales), p.layout.rows, p.layout.cols, p.block, p.blocks,
      Out<typename C::T>(out));
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
  RingHopInt8Kernel<<<GridFor(p.layout.rows * p.blocks, kWarpsPerBlock), kThreads, 0, st>>>(
      In<int8_t>(q), In<float>(scales), In<float>(partial), seed ? In<uint32_t>(*seed) : nullptr,
      p.layout.rows, p.layout.cols, p.block, p.blocks, stochastic, Out<float>(new_partial),
      q_out ? Out<int8_t>(*q_out) : nullptr, scales_out ? Out<float>(*scales_out) : nullptr);
  return LaunchError(op);
}

ffi::Error RingHopInt8Cuda(cudaStream_t st, AnyBuffer q, AnyBuffer scales, AnyBuffer partial,
                           AnyBuffer seed, Result<AnyBuffer> new_partial, Result<AnyBuffer> q_out,
                           Result<AnyBuffer> scales_out, int64_t block_size, bool stochastic) {
  constexpr std::string_view op = "jaxring_ring_hop_int8";
  BlockPlan p;
  JR_RETURN_IF_ERROR(PlanRingHopInt8(op, q, scales, partial, &seed, *new_partial, &*q_out,
                                     &*scales_out, block_size, &p));
  return LaunchRingHopInt8(op, st, p, q, scales, partial, &seed, *new_partial, &*q_out,
                           &*scales_out, stochastic);
}

ffi::Error RingHopInt8LastCuda(cudaStream_t st, AnyBuffer q, AnyBuffer scales, AnyBuffer partial,
                               Result<AnyBuffer> new_partial, int64_t block_size) {
  constexpr std::string_view op = "jaxring_ring_hop_int8_last";
  BlockPlan p;
  JR_RETURN_IF_ERROR(PlanRingHopInt8(op, q, scales, partial, nullptr, *new_partial, nullptr,
                                     nullptr, block_size, &p));
  return LaunchRingHopInt8(op, st, p, q, scales, partial, nullptr, *new_partial, nullptr, nullptr,
                           false);
}

template <class C>
void LaunchRingHopCast(cudaStream_t st, int64_t total, const AnyBuffer& recv,
                       const AnyBuffer& partial, const AnyBuffer& new_partial,
                       const AnyBuffer* out) {
  RingHopCastKernel<C><<<GridFor(total, kThreads), kThreads, 0, st>>>(
      In<typename C::T>(recv), In<float>(partial), total, Out<float>(new_partial),
      out ? Out<typename C::T>(*out) : nullptr);
}

ffi::Error RingHopCast(std::string_view op, cudaStream_t st, const AnyBuffer& recv,
                       const AnyBuffer& partial, const AnyBuffer& new_partial,
                       const AnyBuffer* out) {
  RowLayout l;
  JR_RETURN_IF_ERROR(PlanRingHopCast(op, recv, partial, new_partial, out, &l));
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
  ChunkNormsKernel<<<GridFor(p.layout.rows * p.chunks, 1), ThreadsForBlock(p.chunk), 0, st>>>(
      In<float>(x), p.layout.rows, p.layout.cols, p.chunk, p.chunks, Out<float>(*norms));
  return LaunchError(op);
}

template <typename T>
void LaunchGather(cudaStream_t st, const ChunkPlan& p, const AnyBuffer& x, const AnyBuffer& idx,
                  const AnyBuffer& out) {
  GatherChunksKernel<T><<<GridFor(p.layout.rows * p.k * p.chunk, kThreads), kThreads, 0, st>>>(
      In<T>(x), In<int32_t>(idx), p.layout.rows, p.layout.cols, p.k, p.chunk, p.chunks,
      Out<T>(out));
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
  const int64_t total = p.layout.rows * p.k * p.chunk;
  if (total > 0)
    ScatterAddChunksKernel<<<GridFor(total, kThreads), kThreads, 0, st>>>(
        In<int32_t>(idx), In<float>(packed), p.layout.rows, p.layout.cols, p.k, p.chunk,
        p.chunks, Out<float>(*out));
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
