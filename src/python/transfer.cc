// ecx.Error, byte views, and the transfer layer: Agent, regions, batched READ/WRITE.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <map>

#include "ecx/common/checksum.h"
#include "ecx/common/mutex.h"
#include "ecx/transfer/agent.h"
#include "python/bindings.h"
#include "python/py_agent.h"

namespace ecx::python {

namespace {

PyObject* g_error = nullptr;  // ecx.Error, created once at import

}  // namespace

void check(const Status& s) {
  if (!s.ok()) throw StatusError{s};
}

nb::object view_owner(ViewOwner owner) {
  auto* held = new ViewOwner(std::move(owner));
  return nb::capsule(held, [](void* p) noexcept {
    auto* held = static_cast<ViewOwner*>(p);
    held->token.reset();  // this array no longer views the memory
    if (held->on_end) {
      try {
        held->on_end();
      } catch (...) {  // a destructor cannot raise: the end is best effort, as a finalizer's
      }
    }
    delete held;  // lets go of `keep` last
  });
}

ByteArray byte_view(std::byte* data, uint64_t length, nb::handle owner) {
  size_t shape[1] = {static_cast<size_t>(length)};
  return ByteArray(data, 1, shape, owner);
}

ReadOnlyByteArray read_only_view(const std::byte* data, uint64_t length, nb::handle owner) {
  size_t shape[1] = {static_cast<size_t>(length)};
  return ReadOnlyByteArray(reinterpret_cast<const uint8_t*>(data), 1, shape, owner);
}

Buffer buffer_of(const nb::ndarray<nb::c_contig>& array) {
  if (array.device_type() != nb::device::cpu::value) {
    check(InvalidArgument("a host (CPU) buffer is needed; copy device tensors to the host first"));
  }
  return {static_cast<std::byte*>(array.data()), static_cast<uint64_t>(array.nbytes())};
}

transfer::Capability capability_of(const std::string& hex) {
  if (hex.empty()) return {};
  return unwrap(transfer::Capability::parse_hex(hex));
}

void bind_errors(nb::module_& m) {
  g_error = PyErr_NewExceptionWithDoc(
      "ecx.Error", "An ecx Status that is not ok: .code (e.g. 'not_found') and .message.",
      PyExc_RuntimeError, nullptr);
  m.attr("Error") = nb::handle(g_error);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      std::string code(status_code_name(e.status.code()));
      nb::object exc =
          nb::steal(PyObject_CallFunction(g_error, "ss", code.c_str(), e.status.message().c_str()));
      if (!exc.is_valid()) return;  // the call raised: that error stands
      exc.attr("code") = code;
      exc.attr("message") = e.status.message();
      PyErr_SetObject(g_error, exc.ptr());
    }
  });
}

// ---------------- PyAgent ----------------

PyAgent::PyAgent(transfer::AgentConfig config)
    : agent_(unwrap(transfer::Agent::create(std::move(config)))) {}

PyAgent::~PyAgent() { agent_->shutdown(); }

PyRegion PyAgent::allocate(uint64_t length, bool remote_write, bool require_grant) {
  auto region = unwrap(agent_->allocate(
      length, {.remote_read = true, .remote_write = remote_write, .require_grant = require_grant}));
  MutexLock lock(&mu_);
  regions_[region.id] = {region.data, region.length};
  return {region.id, region.length};
}

PyRegion PyAgent::register_memory(nb::ndarray<nb::c_contig> array, bool remote_write) {
  Buffer b = buffer_of(array);
  auto region = unwrap(agent_->register_memory(b.data, b.length, transfer::MemoryKind::kHost,
                                               {.remote_write = remote_write}));
  MutexLock lock(&mu_);
  regions_[region.id] = {b.data, b.length};
  kept_[region.id] = nb::cast(array);  // the memory must outlive its registration
  return {region.id, region.length};
}

