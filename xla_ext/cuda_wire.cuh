// What the CUDA kernels share (cuda_kernels.cuh, cuda_fp4.cuh): the launch shape, the wire types,
// a warp's quantization block, vector accesses. Device code only, in the including translation
// unit's anonymous namespace.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace jaxring {
namespace {

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

constexpr int kWarpsPerBlock = kThreads / 32;

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

}  // namespace
}  // namespace jaxring
