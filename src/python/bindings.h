// Shared pieces of the Python binding (module.cc): Status to ecx.Error, byte views.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <memory>
#include <string>

#include "ecx/common/status.h"
#include "ecx/transfer/types.h"

namespace ecx::python {

namespace nb = nanobind;

// A C++ error on its way to Python as ecx.Error(code, message).
struct StatusError {
  Status status;
};

// Raises ecx.Error unless `s` is ok.
void check(const Status& s);
template <typename T>
T unwrap(Result<T> r) {
  if (!r.ok()) check(r.status());
  return std::move(r).value();
}

// A one-dimensional uint8 ndarray over [data, data + length), kept valid by `owner`.
// A numpy array over ecx memory (torch.from_numpy / DLPack share it too); no copy.
using ByteArray = nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>, nb::c_contig>;
using ReadOnlyByteArray = nb::ndarray<nb::numpy, const uint8_t, nb::ndim<1>, nb::c_contig>;
ByteArray byte_view(std::byte* data, uint64_t length, nb::handle owner);
// A read-only numpy view (a zero-copy load may be another process's read-only mapping).
ReadOnlyByteArray read_only_view(const std::byte* data, uint64_t length, nb::handle owner);
// The memory of a Python buffer (anything with the buffer protocol or DLPack).
struct Buffer {
  std::byte* data = nullptr;
  uint64_t length = 0;
};
Buffer buffer_of(const nb::ndarray<nb::c_contig>& array);

transfer::Capability capability_of(const std::string& hex);

void bind_errors(nb::module_& m);
void bind_transfer(nb::module_& m);
void bind_agent(nb::module_& m);  // from bind_transfer
void bind_cache(nb::module_& m);
void bind_connector(nb::module_& m);

}  // namespace ecx::python
