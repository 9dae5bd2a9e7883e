// CPU kernels of the fp4 codec, written like cpu_kernels.cc's to vectorize at -O3
// -fno-trapping-math: an integer max for max|x|, branch-free code and value rules (numerics.h),
// pairs of elements per byte.
#include "cpu_fp4.h"

#include <cstring>

#include "cpu_loops.h"
#include "numerics.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define JR_MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define JR_MULTIVERSION
#endif

namespace jaxring::cpu {
namespace {

#define JR_DISPATCH_WIRE(wire, KERNEL, ...)                    \
  switch (wire) {                                              \
    case Wire::kF32: KERNEL<F32>(__VA_ARGS__); break;          \
    case Wire::kBf16: KERNEL<Bf16>(__VA_ARGS__); break;        \
    case Wire::kF16: KERNEL<F16>(__VA_ARGS__); break;          \
  }

// Encodes one block of `len` values (its first at row index `base`, even) into (len + 1) / 2
// bytes of q and returns its scale.
template <class C>
JR_INLINE float EncodeFp4Block(const typename C::T* __restrict x, int64_t len,
                               uint8_t* __restrict q, bool stochastic, uint32_t key,
                               int64_t base) {
  typename C::Key amax = 0;
  for (int64_t i = 0; i < len; ++i) {
    const typename C::Key a = C::AbsKey(x[i]);
    amax = a > amax ? a : amax;
  }
  const BlockScale s = Fp4ScaleFromAmaxBits(C::AmaxBits(amax));
  const int64_t pairs = len / 2;
  if (s.inv == 0.0f) {
    std::memset(q, 0, static_cast<size_t>((len + 1) / 2));
    return s.scale;
  }
  if (!stochastic) {
    for (int64_t i = 0; i < pairs; ++i)
      q[i] = static_cast<uint8_t>(Fp4Code(C::Load(x[2 * i]) * s.inv) |
                                  (Fp4Code(C::Load(x[2 * i + 1]) * s.inv) << 4));
    if (len & 1) q[pairs] = static_cast<uint8_t>(Fp4Code(C::Load(x[len - 1]) * s.inv));
  } else {
    uint32_t w = WeylState(key, static_cast<uint32_t>(base));
    for (int64_t i = 0; i < pairs; ++i, w += 2 * kWeyl)
      q[i] = static_cast<uint8_t>(
          Fp4StochasticCode(C::Load(x[2 * i]) * s.inv, RandomBits16(w)) |
          (Fp4StochasticCode(C::Load(x[2 * i + 1]) * s.inv, RandomBits16(w + kWeyl)) << 4));
    if (len & 1)
      q[pairs] = static_cast<uint8_t>(Fp4StochasticCode(C::Load(x[len - 1]) * s.inv,
                                                        RandomBits16(w)));
  }
  return s.scale;
}

template <class C>
JR_INLINE void QuantizeFp4Range(const void* x, int64_t n, int64_t bs, int64_t b0, int64_t b1,
                                bool stochastic, uint32_t key, uint8_t* q, float* scales) {
  const auto* xs = static_cast<const typename C::T*>(x);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * bs;
    scales[b] = EncodeFp4Block<C>(xs + start, BlockLen(n, start, bs), q + start / 2, stochastic,
                                  key, start);
  }
}

template <class C>
JR_INLINE void DequantizeFp4Range(const uint8_t* q, const float* scales, int64_t n, int64_t bs,
                                  int64_t b0, int64_t b1, void* out) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * bs, len = BlockLen(n, start, bs), pairs = len / 2;
    const float s = scales[b];
    const uint8_t* __restrict qb = q + start / 2;
    typename C::T* __restrict ob = static_cast<typename C::T*>(out) + start;
    if (s != s) {  // a non-finite block: NaN everywhere
      for (int64_t i = 0; i < len; ++i) ob[i] = C::Store(s);
      continue;
    }
    for (int64_t i = 0; i < pairs; ++i) {
      ob[2 * i] = C::StoreNotNan(Fp4Value(qb[i] & 15u) * s);
      ob[2 * i + 1] = C::StoreNotNan(Fp4Value(qb[i] >> 4) * s);
    }
    if (len & 1) ob[len - 1] = C::StoreNotNan(Fp4Value(qb[pairs] & 15u) * s);
  }
}

}  // namespace

JR_MULTIVERSION
void QuantizeFp4Blocks(Wire wire, const void* x, int64_t n, int64_t bs, int64_t b0, int64_t b1,
                       bool stochastic, uint32_t key, uint8_t* q, float* scales) {
  if (wire == Wire::kF32 && UseFp4V3())
    return QuantizeFp4F32BlocksV3(static_cast<const float*>(x), n, bs, b0, b1, stochastic, key, q,
                                  scales);
  JR_DISPATCH_WIRE(wire, QuantizeFp4Range, x, n, bs, b0, b1, stochastic, key, q, scales)
}

JR_MULTIVERSION
void DequantizeFp4Blocks(Wire wire, const uint8_t* q, const float* scales, int64_t n, int64_t bs,
                         int64_t b0, int64_t b1, void* out) {
  if (wire == Wire::kF32 && UseFp4V3())
    return DequantizeFp4F32BlocksV3(q, scales, n, bs, b0, b1, static_cast<float*>(out));
  JR_DISPATCH_WIRE(wire, DequantizeFp4Range, q, scales, n, bs, b0, b1, out)
}

JR_MULTIVERSION
void RingHopFp4Blocks(const uint8_t* q, const float* scales, const float* partial, int64_t n,
                      int64_t bs, int64_t b0, int64_t b1, bool stochastic, uint32_t key,
                      float* new_partial, uint8_t* q_out, float* scales_out) {
  if (UseFp4V3())
    return RingHopFp4BlocksV3(q, scales, partial, n, bs, b0, b1, stochastic, key, new_partial,
                              q_out, scales_out);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * bs, len = BlockLen(n, start, bs), pairs = len / 2;
    const float s = scales[b];
    const uint8_t* __restrict qb = q + start / 2;
    const float* __restrict pb = partial + start;
    float* __restrict vb = new_partial + start;
    for (int64_t i = 0; i < pairs; ++i) {
      vb[2 * i] = Fp4Value(qb[i] & 15u) * s + pb[2 * i];
      vb[2 * i + 1] = Fp4Value(qb[i] >> 4) * s + pb[2 * i + 1];
    }
    if (len & 1) vb[len - 1] = Fp4Value(qb[pairs] & 15u) * s + pb[len - 1];
    if (q_out)
      scales_out[b] = EncodeFp4Block<F32>(vb, len, q_out + start / 2, stochastic, key, start);
  }
}

}  // namespace jaxring::cpu
