// Loop bodies shared by the CPU kernel files (cpu_kernels.cc, cpu_f16c.cc): element codecs and
// the int8 block encoder. Everything is force-inlined so that it is compiled for the target of the
// kernel it ends up in (baseline, x86-64-v3).
#ifndef JAXRING_XLA_EXT_CPU_LOOPS_H_
#define JAXRING_XLA_EXT_CPU_LOOPS_H_

#include <cstdint>
#include <cstring>

#include "numerics.h"

#define JR_INLINE inline __attribute__((always_inline))

namespace jaxring::cpu {

// Element codecs. AbsKey orders |x| like the float order (sign-magnitude formats: clear the sign
// bit), in the storage width so that the max|x| pass runs on 16 lanes for 16-bit inputs;
// AmaxBits turns the largest key into the f32 bits of max|x| (Inf and NaN included).
struct F32 {
  using T = float;
  using Key = uint32_t;
  JR_INLINE static float Load(float v) { return v; }
  JR_INLINE static float Store(float v) { return v; }
  JR_INLINE static float StoreNotNan(float v) { return v; }
  JR_INLINE static Key AbsKey(float v) { return AbsBits(v); }
  JR_INLINE static uint32_t AmaxBits(Key k) { return k; }
};
struct Bf16 {
  using T = uint16_t;
  using Key = uint16_t;
  JR_INLINE static float Load(uint16_t v) { return Bf16ToF32(v); }
  JR_INLINE static uint16_t Store(float v) { return F32ToBf16(v); }
  JR_INLINE static uint16_t StoreNotNan(float v) { return F32ToBf16NotNan(v); }
  JR_INLINE static Key AbsKey(uint16_t v) { return v & 0x7fffu; }
  JR_INLINE static uint32_t AmaxBits(Key k) { return static_cast<uint32_t>(k) << 16; }
};
struct F16 {
  using T = uint16_t;
  using Key = uint16_t;
  JR_INLINE static float Load(uint16_t v) { return F16ToF32(v); }
  JR_INLINE static uint16_t Store(float v) { return F32ToF16(v); }
  JR_INLINE static uint16_t StoreNotNan(float v) { return F32ToF16(v); }
  JR_INLINE static Key AbsKey(uint16_t v) { return v & 0x7fffu; }
  JR_INLINE static uint32_t AmaxBits(Key k) { return F32Bits(F16ToF32(k)); }
};

JR_INLINE int64_t BlockLen(int64_t n, int64_t start, int64_t bs) {
  return n - start < bs ? n - start : bs;
}

// Encodes one block of `len` values and returns its scale; `base` is the row index of x[0].
template <class C>
JR_INLINE float EncodeBlock(const typename C::T* __restrict x, int64_t len, int8_t* __restrict q,
                            bool stochastic, uint32_t key, int64_t base) {
  typename C::Key amax = 0;
  for (int64_t i = 0; i < len; ++i) {
    const typename C::Key a = C::AbsKey(x[i]);
    amax = a > amax ? a : amax;
  }
  const BlockScale s = ScaleFromAmaxBits(C::AmaxBits(amax));
  if (s.inv == 0.0f) {
    std::memset(q, 0, static_cast<size_t>(len));
    return s.scale;
  }
  if (!stochastic) {
    for (int64_t i = 0; i < len; ++i) q[i] = RoundToCode(C::Load(x[i]) * s.inv);
  } else {
    // inv * 2^16 is exact, so v16 = (x * inv) * 2^16 exactly. The Weyl state is stepped rather
    // than recomputed from the index: one vector add instead of a multiply per element.
    const float inv16 = s.inv * 65536.0f;
    uint32_t w = WeylState(key, static_cast<uint32_t>(base));
    for (int64_t i = 0; i < len; ++i, w += kWeyl)
      q[i] = StochasticCode(C::Load(x[i]) * inv16, RandomBits16(w));
  }
  return s.scale;
}

}  // namespace jaxring::cpu

#endif  // JAXRING_XLA_EXT_CPU_LOOPS_H_
