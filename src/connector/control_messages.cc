#include "connector/control_messages.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "ecx/common/json_reader.h"

namespace ecx::connector {
namespace {

using nlohmann::json;

constexpr Presence kRequired = Presence::kRequired;
constexpr Presence kOptional = Presence::kOptional;

// The documents here are flat: anything nested deeper than this is not ours.
constexpr JsonLimits kMessageLimits{size_t{64} << 20, 16};

Result<MmHash> read_mm_hash(const JsonReader& r) {
  ECX_ASSIGN_OR_RETURN(std::string s, r.string("mm_hash", kRequired, 256));
  auto h = MmHash::parse(s);
  if (!h.ok()) return h.status().with_context(r.where() + " 'mm_hash'");
  return h;
}

Result<transfer::Capability> read_capability(const JsonReader& r, const char* key) {
  ECX_ASSIGN_OR_RETURN(std::string s, r.string(key, kOptional, 32));
  if (s.empty()) return transfer::Capability{};
  auto c = transfer::Capability::parse_hex(s);
  if (!c.ok()) return c.status().with_context(r.where() + " '" + key + "'");
  return c;
}

// How long the caller lets the producer wait for a not-ready entry (clamped).
Result<int64_t> read_wait_ms(const JsonReader& r) {
  ECX_ASSIGN_OR_RETURN(int64_t v, r.i64("wait_ms", INT64_MIN, INT64_MAX));
  return std::clamp<int64_t>(v, 0, 60000);
}

Result<const json*> read_items(const JsonReader& r, const char* key) {
  return r.array(key, kRequired, kMaxMessageItems);
}

json status_fields(const Status& s) {
  return {{"status", std::string(status_code_name(s.code()))}, {"message", s.message()}};
}

Result<LookupRequest> parse_lookup(const JsonReader& r) {
  LookupRequest m;
  ECX_ASSIGN_OR_RETURN(m.wait_ms, read_wait_ms(r));
  ECX_ASSIGN_OR_RETURN(const json* items, read_items(r, "items"));
  for (size_t i = 0; i < items->size(); ++i) {
    JsonReader item((*items)[i], "lookup item " + std::to_string(i));
    ECX_RETURN_IF_ERROR(item.object());
    LookupItem out;
    ECX_ASSIGN_OR_RETURN(out.mm_hash, read_mm_hash(item));
    ECX_ASSIGN_OR_RETURN(out.capability, read_capability(item, "capability"));
    m.items.push_back(out);
  }
  return m;
}

Result<LoadBlocksRequest> parse_load(const JsonReader& r) {
  LoadBlocksRequest m;
  ECX_ASSIGN_OR_RETURN(m.consumer, r.string("consumer", kRequired, 1 << 20));
  ECX_ASSIGN_OR_RETURN(std::string backend, r.string("backend", kOptional, 16));
  if (!backend.empty()) {
    ECX_ASSIGN_OR_RETURN(m.backend, transfer::parse_backend(backend));
  }
  ECX_ASSIGN_OR_RETURN(m.wait_ms, read_wait_ms(r));
  ECX_ASSIGN_OR_RETURN(const json* items, read_items(r, "items"));
  for (size_t i = 0; i < items->size(); ++i) {
    JsonReader item((*items)[i], "load item " + std::to_string(i));
    ECX_RETURN_IF_ERROR(item.object());
    LoadItemRequest out;
    ECX_ASSIGN_OR_RETURN(out.mm_hash, read_mm_hash(item));
    ECX_ASSIGN_OR_RETURN(out.capability, read_capability(item, "capability"));
    ECX_ASSIGN_OR_RETURN(uint64_t region, item.u64("dst_region", kRequired, UINT32_MAX));
    out.dst_region = static_cast<uint32_t>(region);
    ECX_ASSIGN_OR_RETURN(out.dst_offset, item.u64("dst_offset", kRequired));
    ECX_ASSIGN_OR_RETURN(out.dst_length, item.u64("dst_length", kRequired));
    ECX_ASSIGN_OR_RETURN(out.dst_capability, read_capability(item, "dst_capability"));
    ECX_ASSIGN_OR_RETURN(out.generation, item.u64("generation", kOptional));
    ECX_ASSIGN_OR_RETURN(out.pin, item.u64("pin", kOptional));
    m.items.push_back(out);
  }
  return m;
}

Result<ParamsRequest> parse_params(const JsonReader& r) {
  ParamsRequest m;
  ECX_ASSIGN_OR_RETURN(m.wait_ms, read_wait_ms(r));
  ECX_ASSIGN_OR_RETURN(const json* items, read_items(r, "items"));
  for (size_t i = 0; i < items->size(); ++i) {
    JsonReader item((*items)[i], "params item " + std::to_string(i));
    ECX_RETURN_IF_ERROR(item.object());
    ECX_ASSIGN_OR_RETURN(MmHash h, read_mm_hash(item));
    m.items.push_back(h);
  }
  return m;
}

Result<RenewRequest> parse_renew(const JsonReader& r) {
  RenewRequest m;
  ECX_ASSIGN_OR_RETURN(const json* items, read_items(r, "items"));
  for (size_t i = 0; i < items->size(); ++i) {
    JsonReader item((*items)[i], "renew item " + std::to_string(i));
    ECX_RETURN_IF_ERROR(item.object());
    RenewItem out;
    ECX_ASSIGN_OR_RETURN(out.mm_hash, read_mm_hash(item));
    ECX_ASSIGN_OR_RETURN(out.pin, item.u64("pin", kRequired));
    ECX_ASSIGN_OR_RETURN(out.capability, read_capability(item, "capability"));
    m.items.push_back(out);
  }
  return m;
}

}  // namespace

std::string to_json(const RenewRequest& m) {
  json items = json::array();
  for (const auto& it : m.items) {
    items.push_back(
        {{"mm_hash", it.mm_hash.str()}, {"pin", it.pin}, {"capability", it.capability.hex()}});
  }
  return json{{"op", "renew"}, {"items", items}}.dump();
}

std::string to_json(const ParamsRequest& m) {
  json items = json::array();
  for (const auto& h : m.items) items.push_back({{"mm_hash", h.str()}});
  return json{{"op", "params"}, {"wait_ms", m.wait_ms}, {"items", items}}.dump();
}

std::string to_json(const LookupRequest& m) {
  json items = json::array();
  for (const auto& it : m.items) {
    json j = {{"mm_hash", it.mm_hash.str()}};
    if (!it.capability.empty()) j["capability"] = it.capability.hex();
    items.push_back(std::move(j));
  }
  return json{{"op", "lookup"}, {"wait_ms", m.wait_ms}, {"items", items}}.dump();
}

std::string to_json(const LoadBlocksRequest& m) {
  json items = json::array();
  for (const auto& it : m.items) {
    json j = {{"mm_hash", it.mm_hash.str()},
              {"dst_region", it.dst_region},
              {"dst_offset", it.dst_offset},
              {"dst_length", it.dst_length}};
    if (!it.capability.empty()) j["capability"] = it.capability.hex();
    if (!it.dst_capability.empty()) j["dst_capability"] = it.dst_capability.hex();
    if (it.generation) j["generation"] = it.generation;
    if (it.pin) j["pin"] = it.pin;
    items.push_back(std::move(j));
  }
  return json{{"op", "load"},
              {"consumer", m.consumer},
              {"backend", std::string(transfer::backend_name(m.backend))},
              {"wait_ms", m.wait_ms},
              {"items", items}}
      .dump();
}

std::string to_json(const ItemsReply& m) {
  json items = json::array();
  for (const auto& it : m.items) {
    json j = status_fields(it.status);
    j["mm_hash"] = it.mm_hash.str();
    const BlockLocation& w = it.where;
    if (it.status.ok() && w.region != 0) {
      j.update({{"region", w.region},
                {"offset", w.offset},
                {"length", w.length},
                {"generation", w.generation},
                {"pin", w.pin}});
      if (!w.capability.empty()) j["capability"] = w.capability.hex();
    }
    if (it.status.ok() && it.params) j["params"] = it.params->to_json();
    items.push_back(std::move(j));
  }
  return json{{"items", items}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string to_json(const ReleaseNotice& m) {
  json pins = json::array();
  for (const auto& p : m.pins) pins.push_back({{"pin", p.pin}, {"capability", p.capability.hex()}});
  return json{{"op", "release"}, {"pins", pins}}.dump();
}

std::string to_json(const OfferNotice& m) {
  json items = json::array();
  for (const auto& p : m.items) items.push_back(p.to_json());
  return json{{"op", "offer"}, {"items", items}}.dump();
}

Result<ControlRequest> parse_control_request(std::string_view text) {
  ECX_ASSIGN_OR_RETURN(json j, parse_json_object(text, "control request", kMessageLimits));
  JsonReader r(j, "control request");
  ECX_ASSIGN_OR_RETURN(std::string op, r.string("op", kRequired, 32));
  if (op == "lookup") {
    ECX_ASSIGN_OR_RETURN(LookupRequest m, parse_lookup(r));
    return ControlRequest(std::move(m));
  }
  if (op == "load") {
    ECX_ASSIGN_OR_RETURN(LoadBlocksRequest m, parse_load(r));
    return ControlRequest(std::move(m));
  }
  if (op == "params") {
    ECX_ASSIGN_OR_RETURN(ParamsRequest m, parse_params(r));
    return ControlRequest(std::move(m));
  }
  if (op == "renew") {
    ECX_ASSIGN_OR_RETURN(RenewRequest m, parse_renew(r));
    return ControlRequest(std::move(m));
  }
  return InvalidArgument("control request: unknown op '" + op + "'");
}

Result<ItemsReply> parse_items_reply(std::string_view text, size_t expected_items) {
  ECX_ASSIGN_OR_RETURN(json j, parse_json_object(text, "reply", kMessageLimits));
  JsonReader r(j, "reply");
  ECX_ASSIGN_OR_RETURN(const json* items, read_items(r, "items"));
  if (items->size() != expected_items) {
    return InvalidArgument("reply has " + std::to_string(items->size()) +
                           " items for a request of " + std::to_string(expected_items));
  }
  ItemsReply m;
  for (size_t i = 0; i < items->size(); ++i) {
    JsonReader item((*items)[i], "reply item " + std::to_string(i));
    ECX_RETURN_IF_ERROR(item.object());
    ItemReply out;
    ECX_ASSIGN_OR_RETURN(out.mm_hash, read_mm_hash(item));
    ECX_ASSIGN_OR_RETURN(std::string code, item.string("status", kRequired, 32));
    ECX_ASSIGN_OR_RETURN(std::string message, item.string("message", kOptional, 4096));
    auto parsed = status_code_from_name(code);
    if (!parsed)
      return InvalidArgument("reply item " + std::to_string(i) + ": unknown status '" + code + "'");
    out.status = Status(*parsed, message);
    if (out.status.ok()) {
      ECX_ASSIGN_OR_RETURN(uint64_t region, item.u64("region", kOptional, UINT32_MAX));
      BlockLocation& w = out.where;
      w.region = static_cast<uint32_t>(region);
      ECX_ASSIGN_OR_RETURN(w.offset, item.u64("offset", kOptional));
      ECX_ASSIGN_OR_RETURN(w.length, item.u64("length", kOptional));
      ECX_ASSIGN_OR_RETURN(w.generation, item.u64("generation", kOptional));
      ECX_ASSIGN_OR_RETURN(w.pin, item.u64("pin", kOptional));
      ECX_ASSIGN_OR_RETURN(w.capability, read_capability(item, "capability"));
      ECX_ASSIGN_OR_RETURN(const json* params, item.object("params", kOptional));
      if (params != nullptr) {
        auto p = EcTransferParams::from_json(*params);
        if (!p.ok()) return p.status().with_context("reply item " + std::to_string(i));
        out.params = std::move(*p);
      }
    }
    m.items.push_back(std::move(out));
  }
  return m;
}

namespace {

Result<ReleaseNotice> parse_release(const JsonReader& r) {
  ECX_ASSIGN_OR_RETURN(const json* pins, read_items(r, "pins"));
  ReleaseNotice m;
  for (size_t i = 0; i < pins->size(); ++i) {
    JsonReader pin((*pins)[i], "released pin " + std::to_string(i));
    ECX_RETURN_IF_ERROR(pin.object());
    ReleasedPin out;
    ECX_ASSIGN_OR_RETURN(out.pin, pin.u64("pin", kRequired));
    ECX_ASSIGN_OR_RETURN(out.capability, read_capability(pin, "capability"));
    m.pins.push_back(out);
  }
  return m;
}

Result<OfferNotice> parse_offer(const JsonReader& r) {
  ECX_ASSIGN_OR_RETURN(const json* items, r.array("items", kRequired, kMaxOfferItems));
  OfferNotice m;
  for (size_t i = 0; i < items->size(); ++i) {
    auto p = EcTransferParams::from_json((*items)[i]);
    if (!p.ok()) return p.status().with_context("offered item " + std::to_string(i));
    m.items.push_back(std::move(*p));
  }
  return m;
}

}  // namespace

Result<Notification> parse_notification(std::string_view text) {
  ECX_ASSIGN_OR_RETURN(json j, parse_json_object(text, "notification", kMessageLimits));
  JsonReader r(j, "notification");
  ECX_ASSIGN_OR_RETURN(std::string op, r.string("op", kRequired, 32));
  if (op == "release") {
    ECX_ASSIGN_OR_RETURN(ReleaseNotice m, parse_release(r));
    return Notification(std::move(m));
  }
  if (op == "offer") {
    ECX_ASSIGN_OR_RETURN(OfferNotice m, parse_offer(r));
    return Notification(std::move(m));
  }
  return InvalidArgument("notification: unknown op '" + op + "'");
}

}  // namespace ecx::connector
