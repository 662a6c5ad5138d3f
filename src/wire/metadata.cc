#include "ecx/transfer/metadata.h"

#include <cstring>

#include "ecx/common/auth.h"
#include "ecx/common/bytes.h"
#include "ecx/common/enum_names.h"
#include "ecx/common/json_reader.h"

#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>

namespace ecx::transfer {
namespace {

constexpr size_t kMaxNameLength = 256;
constexpr size_t kMaxRegions = 65536;
constexpr uint64_t kMaxRegionLength = uint64_t{1} << 48;

// A backend's endpoint or region data (a UCX worker address or packed memory key in hex
// is a few hundred bytes).
constexpr size_t kMaxBackendDataChars = 16384;
// The backends whose endpoints and region data metadata carries; others are ignored.
constexpr Backend kDataBackends[] = {Backend::kShm, Backend::kTcp, Backend::kUcx};
constexpr size_t kMaxSessionChars = 64;

using nlohmann::json;

Status check_hex(const std::string& text, const char* what) {
  return hex_decode(text, what).status();
}

// A backend's string, checked at the boundary before anything uses it: printable ASCII
// within the backend's bounds (an shm endpoint must fit an abstract socket address), and
// for ucx whole bytes of lower-case hex. What it means stays that backend's business.
Status check_backend_string(Backend backend, const std::string& text, const std::string& what) {
  if (backend == Backend::kUcx) return check_hex(text, what.c_str());
  const size_t max = backend == Backend::kShm ? 107 : kMaxNameLength;
  if (text.size() > max) {
    return InvalidArgument(what + " is longer than " + std::to_string(max) + " bytes");
  }
  for (unsigned char c : text) {
    if (c < 0x20 || c > 0x7e) return InvalidArgument(what + " holds a non-printable byte");
  }
  return Status::Ok();
}

// {"shm": "...", "ucx": "..."}: the per-backend strings of `r`'s `key`, empty ones left out.
Result<std::map<Backend, std::string>> parse_per_backend(const JsonReader& r, const char* key,
                                                         Presence presence) {
  std::map<Backend, std::string> out;
  ECX_ASSIGN_OR_RETURN(JsonReader child, r.child(key, presence));  // {} when absent
  for (Backend b : kDataBackends) {
    const std::string name(backend_name(b));
    ECX_ASSIGN_OR_RETURN(std::string value,
                         child.string(name, Presence::kOptional, kMaxBackendDataChars));
    ECX_RETURN_IF_ERROR(check_backend_string(b, value, child.where() + "." + name));
    if (!value.empty()) out.emplace(b, std::move(value));
  }
  return out;
}

json per_backend_json(const std::map<Backend, std::string>& values) {
  json j = json::object();
  for (const auto& [b, value] : values) j[std::string(backend_name(b))] = value;
  return j;
}

const std::string& value_for(const std::map<Backend, std::string>& values, Backend b) {
  static const std::string kNone;
  auto it = values.find(b);
  return it == values.end() ? kNone : it->second;
}

constexpr EnumName<MemoryKind> kMemoryKinds[] = {{MemoryKind::kHost, "host"},
                                                 {MemoryKind::kCuda, "cuda"}};
constexpr EnumName<Backend> kBackends[] = {{Backend::kAuto, "auto"},
                                           {Backend::kShm, "shm"},
                                           {Backend::kTcp, "tcp"},
                                           {Backend::kUcx, "ucx"}};

Result<MemoryKind> parse_kind(const std::string& kind) {
  return parse_name<MemoryKind>(kMemoryKinds, kind, "agent metadata region kind");
}

Result<RegionInfo> parse_region(const JsonReader& r) {
  ECX_RETURN_IF_ERROR(r.object());
  RegionInfo info;
  ECX_ASSIGN_OR_RETURN(uint64_t id, r.u64("id", Presence::kRequired, UINT32_MAX));
  info.id = static_cast<uint32_t>(id);
  ECX_ASSIGN_OR_RETURN(info.length, r.u64("length", Presence::kRequired, kMaxRegionLength));
  ECX_ASSIGN_OR_RETURN(std::string kind, r.string("kind", Presence::kRequired, 16));
  ECX_ASSIGN_OR_RETURN(info.kind, parse_kind(kind));
  ECX_ASSIGN_OR_RETURN(info.remote_write, r.boolean("remote_write"));
  ECX_ASSIGN_OR_RETURN(info.shareable, r.boolean("shareable"));
  ECX_ASSIGN_OR_RETURN(info.backend_data,
                       parse_per_backend(r, "backend_data", Presence::kOptional));
  return info;
}

}  // namespace

const std::string& RegionInfo::data_for(Backend backend) const {
  return value_for(backend_data, backend);
}

const std::string& AgentMetadata::endpoint(Backend backend) const {
  return value_for(endpoints, backend);
}

std::string AgentMetadata::to_json() const {
  json regions_json = json::array();
  for (const auto& r : regions) {
    regions_json.push_back({{"id", r.id},
                            {"length", r.length},
                            {"kind", std::string(memory_kind_name(r.kind))},
                            {"remote_write", r.remote_write},
                            {"shareable", r.shareable}});
    if (!r.backend_data.empty())
      regions_json.back()["backend_data"] = per_backend_json(r.backend_data);
  }
  json j = {{"name", name},
            {"protocol_version", protocol_version},
            {"compat_hash", compat_hash},
            {"host_id", host_id},
            {"endpoints", per_backend_json(endpoints)},
            {"regions", regions_json}};
  if (!session.empty()) j["session"] = session;
  return j.dump();
}

Result<AgentMetadata> AgentMetadata::parse(std::string_view text) {
  ECX_ASSIGN_OR_RETURN(json j, parse_json_object(text, "agent metadata", {16 << 20, 16}));
  JsonReader r(j, "agent metadata");
  AgentMetadata m;
  ECX_ASSIGN_OR_RETURN(m.name, r.string("name", Presence::kRequired, kMaxNameLength));
  if (m.name.empty()) return InvalidArgument("agent metadata has an empty name");
  // '#' separates a name from its session in a peer's identity (AgentMetadata::holder).
  if (m.name.find('#') != std::string::npos) {
    return InvalidArgument("agent metadata: name '" + m.name + "' contains '#'");
  }
  ECX_ASSIGN_OR_RETURN(uint64_t version,
                       r.u64("protocol_version", Presence::kRequired, UINT32_MAX));
  m.protocol_version = static_cast<uint32_t>(version);
  ECX_ASSIGN_OR_RETURN(m.compat_hash, r.string("compat_hash", Presence::kRequired, kMaxNameLength));
  ECX_ASSIGN_OR_RETURN(m.host_id, r.string("host_id", Presence::kOptional, kMaxNameLength));
  ECX_ASSIGN_OR_RETURN(m.endpoints, parse_per_backend(r, "endpoints", Presence::kRequired));
  ECX_ASSIGN_OR_RETURN(m.session, r.string("session", Presence::kOptional, kMaxSessionChars));
  ECX_RETURN_IF_ERROR(check_hex(m.session, "agent metadata: session"));
  ECX_ASSIGN_OR_RETURN(const json* regions, r.array("regions", Presence::kRequired, kMaxRegions));
  for (size_t i = 0; i < regions->size(); ++i) {
    ECX_ASSIGN_OR_RETURN(
        RegionInfo info,
        parse_region(JsonReader((*regions)[i], "agent metadata region " + std::to_string(i))));
    m.regions.push_back(info);
  }
  return m;
}

// Boot id, hostname and network namespace: two processes in two network namespaces
// (the test hosts of scripts/hosts) cannot reach each other's abstract unix sockets,
// so they are two hosts to the backends.
std::string local_host_id() {
  std::string boot;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::getline(in, boot);
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  char netns[64] = {};  // "net:[4026531840]"
  ssize_t n = ::readlink("/proc/self/ns/net", netns, sizeof(netns) - 1);
  return boot + "/" + host + (n > 0 ? "/" + std::string(netns, static_cast<size_t>(n)) : "");
}

std::string_view memory_kind_name(MemoryKind kind) {
  return name_of<MemoryKind>(kMemoryKinds, kind);
}

std::string_view backend_name(Backend backend) { return name_of<Backend>(kBackends, backend); }

Result<Backend> parse_backend(std::string_view name) {
  return parse_name<Backend>(kBackends, name, "backend");
}

bool Capability::empty() const {
  for (uint8_t b : bytes) {
    if (b != 0) return false;
  }
  return true;
}

std::string Capability::hex() const {
  static const char* kDigits = "0123456789abcdef";
  std::string s;
  s.reserve(32);
  for (uint8_t b : bytes) {
    s.push_back(kDigits[b >> 4]);
    s.push_back(kDigits[b & 15]);
  }
  return s;
}

Result<Capability> Capability::parse_hex(std::string_view hex) {
  if (hex.size() != 32) return InvalidArgument("a capability is 32 hex digits");
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  Capability cap;
  for (size_t i = 0; i < cap.bytes.size(); ++i) {
    int hi = digit(hex[2 * i]), lo = digit(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return InvalidArgument("a capability is lower-case hex");
    cap.bytes[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return cap;
}

Capability Capability::random() {
  Capability cap;
  std::string r = random_bytes(cap.bytes.size());
  std::memcpy(cap.bytes.data(), r.data(), cap.bytes.size());
  return cap;
}

}  // namespace ecx::transfer
