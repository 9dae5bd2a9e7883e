// The fp4 kernels on x86-64-v3 (AVX2), for f32 blocks: GCC vectorized the portable loops
// (cpu_fp4.cc) into byte-lane arithmetic with widening and narrowing around every operation,
// 3x slower than the int8 kernels (measured on the 2-core development VM: quantize 6 GB/s, decode
// 11 GB/s). Here every element is one 32-bit lane from load to code: the e2m1 values come from
// one vpermps of an 8-entry table, codes are split into even and odd elements by two shuffles,
// and the same rules as numerics.h give the same bits as the portable path.
#include "cpu_fp4.h"

#include <cstdlib>
#include <cstring>

#include "cpu_loops.h"
#include "numerics.h"

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#include <immintrin.h>
#define JR_V3 __attribute__((target("arch=x86-64-v3")))

namespace jaxring::cpu {
namespace {

// The magnitude codes of |v| (round to nearest even), as Fp4Code.
JR_V3 JR_INLINE __m256i Magnitudes(__m256 a) {
  const __m256 big = _mm256_cmp_ps(a, _mm256_set1_ps(4.0f), _CMP_GE_OQ);
  const __m256 mid = _mm256_cmp_ps(a, _mm256_set1_ps(2.0f), _CMP_GE_OQ);
  const __m256 mult = _mm256_blendv_ps(_mm256_blendv_ps(_mm256_set1_ps(2.0f),
                                                        _mm256_set1_ps(1.0f), mid),
                                       _mm256_set1_ps(0.5f), big);
  const __m256i offset = _mm256_add_epi32(
      _mm256_and_si256(_mm256_castps_si256(mid), _mm256_set1_epi32(2)),
      _mm256_and_si256(_mm256_castps_si256(big), _mm256_set1_epi32(2)));
  return _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(a, mult)), offset);
}

// The stochastic magnitude codes of |v| with random bits k, as Fp4StochasticCode.
JR_V3 JR_INLINE __m256i StochasticMagnitudes(__m256 a, __m256i k) {
  const __m256 big = _mm256_cmp_ps(a, _mm256_set1_ps(4.0f), _CMP_GE_OQ);
  const __m256 mid = _mm256_cmp_ps(a, _mm256_set1_ps(2.0f), _CMP_GE_OQ);
  const __m256 mult = _mm256_blendv_ps(_mm256_blendv_ps(_mm256_set1_ps(131072.0f),
                                                        _mm256_set1_ps(65536.0f), mid),
                                       _mm256_set1_ps(32768.0f), big);
  const __m256i offset = _mm256_add_epi32(
      _mm256_and_si256(_mm256_castps_si256(mid), _mm256_set1_epi32(2)),
      _mm256_and_si256(_mm256_castps_si256(big), _mm256_set1_epi32(2)));
  const __m256i f = _mm256_cvtps_epi32(_mm256_mul_ps(a, mult));
  const __m256i mag = _mm256_add_epi32(_mm256_srai_epi32(_mm256_add_epi32(f, k), 16), offset);
  return _mm256_min_epi32(mag, _mm256_set1_epi32(7));
}

// RandomBits16 of the Weyl states w.
JR_V3 JR_INLINE __m256i RandomBits(__m256i w) {
  w = _mm256_xor_si256(w, _mm256_srli_epi32(w, 16));
  w = _mm256_mullo_epi32(w, _mm256_set1_epi32(0x7feb352d));
  w = _mm256_xor_si256(w, _mm256_srli_epi32(w, 15));
  w = _mm256_mullo_epi32(w, _mm256_set1_epi32(static_cast<int>(0x846ca68bu)));
  return _mm256_srli_epi32(w, 16);
}

// The 4-bit codes of v: the magnitude, and v's sign unless the magnitude is 0 (Fp4WithSign).
JR_V3 JR_INLINE __m256i WithSign(__m256 v, __m256i mag) {
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(v), 28),
                                        _mm256_set1_epi32(8));
  const __m256i zero = _mm256_cmpeq_epi32(mag, _mm256_setzero_si256());
  return _mm256_or_si256(mag, _mm256_andnot_si256(zero, sign));
}

