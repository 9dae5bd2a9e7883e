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
#include <type_traits>

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

// The int8 family works one warp per quantization block: lanes read the block coalesced, the
// block's abs-max is one warp reduction (__reduce_max_sync) and a thread block of kThreads covers
// kThreads / 32 quantization blocks, with no __syncthreads. Two paths:
//  * vector (the common case: rows and block size a multiple of V, a block of at most
//    32 V kMaxIters elements, aligned buffers): each lane moves V consecutive elements per access
//    (V = 4 for f32 and 8 for bf16/f16 inputs of quantize: 16-byte loads; 8 codes per access in
//    dequantize; 4 in the ring hop) and quantize and the hop keep the lane's part of the block in
//    registers between the abs-max and the encode, so the input is read once;
//  * scalar (any shape and alignment): lane l takes elements l, l + 32, ... and the encode reads
//    the block again (from L1).
// Both compute the same values in the same order per element, so they agree bit for bit.
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kVec = 4;        // f32 elements per 16-byte access
constexpr int kMaxIters = 8;   // register cache: at most 8 accesses per lane and block

// Elements per lane access on the vector path for a wire type: one 16-byte load of it.
template <class C>
constexpr int VecOf() { return static_cast<int>(16 / sizeof(typename C::T)); }

struct WarpSlot {
  int64_t index, count;  // this warp's first quantization block and the grid's warps
  int lane;
};

__device__ __forceinline__ WarpSlot Warp() {
  return {blockIdx.x * int64_t{kWarpsPerBlock} + (threadIdx.x >> 5),
          int64_t{gridDim.x} * kWarpsPerBlock, static_cast<int>(threadIdx.x & 31)};
}

// V consecutive elements moved as one access (the struct's alignment makes it one vector load).
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T e[V];
};

template <class C, int V>
__device__ __forceinline__ void LoadV(const typename C::T* p, float (&v)[V]) {
  const Pack<typename C::T, V> pk = *reinterpret_cast<const Pack<typename C::T, V>*>(p);
#pragma unroll
  for (int k = 0; k < V; ++k) v[k] = C::Load(pk.e[k]);
}

template <class C, int V>
__device__ __forceinline__ void StoreV(typename C::T* p, const float (&v)[V]) {
  Pack<typename C::T, V> pk;
#pragma unroll
  for (int k = 0; k < V; ++k) pk.e[k] = C::Store(v[k]);
  *reinterpret_cast<Pack<typename C::T, V>*>(p) = pk;
}

__device__ __forceinline__ int8_t EncodeOne(float v, const BlockScale& s, bool stochastic,
                                            uint32_t key, int64_t index) {
  if (s.inv == 0.0f) return 0;
  return stochastic ? StochasticCode(__fmul_rn(v, s.inv * 65536.0f),
                                     RandomBits16(WeylState(key, static_cast<uint32_t>(index))))
                    : RoundToCode(__fmul_rn(v, s.inv));
}

// Scalar path: encodes v[0..len) of one quantization block with the calling warp (reading v
// twice); returns the block's scale.
template <class C>
__device__ float WarpEncodeBlock(const typename C::T* v, int64_t len, int8_t* q, bool stochastic,
                                 uint32_t key, int64_t base, int lane) {
  uint32_t amax = 0;
  for (int64_t i = lane; i < len; i += 32) amax = max(amax, AbsBits(C::Load(v[i])));
  const BlockScale s = ScaleFromAmaxBits(__reduce_max_sync(0xffffffffu, amax));
  for (int64_t i = lane; i < len; i += 32)
    q[i] = EncodeOne(C::Load(v[i]), s, stochastic, key, base + i);
  return s.scale;
}

// Vector path: the lane's kIters accesses of the block, v[j] at element (32 j + lane) * V,
// encoded from registers; returns the block's scale.
template <int V, int kIters>
__device__ __forceinline__ float EncodeCached(const float (&v)[kIters][V], uint32_t amax,
                                              int64_t len, int8_t* q, bool stochastic,
                                              uint32_t key, int64_t base, int lane) {
  const BlockScale s = ScaleFromAmaxBits(__reduce_max_sync(0xffffffffu, amax));
#pragma unroll
  for (int j = 0; j < kIters; ++j) {
    const int64_t i = (int64_t{j} * 32 + lane) * V;
    if (i >= len) break;
    Pack<int8_t, V> c;
#pragma unroll
    for (int k = 0; k < V; ++k) c.e[k] = EncodeOne(v[j][k], s, stochastic, key, base + i + k);
    *reinterpret_cast<Pack<int8_t, V>*>(q + i) = c;
  }
  return s.scale;
}

