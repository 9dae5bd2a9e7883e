// binary16 kernels on x86-64-v3 (F16C conversions, AVX2 arithmetic): the software conversions in
// numerics.h take ~10 vector operations per 8 halves, which made every kernel that reads or writes
// float16 3-4x slower than a memory copy. Same results as the software path (NaN payloads aside).
#ifndef JAXRING_XLA_EXT_CPU_F16C_H_
#define JAXRING_XLA_EXT_CPU_F16C_H_

#include <cstdint>

namespace jaxring::cpu {

// Whether the kernels below can run here: an x86-64-v3 CPU, and JAXRING_CPU_F16C is not "0"
// (which forces the portable path, for tests).
bool UseF16c();

void QuantizeF16Blocks(const uint16_t* x, int64_t n, int64_t bs, int64_t b0, int64_t b1,
                       bool stochastic, uint32_t key, int8_t* q, float* scales);
void DequantizeF16Blocks(const int8_t* q, const float* scales, int64_t n, int64_t bs, int64_t b0,
                         int64_t b1, uint16_t* out);
void RingHopCastF16Range(const uint16_t* recv, const float* partial, int64_t i0, int64_t i1,
                         float* new_partial, uint16_t* out);

// Blocks longer than this take the portable path (the tiles live on the stack).
constexpr int64_t kF16Tile = 4096;

}  // namespace jaxring::cpu

#endif  // JAXRING_XLA_EXT_CPU_F16C_H_
