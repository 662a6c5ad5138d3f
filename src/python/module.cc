// ecx._ecx: the Python binding of ecx's public C++ API (nanobind). It moves no bytes of
// its own: every transfer, copy and check happens in the C++ library. Memory crosses
// into Python without a copy, as ndarrays (buffer protocol and DLPack) over ecx's own
// regions; every call that can block releases the GIL; errors raise ecx.Error carrying
// the Status code name and message.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include "ecx/common/log.h"
#include "python/bindings.h"

namespace nb = nanobind;

NB_MODULE(_ecx, m) {
  m.doc() = "ecx: encoder-cache transfer for EPD-disaggregated LLM serving (C++ core)";
  ecx::python::bind_errors(m);
  ecx::python::bind_transfer(m);
  ecx::python::bind_cache(m);
  ecx::python::bind_connector(m);
  m.def(
      "set_log_level",
      [](const std::string& level) { ecx::python::check(ecx::set_log_level(level)); },
      nb::arg("level"),
      "The C++ core's log level for this process: trace, debug, info, warn, err, critical or "
      "off (ecx.Error 'invalid_argument' for another name).");
}