void PyAgent::deregister(uint32_t region) {
  {
    MutexLock lock(&mu_);
    auto token = view_tokens_.find(region);
    if (token != view_tokens_.end() && live_views(token->second) > 0) {
      check(Status(StatusCode::kFailedPrecondition,
                   "region " + std::to_string(region) + " is still viewed by " +
                       std::to_string(live_views(token->second)) +
                       " array(s) from Agent.buffer(): let them go before deregister()"));
    }
    view_tokens_.erase(region);
  }
  check(agent_->deregister(region));
  MutexLock lock(&mu_);
  regions_.erase(region);
  kept_.erase(region);
}

std::pair<std::byte*, uint64_t> PyAgent::local(uint32_t region) const {
  MutexLock lock(&mu_);
  auto it = regions_.find(region);
  if (it == regions_.end()) check(NotFound("no local region " + std::to_string(region)));
  return it->second;
}

ByteArray PyAgent::buffer(uint32_t region, nb::handle self) {
  auto [data, length] = local(region);
  std::shared_ptr<int> token;
  {
    MutexLock lock(&mu_);
    auto& t = view_tokens_[region];
    if (!t) t = std::make_shared<int>(0);
    token = t;
  }
  nb::object owner = view_owner({{nb::borrow(self)}, std::move(token), {}});
  return byte_view(data, length, owner);
}

std::vector<transfer::TransferDescriptor> PyAgent::descriptors(
    const std::vector<DescriptorTuple>& batch) const {
  std::vector<transfer::TransferDescriptor> out;
  out.reserve(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    const auto& [region, offset, remote_region, remote_offset, length, cap] = batch[i];
    auto [data, size] = local(region);
    if (offset > size || length > size - offset) {
      check(OutOfRange("descriptor " + std::to_string(i) + ": [" + std::to_string(offset) + ", +" +
                       std::to_string(length) + ") is outside local region " +
                       std::to_string(region) + " of " + std::to_string(size) + " bytes"));
    }
    out.push_back({data + offset, remote_region, remote_offset, length, capability_of(cap)});
  }
  return out;
}

namespace {

std::optional<Deadline> deadline_of(std::optional<int64_t> timeout_ms) {
  if (!timeout_ms) return std::nullopt;
  return Deadline::after_ms(*timeout_ms);
}

}  // namespace

transfer::TransferHandle PyAgent::read(const std::string& peer,
                                       const std::vector<DescriptorTuple>& batch,
                                       std::optional<int64_t> timeout_ms) {
  auto descs = descriptors(batch);
  nb::gil_scoped_release release;
  return unwrap(agent_->read(peer, descs, deadline_of(timeout_ms)));
}

transfer::TransferHandle PyAgent::write(const std::string& peer,
                                        const std::vector<DescriptorTuple>& batch,
                                        std::optional<std::string> notification,
                                        std::optional<int64_t> timeout_ms) {
  auto descs = descriptors(batch);
  nb::gil_scoped_release release;
  return unwrap(agent_->write(peer, descs, std::move(notification), deadline_of(timeout_ms)));
}

std::string PyAgent::connect(const std::string& metadata, const std::string& backend,
                             std::optional<int64_t> timeout_ms) {
  auto meta = unwrap(transfer::AgentMetadata::parse(metadata));
  transfer::ConnectOptions options{.backend = unwrap(transfer::parse_backend(backend)),
                                   .deadline = deadline_of(timeout_ms)};
  Status s;
  {
    nb::gil_scoped_release release;
    s = agent_->connect(meta, options).status();
  }
  check(s);
  return std::string(transfer::backend_name(unwrap(agent_->peer_backend(meta.name))));
}

void bind_transfer(nb::module_& m) {
  m.def(
      "fill_pattern",
      [](nb::ndarray<nb::c_contig> array, uint64_t seed) {
        Buffer b = buffer_of(array);
        fill_pattern(b.data, b.length, seed);
      },
      nb::arg("array"), nb::arg("seed"),
      "Fills a buffer with the deterministic test pattern of `seed` (what ecx's benchmark "
      "producers write).");
  nb::class_<PyRegion>(m, "Region", "A registered region of this process's memory.")
      .def_ro("id", &PyRegion::id)
      .def_ro("length", &PyRegion::length)
      .def("__repr__", [](const PyRegion& r) {
        return "ecx.Region(id=" + std::to_string(r.id) + ", length=" + std::to_string(r.length) +
               ")";
      });

  nb::class_<transfer::TransferHandle>(m, "TransferHandle", "A batch of READs or WRITEs.")
      .def(
          "wait",
          [](transfer::TransferHandle& h, int64_t timeout_ms) {
            Status s;
            {
              nb::gil_scoped_release release;
              s = h.wait(Deadline::after_ms(timeout_ms));
            }
            check(s);
          },
          nb::arg("timeout_ms"), "Waits for the batch (GIL released); raises ecx.Error on failure.")
      .def("done", &transfer::TransferHandle::done)
      .def("cancel", &transfer::TransferHandle::cancel);

  bind_agent(m);
}

