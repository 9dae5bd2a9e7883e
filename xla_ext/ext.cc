// Registration module for jaxring's XLA FFI handlers (filled in by the kernels).
#include <nanobind/nanobind.h>

namespace nb = nanobind;

NB_MODULE(_ext, m) {
  m.def("registrations", []() { return nb::dict(); });
}
