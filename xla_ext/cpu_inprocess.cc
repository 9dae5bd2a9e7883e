// In-process collectives for the CPU: the devices of one process share memory, so a level whose
// members all live in this process (the `local` level of one process per node) can reduce-scatter
// and all-gather by reading each other's buffers, instead of going through gloo's loopback TCP
// (XLA:CPU runs every collective of a multi-process program over gloo, even between two devices
// of one process).
//
// Each device's instance of the call rendezvouses with the others of its group under the key
// (run id, call site, group): it publishes its input pointer, waits until every member has,
// computes its part from all inputs, then waits until every member has finished reading before it
// returns (after which XLA may reuse the inputs). Every wait has a timeout that names the members
// that did not come; a group that timed out is marked abandoned, so a late member fails instead of
// reading buffers its peers no longer hold.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

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

std::mutex registry_mu;
std::map<Key, std::shared_ptr<Group>>& Registry() {
  static auto* groups = new std::map<Key, std::shared_ptr<Group>>();
  return *groups;
}

// A call inside a loop meets again under the same key in the same execution. Every member leaves
// an iteration only after all have finished it, so a member that finds its key's group finished
// is the first of the next iteration, and starts a new group.
std::shared_ptr<Group> Join(const Key& key, int64_t size) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto& g = Registry()[key];
  if (g) {
    std::lock_guard<std::mutex> group_lock(g->mu);
    if (g->finished == static_cast<int64_t>(g->inputs.size())) g.reset();
  }
  if (!g) g = std::make_shared<Group>(size);
  return g;
}