// Byte k of the result packs elements 2k (low nibble) and 2k + 1 of the 16 floats at x, each
// scaled by inv; `w0` is the Weyl state of x[0] (stochastic only).
template <bool kStochastic>
JR_V3 JR_INLINE __m256i EncodePairs(const float* x, __m256 inv, uint32_t w0) {
  const __m256 a = _mm256_loadu_ps(x), b = _mm256_loadu_ps(x + 8);
  // even: a0 a2 b0 b2 | a4 a6 b4 b6 (elements 0 2 8 10 4 6 12 14); odd: the next ones
  const __m256 even = _mm256_mul_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), inv);
  const __m256 odd = _mm256_mul_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)), inv);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256i lo, hi;
  if constexpr (kStochastic) {
    const __m256i at = _mm256_setr_epi32(0, 2, 8, 10, 4, 6, 12, 14);
    const __m256i we = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(w0)),
                                        _mm256_mullo_epi32(at, _mm256_set1_epi32(
                                            static_cast<int>(kWeyl))));
    const __m256i wo = _mm256_add_epi32(we, _mm256_set1_epi32(static_cast<int>(kWeyl)));
    lo = WithSign(even, StochasticMagnitudes(_mm256_and_ps(even, abs_mask), RandomBits(we)));
    hi = WithSign(odd, StochasticMagnitudes(_mm256_and_ps(odd, abs_mask), RandomBits(wo)));
  } else {
    lo = WithSign(even, Magnitudes(_mm256_and_ps(even, abs_mask)));
    hi = WithSign(odd, Magnitudes(_mm256_and_ps(odd, abs_mask)));
  }
  // bytes of pairs 0 1 4 5 2 3 6 7: 64-bit chunks (0, 2, 1, 3) put them in order
  return _mm256_permute4x64_epi64(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), 0xD8);
}

// Encodes one f32 block (as EncodeFp4Block<F32>) and returns its scale.
template <bool kStochastic>
JR_V3 JR_INLINE float EncodeBlockV3(const float* x, int64_t len, uint8_t* q, uint32_t key,
                                    int64_t base) {
  __m256i vmax = _mm256_setzero_si256();
  const __m256i abs_bits = _mm256_set1_epi32(0x7fffffff);
  int64_t i = 0;
  for (; i + 8 <= len; i += 8)
    vmax = _mm256_max_epu32(vmax, _mm256_and_si256(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), abs_bits));
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), vmax);
  uint32_t amax = 0;
  for (uint32_t l : lanes) amax = l > amax ? l : amax;
  for (; i < len; ++i) amax = AbsBits(x[i]) > amax ? AbsBits(x[i]) : amax;
  const BlockScale s = Fp4ScaleFromAmaxBits(amax);
  if (s.inv == 0.0f) {
    std::memset(q, 0, static_cast<size_t>((len + 1) / 2));
    return s.scale;
  }
  const __m256 inv = _mm256_set1_ps(s.inv);
  const uint32_t w0 = WeylState(key, static_cast<uint32_t>(base));
  int64_t j = 0;   // 32 values (16 bytes) a step
  for (; 2 * j + 32 <= len; j += 16) {
    const uint32_t w = w0 + static_cast<uint32_t>(2 * j) * kWeyl;
    const __m256i c0 = EncodePairs<kStochastic>(x + 2 * j, inv, w);
    const __m256i c1 = EncodePairs<kStochastic>(x + 2 * j + 16, inv, w + 16 * kWeyl);
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(c0, c1), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j),
                     _mm_packus_epi16(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1)));
  }
  for (; 2 * j + 1 < len; ++j) {
    const int64_t e = 2 * j;
    const uint32_t w = w0 + static_cast<uint32_t>(e) * kWeyl;
    q[j] = static_cast<uint8_t>(
        kStochastic ? Fp4StochasticCode(x[e] * s.inv, RandomBits16(w)) |
                          (Fp4StochasticCode(x[e + 1] * s.inv, RandomBits16(w + kWeyl)) << 4)
                    : Fp4Code(x[e] * s.inv) | (Fp4Code(x[e + 1] * s.inv) << 4));
  }
  if (len & 1) {
    const uint32_t w = w0 + static_cast<uint32_t>(len - 1) * kWeyl;
    q[j] = static_cast<uint8_t>(kStochastic ? Fp4StochasticCode(x[len - 1] * s.inv,
                                                                RandomBits16(w))
                                            : Fp4Code(x[len - 1] * s.inv));
  }
  return s.scale;
}

// The values of 4-bit codes (one a lane): the magnitude's from the table, the sign bit moved up.
JR_V3 JR_INLINE __m256 Values(__m256 table, __m256i code) {
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(8)), 28);
  return _mm256_or_ps(_mm256_permutevar8x32_ps(table, _mm256_and_si256(code, _mm256_set1_epi32(7))),
                      _mm256_castsi256_ps(sign));
}

