// Plain CPU kernels: loops over one row of a flat buffer. Each works on a range of blocks,
// chunks or elements so that callers can split a row over threads. On x86-64 each is compiled
// twice (baseline SSE2 and x86-64-v3/AVX2) and picked at load time by the CPU it runs on.
#ifndef JAXRING_XLA_EXT_CPU_KERNELS_H_
#define JAXRING_XLA_EXT_CPU_KERNELS_H_

#include <cstddef>
#include <cstdint>

namespace jaxring::cpu {

// Storage type of a float buffer; all arithmetic is f32.
enum class Wire { kF32, kBf16, kF16 };

// Encodes blocks [b0, b1) of x (n values, blocks of bs) into q and scales (numerics.h rules).
// The stochastic-rounding counter is the element index within the row.
void QuantizeBlocks(Wire wire, const void* x, int64_t n, int64_t bs, int64_t b0, int64_t b1,
                    bool stochastic, uint32_t key, int8_t* q, float* scales);

// out = q * scale for blocks [b0, b1), rounded to the wire type.
void DequantizeBlocks(Wire wire, const int8_t* q, const float* scales, int64_t n, int64_t bs,
                      int64_t b0, int64_t b1, void* out);

// out[i] = in[i] widened to f32 (exactly) for i in [i0, i1).
void WidenRange(Wire wire, const void* in, int64_t i0, int64_t i1, float* out);

// new_partial = decode(q, scales) + partial for blocks [b0, b1); then, when q_out is not null,
// the new partial is encoded again while its block is still in L1: one pass over memory.
void RingHopInt8Blocks(const int8_t* q, const float* scales, const float* partial, int64_t n,
                       int64_t bs, int64_t b0, int64_t b1, bool stochastic, uint32_t key,
                       float* new_partial, int8_t* q_out, float* scales_out);

// new_partial[i] = recv[i] + partial[i] in f32 and, when out is not null, out[i] = new_partial[i]
// rounded to the wire type, for i in [i0, i1).
void RingHopCastRange(Wire wire, const void* recv, const float* partial, int64_t i0, int64_t i1,
                      float* new_partial, void* out);

// L2 norms of chunks [c0, c1) of x (n values, chunks of cs): squares summed in f64, the root
// rounded once to f32.
void ChunkNormsRange(const float* x, int64_t n, int64_t cs, int64_t c0, int64_t c1, float* norms);

// Copies chunk idx[j] of x to out[j * cs, (j + 1) * cs) for j in [j0, j1); the tail of a
// partial last chunk is zero-filled. Indices must be in range.
void GatherChunksRange(const char* x, int64_t n, const int32_t* idx, int64_t cs, size_t width,
                       int64_t j0, int64_t j1, char* out);

// out[chunk idx[j]] += packed[j] for j in [0, k), in index order (duplicates add up); `out`
// already holds x. Indices must be in range.
void ScatterAddChunks(const int32_t* idx, int64_t k, const float* packed, int64_t n, int64_t cs,
                      float* out);

}  // namespace jaxring::cpu

#endif  // JAXRING_XLA_EXT_CPU_KERNELS_H_
