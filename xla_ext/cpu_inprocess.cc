// In-process collectives for the CPU: the devices of one process share memory, so a level whose
// members all live in this process (the `local` level of one process per node) can reduce-scatter
// and all-gather by reading each other's buffers, instead of going through gloo's loopback TCP
// (XLA:CPU runs every collective of a multi-process program over gloo, even between two devices
// of one process).
//
// Each device's instance of the call rendezvouses with the others of its group under the key
// (run id, call site, group), the call site being the custom-call instruction itself: XLA
// instantiates a state for each of its thunks (CallSite), and every device of the process runs the
// same thunks. A program that calls one jitted function twice holds two instructions, and two
// sites, where a site numbered at trace time was one (JAX traces and lowers that function once).
// The instance publishes its input pointer, waits until every member has, computes its part from
// all inputs, then waits until every member has finished reading before it returns (after which
// XLA may reuse the inputs). Every wait has a timeout that names the members
// that did not come; a group that timed out is marked abandoned, so a late member fails instead of
// reading buffers its peers no longer hold.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_stream.h"
#include "handlers.h"
#include "xla/ffi/api/ffi.h"

namespace jaxring {
namespace ffi = xla::ffi;
namespace {

using ffi::AnyBuffer;
using ffi::Result;

struct Group {
  explicit Group(int64_t size) : inputs(size, nullptr) {}
  std::mutex mu;
  std::condition_variable cv;
  std::vector<const void*> inputs;
  int64_t arrived = 0, finished = 0, bytes = -1;
  bool abandoned = false;
};

using Key = std::tuple<int64_t, int64_t, int64_t>;  // run id, call site, group index

// A call site: one custom-call instruction of a compiled program, numbered when XLA creates its
// thunk (the handlers' instantiate stage).
struct CallSite {
  static ffi::TypeId id;
  int64_t serial;
};
ffi::TypeId CallSite::id = {};
constexpr XLA_FFI_TypeInfo kCallSiteInfo = ffi::MakeTypeInfo<CallSite>();

ffi::ErrorOr<std::unique_ptr<CallSite>> NewCallSite() {
  static auto* next = new std::atomic<int64_t>(1);
  return std::make_unique<CallSite>(CallSite{next->fetch_add(1)});
}

// Never destroyed: a parked member's thread may still be waiting while the process exits.
std::mutex& RegistryMutex() {
  static auto* mu = new std::mutex();
  return *mu;
}
std::map<Key, std::shared_ptr<Group>>& Registry() {
  static auto* groups = new std::map<Key, std::shared_ptr<Group>>();
  return *groups;
}

// A call inside a loop meets again under the same key in the same execution. Every member leaves
// an iteration only after all have finished it, so a member that finds its key's group finished
// is the first of the next iteration, and starts a new group.
std::shared_ptr<Group> Join(const Key& key, int64_t size) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto& g = Registry()[key];
  if (g) {
    std::lock_guard<std::mutex> group_lock(g->mu);
    if (g->finished == static_cast<int64_t>(g->inputs.size())) g.reset();
  }
  if (!g) g = std::make_shared<Group>(size);
  return g;
}

void Forget(const Key& key, const Group* done) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(key);
  if (it != Registry().end() && it->second.get() == done) Registry().erase(it);
}

std::string Missing(const Group& g, bool finishing) {
  std::ostringstream s;
  s << "[";
  bool first = true;
  for (size_t r = 0; r < g.inputs.size(); ++r)
    if (finishing ? false : g.inputs[r] == nullptr) {
      s << (first ? "" : ", ") << r;
      first = false;
    }
  s << "]";
  return s.str();
}

ffi::Error Fail(std::string_view op, const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, std::string(op) + ": " + msg);
}

// One member's part of the collective, run once every member has arrived: it reads the members'
// inputs and writes this member's result. It may run after the handler has returned (on the
// thread of a parked member), so it owns copies of everything it uses.
using Body = std::function<void(const std::vector<const void*>&)>;

ffi::Future Done(ffi::Error error) {
  ffi::Promise promise;
  ffi::Future future(promise);
  if (error.success()) {
    promise.SetAvailable();
  } else {
    promise.SetError(std::move(error));
  }
  return future;
}

