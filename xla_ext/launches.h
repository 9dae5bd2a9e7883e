// The launch markers' table (launches.cc), read by Python through ext.cc.
#ifndef JAXRING_XLA_EXT_LAUNCHES_H_
#define JAXRING_XLA_EXT_LAUNCHES_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace jaxring {

// The most recent collective keys kept (jaxring/_src/reliability/launches.py's KEEP).
constexpr std::size_t kLaunchKeep = 256;

struct LaunchLatest {
  bool any = false;
  std::string key;
  int64_t count = 0;
  double monotonic_s = 0;  // CLOCK_MONOTONIC, as Python's time.monotonic()
};

// key -> launches counted, least recently launched first.
std::vector<std::pair<std::string, int64_t>> LaunchTable();
LaunchLatest LaunchLatestEntry();
int64_t LaunchVersion();  // changes whenever the table does
void LaunchReset();

}  // namespace jaxring

#endif  // JAXRING_XLA_EXT_LAUNCHES_H_
