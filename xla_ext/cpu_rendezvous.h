// The rendezvous of the in-process collectives (cpu_rendezvous.cc), which their handlers
// (cpu_inprocess.cc) call with the part each member computes once all have arrived.
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
#ifndef JAXRING_XLA_EXT_CPU_RENDEZVOUS_H_
#define JAXRING_XLA_EXT_CPU_RENDEZVOUS_H_

#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxring {
namespace ffi = xla::ffi;

// A call site: one custom-call instruction of a compiled program, numbered when XLA creates its
// thunk (the handlers' instantiate stage, JaxringLocalCallSiteCpu).
struct CallSite {
  static ffi::TypeId id;
  int64_t serial;
};

// One member's part of the collective, run once every member has arrived: it reads the members'
// inputs and writes this member's result. It may run after the handler has returned (on the
// thread of a parked member), so it owns copies of everything it uses.
using Body = std::function<void(const std::vector<const void*>&)>;

// A future already completed with ``error`` (or success).
ffi::Future Done(ffi::Error error);

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
                       int64_t timeout_ms, Body body);

}  // namespace jaxring

#endif  // JAXRING_XLA_EXT_CPU_RENDEZVOUS_H_