// Messages between agents: notify a peer, wait for a peer's word.
void bind_notifications(nb::class_<PyAgent>& agent) {
  agent
      .def(
          "notify",
          [](PyAgent& a, const std::string& peer, std::string message) {
            check(a.agent().notify(peer, std::move(message)));
          },
          nb::arg("peer"), nb::arg("message"))
      .def(
          "wait_notification",
          [](PyAgent& a, int64_t timeout_ms) {
            Result<transfer::Notification> n = Status(StatusCode::kInternal, "unset");
            {
              nb::gil_scoped_release release;
              n = a.agent().wait_notification(Deadline::after_ms(timeout_ms));
            }
            auto got = unwrap(std::move(n));
            return std::make_pair(got.from, got.message);
          },
          nb::arg("timeout_ms"));
}

void bind_agent(nb::module_& m) {
  nb::class_<PyAgent> agent(m, "Agent",
                            "One per process: registers memory, connects, moves bytes.");
  agent
      .def(
          "__init__",
          [](PyAgent* self, const std::string& name, const std::string& compat_hash,
             const std::string& auth_secret, const std::string& tcp_host, uint16_t tcp_port) {
            new (self) PyAgent({.name = name,
                                .compat_hash = compat_hash,
                                .tcp_host = tcp_host,
                                .tcp_port = tcp_port,
                                .auth_secret = auth_secret});
          },
          nb::arg("name"), nb::arg("compat_hash") = "ecx", nb::arg("auth_secret") = "",
          nb::arg("tcp_host") = "127.0.0.1", nb::arg("tcp_port") = 0)
      .def_prop_ro("name", [](const PyAgent& a) { return a.agent().name(); })
      .def("allocate", &PyAgent::allocate, nb::arg("length"), nb::arg("remote_write") = false,
           nb::arg("require_grant") = false)
      .def("register_memory", &PyAgent::register_memory, nb::arg("array"),
           nb::arg("remote_write") = false)
      .def("deregister", &PyAgent::deregister, nb::arg("region"))
      .def(
          "buffer",
          [](nb::handle self, uint32_t region) {
            return nb::cast<PyAgent&>(self).buffer(region, self);
          },
          nb::arg("region"), "The region's bytes, without a copy (numpy/torch/DLPack).")
      .def(
          "grant",
          [](PyAgent& a, uint32_t region, uint64_t offset, uint64_t length, bool write,
             const std::string& holder) {
            return unwrap(a.agent().grant(region, offset, length, write, holder)).hex();
          },
          nb::arg("region"), nb::arg("offset"), nb::arg("length"), nb::arg("write") = false,
          nb::arg("holder") = "")
      .def("metadata", [](const PyAgent& a) { return a.agent().metadata().to_json(); })
      .def("connect", &PyAgent::connect, nb::arg("metadata"), nb::arg("backend") = "auto",
           nb::arg("timeout_ms") = nb::none(),
           "Connects to a peer from its metadata JSON; returns the backend in use.")
      .def("read", &PyAgent::read, nb::arg("peer"), nb::arg("descriptors"),
           nb::arg("timeout_ms") = nb::none(),
           "descriptors: [(local_region, local_offset, remote_region, remote_offset, length, "
           "capability_hex)]")
      .def("write", &PyAgent::write, nb::arg("peer"), nb::arg("descriptors"),
           nb::arg("notification") = nb::none(), nb::arg("timeout_ms") = nb::none());
  bind_notifications(agent);
}

}  // namespace ecx::python
