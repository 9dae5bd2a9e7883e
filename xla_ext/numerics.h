// Numerics shared by the CPU and CUDA kernels: the int8 and fp4 block-scale rules, rounding, the
// stochastic-rounding hash and the 16-bit float conversions. Every rule here is also written
// once in jaxring/_src/ext/reference.py; the two must stay bit-identical.
#ifndef JAXRING_XLA_EXT_NUMERICS_H_
#define JAXRING_XLA_EXT_NUMERICS_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define JR_HD __host__ __device__ __forceinline__
#else
#define JR_HD inline __attribute__((always_inline))
#endif

namespace jaxring {

// Largest int8 code; codes are symmetric in [-127, 127] so that -128 is never produced.
constexpr float kQMax = 127.0f;
// Bits of |x| at or above this mean Inf or NaN (the f32 exponent is all ones).
constexpr uint32_t kNonFiniteBits = 0x7f800000u;
// Blocks whose max|x| is below 2^-64 encode as zeros: it keeps every scale, code * scale and
// the references' split of the scale (reference.py) normal f32 numbers, so results do not depend
// on the denormal mode (XLA:CPU runs with flush-to-zero), and 127 / amax cannot overflow.
constexpr uint32_t kMinAmaxBits = 0x1f800000u;  // 2^-64
// scale = amax * RN(1/127): a multiplication, which every compiler (XLA included, which turns
// x / 127 into x * RN(1/127)) evaluates the same way.
constexpr float kInvQMax = 1.0f / 127.0f;

JR_HD uint32_t F32Bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

JR_HD float BitsF32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// |x| as bits: for non-negative floats the integer order is the float order, and NaN bits
// exceed Inf bits, so one integer max over a block finds max|x| and detects Inf/NaN at once
// (and, unlike a float max, it vectorizes without -ffast-math).
JR_HD uint32_t AbsBits(float x) { return F32Bits(x) & 0x7fffffffu; }

struct BlockScale {
  float scale;  // what goes on the wire: decode is q * scale
  float inv;    // what encode multiplies by: 127 / amax, or 0 for zero and non-finite blocks
};

// The block-scale rule, from the bits of max|x| over the block:
//   finite, >= 2^-64:  scale = amax * RN(1/127), inv = 127 / amax  (each rounded once)
//   below 2^-64:       scale = 0, inv = 0                          (decodes to zeros)
//   Inf or NaN inside: scale = NaN, inv = 0                        (decodes to NaN: never hidden)
JR_HD BlockScale ScaleFromAmaxBits(uint32_t amax_bits) {
  if (amax_bits >= kNonFiniteBits) return {BitsF32(0x7fc00000u), 0.0f};
  if (amax_bits < kMinAmaxBits) return {0.0f, 0.0f};
  const float amax = BitsF32(amax_bits);
  return {amax * kInvQMax, kQMax / amax};
}

// The int8 code of round_half_even(v) for |v| <= 127.5 (what the block-scale rule guarantees:
// |x * 127 / amax| <= 127 (1 + 2^-23)^2). On the CPU the code is read straight from the low
// mantissa bits of v + 1.5 * 2^23, which holds 2^22 + round(v): no float-to-int conversion and
// no clamp, which is what makes the encode loop as fast as a copy.
JR_HD int8_t RoundToCode(float v) {
#if defined(__CUDA_ARCH__)
  return static_cast<int8_t>(__float2int_rn(v));
#else
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  return static_cast<int8_t>(F32Bits(v + kMagic) & 0xffu);
#endif
}

// Stochastic rounding, in 16-bit fixed point. With v = x * inv (as for round to nearest),
// f = clamp(round_half_even(v * 2^16), -127 * 2^16, 127 * 2^16) and a 16-bit random k, the code is
// (f + k) >> 16 (an arithmetic shift, so a floor): it rounds up with probability
// (f mod 2^16) / 2^16 = frac(v) to within 2^-17, and E[code] = f / 2^16 exactly. All of it is
// integer work after one product (x * inv * 2^16, exact scaling of x * inv), which vectorizes,
// and which XLA cannot fuse into a multiply-add in the jnp reference (nothing is added to it).
//
// k is the top half of a counter-based hash: a Weyl sequence w = key + index * kWeyl (the
// element index within its row, keyed per row by SeedKey), then two multiply-xorshift rounds
// (lowbias32 by C. Wellons, whose last xorshift only touches the low half and is left out). The
// Weyl step spreads consecutive indices over all 32 bits before mixing: hashing the raw index
// left rounding decisions at small lags visibly dependent (chi-square over 2^24 pairs).
constexpr uint32_t kWeyl = 0x9e3779b9u;  // 2^32 / golden ratio, odd
constexpr int32_t kCodeLimit16 = 127 << 16;

JR_HD uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

JR_HD uint32_t SeedKey(uint32_t seed) { return Mix32(seed + kWeyl); }

// The Weyl state of element `index`; the next element's state is this plus kWeyl.
JR_HD uint32_t WeylState(uint32_t key, uint32_t index) { return key + index * kWeyl; }

// The 16 random bits k for the element whose Weyl state is w.
JR_HD int32_t RandomBits16(uint32_t w) {
  w ^= w >> 16;
  w *= 0x7feb352du;
  w ^= w >> 15;
  w *= 0x846ca68bu;
  return static_cast<int32_t>(w >> 16);
}

// round_half_even(v) for |v| < 2^31 under the default rounding mode: cvtps2dq, which GCC
// vectorizes (std::lrint returns a long and does not).
JR_HD int32_t RoundToInt32(float v) {
#if defined(__CUDA_ARCH__)
  return __float2int_rn(v);
#elif defined(__GNUC__) && !defined(__clang__)
  return __builtin_irintf(v);
#else
  return static_cast<int32_t>(std::nearbyint(v));
#endif
}

// The code for v16 = x * (inv * 2^16) and random bits k in [0, 2^16).
JR_HD int8_t StochasticCode(float v16, int32_t k) {
  int32_t f = RoundToInt32(v16);
  f = f < -kCodeLimit16 ? -kCodeLimit16 : f;
  f = f > kCodeLimit16 ? kCodeLimit16 : f;
  return static_cast<int8_t>((f + k) >> 16);
}

// --- fp4 (e2m1) blocks ----------------------------------------------------------------------
// Codes are 4 bits, sign-magnitude: a sign bit over the e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6
// (magnitude codes 0..7), two codes per byte (element 2i in the low nibble). One f32 scale per
// block maps the block's max|x| to 6. The tiny and non-finite rules are int8's (kMinAmaxBits,
// kNonFiniteBits): below 2^-64 the block is zeros, a block holding Inf/NaN decodes to NaN.
constexpr float kFp4Max = 6.0f;
// scale = amax * the largest f32 below 1/6 (RN(1/6) is above it): 6 * scale then never exceeds
// amax, so no finite value decodes to Inf, up to f32's largest.
constexpr float kFp4ScaleMul = 0x1.555554p-3f;

JR_HD BlockScale Fp4ScaleFromAmaxBits(uint32_t amax_bits) {
  if (amax_bits >= kNonFiniteBits) return {BitsF32(0x7fc00000u), 0.0f};
  if (amax_bits < kMinAmaxBits) return {0.0f, 0.0f};
  const float amax = BitsF32(amax_bits);
  return {amax * kFp4ScaleMul, kFp4Max / amax};
}

// The magnitude grid is uniform within each binade of steps: 0.5 below 2, 1 in [2, 4), 2 from 4
// on. With a = |x * inv| (at most 6 (1 + 2^-22)), m = a / step (exact: a power of two) and
// code = round(m) + offset (offset 0, 2, 4): round half to even on m is round half to even of
// the e2m1 mantissa, and a value rounding up to the next binade lands on its first code.
// Fp4Steps returns m times `unit` (2^16 for stochastic rounding, 1 otherwise).
JR_HD float Fp4Steps(float a, float unit, int32_t* offset) {
  const bool big = a >= 4.0f, mid = a >= 2.0f;
  *offset = big ? 4 : (mid ? 2 : 0);
  return a * (big ? 0.5f * unit : (mid ? unit : 2.0f * unit));
}

// The 4-bit code: the magnitude code, and the sign of v unless the magnitude is 0 (no -0 codes).
JR_HD uint32_t Fp4WithSign(float v, uint32_t mag) {
  return mag | (mag != 0u ? (F32Bits(v) >> 28) & 8u : 0u);
}

JR_HD uint32_t Fp4Code(float v) {
  int32_t offset;
  const float m = Fp4Steps(v < 0.0f ? -v : v, 1.0f, &offset);
  return Fp4WithSign(v, static_cast<uint32_t>(RoundToInt32(m) + offset));
}

// Stochastic rounding as for int8 (StochasticCode), in 16-bit fixed point of the binade's step:
// f = round_half_even(m * 2^16), magnitude = min(((f + k) >> 16) + offset, 7), so E[decoded] is
// the value to within 2^-17 of a step (the min only bites within an ulp of 6).
JR_HD uint32_t Fp4StochasticCode(float v, int32_t k) {
  int32_t offset;
  const float m16 = Fp4Steps(v < 0.0f ? -v : v, 65536.0f, &offset);
  const int32_t mag = ((RoundToInt32(m16) + k) >> 16) + offset;
  return Fp4WithSign(v, static_cast<uint32_t>(mag < 7 ? mag : 7));
}

// The value of a 4-bit code, from its bits: 0.5 for magnitude 1, (mag << 22) + the bits of 0.5
// for magnitudes 2..7 (1, 1.5, 2, 3, 4, 6), the sign bit moved to f32's.
JR_HD float Fp4Value(uint32_t c) {
  const uint32_t mag = c & 7u;
  const uint32_t bits = mag >= 2u ? (mag << 22) + 0x3f000000u : (mag == 1u ? 0x3f000000u : 0u);
  return BitsF32(bits | ((c & 8u) << 28));
}

// --- 16-bit floats, round to nearest even, NaN stays NaN (quiet) -------------------------

JR_HD float Bf16ToF32(uint16_t h) { return BitsF32(static_cast<uint32_t>(h) << 16); }

JR_HD uint16_t F32ToBf16(float f) {
  const uint32_t u = F32Bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > kNonFiniteBits ? nan : rounded);
}

