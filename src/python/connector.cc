// The cache and connector layers for Python: EncoderCachePool, and EcConnector created
// from the same JSON config as the services. ec_transfer_params cross as JSON text, read
// by the strict reader (a wrong key or type raises ecx.Error naming it).
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <map>
#include <set>

#include "ecx/cache/encoder_cache_pool.h"
#include "ecx/common/bytes.h"
#include "ecx/common/copy.h"
#include "ecx/common/json_reader.h"
#include "ecx/common/recycled_buffers.h"
#include "ecx/connector/ec_connector.h"
#include "python/bindings.h"
#include "python/py_agent.h"

namespace ecx::python {
namespace {

using connector::EcConnector;
using connector::LoadItem;
using connector::LoadRequest;

// Params as JSON text, or parsed once (TransferParams) ahead of a timed load.
using ParamsArg = std::variant<connector::EcTransferParams, std::string>;
MmHash hash_of(const std::string& text) { return unwrap(MmHash::parse(text)); }

TensorMeta meta_of(const std::string& dtype, const std::vector<int64_t>& shape) {
  TensorMeta meta{unwrap(dtype_from_name(dtype)), shape};
  check(meta.validate());
  return meta;
}

// ecx.Item: one item a request names, checked when it is made: its key, the tensor its
// encoder produced (dtype and shape) and, to load it, its params (JSON text, or
// TransferParams parsed ahead of a timed load).
struct PyItem {
  MmHash mm_hash;
  TensorMeta meta;
  std::optional<ParamsArg> params;
  std::optional<double> own_pin_taken;  // LoadItem::own_pin_taken, in time.monotonic()'s seconds
};

connector::EcTransferParams params_of(const std::string& text) {
  auto j = unwrap(parse_json_object(text, "ec_transfer_params"));
  return unwrap(connector::EcTransferParams::from_json(j));
}

LoadRequest request_of(const std::string& request_id, const std::vector<PyItem>& items) {
  LoadRequest r{.request_id = request_id};
  for (const auto& [hash, meta, params, own_pin_taken] : items) {
    LoadItem item{hash, meta, std::nullopt, std::nullopt};
    if (own_pin_taken) {  // Python's time.monotonic() and steady_clock: CLOCK_MONOTONIC
      item.own_pin_taken = Clock::time_point(std::chrono::duration_cast<Clock::duration>(
          std::chrono::duration<double>(*own_pin_taken)));
    }
    if (params) {
      auto* parsed = std::get_if<connector::EcTransferParams>(&*params);
      item.params = parsed ? *parsed : params_of(std::get<std::string>(*params));
    }
    r.items.push_back(std::move(item));
  }
  return r;
}

nb::dict outcome_dict(const connector::LoadOutcome& o) {
  nb::list items;
  for (const auto& it : o.items) {
    nb::dict d;
    d["mm_hash"] = it.mm_hash.str();
    d["ok"] = it.status.ok();
    d["code"] = std::string(status_code_name(it.status.code()));
    d["message"] = it.status.message();
    d["recomputed"] = it.recomputed;
    d["local_hit"] = it.local_hit;
    items.append(d);
  }
  nb::dict out;
  out["ok"] = o.status.ok();
  out["code"] = std::string(status_code_name(o.status.code()));
  out["message"] = o.status.message();
  out["items"] = items;
  out["load_ms"] = o.load_ms;
  out["bytes"] = o.bytes;
  return out;
}

nb::object json_to_python(const nlohmann::json& j) {
  return nb::module_::import_("json").attr("loads")(j.dump());
}

// A recompute callback in Python: fn(mm_hash, out) fills `out` (a writable uint8 array
// valid during the call). Runs on a loader thread, which takes the GIL for it.
connector::RecomputeFn python_recompute(nb::callable fn) {
  auto shared = std::make_shared<nb::callable>(std::move(fn));
  return [shared](const MmHash& h, const TensorMeta&, std::span<std::byte> out) -> Status {
    nb::gil_scoped_acquire acquire;
    try {
      (*shared)(h.str(), byte_view(out.data(), out.size(), nb::handle()));
      return Status::Ok();
    } catch (const std::exception& e) {
      return Internal(std::string("Python recompute failed: ") + e.what());
    }
  };
}

class PyConnector {
 public:
  PyConnector(const std::string& config, std::optional<nb::callable> recompute) {
    auto parsed = unwrap(connector::ConnectorConfig::parse(config));
    connector::ConnectorContext ctx;
    if (recompute) ctx.recompute = python_recompute(std::move(*recompute));
    nb::gil_scoped_release release;
    conn_ = unwrap(connector::create_connector(parsed, std::move(ctx)));
  }
  ~PyConnector() {
    nb::gil_scoped_release release;  // loader threads may be waiting for the GIL
    conn_.reset();
  }

