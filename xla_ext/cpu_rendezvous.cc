// The in-process collectives' rendezvous (cpu_rendezvous.h): the groups of members that meet
// under one key, their registry, the waits and their timeouts, and the call-site state XLA
// instantiates for each custom-call instruction.
#include "cpu_rendezvous.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "handlers.h"
#include "xla/ffi/api/ffi.h"

namespace jaxring {

ffi::TypeId CallSite::id = {};

namespace {

struct Group {
  explicit Group(int64_t size) : inputs(size, nullptr) {}
  std::mutex mu;
  std::condition_variable cv;
  std::vector<const void*> inputs;
  int64_t arrived = 0, finished = 0, bytes = -1;
  bool abandoned = false;
};

using Key = std::tuple<int64_t, int64_t, int64_t>;  // run id, call site, group index

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

}  // namespace

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

const void* CallSiteTypeId() { return &CallSite::id; }
const void* CallSiteTypeInfo() { return &kCallSiteInfo; }
}  // namespace jaxring

namespace ffi = xla::ffi;

// Every in-process target's instantiate stage: its call site (see CallSite).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringLocalCallSiteCpu, jaxring::NewCallSite,
                              ffi::Ffi::BindInstantiate());
