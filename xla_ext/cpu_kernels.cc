// CPU kernels, written so that GCC/Clang vectorize them at -O3 -fno-trapping-math: branch-free
// bodies, an integer max for max|x|, codes read from float bits (numerics.h), no libm calls in the
// hot loops; float16 goes through F16C conversions where the CPU has them (cpu_f16c.cc).
#include "cpu_kernels.h"

#include <cmath>
#include <cstring>

#include "cpu_f16c.h"
#include "cpu_loops.h"
#include "numerics.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
// Twice the throughput of baseline SSE2 for the int8 encode (measured); resolved once at load.
#define JR_MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define JR_MULTIVERSION
#endif
// Everything a multiversioned kernel calls is force-inlined into it (cpu_loops.h), so that it is
// compiled for that kernel's target too (an outlined helper or lambda would be baseline code).

namespace jaxring::cpu {
namespace {

// Calls KERNEL<F32|Bf16|F16>(args...) for the wire type.
#define JR_DISPATCH_WIRE(wire, KERNEL, ...)                    \
  switch (wire) {                                              \
    case Wire::kF32: KERNEL<F32>(__VA_ARGS__); break;          \
    case Wire::kBf16: KERNEL<Bf16>(__VA_ARGS__); break;        \
    case Wire::kF16: KERNEL<F16>(__VA_ARGS__); break;          \
  }

template <class C>
JR_INLINE void QuantizeRange(const void* x, int64_t n, int64_t bs, int64_t b0, int64_t b1,
                             bool stochastic, uint32_t key, int8_t* q, float* scales) {
  const auto* xs = static_cast<const typename C::T*>(x);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * bs;
    scales[b] = EncodeBlock<C>(xs + start, BlockLen(n, start, bs), q + start, stochastic, key,
                               start);
  }
}

template <class C>
JR_INLINE void DequantizeRange(const int8_t* q, const float* scales, int64_t n, int64_t bs,
                               int64_t b0, int64_t b1, void* out) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * bs, len = BlockLen(n, start, bs);
    const float s = scales[b];
    const int8_t* __restrict qb = q + start;
    typename C::T* __restrict ob = static_cast<typename C::T*>(out) + start;
    if (s != s) {  // a non-finite block: NaN everywhere (the scale is the only possible NaN)
      for (int64_t i = 0; i < len; ++i) ob[i] = C::Store(s);
    } else {
      for (int64_t i = 0; i < len; ++i) ob[i] = C::StoreNotNan(static_cast<float>(qb[i]) * s);
    }
  }
}

template <class C>
JR_INLINE void CastHopRange(const void* recv, const float* partial, int64_t i0, int64_t i1,
                            float* new_partial, void* out) {
  const typename C::T* __restrict r = static_cast<const typename C::T*>(recv);
  const float* __restrict p = partial;
  float* __restrict np = new_partial;
  if (out) {
    typename C::T* __restrict o = static_cast<typename C::T*>(out);
    for (int64_t i = i0; i < i1; ++i) {
      const float v = C::Load(r[i]) + p[i];
      np[i] = v;
      o[i] = C::Store(v);
    }
  } else {
    for (int64_t i = i0; i < i1; ++i) np[i] = C::Load(r[i]) + p[i];
  }
}

template <class C>
JR_INLINE void WidenElems(const void* in, int64_t i0, int64_t i1, float* out) {
  const typename C::T* __restrict x = static_cast<const typename C::T*>(in);
  float* __restrict o = out;
  for (int64_t i = i0; i < i1; ++i) o[i] = C::Load(x[i]);
}

}  // namespace

JR_MULTIVERSION
void WidenRange(Wire wire, const void* in, int64_t i0, int64_t i1, float* out) {
  JR_DISPATCH_WIRE(wire, WidenElems, in, i0, i1, out)
}