// Waits (the group's lock held) until every member has arrived, or fails naming those that have
// not; a group that timed out is abandoned, and this member's input is withdrawn.
ffi::Error AwaitArrivals(std::string_view op, Group& g, std::unique_lock<std::mutex>& lock,
                         int64_t group_index, int64_t rank, int64_t timeout_ms,
                         std::chrono::steady_clock::time_point deadline) {
  const int64_t size = static_cast<int64_t>(g.inputs.size());
  if (g.cv.wait_until(lock, deadline, [&] { return g.arrived == size || g.abandoned; }) &&
      !g.abandoned)
    return ffi::Error::Success();
  const std::string who = Missing(g, false);
  g.abandoned = true;
  g.inputs[rank] = nullptr;   // nobody may read it any more
  g.cv.notify_all();
  return Fail(op, "member " + std::to_string(rank) + " of group " + std::to_string(group_index) +
                      " waited " + std::to_string(timeout_ms / 1000.0) + " s; member(s) " + who +
                      " of " + std::to_string(size) + " never arrived");
}

// Runs this member's part, then waits until every member has finished reading its input (after
// the call completes XLA may reuse it). The others have all arrived, so the wait is bounded by
// their work, never by what their devices do next.
ffi::Error WorkAndFinish(std::string_view op, const std::shared_ptr<Group>& g, const Key& key,
                         int64_t rank, const Body& body,
                         std::chrono::steady_clock::time_point deadline) {
  body(g->inputs);
  std::unique_lock<std::mutex> lock(g->mu);
  const int64_t size = static_cast<int64_t>(g->inputs.size());
  if (++g->finished == size) {
    g->cv.notify_all();
    lock.unlock();
    Forget(key, g.get());
    return ffi::Error::Success();
  }
  if (!g->cv.wait_until(lock, deadline, [&] { return g->finished == size; }))
    return Fail(op, "member " + std::to_string(rank) + " waited for its group to finish reading");
  return ffi::Error::Success();
}

// The rendezvous of one member. The last member to arrive does its part on XLA's thread and
// returns a completed future. A member that arrives earlier parks: it returns a pending future at
// once and leaves the waiting, its part and the completion to a thread of its own. XLA's thunk
// executor goes on with the device's other ready operations meanwhile, so two devices of this
// process that reach independent collectives (ours, or XLA's gloo ones) in different orders both
// make progress; a member blocking XLA's thread here used to hold back the very call its peer
// was blocked in. Completing the future runs the device's next operations on the parked
// member's thread, so that thread completes nothing else after it.
ffi::Future Rendezvous(std::string_view op, int64_t run_id, int64_t site, int64_t group_index,
                       int64_t rank, int64_t size, const void* input, int64_t bytes,
                       int64_t timeout_ms, Body body) {
  if (size < 1 || rank < 0 || rank >= size)
    return Done(ffi::Error::InvalidArgument(std::string(op) + ": member " +
                                            std::to_string(rank) + " is outside a group of " +
                                            std::to_string(size)));
  const Key key{run_id, site, group_index};
  auto g = Join(key, size);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  const auto finish_by = deadline + std::chrono::milliseconds(timeout_ms);
  std::unique_lock<std::mutex> lock(g->mu);
  if (g->abandoned)
    return Done(Fail(op, "member " + std::to_string(rank) + " arrived after its group gave up"));
  if (g->inputs[rank] != nullptr)
    return Done(ffi::Error::InvalidArgument(
        std::string(op) + ": member " + std::to_string(rank) + " of group " +
        std::to_string(group_index) + " arrived twice in one execution (run " +
        std::to_string(run_id) + ", call site " + std::to_string(site) + ", " +
        std::to_string(g->arrived) + " arrived, " + std::to_string(g->finished) + " finished)"));
  if (g->bytes >= 0 && g->bytes != bytes)
    return Done(ffi::Error::InvalidArgument(std::string(op) + ": members disagree on the size (" +
                                            std::to_string(bytes) + " vs " +
                                            std::to_string(g->bytes) + " bytes)"));
  g->bytes = bytes;
  g->inputs[rank] = input;
  if (++g->arrived == size) {
    g->cv.notify_all();
    lock.unlock();
    return Done(WorkAndFinish(op, g, key, rank, body, finish_by));
  }
  lock.unlock();
  ffi::Promise promise;
  ffi::Future future(promise);
  std::thread([op, g, key, group_index, rank, timeout_ms, deadline, finish_by,
               body = std::move(body), promise]() mutable {
    ffi::Error error = ffi::Error::Success();
    {
      std::unique_lock<std::mutex> lock(g->mu);
      error = AwaitArrivals(op, *g, lock, group_index, rank, timeout_ms, deadline);
    }
    if (error.success()) error = WorkAndFinish(op, g, key, rank, body, finish_by);
    if (error.success()) {
      promise.SetAvailable();
    } else {
      promise.SetError(std::move(error));
    }
  }).detach();
  return future;
}

