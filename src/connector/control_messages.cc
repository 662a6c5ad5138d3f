#include "connector/control_messages.h"

#include <nlohmann/json.hpp>

namespace ecx::connector {
namespace {

using nlohmann::json;

// Field readers: each checks presence and type, and names the field on failure.
class Reader {
 public:
  Reader(const json& object, std::string where) : j_(object), where_(std::move(where)) {}

  Status object() const {
    return j_.is_object() ? Status::Ok() : InvalidArgument(where_ + " must be a JSON object");
  }
  Result<std::string> string(const char* key, bool required, size_t max) const {
    auto it = j_.find(key);
    if (it == j_.end()) return required ? missing(key) : Result<std::string>(std::string());
    if (!it->is_string()) return wrong(key, "a string");
    const auto& s = it->get_ref<const std::string&>();
    if (s.size() > max) return wrong(key, "at most " + std::to_string(max) + " characters");
    return s;
  }
  Result<uint64_t> u64(const char* key, bool required, uint64_t max = UINT64_MAX) const {
    auto it = j_.find(key);
    if (it == j_.end()) return required ? missing(key) : Result<uint64_t>(uint64_t{0});
    if (!it->is_number_unsigned()) return wrong(key, "a non-negative integer");
    uint64_t v = it->get<uint64_t>();
    if (v > max) return wrong(key, "at most " + std::to_string(max));
    return v;
  }
  Result<int64_t> i64(const char* key, int64_t min, int64_t max) const {
    auto it = j_.find(key);
    if (it == j_.end()) return int64_t{0};
    if (!it->is_number_integer()) return wrong(key, "an integer");
    int64_t v = it->get<int64_t>();
    return std::clamp(v, min, max);
  }
  Result<MmHash> mm_hash() const {
    ECX_ASSIGN_OR_RETURN(std::string s, string("mm_hash", true, 256));
    auto h = MmHash::parse(s);
    if (!h.ok()) return h.status().with_context(where_ + " 'mm_hash'");
    return h;
  }
  Result<transfer::Capability> capability(const char* key) const {
    ECX_ASSIGN_OR_RETURN(std::string s, string(key, false, 32));
    if (s.empty()) return transfer::Capability{};
    auto c = transfer::Capability::parse_hex(s);
    if (!c.ok()) return c.status().with_context(where_ + " '" + key + "'");
    return c;
  }
  Result<const json*> array(const char* key) const {
    auto it = j_.find(key);
    if (it == j_.end()) return missing(key);
    if (!it->is_array()) return wrong(key, "an array");
    if (it->size() > kMaxMessageItems) {
      return wrong(key, "at most " + std::to_string(kMaxMessageItems) + " items");
    }
    return &*it;
  }