  EcConnector& get() { return *conn_; }

  // Zero-copy arrays of loaded items: while any array views an item, the request's hold
  // on it stays, so no array is ever read after its bytes were given back (unmapped, or
  // reused for another item). item_finished and request_finished put the end off until
  // the last such array is gone. All of it runs under the GIL.
  nb::object loaded_view(nb::handle self, const std::string& id, const MmHash& h, nb::handle owner);
  // A writable copy of a loaded item in a buffer of `buffers` (kept warm for the next copy
  // once the array's last user is gone). The item is read without the GIL, held meanwhile
  // as a view is: an end asked for during the copy waits for it.
  nb::object loaded_copy(const std::string& id, const MmHash& h, RecycledBuffers& buffers);
  void finish_item(const std::string& id, const MmHash& h);
  void finish_request(const std::string& id);

 private:
  struct Held {
    std::map<MmHash, std::shared_ptr<int>> views;  // tokens of the arrays per item
    std::set<MmHash> items_ended;                  // item_finished, put off
    bool request_ended = false;                    // request_finished, put off
  };
  bool viewed(const Held& held) const {
    return std::any_of(held.views.begin(), held.views.end(),
                       [](const auto& v) { return live_views(v.second) > 0; });
  }
  void view_ended(const std::string& id, const MmHash& h);
  // Raises ecx.Error (failed_precondition) once the item's or the request's end was asked
  // for: no new array over what is being given back.
  void refuse_if_ending(const std::string& id, const MmHash& h) const;
  void end_request_now(const std::string& id) {
    nb::gil_scoped_release release;
    conn_->request_finished(id);
  }