// ``order`` describes the chunks as rows: x is order.size() equal rows, ``size`` members x ``R``
// rows each, and member ``rank``'s row k is row order[rank * R + k] of x (identity: 0, 1, ...).
// Reading the rows where they lie spares the caller a permuting copy of x.
ffi::Error CheckOrder(std::string_view op, ffi::Span<const int64_t> order, int64_t size,
                      int64_t units) {
  const int64_t rows = static_cast<int64_t>(order.size());
  if (size < 1 || rows < size || rows % size || units % rows)
    return ffi::Error::InvalidArgument(std::string(op) + ": " + std::to_string(units) +
                                       " units do not split into " + std::to_string(rows) +
                                       " rows of " + std::to_string(size) + " members");
  for (int64_t r : order)
    if (r < 0 || r >= rows)
      return ffi::Error::InvalidArgument(std::string(op) + ": order names row " +
                                         std::to_string(r) + " of " + std::to_string(rows));
  return ffi::Error::Success();
}

// out[i] = sum_j in[j][i], in member order (the same rounding on every member), one pass over
// the output for the first two members. Stored normally, not streamed (cpu_stream.h): the next
// level reads this shard right away (streaming it measured 10% slower on the FSDP int8 call).
void SumRows(float* out, const std::vector<const float*>& in, int64_t n) {
  if (in.size() == 1) {
    std::memcpy(out, in[0], n * sizeof(float));
    return;
  }
  const float* a = in[0];
  const float* b = in[1];
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
  for (size_t j = 2; j < in.size(); ++j) {
    const float* c = in[j];
    for (int64_t i = 0; i < n; ++i) out[i] += c[i];
  }
}

ffi::Future LocalReduceScatterImpl(ffi::RunId run, CallSite* site, AnyBuffer x, AnyBuffer member,
                                   Result<AnyBuffer> out, int64_t size, int64_t timeout_ms,
                                   ffi::Span<const int64_t> order) {
  constexpr std::string_view op = "jaxring_local_reduce_scatter";
  if (x.element_type() != ffi::DataType::F32 || out->element_type() != ffi::DataType::F32)
    return Done(ffi::Error::InvalidArgument(std::string(op) +
                                            ": x and the result must be float32"));
  const int64_t n = static_cast<int64_t>(x.element_count());
  const int64_t m = static_cast<int64_t>(out->element_count());
  if (size < 1 || m * size != n)
    return Done(ffi::Error::InvalidArgument(std::string(op) + ": x has " + std::to_string(n) +
                                            " elements, not " + std::to_string(size) + " x " +
                                            std::to_string(m)));
  if (auto e = CheckOrder(op, order, size, n); e.failure()) return Done(std::move(e));
  const int64_t per = static_cast<int64_t>(order.size()) / size, len = m / per;
  const auto* ids = reinterpret_cast<const int32_t*>(member.untyped_data());
  const int64_t rank = ids[0], group = ids[1];
  float* o = reinterpret_cast<float*>(out->untyped_data());
  // this member's rows, in the order it reads them
  std::vector<int64_t> mine(order.begin() + rank * per, order.begin() + (rank + 1) * per);
  return Rendezvous(op, run.run_id, site->serial, group, rank, size, x.untyped_data(), n * 4,
                    timeout_ms,
                    [o, len, mine = std::move(mine)](const std::vector<const void*>& inputs) {
                      std::vector<const float*> rows(inputs.size());
                      for (size_t k = 0; k < mine.size(); ++k) {
                        for (size_t j = 0; j < inputs.size(); ++j)
                          rows[j] = static_cast<const float*>(inputs[j]) + mine[k] * len;
                        SumRows(o + k * len, rows, len);
                      }
                    });
}

