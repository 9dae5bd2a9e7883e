// Launch markers for the stuck-peer check (jaxring/_src/reliability/launches.py): the custom call
// "jaxring_launch_mark" sits on the data path of each collective of a multi-process job (its result
// is tied to the collective's input by an optimization barrier, so it runs before the collective)
// and counts, per collective key, the launches of programs that reached it. The devices of one
// process run their instance under the same run id: a launch is counted once, by the first.
//
// The handler only counts on the host: it neither reads nor writes a buffer (its result is a
// placeholder that the barrier holds), so the same handler serves the CPU and CUDA platforms.
// Python reads the table through the nanobind functions of ext.cc.
#include "launches.h"

#include <time.h>

#include <climits>
#include <cstdint>
#include <list>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "handlers.h"
#include "xla/ffi/api/ffi.h"

namespace jaxring {
namespace ffi = xla::ffi;
namespace {

struct Entry {
  int64_t count = 0;
  int64_t last_run = INT64_MIN;
  std::list<std::string>::iterator at;  // its place in Table::order
};

struct Table {
  std::mutex mu;
  std::list<std::string> order;  // least recently launched first
  std::unordered_map<std::string, Entry> entries;
  LaunchLatest latest;
  int64_t version = 0;
};

// Never destroyed: a program may still be running while the process exits.
Table& Launches() {
  static auto* table = new Table();
  return *table;
}

double MonotonicSeconds() {  // the clock of Python's time.monotonic() on Linux
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

ffi::Error LaunchMarkImpl(ffi::RunId run, ffi::Result<ffi::AnyBuffer>, std::string_view key) {
  Table& t = Launches();
  std::lock_guard<std::mutex> lock(t.mu);
  auto [it, fresh] = t.entries.try_emplace(std::string(key));
  Entry& e = it->second;
  if (!fresh && e.last_run == run.run_id) return ffi::Error::Success();  // another local device
  if (!fresh) t.order.erase(e.at);
  e.at = t.order.insert(t.order.end(), it->first);
  e.last_run = run.run_id;
  e.count += 1;
  t.latest = LaunchLatest{true, it->first, e.count, MonotonicSeconds()};
  t.version += 1;
  while (t.order.size() > kLaunchKeep) {
    t.entries.erase(t.order.front());
    t.order.pop_front();
  }
  return ffi::Error::Success();
}

}  // namespace

std::vector<std::pair<std::string, int64_t>> LaunchTable() {
  Table& t = Launches();
  std::lock_guard<std::mutex> lock(t.mu);
  std::vector<std::pair<std::string, int64_t>> out;
  out.reserve(t.order.size());
  for (const std::string& key : t.order) out.emplace_back(key, t.entries.at(key).count);
  return out;
}

LaunchLatest LaunchLatestEntry() {
  Table& t = Launches();
  std::lock_guard<std::mutex> lock(t.mu);
  return t.latest;
}

int64_t LaunchVersion() {
  Table& t = Launches();
  std::lock_guard<std::mutex> lock(t.mu);
  return t.version;
}

void LaunchReset() {
  Table& t = Launches();
  std::lock_guard<std::mutex> lock(t.mu);
  t.entries.clear();
  t.order.clear();
  t.latest = LaunchLatest{};
  t.version += 1;
}

}  // namespace jaxring

#define JAXRING_LAUNCH_MARK_BINDING                                  \
  xla::ffi::Ffi::Bind()                                              \
      .Ctx<xla::ffi::RunId>()                                        \
      .Ret<xla::ffi::AnyBuffer>()                                    \
      .Attr<std::string_view>("key")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringLaunchMarkCpu, jaxring::LaunchMarkImpl,
                              JAXRING_LAUNCH_MARK_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringLaunchMarkCuda, jaxring::LaunchMarkImpl,
                              JAXRING_LAUNCH_MARK_BINDING);