// The same for a value known not to be NaN (decoding a block whose scale is not NaN).
JR_HD uint16_t F32ToBf16NotNan(float f) {
  const uint32_t u = F32Bits(f);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Branch-free IEEE binary16 conversions (after F. Giesen's half_to_float / float_to_half_rtne)
// so that the loops over them vectorize.
JR_HD float F16ToF32(uint16_t h) {
  const uint32_t shifted_exp = 0x7c00u << 13;
  uint32_t o = (static_cast<uint32_t>(h) & 0x7fffu) << 13;
  const uint32_t exp = shifted_exp & o;
  o += (127u - 15u) << 23;
  const uint32_t inf_nan = o + ((128u - 16u) << 23);
  // Subnormal halves: renormalize through one f32 subtraction (all operands are normal).
  const float sub = BitsF32(o + (1u << 23)) - BitsF32(113u << 23);
  o = exp == shifted_exp ? inf_nan : (exp == 0 ? F32Bits(sub) : o);
  return BitsF32(o | ((static_cast<uint32_t>(h) & 0x8000u) << 16));
}

JR_HD uint16_t F32ToF16(float f) {
  const uint32_t u = F32Bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  // Overflow (>= 65520 after rounding) -> Inf; NaN -> quiet NaN.
  const uint32_t big = a > kNonFiniteBits ? 0x7e00u : 0x7c00u;
  // Subnormal results: the f32 add aligns the mantissa and rounds to nearest even.
  const uint32_t denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  const uint32_t small = F32Bits(BitsF32(a) + BitsF32(denorm_magic)) - denorm_magic;
  const uint32_t mant_odd = (a >> 13) & 1u;
  const uint32_t normal = (a + (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + mant_odd) >> 13;
  const uint32_t o = a >= ((127u + 16u) << 23) ? big : (a < (113u << 23) ? small : normal);
  return static_cast<uint16_t>(o | sign);
}

}  // namespace jaxring

#endif  // JAXRING_XLA_EXT_NUMERICS_H_