template <class C>
__global__ void QuantizeKernel(const typename C::T* x, const uint32_t* seed, int64_t rows,
                               int64_t n, int64_t bs, int64_t nb, bool stochastic, int8_t* q,
                               float* scales) {
  const WarpSlot w = Warp();
  for (int64_t g = w.index; g < rows * nb; g += w.count) {
    const int64_t r = g / nb, start = (g - r * nb) * bs, len = min(bs, n - start);
    const float s = WarpEncodeBlock<C>(x + r * n + start, len, q + r * n + start, stochastic,
                                       SeedKey(seed[r]), start, w.lane);
    if (w.lane == 0) scales[g] = s;
  }
}

template <class C, int V, int kIters>
__global__ void QuantizeVecKernel(const typename C::T* x, const uint32_t* seed, int64_t rows,
                                  int64_t n, int64_t bs, int64_t nb, bool stochastic, int8_t* q,
                                  float* scales) {
  const WarpSlot w = Warp();
  for (int64_t g = w.index; g < rows * nb; g += w.count) {
    const int64_t r = g / nb, start = (g - r * nb) * bs, len = min(bs, n - start);
    const int64_t off = r * n + start;
    float v[kIters][V];
    uint32_t amax = 0;
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      const int64_t i = (int64_t{j} * 32 + w.lane) * V;
      if (i >= len) break;
      LoadV<C, V>(x + off + i, v[j]);
#pragma unroll
      for (int k = 0; k < V; ++k) amax = max(amax, AbsBits(v[j][k]));
    }
    const float s = EncodeCached<V, kIters>(v, amax, len, q + off, stochastic, SeedKey(seed[r]),
                                         start, w.lane);
    if (w.lane == 0) scales[g] = s;
  }
}

template <class C, int V>
__global__ void DequantizeKernel(const int8_t* q, const float* scales, int64_t rows, int64_t n,
                                 int64_t bs, int64_t nb, typename C::T* out) {
  const WarpSlot w = Warp();
  for (int64_t g = w.index; g < rows * nb; g += w.count) {
    const int64_t r = g / nb, b = (g - r * nb) * bs, off = r * n + b, len = min(bs, n - b);
    const float s = scales[g];
#pragma unroll 2
    for (int64_t i = int64_t{w.lane} * V; i < len; i += 32 * V) {
      const Pack<int8_t, V> c = *reinterpret_cast<const Pack<int8_t, V>*>(q + off + i);
      float o[V];
#pragma unroll
      for (int k = 0; k < V; ++k) o[k] = __fmul_rn(static_cast<float>(c.e[k]), s);
      StoreV<C, V>(out + off + i, o);
    }
  }
}

