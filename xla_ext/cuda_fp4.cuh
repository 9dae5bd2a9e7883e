// The CUDA kernels of the fp4 codec, laid out as the int8 ones (cuda_kernels.cuh): one warp per
// quantization block, the block's abs-max one warp reduction, the encode reading the block again
// (from L1). A lane takes units of V consecutive elements, V / 2 bytes of packed codes:
//  * V = 8 (rows and block size multiples of 8, aligned buffers): one vector load of the values
//    (two for f32) and one 4-byte access of codes;
//  * V = 2 (any shape): element by element, a byte of codes per unit, the odd tail of a row
//    alone in its byte.
// Every element's value is computed as on the CPU (numerics.h), so both paths, the CPU kernels
// and the jnp references agree bit for bit.
//
// Included by cuda_fp4.cu alone (its definitions sit in that translation unit's anonymous
// namespace).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_wire.cuh"
#include "numerics.h"

namespace jaxring {
namespace {

__device__ __forceinline__ uint32_t Fp4EncodeOne(float v, const BlockScale& s, bool stochastic,
                                                 uint32_t key, int64_t index) {
  if (s.inv == 0.0f) return 0u;
  const float scaled = __fmul_rn(v, s.inv);
  return stochastic
             ? Fp4StochasticCode(scaled, RandomBits16(WeylState(key, static_cast<uint32_t>(index))))
             : Fp4Code(scaled);
}

// Unit u of a block: its V values (0 past the block's end, which only a V = 2 tail has).
template <class C, int V>
__device__ __forceinline__ void LoadUnit(const typename C::T* xb, int64_t u, int64_t len,
                                         float (&v)[V]) {
  if constexpr (V == 2) {
    v[0] = C::Load(xb[2 * u]);
    v[1] = 2 * u + 1 < len ? C::Load(xb[2 * u + 1]) : 0.0f;
  } else {
    LoadV<C, V>(xb + V * u, v);
  }
}

template <class C, int V>
__device__ __forceinline__ void StoreUnit(typename C::T* ob, int64_t u, int64_t len,
                                          const float (&v)[V]) {
  if constexpr (V == 2) {
    ob[2 * u] = C::Store(v[0]);
    if (2 * u + 1 < len) ob[2 * u + 1] = C::Store(v[1]);
  } else {
    StoreV<C, V>(ob + V * u, v);
  }
}

// The V / 2 bytes of unit u: read as one access for V = 8.
template <int V>
__device__ __forceinline__ uint32_t LoadCodes(const uint8_t* qb, int64_t u) {
  if constexpr (V == 2) return qb[u];
  else return *reinterpret_cast<const uint32_t*>(qb + 4 * u);
}

template <int V>
__device__ __forceinline__ void StoreCodes(uint8_t* qb, int64_t u, uint32_t codes) {
  if constexpr (V == 2) qb[u] = static_cast<uint8_t>(codes);
  else *reinterpret_cast<uint32_t*>(qb + 4 * u) = codes;
}

// Encodes the warp's block vb[0, len) (row index of vb[0]: `base`) into qb and returns its scale;
// `amax` is the lane's share of the block's largest |x| bits.
template <class C, int V>
__device__ __forceinline__ float WarpEncodeFp4(const typename C::T* vb, int64_t len, uint32_t amax,
                                               uint8_t* qb, bool stochastic, uint32_t key,
                                               int64_t base, int lane) {
  const BlockScale s = Fp4ScaleFromAmaxBits(__reduce_max_sync(0xffffffffu, amax));
  const int64_t units = (len + V - 1) / V;
  for (int64_t u = lane; u < units; u += 32) {
    float v[V];
    LoadUnit<C, V>(vb, u, len, v);
    uint32_t codes = 0;
#pragma unroll
    for (int k = 0; k < V; ++k)
      if (V * u + k < len)
        codes |= Fp4EncodeOne(v[k], s, stochastic, key, base + V * u + k) << (4 * k);
    StoreCodes<V>(qb, u, codes);
  }
  return s.scale;
}

template <class C, int V>
__global__ void QuantizeFp4Kernel(const typename C::T* x, const uint32_t* seed, int64_t rows,
                                  int64_t n, int64_t bs, int64_t nb, bool stochastic, uint8_t* q,
                                  float* scales) {
  const WarpSlot w = Warp();
  const int64_t bytes = (n + 1) / 2;
  for (int64_t g = w.index; g < rows * nb; g += w.count) {
    const int64_t r = g / nb, start = (g - r * nb) * bs, len = min(bs, n - start);
    const typename C::T* xb = x + r * n + start;
    uint32_t amax = 0;
    for (int64_t u = w.lane; u < (len + V - 1) / V; u += 32) {
      float v[V];
      LoadUnit<C, V>(xb, u, len, v);
#pragma unroll
      for (int k = 0; k < V; ++k) amax = max(amax, AbsBits(v[k]));
    }
    const float s = WarpEncodeFp4<C, V>(xb, len, amax, q + r * bytes + start / 2, stochastic,
                                        SeedKey(seed[r]), start, w.lane);
    if (w.lane == 0) scales[g] = s;
  }
}

template <class C, int V>
__global__ void DequantizeFp4Kernel(const uint8_t* q, const float* scales, int64_t rows,
                                    int64_t n, int64_t bs, int64_t nb, typename C::T* out) {
  const WarpSlot w = Warp();
  const int64_t bytes = (n + 1) / 2;
  for (int64_t g = w.index; g < rows * nb; g += w.count) {
    const int64_t r = g / nb, start = (g - r * nb) * bs, len = min(bs, n - start);
    const uint8_t* qb = q + r * bytes + start / 2;
    typename C::T* ob = out + r * n + start;
    const float s = scales[g];
    for (int64_t u = w.lane; u < (len + V - 1) / V; u += 32) {
      const uint32_t codes = LoadCodes<V>(qb, u);
      float v[V];
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = __fmul_rn(Fp4Value((codes >> (4 * k)) & 15u), s);
      StoreUnit<C, V>(ob, u, len, v);
    }
  }
}

// new_partial = decode(q) + partial for the warp's block; then, unless this is the last hop
// (q_out null), the block is encoded again from new_partial (each lane reads back its own units).
template <int V>
__global__ void RingHopFp4Kernel(const uint8_t* q, const float* scales, const float* partial,
                                 const uint32_t* seed, int64_t rows, int64_t n, int64_t bs,
                                 int64_t nb, bool stochastic, float* new_partial, uint8_t* q_out,
                                 float* scales_out) {
  const WarpSlot w = Warp();
  const int64_t bytes = (n + 1) / 2;
  for (int64_t g = w.index; g < rows * nb; g += w.count) {
    const int64_t r = g / nb, start = (g - r * nb) * bs, len = min(bs, n - start);
    const int64_t off = r * n + start, qoff = r * bytes + start / 2;
    const float s = scales[g];
    uint32_t amax = 0;
    for (int64_t u = w.lane; u < (len + V - 1) / V; u += 32) {
      const uint32_t codes = LoadCodes<V>(q + qoff, u);
      float p[V];
      LoadUnit<DF32, V>(partial + off, u, len, p);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        p[k] = __fadd_rn(__fmul_rn(Fp4Value((codes >> (4 * k)) & 15u), s), p[k]);
        if (V * u + k < len) amax = max(amax, AbsBits(p[k]));
      }
      StoreUnit<DF32, V>(new_partial + off, u, len, p);
    }
    if (q_out == nullptr) continue;
    const float so = WarpEncodeFp4<DF32, V>(new_partial + off, len, amax, q_out + qoff,
                                            stochastic, SeedKey(seed[r]), start, w.lane);
    if (w.lane == 0) scales_out[g] = so;
  }
}

}  // namespace
}  // namespace jaxring
