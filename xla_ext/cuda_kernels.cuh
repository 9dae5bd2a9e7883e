// The CUDA kernels of jaxring's FFI targets but fp4's (cuda_fp4.cuh): one __global__ kernel (with
// its device helpers) per operation, over the wire types of cuda_wire.cuh. Device code only;
// cuda_handlers.cu checks the operands, chooses a kernel and launches it. Built with --fmad=false so that every product is rounded before it
// is added, as on the CPU and in the jnp references.
//
// Differences from the CPU kernels, because a kernel cannot return an error without a
// device-to-host synchronization: out-of-range chunk indices are not reported; gather_chunks reads
// such a chunk as zeros and scatter_add_chunks skips it. Duplicate indices in scatter_add_chunks
// add up in an unspecified order (atomics).
//
// Included by cuda_handlers.cu alone (its definitions sit in that translation unit's anonymous
// namespace).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda_wire.cuh"
#include "numerics.h"

namespace jaxring {
namespace {

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
constexpr int kVec = 4;        // f32 elements per 16-byte access
constexpr int kMaxIters = 8;   // register cache: at most 8 accesses per lane and block

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

// U quantization blocks per warp and pass: the warp issues every load of its U consecutive
// blocks before the first abs-max reduction, so a lane has U accesses in flight where a block of
// one access per lane (bf16/f16 in 256-element blocks: 16 bytes a lane) left it one. Each block's
// values are computed as with U = 1, bit for bit.
template <class C, int V, int kIters, int U>
__global__ void QuantizeVecKernel(const typename C::T* x, const uint32_t* seed, int64_t rows,
                                  int64_t n, int64_t bs, int64_t nb, bool stochastic, int8_t* q,
                                  float* scales) {
  const WarpSlot w = Warp();
  const int64_t total = rows * nb;
  for (int64_t g0 = w.index * U; g0 < total; g0 += w.count * U) {
    float v[U][kIters][V];
    uint32_t amax[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      amax[u] = 0;
      const int64_t g = g0 + u;
      if (g >= total) break;
      const int64_t r = g / nb, start = (g - r * nb) * bs, len = min(bs, n - start);
#pragma unroll
      for (int j = 0; j < kIters; ++j) {
        const int64_t i = (int64_t{j} * 32 + w.lane) * V;
        if (i >= len) break;
        LoadV<C, V>(x + r * n + start + i, v[u][j]);
#pragma unroll
        for (int k = 0; k < V; ++k) amax[u] = max(amax[u], AbsBits(v[u][j][k]));
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t g = g0 + u;
      if (g >= total) break;
      const int64_t r = g / nb, start = (g - r * nb) * bs, len = min(bs, n - start);
      const float s = EncodeCached<V, kIters>(v[u], amax[u], len, q + r * n + start, stochastic,
                                           SeedKey(seed[r]), start, w.lane);
      if (w.lane == 0) scales[g] = s;
    }
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

}  // namespace
}  // namespace jaxring