  std::unique_ptr<EcConnector> conn_;
  std::map<std::string, Held> held_;  // by request id (GIL)
};

nb::object PyConnector::loaded_view(nb::handle self, const std::string& id, const MmHash& h,
                                    nb::handle owner) {
  refuse_if_ending(id, h);
  auto ref = unwrap(conn_->loaded(id, h));
  auto& token = held_[id].views[h];
  if (!token) token = std::make_shared<int>(0);
  std::vector<nb::object> keep{nb::borrow(self)};
  if (!owner.is_none()) keep.push_back(nb::borrow(owner));
  nb::object capsule = view_owner({std::move(keep), token, [this, id, h] { view_ended(id, h); }});
  return nb::cast(read_only_view(ref.payload(), ref.payload_length(), capsule));
}

void PyConnector::refuse_if_ending(const std::string& id, const MmHash& h) const {
  auto found = held_.find(id);
  if (found != held_.end() && (found->second.request_ended || found->second.items_ended.count(h))) {
    check(Status(StatusCode::kFailedPrecondition,
                 "request " + id + " has finished with " + h.str() + " (its arrays still live)"));
  }
}

nb::object PyConnector::loaded_copy(const std::string& id, const MmHash& h,
                                    RecycledBuffers& buffers) {
  refuse_if_ending(id, h);
  auto ref = unwrap(conn_->loaded(id, h));
  const uint64_t length = ref.payload_length();
  auto copy = buffers.take(length);  // may throw: before the hold below
  {
    auto& token = held_[id].views[h];
    if (!token) token = std::make_shared<int>(0);
    std::shared_ptr<int> reading = token;  // counts as an array while the GIL is free
    nb::gil_scoped_release release;
    copy_streaming(copy.get(), ref.payload(), length);
  }
  view_ended(id, h);  // an end asked for meanwhile takes effect now
  nb::object capsule = view_owner({{}, nullptr, [copy] {}});
  return nb::cast(byte_view(copy.get(), length, capsule));
}

// An item or request being ended keeps its mark (items_ended, request_ended) while the
// connector ends it without the GIL: loaded() refuses it meanwhile, so no array is made
// over what is being given back. Entries are found again by key afterwards (another
// thread may have changed held_ while the GIL was free).
void PyConnector::finish_item(const std::string& id, const MmHash& h) {
  Held& held = held_[id];
  auto v = held.views.find(h);
  const bool viewed_now = v != held.views.end() && live_views(v->second) > 0;
  held.items_ended.insert(h);
  if (viewed_now) return;  // ends with its last array (view_ended)
  if (v != held.views.end()) held.views.erase(v);
  Status s;
  {
    nb::gil_scoped_release release;
    s = conn_->item_finished(id, h);
  }
  check(s);
}

void PyConnector::finish_request(const std::string& id) {
  Held& held = held_[id];
  held.request_ended = true;
  if (viewed(held)) return;  // ends with its last array (view_ended)
  end_request_now(id);
  held_.erase(id);
}

void PyConnector::view_ended(const std::string& id, const MmHash& h) {
  auto found = held_.find(id);
  if (found == held_.end()) return;
  Held& held = found->second;
  bool end_item = false;
  auto v = held.views.find(h);
  if (v != held.views.end() && live_views(v->second) == 0) {
    held.views.erase(v);
    end_item = held.items_ended.count(h) > 0 && !held.request_ended;
  }
  const bool unviewed = !viewed(held);
  const bool end_request = unviewed && held.request_ended;
  if (unviewed && !held.request_ended && held.items_ended.empty()) held_.erase(found);
  if (end_item) {
    nb::gil_scoped_release release;
    conn_->item_finished(id, h).ignore_error();  // ended, as asked, once unviewed
  }
  if (end_request) {
    end_request_now(id);
    held_.erase(id);
  }
}

// Runs `fn` without the GIL and returns its value (errors raise once the GIL is back).
template <typename Fn>
auto released(Fn&& fn) {
  nb::gil_scoped_release release;
  return fn();
}

void bind_pool(nb::module_& m) {
  struct PyPool {
    nb::object agent;  // keeps the agent (and the arena) alive
    std::unique_ptr<cache::EncoderCachePool> pool;
  };
  nb::class_<PyPool>(m, "EncoderCachePool", "Encoder outputs by mm_hash in a registered arena.")
      .def(
          "__init__",
          [](PyPool* self, nb::object agent, const std::string& name, uint64_t capacity_bytes,
             int64_t lease_ms, bool require_grant) {
            if (!nb::isinstance<PyAgent>(agent)) {
              check(InvalidArgument("EncoderCachePool: agent must be an ecx.Agent, not " +
                                    std::string(nb::type_name(agent.type()).c_str())));
            }
            auto& a = nb::cast<PyAgent&>(agent);
            cache::PoolConfig config{.name = name,
                                     .capacity_bytes = capacity_bytes,
                                     .lease = std::chrono::milliseconds(lease_ms),
                                     .require_grant = require_grant};
            new (self) PyPool{agent, unwrap(cache::EncoderCachePool::create(&a.agent(), config))};
          },
          nb::arg("agent"), nb::arg("name") = "pool", nb::arg("capacity_bytes") = 1ull << 30,
          nb::arg("lease_ms") = 30000, nb::arg("require_grant") = false)
      .def_prop_ro("region", [](PyPool& p) { return p.pool->region_id(); })
      .def(
          "put",
          [](PyPool& p, const std::string& h, const std::string& dtype,
             const std::vector<int64_t>& shape, nb::ndarray<nb::ro, nb::c_contig> data) {
            Buffer b{static_cast<std::byte*>(const_cast<void*>(data.data())), data.nbytes()};
            auto meta = meta_of(dtype, shape);
            auto ref = unwrap(released([&] {
              return p.pool->put(hash_of(h), meta, {b.data, static_cast<size_t>(b.length)});
            }));
            return std::make_tuple(ref.offset, ref.block_length, ref.generation);
          },
          nb::arg("mm_hash"), nb::arg("dtype"), nb::arg("shape"), nb::arg("data"),
          "Copies an item in; returns (offset, block_length, generation).")
      .def(
          "find",
          [](nb::handle self, const std::string& h) {
            auto ref = unwrap(nb::cast<PyPool&>(self).pool->find(hash_of(h)));
            return byte_view(ref.payload(), ref.payload_length(), self);
          },
          nb::arg("mm_hash"), "The item's payload, without a copy (valid while it is cached).")
      .def(
          "pin",
          [](PyPool& p, const std::string& h, const std::string& holder) {
            return unwrap(p.pool->pin(hash_of(h), holder)).pin_id;
          },
          nb::arg("mm_hash"), nb::arg("holder"))
      .def(
          "unpin", [](PyPool& p, uint64_t pin) { check(p.pool->unpin(pin)); }, nb::arg("pin"))
      .def("stats", [](PyPool& p) { return json_to_python(connector::to_json(p.pool->stats())); });
}

// Params of items another producer holds, in one call: per item (params JSON, None) or
// (None, (code, message)).
nb::list remote_saved_params(PyConnector& c, const std::string& producer,
                             const std::vector<std::string>& hashes, int64_t timeout_ms) {
  std::vector<MmHash> parsed;
  for (const auto& h : hashes) parsed.push_back(hash_of(h));
  auto replies = unwrap(released([&] {
    return c.get().remote_saved_params(producer, parsed, Deadline::after_ms(timeout_ms));
  }));
  nb::list out;
  for (const auto& r : replies) {
    if (r.ok()) {
      out.append(nb::make_tuple(r->to_json().dump(), nb::none()));
    } else {
      out.append(nb::make_tuple(
          nb::none(),
          nb::make_tuple(std::string(status_code_name(r.status().code())), r.status().message())));
    }
  }
  return out;
}

void bind_producer(nb::class_<PyConnector>& c) {
  c.def(
       "save",
       [](PyConnector& c, const std::string& h, const std::string& dtype,
          const std::vector<int64_t>& shape, nb::ndarray<nb::ro, nb::c_contig> data) {
         auto meta = meta_of(dtype, shape);
         std::span<const std::byte> bytes(static_cast<const std::byte*>(data.data()),
                                          data.nbytes());
         auto p = unwrap(released([&] { return c.get().save_caches(hash_of(h), meta, bytes); }));
         return p.to_json().dump();
       },
       nb::arg("mm_hash"), nb::arg("dtype"), nb::arg("shape"), nb::arg("data"),
       "Stores an encoder output; returns its ec_transfer_params (JSON).")
      .def(
          "saved_params",
          [](PyConnector& c, const std::string& h) {
            return unwrap(released([&] { return c.get().saved_params(hash_of(h)); }))
                .to_json()
                .dump();
          },
          nb::arg("mm_hash"))
      .def(
          "release_params",
          [](PyConnector& c, const std::string& params) {
            auto p = params_of(params);
            check(released([&] { return c.get().release_params(p); }));
          },
          nb::arg("params"))
      .def(
          "holds", [](PyConnector& c, const std::string& h) { return c.get().holds(hash_of(h)); },
          nb::arg("mm_hash"), "Whether this producer holds a ready entry (no pin taken).")
      .def(
          "offer",
          [](PyConnector& c, const std::string& address, const std::vector<std::string>& params) {
            std::vector<connector::EcTransferParams> items;
            items.reserve(params.size());
            for (const auto& p : params) items.push_back(params_of(p));
            check(c.get().offer(address, items));
          },
          nb::arg("address"), nb::arg("params"),
          "Sends the consumer agent at `address` (host:port, its tcp endpoint) these params "
          "(JSON) so that it loads them now, before their request reaches it. Returns once "
          "queued; never waits for the consumer.")
      .def("remote_saved_params", &remote_saved_params, nb::arg("producer"), nb::arg("mm_hashes"),
           nb::arg("timeout_ms"),
           "Params of items the producer agent `producer` (its metadata JSON) holds, in one "
           "call: per item (params JSON, None) or (None, (code, message)).")
      .def(
          "wait_for_readers",
          [](PyConnector& c, int64_t timeout_ms) {
            check(
                released([&] { return c.get().wait_for_readers(Deadline::after_ms(timeout_ms)); }));
          },
          nb::arg("timeout_ms"));
}

void bind_loaded(nb::class_<PyConnector>& c);
void bind_ending(nb::class_<PyConnector>& c);

// The scheduler side of a consumer.
void bind_consumer(nb::class_<PyConnector>& c) {
  c.def(
       "has_caches",
       [](PyConnector& c, const std::string& id, const std::vector<PyItem>& items) {
         auto r = request_of(id, items);
         return released([&] { return c.get().has_caches(r); });
       },
       nb::arg("request_id"), nb::arg("items"))
      .def(
          "update_state_after_alloc",
          [](PyConnector& c, const std::string& id, const std::vector<PyItem>& items,
             size_t index) {
            check(c.get().update_state_after_alloc(request_of(id, items), index));
          },
          nb::arg("request_id"), nb::arg("items"), nb::arg("index"))
      .def("build_connector_meta", [](PyConnector& c) { return c.get().build_connector_meta(); });
}

// The worker side of a consumer: loads, and what they brought.
void bind_consumer_worker(nb::class_<PyConnector>& c) {
  c.def(
       "start_load_caches",
       [](PyConnector& c, const connector::ConnectorMetadata& meta) {
         check(released([&] { return c.get().start_load_caches(meta); }));
       },
       nb::arg("metadata"))
      .def(
          "wait_for_load",
          [](PyConnector& c, const std::string& id, int64_t timeout_ms) {
            auto o =
                released([&] { return c.get().wait_for_load(id, Deadline::after_ms(timeout_ms)); });
            return outcome_dict(o);
          },
          nb::arg("request_id"), nb::arg("timeout_ms"))
      .def(
          "load",
          [](PyConnector& c, const std::string& id, const std::vector<PyItem>& items,
             int64_t timeout_ms) {
            auto r = request_of(id, items);
            auto o = released([&] { return c.get().load(r, Deadline::after_ms(timeout_ms)); });
            return outcome_dict(o);
          },
          nb::arg("request_id"), nb::arg("items"), nb::arg("timeout_ms"))
      .def("get_finished", [](PyConnector& c) { return c.get().get_finished(); });
  bind_loaded(c);
}

// What a consumer holds once loaded: the bytes, shares of them, and their end.
void bind_loaded(nb::class_<PyConnector>& c) {
  c.def(
       "loaded",
       [](nb::handle self, const std::string& id, const std::string& h, nb::handle owner) {
         return nb::cast<PyConnector&>(self).loaded_view(self, id, hash_of(h), owner);
       },
       nb::arg("request_id"), nb::arg("mm_hash"), nb::arg("owner") = nb::none(),
       "The loaded bytes, read-only and without a copy (a NumPy array; torch.from_dlpack "
       "takes it as is). With zero_copy, the producer's own block. The request holds the "
       "item while any such array (or one made from it) lives: item_finished and "
       "request_finished take effect once the last is gone, so an array never shows bytes "
       "that were given back. The array keeps this connector and `owner` alive: an owner "
       "whose end calls item_finished (or request_finished) ties the hold to the array's "
       "last user.")
      .def(
          "loaded_copy",
          [](PyConnector& c, const std::string& id, const std::string& h,
             std::shared_ptr<RecycledBuffers> buffers) {
            return c.loaded_copy(id, hash_of(h), *buffers);
          },
          nb::arg("request_id"), nb::arg("mm_hash"), nb::arg("buffers"),
          "A copy of the loaded bytes (a writable NumPy array, its own memory) in a buffer "
          "of `buffers` (ecx.CopyBuffers): it outlives the request, and its memory goes back "
          "to `buffers`, already faulted in, for the next copy once its last user is gone.")
      .def(
          "view_intact",
          [](PyConnector& c, const std::string& id, const std::string& h) {
            check(c.get().view_intact(id, hash_of(h)));
          },
          nb::arg("request_id"), nb::arg("mm_hash"),
          "Raises ecx.Error unless the request still reads the item where it lies: "
          "'evicted' once the view's pins or its block's header are lost (stop reading it), "
          "'failed_precondition' for an item held as a copy.")
      .def(
          "loaded_address",
          [](PyConnector& c, const std::string& id, const std::string& h) {
            auto ref = unwrap(c.get().loaded(id, hash_of(h)));
            return reinterpret_cast<uintptr_t>(ref.payload());
          },
          nb::arg("request_id"), nb::arg("mm_hash"))
      .def(
          "share_loaded",
          [](PyConnector& c, const std::string& id, const std::string& h, size_t readers) {
            auto shared =
                unwrap(released([&] { return c.get().share_loaded(id, hash_of(h), readers); }));
            std::vector<std::string> out;
            for (const auto& p : shared) out.push_back(p.to_json().dump());
            return out;
          },
          nb::arg("request_id"), nb::arg("mm_hash"), nb::arg("readers"),
          "Params (JSON) that let `readers` other agents READ a loaded item, one each.")
      .def(
          "agent_metadata",
          [](PyConnector& c) { return released([&] { return c.get().agent_metadata(); }); },
          "This connector's agent metadata (JSON): how a peer of the same deployment reaches "
          "it.");
  bind_ending(c);
}

// A consumer's holds ending: per item, per request, or before any load.
void bind_ending(nb::class_<PyConnector>& c) {
  c.def(
       "item_finished",
       [](PyConnector& c, const std::string& id, const std::string& h) {
         c.finish_item(id, hash_of(h));
       },
       nb::arg("request_id"), nb::arg("mm_hash"),
       "Ends the request's hold on one item (its view's pins at the producer, or its "
       "cache pins) before request_finished; the others stay held. While an array from "
       "loaded() views the item, the end waits for the last of them. Raises ecx.Error "
       "('failed_precondition') when the request does not hold it.")
      .def(
          "request_finished", [](PyConnector& c, const std::string& id) { c.finish_request(id); },
          nb::arg("request_id"),
          "Ends the request's holds; while arrays from loaded() live, once the last is gone.")
      .def(
          "discard",
          [](PyConnector& c, const std::string& id, const std::vector<PyItem>& items) {
            c.get().discard(request_of(id, items));
          },
          nb::arg("request_id"), nb::arg("items"));
}

}  // namespace

void bind_cache(nb::module_& m) { bind_pool(m); }

void bind_params(nb::module_& m) {
  nb::class_<connector::EcTransferParams>(m, "TransferParams",
                                          "ec_transfer_params, parsed and checked once.")
      .def_static("from_json", &params_of, nb::arg("text"))
      .def("to_json", [](const connector::EcTransferParams& p) { return p.to_json().dump(); })
      .def_prop_ro("mm_hash", [](const connector::EcTransferParams& p) { return p.mm_hash.str(); })
      .def_ro("engine_id", &connector::EcTransferParams::engine_id);
}

namespace {

void bind_item(nb::module_& m) {
  nb::class_<PyItem>(m, "Item",
                     "One item of a request: its key (mm_hash), the tensor its encoder produced "
                     "(dtype, shape) and, to load it, its ec_transfer_params (JSON text or "
                     "TransferParams; None: looked up or computed). own_pin_taken: when (time."
                     "monotonic()) the params' pin was taken for this reader alone (a worker's "
                     "own scheduler shared the item): a same-host view holds it instead of "
                     "taking one by a lookup while it is younger than lease_ms / 3. Checked when "
                     "made: a bad key, dtype or shape raises ecx.Error ('invalid_argument').")
      .def(
          "__init__",
          [](PyItem* self, const std::string& mm_hash, const std::string& dtype,
             const std::vector<int64_t>& shape, std::optional<ParamsArg> params,
             std::optional<double> own_pin_taken) {
            // A time.monotonic() reading: finite, not negative, not beyond a century.
            if (own_pin_taken && !(*own_pin_taken >= 0 && *own_pin_taken < 3.2e9)) {
              check(
                  InvalidArgument("Item: own_pin_taken must be a time.monotonic() reading, "
                                  "not " +
                                  std::to_string(*own_pin_taken)));
            }
            new (self)
                PyItem{hash_of(mm_hash), meta_of(dtype, shape), std::move(params), own_pin_taken};
          },
          nb::arg("mm_hash"), nb::arg("dtype"), nb::arg("shape"), nb::arg("params") = nb::none(),
          nb::arg("own_pin_taken") = nb::none())
      .def_prop_ro("mm_hash", [](const PyItem& i) { return i.mm_hash.str(); })
      .def_prop_ro("dtype", [](const PyItem& i) { return std::string(dtype_name(i.meta.dtype)); })
      .def_prop_ro("shape", [](const PyItem& i) { return i.meta.shape; })
      .def_prop_ro("params", [](const PyItem& i) { return i.params; })
      .def("__repr__", [](const PyItem& i) {
        return "ecx.Item(" + i.mm_hash.str() + ", " + i.meta.to_string() +
               (i.params ? ", with params)" : ")");
      });
}

}  // namespace

// ecx.CopyBuffers: host buffers for copies that outlive their source, kept warm.
void bind_copy_buffers(nb::module_& m) {
  nb::class_<RecycledBuffers>(
      m, "CopyBuffers",
      "Host buffers for Connector.loaded_copy: one given back is kept for the next copy "
      "of a similar size (a fresh one faults on every page as it is first written), up to "
      "idle_bytes held idle (an int, or a size such as '64MiB').")
      .def(nb::new_([](std::variant<uint64_t, std::string> idle_bytes) {
             auto* text = std::get_if<std::string>(&idle_bytes);
             return RecycledBuffers::create(text ? unwrap(parse_bytes(*text))
                                                 : std::get<uint64_t>(idle_bytes));
           }),
           nb::arg("idle_bytes"))
      .def_prop_ro("idle_cap", &RecycledBuffers::idle_cap)
      .def("stats", [](const RecycledBuffers& b) {
        auto s = b.stats();
        nb::dict d;
        d["reused"] = s.reused;
        d["allocated"] = s.allocated;
        d["released"] = s.released;
        d["idle_bytes"] = s.idle_bytes;
        return d;
      });
}

void bind_connector(nb::module_& m) {
  bind_params(m);
  bind_copy_buffers(m);
  bind_item(m);
  nb::class_<connector::ConnectorMetadata>(m, "ConnectorMetadata",
                                           "The loads one scheduler step scheduled.")
      .def_prop_ro("num_loads",
                   [](const connector::ConnectorMetadata& meta) { return meta.loads.size(); });
  nb::class_<PyConnector> c(m, "Connector",
                            "An EC connector from a JSON config, as the services take it.");
  c.def(nb::init<const std::string&, std::optional<nb::callable>>(), nb::arg("config"),
        nb::arg("recompute") = nb::none())
      .def_prop_ro("name", [](PyConnector& c) { return c.get().name(); })
      .def_prop_ro("role",
                   [](PyConnector& c) { return std::string(connector::role_name(c.get().role())); })
      .def("stats",
           [](PyConnector& c) { return json_to_python(connector::to_json(c.get().stats())); });
  bind_producer(c);
  bind_consumer(c);
  bind_consumer_worker(c);
}

}  // namespace ecx::python