JR_MULTIVERSION
void QuantizeBlocks(Wire wire, const void* x, int64_t n, int64_t bs, int64_t b0, int64_t b1,
                    bool stochastic, uint32_t key, int8_t* q, float* scales) {
  if (wire == Wire::kF16 && bs <= kF16Tile && UseF16c())
    return QuantizeF16Blocks(static_cast<const uint16_t*>(x), n, bs, b0, b1, stochastic, key, q,
                             scales);
  JR_DISPATCH_WIRE(wire, QuantizeRange, x, n, bs, b0, b1, stochastic, key, q, scales)
}

JR_MULTIVERSION
void DequantizeBlocks(Wire wire, const int8_t* q, const float* scales, int64_t n, int64_t bs,
                      int64_t b0, int64_t b1, void* out) {
  if (wire == Wire::kF16 && bs <= kF16Tile && UseF16c())
    return DequantizeF16Blocks(q, scales, n, bs, b0, b1, static_cast<uint16_t*>(out));
  JR_DISPATCH_WIRE(wire, DequantizeRange, q, scales, n, bs, b0, b1, out)
}

JR_MULTIVERSION
void RingHopInt8Blocks(const int8_t* q, const float* scales, const float* partial, int64_t n,
                       int64_t bs, int64_t b0, int64_t b1, bool stochastic, uint32_t key,
                       float* new_partial, int8_t* q_out, float* scales_out) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * bs, len = BlockLen(n, start, bs);
    const float s = scales[b];
    const int8_t* __restrict qb = q + start;
    const float* __restrict pb = partial + start;
    float* __restrict vb = new_partial + start;
    for (int64_t i = 0; i < len; ++i) vb[i] = static_cast<float>(qb[i]) * s + pb[i];
    if (q_out) scales_out[b] = EncodeBlock<F32>(vb, len, q_out + start, stochastic, key, start);
  }
}

JR_MULTIVERSION
void RingHopCastRange(Wire wire, const void* recv, const float* partial, int64_t i0, int64_t i1,
                      float* new_partial, void* out) {
  if (wire == Wire::kF16 && UseF16c())
    return RingHopCastF16Range(static_cast<const uint16_t*>(recv), partial, i0, i1, new_partial,
                               static_cast<uint16_t*>(out));
  JR_DISPATCH_WIRE(wire, CastHopRange, recv, partial, i0, i1, new_partial, out)
}

namespace {

// 16 independent f64 accumulators so that the adds pipeline and vectorize.
JR_INLINE float ChunkNorm(const float* __restrict x, int64_t len) {
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

}  // namespace

JR_MULTIVERSION
void ChunkNormsRange(const float* x, int64_t n, int64_t cs, int64_t c0, int64_t c1, float* norms) {
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t start = c * cs;
    norms[c] = ChunkNorm(x + start, BlockLen(n, start, cs));
  }
}

void GatherChunksRange(const char* x, int64_t n, const int32_t* idx, int64_t cs, size_t width,
                       int64_t j0, int64_t j1, char* out) {
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t start = static_cast<int64_t>(idx[j]) * cs, len = BlockLen(n, start, cs);
    char* dst = out + static_cast<size_t>(j * cs) * width;
    std::memcpy(dst, x + static_cast<size_t>(start) * width, static_cast<size_t>(len) * width);
    if (len < cs) std::memset(dst + len * width, 0, static_cast<size_t>(cs - len) * width);
  }
}

JR_MULTIVERSION
void ScatterAddChunks(const int32_t* idx, int64_t k, const float* packed, int64_t n, int64_t cs,
                      float* out) {
  for (int64_t j = 0; j < k; ++j) {
    const int64_t start = static_cast<int64_t>(idx[j]) * cs, len = BlockLen(n, start, cs);
    float* __restrict ob = out + start;
    const float* __restrict pb = packed + j * cs;
    for (int64_t t = 0; t < len; ++t) ob[t] += pb[t];
  }
}

}  // namespace jaxring::cpu
