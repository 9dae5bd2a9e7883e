// binary16 kernels with F16C conversions: each block (or tile) is converted to f32 in L1 with
// vcvtph2ps / vcvtps2ph, then runs the same f32 loop as every other wire type.
#include "cpu_f16c.h"

#include <cstdlib>
#include <cstring>

#include "cpu_loops.h"
#include "numerics.h"

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#include <immintrin.h>
#define JR_V3 __attribute__((target("arch=x86-64-v3")))

namespace jaxring::cpu {
namespace {

JR_V3 JR_INLINE void HalfToFloat(const uint16_t* in, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(in + i))));
  for (; i < n; ++i) out[i] = F16ToF32(in[i]);
}

JR_V3 JR_INLINE void FloatToHalf(const float* in, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + i),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) out[i] = F32ToF16(in[i]);
}

}  // namespace

bool UseF16c() {
  static const bool cpu = __builtin_cpu_supports("x86-64-v3");
  if (!cpu) return false;
  const char* env = std::getenv("JAXRING_CPU_F16C");
  return env == nullptr || std::strcmp(env, "0") != 0;
}

JR_V3 void QuantizeF16Blocks(const uint16_t* x, int64_t n, int64_t bs, int64_t b0, int64_t b1,
                             bool stochastic, uint32_t key, int8_t* q, float* scales) {
  alignas(32) float tile[kF16Tile];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * bs, len = BlockLen(n, start, bs);
    HalfToFloat(x + start, len, tile);
    scales[b] = EncodeBlock<F32>(tile, len, q + start, stochastic, key, start);
  }
}

JR_V3 void DequantizeF16Blocks(const int8_t* q, const float* scales, int64_t n, int64_t bs,
                               int64_t b0, int64_t b1, uint16_t* out) {
  alignas(32) float tile[kF16Tile];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * bs, len = BlockLen(n, start, bs);
    const float s = scales[b];
    const int8_t* __restrict qb = q + start;
    for (int64_t i = 0; i < len; ++i) tile[i] = static_cast<float>(qb[i]) * s;
    FloatToHalf(tile, len, out + start);
  }
}

JR_V3 void RingHopCastF16Range(const uint16_t* recv, const float* partial, int64_t i0, int64_t i1,
                               float* new_partial, uint16_t* out) {
  alignas(32) float tile[kF16Tile];
  for (int64_t t = i0; t < i1; t += kF16Tile) {
    const int64_t len = i1 - t < kF16Tile ? i1 - t : kF16Tile;
    HalfToFloat(recv + t, len, tile);
    const float* __restrict p = partial + t;
    float* __restrict np = new_partial + t;
    for (int64_t i = 0; i < len; ++i) np[i] = tile[i] = tile[i] + p[i];
    if (out) FloatToHalf(tile, len, out + t);
  }
}

}  // namespace jaxring::cpu

#else  // not x86-64 with GCC/Clang on Linux: the portable loops only

namespace jaxring::cpu {
bool UseF16c() { return false; }
void QuantizeF16Blocks(const uint16_t*, int64_t, int64_t, int64_t, int64_t, bool, uint32_t,
                       int8_t*, float*) {}
void DequantizeF16Blocks(const int8_t*, const float*, int64_t, int64_t, int64_t, int64_t,
                         uint16_t*) {}
void RingHopCastF16Range(const uint16_t*, const float*, int64_t, int64_t, float*, uint16_t*) {}
}  // namespace jaxring::cpu

#endif