 private:
  Status missing(const char* key) const { return InvalidArgument(where_ + " lacks '" + key + "'"); }
  Status wrong(const char* key, const std::string& what) const {
    return InvalidArgument(where_ + " '" + key + "' must be " + what);
  }
  const json& j_;
  std::string where_;
};

// Parses text as JSON without exceptions, bounded in nesting (the documents here are flat).
Result<json> parse_document(std::string_view text, const char* what) {
  int depth = 0;
  for (char c : text) {
    if (c == '[' || c == '{') {
      if (++depth > 16) return InvalidArgument(std::string(what) + " nests too deep");
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgument(std::string(what) + " is not valid JSON");
  if (!j.is_object()) return InvalidArgument(std::string(what) + " must be a JSON object");
  return j;
}

json status_fields(const Status& s) {
  return {{"status", std::string(status_code_name(s.code()))}, {"message", s.message()}};
}

Result<LookupRequest> parse_lookup(const Reader& r) {
  LookupRequest m;
  ECX_ASSIGN_OR_RETURN(m.wait_ms, r.i64("wait_ms", 0, 60000));
  ECX_ASSIGN_OR_RETURN(const json* items, r.array("items"));
  for (size_t i = 0; i < items->size(); ++i) {
    Reader item((*items)[i], "lookup item " + std::to_string(i));
    ECX_RETURN_IF_ERROR(item.object());
    LookupItem out;
    ECX_ASSIGN_OR_RETURN(out.mm_hash, item.mm_hash());
    ECX_ASSIGN_OR_RETURN(out.capability, item.capability("capability"));
    m.items.push_back(out);
  }
  return m;
}

Result<LoadBlocksRequest> parse_load(const Reader& r) {
  LoadBlocksRequest m;
  ECX_ASSIGN_OR_RETURN(m.consumer, r.string("consumer", true, 1 << 20));
  ECX_ASSIGN_OR_RETURN(std::string backend, r.string("backend", false, 16));
  if (!backend.empty()) {
    ECX_ASSIGN_OR_RETURN(m.backend, transfer::parse_backend(backend));
  }
  ECX_ASSIGN_OR_RETURN(m.wait_ms, r.i64("wait_ms", 0, 60000));
  ECX_ASSIGN_OR_RETURN(const json* items, r.array("items"));
  for (size_t i = 0; i < items->size(); ++i) {
    Reader item((*items)[i], "load item " + std::to_string(i));
    ECX_RETURN_IF_ERROR(item.object());
    LoadItemRequest out;
    ECX_ASSIGN_OR_RETURN(out.mm_hash, item.mm_hash());
    ECX_ASSIGN_OR_RETURN(out.capability, item.capability("capability"));
    ECX_ASSIGN_OR_RETURN(uint64_t region, item.u64("dst_region", true, UINT32_MAX));
    out.dst_region = static_cast<uint32_t>(region);
    ECX_ASSIGN_OR_RETURN(out.dst_offset, item.u64("dst_offset", true));
    ECX_ASSIGN_OR_RETURN(out.dst_length, item.u64("dst_length", true));
    ECX_ASSIGN_OR_RETURN(out.dst_capability, item.capability("dst_capability"));
    ECX_ASSIGN_OR_RETURN(out.generation, item.u64("generation", false));
    ECX_ASSIGN_OR_RETURN(out.pin, item.u64("pin", false));
    m.items.push_back(out);
  }
  return m;
}

}  // namespace

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
    items.push_back(std::move(j));
  }
  return json{{"items", items}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string to_json(const ReleaseNotice& m) {
  json pins = json::array();
  for (const auto& p : m.pins) pins.push_back({{"pin", p.pin}, {"capability", p.capability.hex()}});
  return json{{"op", "release"}, {"pins", pins}}.dump();
}

Result<ControlRequest> parse_control_request(std::string_view text) {
  ECX_ASSIGN_OR_RETURN(json j, parse_document(text, "control request"));
  Reader r(j, "control request");
  ECX_ASSIGN_OR_RETURN(std::string op, r.string("op", true, 32));
  if (op == "lookup") {
    ECX_ASSIGN_OR_RETURN(LookupRequest m, parse_lookup(r));
    return ControlRequest(std::move(m));
  }
  if (op == "load") {
    ECX_ASSIGN_OR_RETURN(LoadBlocksRequest m, parse_load(r));
    return ControlRequest(std::move(m));
  }
  return InvalidArgument("control request: unknown op '" + op + "'");
}

Result<ItemsReply> parse_items_reply(std::string_view text, size_t expected_items) {
  ECX_ASSIGN_OR_RETURN(json j, parse_document(text, "reply"));
  Reader r(j, "reply");
  ECX_ASSIGN_OR_RETURN(const json* items, r.array("items"));
  if (items->size() != expected_items) {
    return InvalidArgument("reply has " + std::to_string(items->size()) +
                           " items for a request of " + std::to_string(expected_items));
  }
  ItemsReply m;
  for (size_t i = 0; i < items->size(); ++i) {
    Reader item((*items)[i], "reply item " + std::to_string(i));
    ECX_RETURN_IF_ERROR(item.object());
    ItemReply out;
    ECX_ASSIGN_OR_RETURN(out.mm_hash, item.mm_hash());
    ECX_ASSIGN_OR_RETURN(std::string code, item.string("status", true, 32));
    ECX_ASSIGN_OR_RETURN(std::string message, item.string("message", false, 4096));
    auto parsed = status_code_from_name(code);
    if (!parsed)
      return InvalidArgument("reply item " + std::to_string(i) + ": unknown status '" + code + "'");
    out.status = Status(*parsed, message);
    if (out.status.ok()) {
      ECX_ASSIGN_OR_RETURN(uint64_t region, item.u64("region", false, UINT32_MAX));
      BlockLocation& w = out.where;
      w.region = static_cast<uint32_t>(region);
      ECX_ASSIGN_OR_RETURN(w.offset, item.u64("offset", false));
      ECX_ASSIGN_OR_RETURN(w.length, item.u64("length", false));
      ECX_ASSIGN_OR_RETURN(w.generation, item.u64("generation", false));
      ECX_ASSIGN_OR_RETURN(w.pin, item.u64("pin", false));
      ECX_ASSIGN_OR_RETURN(w.capability, item.capability("capability"));
    }
    m.items.push_back(std::move(out));
  }
  return m;
}

Result<ReleaseNotice> parse_release_notice(std::string_view text) {
  ECX_ASSIGN_OR_RETURN(json j, parse_document(text, "release notice"));
  Reader r(j, "release notice");
  ECX_ASSIGN_OR_RETURN(std::string op, r.string("op", true, 32));
  if (op != "release") return InvalidArgument("notification: unknown op '" + op + "'");
  ECX_ASSIGN_OR_RETURN(const json* pins, r.array("pins"));
  ReleaseNotice m;
  for (size_t i = 0; i < pins->size(); ++i) {
    Reader pin((*pins)[i], "released pin " + std::to_string(i));
    ECX_RETURN_IF_ERROR(pin.object());
    ReleasedPin out;
    ECX_ASSIGN_OR_RETURN(out.pin, pin.u64("pin", true));
    ECX_ASSIGN_OR_RETURN(out.capability, pin.capability("capability"));
    m.pins.push_back(out);
  }
  return m;
}

}  // namespace ecx::connector
