// Host side of every CUDA handler (cuda_handlers.cu, cuda_fp4.cu): the wire type's kernel for a
// dtype, grid sizes, typed buffer pointers, alignment, and the launch's error. Included after
// cuda_wire.cuh, in the including translation unit's anonymous namespace.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>

#include "cuda_wire.cuh"
#include "xla/ffi/api/ffi.h"

namespace jaxring {
namespace {

namespace ffi = xla::ffi;

#define JR_CUDA_DISPATCH_WIRE(dtype, KERNEL, ...)                   \
  switch (dtype) {                                                  \
    case ffi::DataType::F32: KERNEL<DF32>(__VA_ARGS__); break;      \
    case ffi::DataType::BF16: KERNEL<DBf16>(__VA_ARGS__); break;    \
    default: KERNEL<DF16>(__VA_ARGS__); break;                      \
  }

inline int64_t GridFor(int64_t work, int64_t per_block) {
  return std::max<int64_t>(1, std::min<int64_t>((work + per_block - 1) / per_block, kMaxGrid));
}

inline int ThreadsForBlock(int64_t block) {
  return static_cast<int>(std::min<int64_t>(kThreads, (block + 31) / 32 * 32));
}

inline ffi::Error LaunchError(std::string_view op) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(op) + ": CUDA error: " + cudaGetErrorString(e));
}

template <typename T>
const T* In(const ffi::AnyBuffer& b) {
  return reinterpret_cast<const T*>(b.untyped_data());
}
template <typename T>
T* Out(const ffi::AnyBuffer& b) {
  return reinterpret_cast<T*>(b.untyped_data());
}

inline bool Aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

}  // namespace
}  // namespace jaxring