// Elementwise layout for the common case (the scale of code e is scales[e >> shift]: blocks of a
// power of two that tile every row): each thread takes U accesses of V codes a thread block
// apart, so every load and store of a warp is coalesced, and issues all U loads before its first
// store. The scale is read per access; all but the first reader of a block hit L1.
template <class C, int V, int U>
__global__ void DequantizeFlatKernel(const int8_t* q, const float* scales, int64_t nvec, int shift,
                                     typename C::T* out) {
  const int64_t step = int64_t{gridDim.x} * blockDim.x * U;
  for (int64_t base = int64_t{blockIdx.x} * blockDim.x * U + threadIdx.x; base < nvec;
       base += step) {
    Pack<int8_t, V> c[U];
    float s[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = base + int64_t{u} * blockDim.x;
      if (v < nvec) {
        c[u] = reinterpret_cast<const Pack<int8_t, V>*>(q)[v];
        s[u] = scales[(v * V) >> shift];
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = base + int64_t{u} * blockDim.x;
      if (v >= nvec) break;
      float o[V];
#pragma unroll
      for (int k = 0; k < V; ++k) o[k] = __fmul_rn(static_cast<float>(c[u].e[k]), s[u]);
      StoreV<C, V>(out + v * V, o);
    }
  }
}

// new_partial = decode(q) + partial for one quantization block per warp; then the block is
// encoded again from new_partial (scalar path: the lane's own writes, read back from L1).
__global__ void RingHopInt8Kernel(const int8_t* q, const float* scales, const float* partial,
                                  const uint32_t* seed, int64_t rows, int64_t n, int64_t bs,
                                  int64_t nb, bool stochastic, float* new_partial, int8_t* q_out,
                                  float* scales_out) {
  const WarpSlot w = Warp();
  for (int64_t g = w.index; g < rows * nb; g += w.count) {
    const int64_t r = g / nb, b = (g - r * nb) * bs, start = r * n + b, len = min(bs, n - b);
    const float s = scales[g];
    for (int64_t i = w.lane; i < len; i += 32)
      new_partial[start + i] =
          __fadd_rn(__fmul_rn(static_cast<float>(q[start + i]), s), partial[start + i]);
    if (q_out == nullptr) continue;
    const float so = WarpEncodeBlock<DF32>(new_partial + start, len, q_out + start, stochastic,
                                           SeedKey(seed[r]), b, w.lane);
    if (w.lane == 0) scales_out[g] = so;
  }
}

template <int kIters>
__global__ void RingHopInt8VecKernel(const int8_t* q, const float* scales, const float* partial,
                                     const uint32_t* seed, int64_t rows, int64_t n, int64_t bs,
                                     int64_t nb, bool stochastic, float* new_partial,
                                     int8_t* q_out, float* scales_out) {
  const WarpSlot w = Warp();
  for (int64_t g = w.index; g < rows * nb; g += w.count) {
    const int64_t r = g / nb, b = (g - r * nb) * bs, off = r * n + b, len = min(bs, n - b);
    const float s = scales[g];
    float v[kIters][kVec];
    uint32_t amax = 0;
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      const int64_t i = (int64_t{j} * 32 + w.lane) * kVec;
      if (i >= len) break;
      const Pack<int8_t, kVec> c = *reinterpret_cast<const Pack<int8_t, kVec>*>(q + off + i);
      float p[kVec];
      LoadV<DF32, kVec>(partial + off + i, p);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        v[j][k] = __fadd_rn(__fmul_rn(static_cast<float>(c.e[k]), s), p[k]);
        amax = max(amax, AbsBits(v[j][k]));
      }
      StoreV<DF32, kVec>(new_partial + off + i, v[j]);
    }
    if (q_out == nullptr) continue;
    const float so = EncodeCached<kVec, kIters>(v, amax, len, q_out + off, stochastic, SeedKey(seed[r]),
                                          b, w.lane);
    if (w.lane == 0) scales_out[g] = so;
  }
}

// Elementwise: V consecutive elements per thread and step (V = 4 on the vector path); the
// total % V elements left over go to the first threads.
template <class C, int V>
__global__ void RingHopCastKernel(const typename C::T* recv, const float* partial, int64_t total,
                                  float* new_partial, typename C::T* out) {
  const int64_t tid = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  const int64_t vecs = total / V;
  for (int64_t e = tid; e < vecs; e += int64_t{gridDim.x} * blockDim.x) {
    float r[V], p[V];
    LoadV<C, V>(recv + e * V, r);
    LoadV<DF32, V>(partial + e * V, p);
#pragma unroll
    for (int k = 0; k < V; ++k) r[k] = __fadd_rn(r[k], p[k]);
    StoreV<DF32, V>(new_partial + e * V, r);
    if (out) StoreV<C, V>(out + e * V, r);
  }
  const int64_t e = vecs * V + tid;
  if (e < total) {
    const float v = __fadd_rn(C::Load(recv[e]), partial[e]);
    new_partial[e] = v;
    if (out) out[e] = C::Store(v);
  }
}