// The values (times s) of the 16 codes in 8 bytes at q, in element order, into lo (elements
// 0..7) and hi (8..15).
JR_V3 JR_INLINE void DecodePairs(const uint8_t* q, __m256 s, __m256* lo, __m256* hi) {
  const __m256 table = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  const __m256i ch = _mm256_srli_epi32(c, 4);
  const __m256 vl = Values(table, c), vh = Values(table, ch);
  const __m256 ul = _mm256_unpacklo_ps(_mm256_mul_ps(vl, s), _mm256_mul_ps(vh, s));
  const __m256 uh = _mm256_unpackhi_ps(_mm256_mul_ps(vl, s), _mm256_mul_ps(vh, s));
  *lo = _mm256_permute2f128_ps(ul, uh, 0x20);
  *hi = _mm256_permute2f128_ps(ul, uh, 0x31);
}

}  // namespace

bool UseFp4V3() {
  static const bool cpu = __builtin_cpu_supports("x86-64-v3");
  if (!cpu) return false;
  const char* env = std::getenv("JAXRING_CPU_FP4_V3");
  return env == nullptr || std::strcmp(env, "0") != 0;
}

JR_V3 void QuantizeFp4F32BlocksV3(const float* x, int64_t n, int64_t bs, int64_t b0, int64_t b1,
                                  bool stochastic, uint32_t key, uint8_t* q, float* scales) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * bs, len = BlockLen(n, start, bs);
    scales[b] = stochastic ? EncodeBlockV3<true>(x + start, len, q + start / 2, key, start)
                           : EncodeBlockV3<false>(x + start, len, q + start / 2, key, start);
  }
}

JR_V3 void DequantizeFp4F32BlocksV3(const uint8_t* q, const float* scales, int64_t n, int64_t bs,
                                    int64_t b0, int64_t b1, float* out) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * bs, len = BlockLen(n, start, bs);
    const uint8_t* qb = q + start / 2;
    float* ob = out + start;
    const __m256 s = _mm256_set1_ps(scales[b]);
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
      __m256 lo, hi;
      DecodePairs(qb + i / 2, s, &lo, &hi);
      _mm256_storeu_ps(ob + i, lo);
      _mm256_storeu_ps(ob + i + 8, hi);
    }
    for (; i < len; ++i) ob[i] = Fp4Value((qb[i / 2] >> (4 * (i & 1))) & 15u) * scales[b];
  }
}

JR_V3 void RingHopFp4BlocksV3(const uint8_t* q, const float* scales, const float* partial,
                              int64_t n, int64_t bs, int64_t b0, int64_t b1, bool stochastic,
                              uint32_t key, float* new_partial, uint8_t* q_out,
                              float* scales_out) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * bs, len = BlockLen(n, start, bs);
    const uint8_t* qb = q + start / 2;
    const float* pb = partial + start;
    float* vb = new_partial + start;
    const __m256 s = _mm256_set1_ps(scales[b]);
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
      __m256 lo, hi;
      DecodePairs(qb + i / 2, s, &lo, &hi);
      _mm256_storeu_ps(vb + i, _mm256_add_ps(lo, _mm256_loadu_ps(pb + i)));
      _mm256_storeu_ps(vb + i + 8, _mm256_add_ps(hi, _mm256_loadu_ps(pb + i + 8)));
    }
    for (; i < len; ++i)
      vb[i] = Fp4Value((qb[i / 2] >> (4 * (i & 1))) & 15u) * scales[b] + pb[i];
    if (q_out)
      scales_out[b] = stochastic ? EncodeBlockV3<true>(vb, len, q_out + start / 2, key, start)
                                 : EncodeBlockV3<false>(vb, len, q_out + start / 2, key, start);
  }
}

}  // namespace jaxring::cpu

#else  // no x86-64-v3 build: the portable kernels only

namespace jaxring::cpu {
bool UseFp4V3() { return false; }
void QuantizeFp4F32BlocksV3(const float*, int64_t, int64_t, int64_t, int64_t, bool, uint32_t,
                            uint8_t*, float*) {}
void DequantizeFp4F32BlocksV3(const uint8_t*, const float*, int64_t, int64_t, int64_t, int64_t,
                              float*) {}
void RingHopFp4BlocksV3(const uint8_t*, const float*, const float*, int64_t, int64_t, int64_t,
                        int64_t, bool, uint32_t, float*, uint8_t*, float*) {}
}  // namespace jaxring::cpu

#endif
