// Shared pieces of the Python binding (module.cc): Status to ecx.Error, byte views.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

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

// What keeps a zero-copy array's memory valid, as the array's owner (a capsule): the
// Python objects that must outlive it, and a token whose live copies count the arrays
// over that memory, so that its holder refuses, or puts off, ending it while any does.
// `on_end` runs as the array goes, once its token copy is let go (GIL held).
struct ViewOwner {
  std::vector<nb::object> keep;
  std::shared_ptr<int> token;
  std::function<void()> on_end;
};
nb::object view_owner(ViewOwner owner);
// How many arrays hold a copy of `token` (view_owner) now.
inline long live_views(const std::shared_ptr<int>& token) {
  return token ? token.use_count() - 1 : 0;
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
