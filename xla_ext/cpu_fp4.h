// Plain CPU kernels of the fp4 (e2m1) block codec: loops over one row of a flat buffer, on a range
// of blocks so that callers can split a row over threads, compiled like cpu_kernels.h's (baseline
// and x86-64-v3, picked at load time). Codes are packed two to a byte (numerics.h); block sizes
// are even, so every block starts on a byte and a block's codes are bytes [start / 2, ...).
#ifndef JAXRING_XLA_EXT_CPU_FP4_H_
#define JAXRING_XLA_EXT_CPU_FP4_H_

#include <cstdint>

#include "cpu_kernels.h"

namespace jaxring::cpu {

// Encodes blocks [b0, b1) of x (n values of the wire type, blocks of bs) into packed codes q
// (ceil(n / 2) bytes a row) and scales. The stochastic-rounding counter is the element index.
void QuantizeFp4Blocks(Wire wire, const void* x, int64_t n, int64_t bs, int64_t b0, int64_t b1,
                       bool stochastic, uint32_t key, uint8_t* q, float* scales);

// out = value(code) * scale for blocks [b0, b1), rounded to the wire type.
void DequantizeFp4Blocks(Wire wire, const uint8_t* q, const float* scales, int64_t n, int64_t bs,
                         int64_t b0, int64_t b1, void* out);

// new_partial = decode(q, scales) + partial for blocks [b0, b1); then, when q_out is not null,
// each block is encoded again while it is in L1.
void RingHopFp4Blocks(const uint8_t* q, const float* scales, const float* partial, int64_t n,
                      int64_t bs, int64_t b0, int64_t b1, bool stochastic, uint32_t key,
                      float* new_partial, uint8_t* q_out, float* scales_out);

// The same for f32 blocks with AVX2 (cpu_fp4_v3.cc), where UseFp4V3(): an x86-64-v3 CPU, and
// JAXRING_CPU_FP4_V3 is not "0" (which forces the portable path, for tests). Same bits.
bool UseFp4V3();
void QuantizeFp4F32BlocksV3(const float* x, int64_t n, int64_t bs, int64_t b0, int64_t b1,
                            bool stochastic, uint32_t key, uint8_t* q, float* scales);
void DequantizeFp4F32BlocksV3(const uint8_t* q, const float* scales, int64_t n, int64_t bs,
                              int64_t b0, int64_t b1, float* out);
void RingHopFp4BlocksV3(const uint8_t* q, const float* scales, const float* partial, int64_t n,
                        int64_t bs, int64_t b0, int64_t b1, bool stochastic, uint32_t key,
                        float* new_partial, uint8_t* q_out, float* scales_out);

}  // namespace jaxring::cpu

#endif  // JAXRING_XLA_EXT_CPU_FP4_H_
