// Plain CPU kernels: loops over one row of a flat buffer, written so that GCC/Clang vectorize
// them at -O3 (branch-free bodies, integer max for max|x|, no libm calls in the hot loops).
// Every function works on a range of blocks or chunks so that callers can split a row.
#ifndef JAXRING_XLA_EXT_CPU_KERNELS_H_
#define JAXRING_XLA_EXT_CPU_KERNELS_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "numerics.h"

namespace jaxring::cpu {

// Element codecs: f32 in registers, storage type in memory.
struct F32 {
  using T = float;
  static float Load(float v) { return v; }
  static float Store(float v) { return v; }
};
struct Bf16 {
  using T = uint16_t;
  static float Load(uint16_t v) { return Bf16ToF32(v); }
  static uint16_t Store(float v) { return F32ToBf16(v); }
};
struct F16 {
  using T = uint16_t;
  static float Load(uint16_t v) { return F16ToF32(v); }
  static uint16_t Store(float v) { return F32ToF16(v); }
};

// Encodes one block of `len` values; returns its scale. `base` is the index of x[0] in its row
// (the stochastic-rounding counter).
template <class C>
float EncodeBlock(const typename C::T* __restrict x, int64_t len, int8_t* __restrict q,
                  bool stochastic, uint32_t key, int64_t base) {
  uint32_t amax = 0;
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t a = AbsBits(C::Load(x[i]));
    amax = a > amax ? a : amax;
  }
  const BlockScale s = ScaleFromAmaxBits(amax);
  if (s.inv == 0.0f) {
    std::memset(q, 0, static_cast<size_t>(len));
    return s.scale;
  }
  if (!stochastic) {
    for (int64_t i = 0; i < len; ++i)
      q[i] = static_cast<int8_t>(static_cast<int32_t>(ClampCode(RoundEvenSmall(C::Load(x[i]) * s.inv))));
  } else {
    const uint32_t b = static_cast<uint32_t>(base);
    for (int64_t i = 0; i < len; ++i) {
      const float u = Uniform01(key, b + static_cast<uint32_t>(i));
      q[i] = static_cast<int8_t>(static_cast<int32_t>(ClampCode(FloorSmall(C::Load(x[i]) * s.inv + u))));
    }
  }
  return s.scale;
}

template <class C>
void QuantizeBlocks(const typename C::T* x, int64_t n, int64_t bs, int64_t b0, int64_t b1,
                    bool stochastic, uint32_t key, int8_t* q, float* scales) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * bs;
    const int64_t len = n - start < bs ? n - start : bs;
    scales[b] = EncodeBlock<C>(x + start, len, q + start, stochastic, key, start);
  }
}

template <class C>
void DequantizeBlocks(const int8_t* __restrict q, const float* __restrict scales, int64_t n,
                      int64_t bs, int64_t b0, int64_t b1, typename C::T* __restrict out) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * bs;
    const int64_t len = n - start < bs ? n - start : bs;
    const float s = scales[b];
    const int8_t* qb = q + start;
    typename C::T* ob = out + start;
    for (int64_t i = 0; i < len; ++i) ob[i] = C::Store(static_cast<float>(qb[i]) * s);
  }
}

// new_partial = decode(q, scales) + partial; then, when q_out is not null, the new partial is
// encoded again while its block is still in L1: one pass over memory.
inline void RingHopInt8Blocks(const int8_t* __restrict q, const float* __restrict scales,
                              const float* __restrict partial, int64_t n, int64_t bs, int64_t b0,
                              int64_t b1, bool stochastic, uint32_t key,
                              float* __restrict new_partial, int8_t* __restrict q_out,
                              float* __restrict scales_out) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * bs;
    const int64_t len = n - start < bs ? n - start : bs;
    const float s = scales[b];
    const int8_t* qb = q + start;
    const float* pb = partial + start;
    float* vb = new_partial + start;
    for (int64_t i = 0; i < len; ++i) vb[i] = static_cast<float>(qb[i]) * s + pb[i];
    if (q_out) scales_out[b] = EncodeBlock<F32>(vb, len, q_out + start, stochastic, key, start);
  }
}

template <class C>
void RingHopCastRange(const typename C::T* __restrict recv, const float* __restrict partial,
                      int64_t i0, int64_t i1, float* __restrict new_partial,
                      typename C::T* __restrict out) {
  if (out) {
    for (int64_t i = i0; i < i1; ++i) {
      const float v = C::Load(recv[i]) + partial[i];
      new_partial[i] = v;
      out[i] = C::Store(v);
    }
  } else {
    for (int64_t i = i0; i < i1; ++i) new_partial[i] = C::Load(recv[i]) + partial[i];
  }
}

// Sum of squares in f64 (16 independent accumulators so the adds pipeline and vectorize), then
// one rounding to f32: the norm is correctly rounded up to the f64 summation error, and chunks
// whose f32 sum of squares would overflow still get a finite norm.
inline float ChunkNorm(const float* __restrict x, int64_t len) {
  constexpr int kLanes = 16;
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes)
    for (int j = 0; j < kLanes; ++j) {
      const double v = x[i + j];
      acc[j] += v * v;
    }
  for (int j = 0; i < len; ++i, ++j) {
    const double v = x[i];
    acc[j] += v * v;
  }
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  return static_cast<float>(std::sqrt(acc[0]));
}

inline void ChunkNormsRange(const float* x, int64_t n, int64_t cs, int64_t c0, int64_t c1,
                            float* norms) {
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t start = c * cs;
    norms[c] = ChunkNorm(x + start, n - start < cs ? n - start : cs);
  }
}

// Copies chunk idx[j] of x to out[j * cs, (j + 1) * cs); the tail of a partial last chunk is
// zero-filled. Indices were checked by the caller.
inline void GatherChunksRange(const char* x, int64_t n, const int32_t* idx, int64_t cs,
                              size_t width, int64_t j0, int64_t j1, char* out) {
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t start = static_cast<int64_t>(idx[j]) * cs;
    const int64_t len = n - start < cs ? n - start : cs;
    char* dst = out + static_cast<size_t>(j * cs) * width;
    std::memcpy(dst, x + static_cast<size_t>(start) * width, static_cast<size_t>(len) * width);
    if (len < cs) std::memset(dst + len * width, 0, static_cast<size_t>(cs - len) * width);
  }
}

// out[chunk idx[j]] += packed[j]; duplicates add in index order. `out` already holds x.
inline void ScatterAddChunks(const int32_t* idx, int64_t k, const float* __restrict packed,
                             int64_t n, int64_t cs, float* __restrict out) {
  for (int64_t j = 0; j < k; ++j) {
    const int64_t start = static_cast<int64_t>(idx[j]) * cs;
    const int64_t len = n - start < cs ? n - start : cs;
    float* ob = out + start;
    const float* pb = packed + j * cs;
    for (int64_t t = 0; t < len; ++t) ob[t] += pb[t];
  }
}

}  // namespace jaxring::cpu

#endif  // JAXRING_XLA_EXT_CPU_KERNELS_H_