// One thread block per chunk; V elements per thread access (4 on the vector path).
template <int V>
__global__ void ChunkNormsKernel(const float* x, int64_t rows, int64_t n, int64_t cs, int64_t nc,
                                 float* norms) {
  __shared__ double smem[32];
  for (int64_t g = blockIdx.x; g < rows * nc; g += gridDim.x) {
    const int64_t r = g / nc, start = (g - r * nc) * cs, len = min(cs, n - start);
    const float* xc = x + r * n + start;
    double acc = 0.0;
#pragma unroll 4
    for (int64_t i = int64_t{threadIdx.x} * V; i < len; i += int64_t{blockDim.x} * V) {
      float v[V];
      LoadV<DF32, V>(xc + i, v);
#pragma unroll
      for (int k = 0; k < V; ++k) acc = __dadd_rn(acc, __dmul_rn(v[k], v[k]));
    }
    const double total = BlockSum(acc, smem);
    if (threadIdx.x == 0) norms[g] = static_cast<float>(sqrt(total));
  }
}

// The chunk kernels: blockIdx.x walks the selected (row, chunk) pairs, blockIdx.y the chunk's
// segments of kSegment elements, so that a few selected chunks still fill the GPU. A whole chunk
// on the vector path moves 16 bytes per access; a chunk that runs past the row's end (or any
// chunk off the vector path) goes element by element, reading zeros past the end.
constexpr int64_t kSegment = 4096;

struct ChunkSpan {
  int64_t lo, hi;  // elements [lo, hi) of the chunk
  bool whole;      // the chunk is in range and ends inside the row
  bool valid;      // the index is in range
};

template <typename I>
__global__ void GatherChunksKernel(const I* x, const int32_t* idx, int64_t rows, int64_t n,
                                   int64_t k, int64_t cs, int64_t nc, bool vec, I* out) {
  for (int64_t g = blockIdx.x; g < rows * k; g += gridDim.x) {
    const int64_t r = g / k, c = idx[g];
    const bool valid = c >= 0 && c < nc, whole = valid && (c + 1) * cs <= n;
    const I* src = x + r * n + c * cs;
    I* dst = out + g * cs;
    for (int64_t lo = blockIdx.y * kSegment; lo < cs; lo += int64_t{gridDim.y} * kSegment) {
      const int64_t hi = min(cs, lo + kSegment);
      if (vec && whole) {
        constexpr int64_t kPer = 16 / sizeof(I);
        for (int64_t i = lo + threadIdx.x * kPer; i < hi; i += int64_t{blockDim.x} * kPer)
          *reinterpret_cast<uint4*>(dst + i) = *reinterpret_cast<const uint4*>(src + i);
      } else {
        for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x)
          dst[i] = (valid && c * cs + i < n) ? src[i] : I(0);
      }
    }
  }
}

__global__ void ScatterAddChunksKernel(const int32_t* idx, const float* packed, int64_t rows,
                                       int64_t n, int64_t k, int64_t cs, int64_t nc, bool vec,
                                       float* out) {
  for (int64_t g = blockIdx.x; g < rows * k; g += gridDim.x) {
    const int64_t r = g / k, c = idx[g];
    if (c < 0 || c >= nc) continue;
    const bool whole = (c + 1) * cs <= n;
    float* dst = out + r * n + c * cs;
    const float* src = packed + g * cs;
    for (int64_t lo = blockIdx.y * kSegment; lo < cs; lo += int64_t{gridDim.y} * kSegment) {
      const int64_t hi = min(cs, lo + kSegment);
      if (vec && whole) {
        for (int64_t i = lo + threadIdx.x * 4; i < hi; i += int64_t{blockDim.x} * 4) {
          const float4 v = *reinterpret_cast<const float4*>(src + i);
#if __CUDA_ARCH__ >= 900
          atomicAdd(reinterpret_cast<float4*>(dst + i), v);  // one vector reduction (sm_90)
#else
          atomicAdd(dst + i, v.x);
          atomicAdd(dst + i + 1, v.y);
          atomicAdd(dst + i + 2, v.z);
          atomicAdd(dst + i + 3, v.w);
#endif
        }
      } else {
        for (int64_t i = lo + threadIdx.x; i < hi && c * cs + i < n; i += blockDim.x)
          atomicAdd(dst + i, src[i]);
      }
    }
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

bool Aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

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
      QuantizeVecKernel<C, V, decltype(iters)::value><<<grid, kThreads, 0, st>>>(
          xp, In<uint32_t>(seed), p.layout.rows, p.layout.cols, p.block, p.blocks, stochastic,
          qp, Out<float>(scales));
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