// ``order``: the result is order.size() rows, member j's input being rows j * R .. j * R + R - 1
// of the members' concatenation; result row i is row order[i] of it (identity: 0, 1, ...).
ffi::Future LocalAllGatherImpl(ffi::RunId run, CallSite* site, AnyBuffer x, AnyBuffer member,
                               Result<AnyBuffer> out, int64_t size, int64_t timeout_ms,
                               ffi::Span<const int64_t> order) {
  constexpr std::string_view op = "jaxring_local_all_gather";
  const int64_t width = ffi::ByteWidth(x.element_type());
  const int64_t bytes = static_cast<int64_t>(x.element_count()) * width;
  if (out->element_type() != x.element_type() ||
      static_cast<int64_t>(out->element_count()) != size * static_cast<int64_t>(x.element_count()))
    return Done(ffi::Error::InvalidArgument(std::string(op) + ": the result must hold " +
                                            std::to_string(size) +
                                            " copies of x's elements and type"));
  if (auto e = CheckOrder(op, order, size, size * static_cast<int64_t>(x.element_count()));
      e.failure())
    return Done(std::move(e));
  const int64_t per = static_cast<int64_t>(order.size()) / size, row = bytes / per;
  const auto* ids = reinterpret_cast<const int32_t*>(member.untyped_data());
  const int64_t rank = ids[0], group = ids[1];
  char* o = reinterpret_cast<char*>(out->untyped_data());
  const bool stream = size * bytes >= cpu::kStreamMinBytes;
  return Rendezvous(op, run.run_id, site->serial, group, rank, size, x.untyped_data(), bytes,
                    timeout_ms,
                    [o, per, row, stream, order = std::vector<int64_t>(order.begin(), order.end())](
                        const std::vector<const void*>& inputs) {
                      for (size_t i = 0; i < order.size(); ++i) {
                        const int64_t src = order[i];
                        const char* from =
                            static_cast<const char*>(inputs[src / per]) + (src % per) * row;
                        if (stream) {
                          cpu::StreamBytes(o + i * row, from, row);
                        } else {
                          std::memcpy(o + i * row, from, row);
                        }
                      }
                      if (stream) cpu::StreamFence();
                    });
}

// The last gather of a level whose payload travelled encoded, decoded as it is copied: each
// member reads the others' codes where they lie and writes f32 rows into ``order``'s places,
// instead of gathering the codes into a buffer of their own and decoding that (two more passes
// over the codes). ``x``: int8 codes with ``scales`` (f32, one per ``block_size`` values; rows
// hold whole blocks), or 16-bit floats (bf16, f16; ``scales`` unused), widened exactly.
struct Encoded {
  const void* values;
  const float* scales;
};

