// What every CPU handler does around its kernels (cpu_handlers.cc, cpu_fp4_handlers.cc): split a
// row over XLA's intra-op pool, key a row's stochastic rounding, read typed buffers, and find a
// windowed call's chunk inside its base buffer.
#ifndef JAXRING_XLA_EXT_CPU_ROWS_H_
#define JAXRING_XLA_EXT_CPU_ROWS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string_view>
#include <thread>

#include "checks.h"
#include "cpu_kernels.h"
#include "numerics.h"
#include "xla/ffi/api/ffi.h"

namespace jaxring {

// Splitting over XLA's intra-op pool is opt-in (JAXRING_CPU_THREADS=N, N > 1): on the 2-core
// development machine two threads measured no faster than one for any kernel at 64 MiB (the
// kernels are memory-bound, and emulated devices already keep every core busy), while the waiting
// costs CPU. Parts are at least this many bytes.
constexpr int64_t kMinBytesPerPart = int64_t{4} << 20;

inline int64_t MaxThreadsFromEnv() {
  const char* s = std::getenv("JAXRING_CPU_THREADS");  // read per call: ~100 ns next to >= 4 MiB
  return s ? std::max<int64_t>(1, std::atoll(s)) : 1;
}

// Runs fn(lo, hi) over [0, items) in parts. Parts are claimed from a shared counter by the
// calling thread and by pool tasks alike, and the caller waits only for parts already running,
// so a busy (or absent) pool never deadlocks it: it just does the work itself.
template <class F>
void ParallelFor(ffi::ThreadPool& pool, int64_t items, int64_t bytes, F&& fn) {
  int64_t parts = std::min<int64_t>({pool.num_threads() + 1, MaxThreadsFromEnv(),
                                     bytes / kMinBytesPerPart, items});
  if (parts <= 1) {
    if (items > 0) fn(int64_t{0}, items);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  auto run = [state, parts, items, &fn] {
    for (int64_t p; (p = state->next.fetch_add(1)) < parts;) {
      fn(items * p / parts, items * (p + 1) / parts);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t p = 1; p < parts; ++p) pool.Schedule(decltype(run)(run));
  run();
  while (state->done.load(std::memory_order_acquire) < parts) std::this_thread::yield();
}

inline uint32_t RowKey(const ffi::AnyBuffer& seed, int64_t row) {
  return SeedKey(reinterpret_cast<const uint32_t*>(seed.untyped_data())[row]);
}

inline cpu::Wire WireOf(ffi::DataType t) {
  return t == ffi::DataType::BF16 ? cpu::Wire::kBf16
                             : (t == ffi::DataType::F16 ? cpu::Wire::kF16 : cpu::Wire::kF32);
}

template <typename T>
T* Data(const ffi::AnyBuffer& b) {
  return reinterpret_cast<T*>(b.untyped_data());
}

// The ring hands its whole f32 buffer and the chunk's first element (an int32 scalar operand,
// traced in SPMD programs, where it depends on the device's rank); a sliced operand would be
// copied by XLA before the call (docs/design.md, "The ring's chunks are read in place").
inline ffi::Error Window(std::string_view op, const ffi::AnyBuffer& base,
                         const ffi::AnyBuffer& offset, int64_t n, const float** out) {
  JR_RETURN_IF_ERROR(CheckDType(op, "base", base.element_type(), {ffi::DataType::F32}));
  if (base.dimensions().size() != 1)
    return InvalidArgument(op, "base must be flat, got shape ", DimsString(base.dimensions()));
  if (offset.element_type() != ffi::DataType::S32 || offset.dimensions().size() != 0)
    return InvalidArgument(op, "offset must be an int32 scalar, got ",
                           DTypeName(offset.element_type()), DimsString(offset.dimensions()));
  const int64_t off = *Data<const int32_t>(offset), len = base.dimensions()[0];
  if (off < 0 || off + n > len)
    return InvalidArgument(op, "the window [", off, ", ", off + n, ") of ", n,
                           " elements is not inside base of ", len);
  *out = Data<const float>(base) + off;
  return ffi::Error::Success();
}

}  // namespace jaxring

#endif  // JAXRING_XLA_EXT_CPU_ROWS_H_