void Forget(const Key& key, const Group* done) {
  std::lock_guard<std::mutex> lock(registry_mu);
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

// Runs body(inputs) once every member has arrived, and returns once every member has finished.
template <class Body>
ffi::Error Rendezvous(std::string_view op, int64_t run_id, int64_t site, int64_t group_index,
                      int64_t rank, int64_t size, const void* input, int64_t bytes,
                      int64_t timeout_ms, Body&& body) {
  if (size < 1 || rank < 0 || rank >= size)
    return ffi::Error::InvalidArgument(std::string(op) + ": member " + std::to_string(rank) +
                                       " is outside a group of " + std::to_string(size));
  const Key key{run_id, site, group_index};
  auto g = Join(key, size);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  std::unique_lock<std::mutex> lock(g->mu);
  if (g->abandoned)
    return Fail(op, "member " + std::to_string(rank) + " arrived after its group gave up");
  if (g->inputs[rank] != nullptr)
    return ffi::Error::InvalidArgument(
        std::string(op) + ": member " + std::to_string(rank) + " of group " +
        std::to_string(group_index) + " arrived twice in one execution (run " +
        std::to_string(run_id) + ", call site " + std::to_string(site) + ", " +
        std::to_string(g->arrived) + " arrived, " + std::to_string(g->finished) + " finished)");
  if (g->bytes >= 0 && g->bytes != bytes)
    return ffi::Error::InvalidArgument(std::string(op) + ": members disagree on the size (" +
                                       std::to_string(bytes) + " vs " + std::to_string(g->bytes) +
                                       " bytes)");
  g->bytes = bytes;
  g->inputs[rank] = input;
  if (++g->arrived == size) g->cv.notify_all();
  if (!g->cv.wait_until(lock, deadline, [&] { return g->arrived == size || g->abandoned; }) ||
      g->abandoned) {
    const std::string who = Missing(*g, false);
    g->abandoned = true;
    g->inputs[rank] = nullptr;   // nobody may read it any more
    g->cv.notify_all();
    return Fail(op, "member " + std::to_string(rank) + " of group " +
                        std::to_string(group_index) + " waited " +
                        std::to_string(timeout_ms / 1000.0) + " s; member(s) " + who + " of " +
                        std::to_string(size) + " never arrived");
  }
  lock.unlock();
  body(g->inputs);
  lock.lock();
  if (++g->finished == size) {
    g->cv.notify_all();
    lock.unlock();
    Forget(key, g.get());
    return ffi::Error::Success();
  }
  // Members still read our input: wait for them (they have all arrived, so they are running).
  if (!g->cv.wait_until(lock, deadline + std::chrono::milliseconds(timeout_ms),
                        [&] { return g->finished == size; }))
    return Fail(op, "member " + std::to_string(rank) + " waited for its group to finish reading");
  return ffi::Error::Success();
}

ffi::Error LocalReduceScatterImpl(ffi::RunId run, AnyBuffer x, AnyBuffer member,
                                  Result<AnyBuffer> out, int64_t site, int64_t size,
                                  int64_t timeout_ms) {
  constexpr std::string_view op = "jaxring_local_reduce_scatter";
  if (x.element_type() != ffi::DataType::F32 || out->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument(std::string(op) + ": x and the result must be float32");
  const int64_t n = static_cast<int64_t>(x.element_count());
  const int64_t m = static_cast<int64_t>(out->element_count());
  if (size < 1 || m * size != n)
    return ffi::Error::InvalidArgument(std::string(op) + ": x has " + std::to_string(n) +
                                       " elements, not " + std::to_string(size) + " x " +
                                       std::to_string(m));
  const auto* ids = reinterpret_cast<const int32_t*>(member.untyped_data());
  const int64_t rank = ids[0], group = ids[1];
  float* o = reinterpret_cast<float*>(out->untyped_data());
  return Rendezvous(op, run.run_id, site, group, rank, size, x.untyped_data(), n * 4, timeout_ms,
                    [&](const std::vector<const void*>& inputs) {
                      // every member sums its chunk in member order: the same rounding on all
                      const float* first = static_cast<const float*>(inputs[0]) + rank * m;
                      std::memcpy(o, first, m * sizeof(float));
                      for (int64_t j = 1; j < size; ++j) {
                        const float* in = static_cast<const float*>(inputs[j]) + rank * m;
                        for (int64_t i = 0; i < m; ++i) o[i] += in[i];
                      }
                    });
}

ffi::Error LocalAllGatherImpl(ffi::RunId run, AnyBuffer x, AnyBuffer member,
                              Result<AnyBuffer> out, int64_t site, int64_t size,
                              int64_t timeout_ms) {
  constexpr std::string_view op = "jaxring_local_all_gather";
  const int64_t width = ffi::ByteWidth(x.element_type());
  const int64_t bytes = static_cast<int64_t>(x.element_count()) * width;
  if (out->element_type() != x.element_type() ||
      static_cast<int64_t>(out->element_count()) != size * static_cast<int64_t>(x.element_count()))
    return ffi::Error::InvalidArgument(std::string(op) + ": the result must hold " +
                                       std::to_string(size) + " copies of x's elements and type");
  const auto* ids = reinterpret_cast<const int32_t*>(member.untyped_data());
  const int64_t rank = ids[0], group = ids[1];
  char* o = reinterpret_cast<char*>(out->untyped_data());
  return Rendezvous(op, run.run_id, site, group, rank, size, x.untyped_data(), bytes, timeout_ms,
                    [&](const std::vector<const void*>& inputs) {
                      for (int64_t j = 0; j < size; ++j)
                        std::memcpy(o + j * bytes, inputs[j], bytes);
                    });
}

}  // namespace
}  // namespace jaxring

namespace ffi = xla::ffi;

namespace {
// Both in-process collectives take (x, [member, group]) and return one buffer.
auto LocalCollectiveBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::RunId>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Attr<int64_t>("site")
      .Attr<int64_t>("size")
      .Attr<int64_t>("timeout_ms");
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringLocalReduceScatterCpu, jaxring::LocalReduceScatterImpl,
                              LocalCollectiveBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringLocalAllGatherCpu, jaxring::LocalAllGatherImpl,
                              LocalCollectiveBinding());