ffi::Future LocalAllGatherDecodeImpl(ffi::RunId run, CallSite* site, AnyBuffer x,
                                     AnyBuffer scales, AnyBuffer member, Result<AnyBuffer> out,
                                     int64_t size, int64_t timeout_ms,
                                     ffi::Span<const int64_t> order, int64_t block_size) {
  constexpr std::string_view op = "jaxring_local_all_gather_decode";
  const ffi::DataType type = x.element_type();
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (out->element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(out->element_count()) != size * n)
    return Done(ffi::Error::InvalidArgument(std::string(op) +
                                            ": the result must be float32 holding " +
                                            std::to_string(size) + " x " + std::to_string(n) +
                                            " values"));
  if (auto e = CheckOrder(op, order, size, size * n); e.failure()) return Done(std::move(e));
  const int64_t per = static_cast<int64_t>(order.size()) / size, len = n / per;
  const bool int8 = type == ffi::DataType::S8;
  if (int8 && (block_size < 1 || len % block_size ||
               static_cast<int64_t>(scales.element_count()) != n / block_size ||
               scales.element_type() != ffi::DataType::F32))
    return Done(ffi::Error::InvalidArgument(
        std::string(op) + ": int8 rows of " + std::to_string(len) + " codes need whole blocks of " +
        std::to_string(block_size) + " and one f32 scale each"));
  if (!int8 && type != ffi::DataType::BF16 && type != ffi::DataType::F16)
    return Done(ffi::Error::InvalidArgument(std::string(op) +
                                            ": x must be int8, bfloat16 or float16"));
  const cpu::Wire wire = type == ffi::DataType::BF16 ? cpu::Wire::kBf16 : cpu::Wire::kF16;
  const int64_t width = ffi::ByteWidth(type);
  const auto* ids = reinterpret_cast<const int32_t*>(member.untyped_data());
  const int64_t rank = ids[0], group = ids[1];
  // what the others read, alive while this member's part is (which ends after theirs)
  auto mine = std::make_shared<const Encoded>(
      Encoded{x.untyped_data(), reinterpret_cast<const float*>(scales.untyped_data())});
  float* o = reinterpret_cast<float*>(out->untyped_data());
  const bool stream = size * n * 4 >= cpu::kStreamMinBytes;
  return Rendezvous(op, run.run_id, site->serial, group, rank, size, mine.get(), n * width,
                    timeout_ms,
                    [mine, o, len, per, int8, wire, width, block_size, stream,
                     order = std::vector<int64_t>(order.begin(), order.end())](
                        const std::vector<const void*>& inputs) {
                      // a tile of whole blocks; decoded straight into place when not streaming
                      const int64_t step =
                          !stream ? len
                                  : (int8 ? std::max<int64_t>(1, cpu::kStreamTile / block_size) *
                                                block_size
                                          : cpu::kStreamTile);
                      std::vector<float> tile(stream ? step : 0);
                      for (size_t i = 0; i < order.size(); ++i) {
                        const int64_t src = order[i], k = src % per;
                        const auto* e = static_cast<const Encoded*>(inputs[src / per]);
                        float* row = o + i * len;
                        for (int64_t i0 = 0; i0 < len; i0 += step) {
                          const int64_t cnt = std::min(step, len - i0), at = k * len + i0;
                          float* dst = stream ? tile.data() : row + i0;
                          if (int8) {
                            cpu::DequantizeBlocks(cpu::Wire::kF32,
                                                  static_cast<const int8_t*>(e->values) + at,
                                                  e->scales + at / block_size, cnt, block_size,
                                                  0, cnt / block_size, dst);
                          } else {
                            cpu::WidenRange(wire, static_cast<const char*>(e->values) + at * width,
                                            0, cnt, dst);
                          }
                          if (stream) cpu::StreamBytes(row + i0, dst, cnt * sizeof(float));
                        }
                      }
                      if (stream) cpu::StreamFence();
                    });
}

}  // namespace

const void* CallSiteTypeId() { return &CallSite::id; }
const void* CallSiteTypeInfo() { return &kCallSiteInfo; }
}  // namespace jaxring

namespace ffi = xla::ffi;

// Every in-process target's instantiate stage: its call site (see CallSite).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringLocalCallSiteCpu, jaxring::NewCallSite,
                              ffi::Ffi::BindInstantiate());

namespace {
// What every in-process collective takes after its buffers; ``order`` places the rows
// (identity: 0 .. size - 1).
template <class Binding>
auto GroupAttrs(Binding binding) {
  return std::move(binding).template Attr<int64_t>("size")
      .template Attr<int64_t>("timeout_ms")
      .template Attr<ffi::Span<const int64_t>>("order");
}

// (x, [member, group]) -> one buffer.
auto LocalCollectiveBinding() {
  return GroupAttrs(ffi::Ffi::Bind()
                        .Ctx<ffi::RunId>()
                        .Ctx<ffi::State<jaxring::CallSite>>()
                        .Arg<ffi::AnyBuffer>()
                        .Arg<ffi::AnyBuffer>()
                        .Ret<ffi::AnyBuffer>());
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringLocalReduceScatterCpu, jaxring::LocalReduceScatterImpl,
                              LocalCollectiveBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringLocalAllGatherCpu, jaxring::LocalAllGatherImpl,
                              LocalCollectiveBinding());
// (codes, scales, [member, group]) -> decoded f32.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringLocalAllGatherDecodeCpu, jaxring::LocalAllGatherDecodeImpl,
                              GroupAttrs(ffi::Ffi::Bind()
                                             .Ctx<ffi::RunId>()
                                             .Ctx<ffi::State<jaxring::CallSite>>()
                                             .Arg<ffi::AnyBuffer>()
                                             .Arg<ffi::AnyBuffer>()
                                             .Arg<ffi::AnyBuffer>()
                                             .Ret<ffi::AnyBuffer>())
                                  .Attr<int64_t>("block_size"));
