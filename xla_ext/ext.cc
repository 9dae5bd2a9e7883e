// Registration module for jaxring's XLA FFI handlers: hands each handler to Python as a capsule,
// plus what it was built against so that jaxring._src.ext can refuse a mismatched build.
#include <nanobind/nanobind.h>

#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <type_traits>

#include "handlers.h"
#include "launches.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

#ifndef JAXRING_JAXLIB_VERSION
#define JAXRING_JAXLIB_VERSION "unknown"
#endif

}  // namespace

NB_MODULE(_ext, m) {
#define JAXRING_ADD_CPU(name, stem) targets["jaxring_" name] = EncapsulateFfiHandler(stem##Cpu);
// A function returning {"jaxring_<name>": capsule} for the CPU handlers of one target list.
#define JAXRING_CPU_TARGETS(FOR_EACH) \
  []() {                             \
    nb::dict targets;                \
    FOR_EACH(JAXRING_ADD_CPU)        \
    return targets;                  \
  }
  m.def("registrations", JAXRING_CPU_TARGETS(JAXRING_FOR_EACH_TARGET));
  // Stages by name: every in-process target makes its call site when XLA instantiates it.
  m.def("inprocess_registrations", []() {
    nb::dict targets;
#define JAXRING_ADD_STAGES(name, stem)                                     \
  {                                                                       \
    nb::dict stages;                                                      \
    stages["instantiate"] = EncapsulateFfiHandler(JaxringLocalCallSiteCpu); \
    stages["execute"] = EncapsulateFfiHandler(stem##Cpu);                 \
    targets["jaxring_" name] = stages;                                    \
  }
    JAXRING_FOR_EACH_INPROCESS_TARGET(JAXRING_ADD_STAGES)
#undef JAXRING_ADD_STAGES
    return targets;
  });
  m.def("inprocess_types", []() {
    nb::dict types;
    nb::dict site;
    site["type_id"] = nb::capsule(const_cast<void*>(jaxring::CallSiteTypeId()));
    site["type_info"] = nb::capsule(const_cast<void*>(jaxring::CallSiteTypeInfo()));
    types["jaxring_call_site"] = site;
    return types;
  });
  m.def("window_registrations", JAXRING_CPU_TARGETS(JAXRING_FOR_EACH_WINDOW_TARGET));
#undef JAXRING_CPU_TARGETS
#undef JAXRING_ADD_CPU
  m.def("host_registrations", []() {
    nb::dict targets;
#define JAXRING_ADD_HOST(name, stem)                                        \
  targets["jaxring_" name] = nb::make_tuple(EncapsulateFfiHandler(stem##Cpu), \
                                            EncapsulateFfiHandler(stem##Cuda));
    JAXRING_FOR_EACH_HOST_TARGET(JAXRING_ADD_HOST)
#undef JAXRING_ADD_HOST
    return targets;
  });
  m.def("launch_table", &jaxring::LaunchTable);
  m.def("launch_latest", []() -> nb::object {
    jaxring::LaunchLatest l = jaxring::LaunchLatestEntry();
    if (!l.any) return nb::none();
    return nb::make_tuple(l.key, l.count, l.monotonic_s);
  });
  m.def("launch_version", &jaxring::LaunchVersion);
  m.def("launch_reset", &jaxring::LaunchReset);
  m.def("cuda_registrations", []() {
    nb::dict targets;
#ifdef JAXRING_WITH_CUDA
#define JAXRING_ADD_CUDA(name, stem) targets["jaxring_" name] = EncapsulateFfiHandler(stem##Cuda);
    JAXRING_FOR_EACH_TARGET(JAXRING_ADD_CUDA)
#undef JAXRING_ADD_CUDA
#endif
    return targets;
  });
  m.def("build_info", []() {
    nb::dict info;
    info["jaxlib_version"] = JAXRING_JAXLIB_VERSION;
    info["ffi_api_version"] = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
#ifdef JAXRING_WITH_CUDA
    info["cuda"] = true;
#else
    info["cuda"] = false;
#endif
    return info;
  });
}
