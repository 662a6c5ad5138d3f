#include "ecx/transfer/metadata.h"

#include <cstring>

#include "ecx/common/auth.h"

#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>

namespace ecx::transfer {
namespace {

constexpr size_t kMaxNameLength = 256;
constexpr size_t kMaxRegions = 65536;
constexpr uint64_t kMaxRegionLength = uint64_t{1} << 48;

using nlohmann::json;

Result<std::string> get_string(const json& j, const char* key, size_t max_len, bool required) {
  auto it = j.find(key);
  if (it == j.end()) {
    if (required) return InvalidArgument(std::string("agent metadata lacks '") + key + "'");
    return std::string();
  }
  if (!it->is_string())
    return InvalidArgument(std::string("agent metadata '") + key + "' is not a string");
  std::string s = it->get<std::string>();
  if (s.size() > max_len) {
    return InvalidArgument(std::string("agent metadata '") + key + "' is longer than " +
                           std::to_string(max_len));
  }
  return s;
}

Result<uint64_t> get_uint(const json& j, const char* key, uint64_t max) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number_unsigned()) {
    return InvalidArgument(std::string("agent metadata needs an unsigned integer '") + key + "'");
  }
  uint64_t v = it->get<uint64_t>();
  if (v > max) return OutOfRange(std::string("agent metadata '") + key + "' out of range");
  return v;
}

}  // namespace

std::string AgentMetadata::to_json() const {
  json regions_json = json::array();
  for (const auto& r : regions) {
    regions_json.push_back({{"id", r.id},
                            {"length", r.length},
                            {"kind", std::string(memory_kind_name(r.kind))},
                            {"remote_write", r.remote_write},
                            {"shareable", r.shareable}});
  }
  json j = {{"name", name},
            {"protocol_version", protocol_version},
            {"compat_hash", compat_hash},
            {"host_id", host_id},
            {"endpoints", {{"shm", shm_endpoint}, {"tcp", tcp_endpoint}}},
            {"regions", regions_json}};
  return j.dump();
}

Result<AgentMetadata> AgentMetadata::parse(std::string_view text) {
  if (text.size() > 16 * 1024 * 1024) return InvalidArgument("agent metadata larger than 16 MiB");
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgument("agent metadata is not valid JSON");
  if (!j.is_object()) return InvalidArgument("agent metadata is not a JSON object");
  AgentMetadata m;
  ECX_ASSIGN_OR_RETURN(m.name, get_string(j, "name", kMaxNameLength, true));
  if (m.name.empty()) return InvalidArgument("agent metadata has an empty name");
  ECX_ASSIGN_OR_RETURN(uint64_t version, get_uint(j, "protocol_version", UINT32_MAX));
  m.protocol_version = static_cast<uint32_t>(version);
  ECX_ASSIGN_OR_RETURN(m.compat_hash, get_string(j, "compat_hash", kMaxNameLength, true));
  ECX_ASSIGN_OR_RETURN(m.host_id, get_string(j, "host_id", kMaxNameLength, false));
  auto ep = j.find("endpoints");
  if (ep == j.end() || !ep->is_object()) return InvalidArgument("agent metadata lacks 'endpoints'");
  ECX_ASSIGN_OR_RETURN(m.shm_endpoint, get_string(*ep, "shm", 107, false));
  ECX_ASSIGN_OR_RETURN(m.tcp_endpoint, get_string(*ep, "tcp", kMaxNameLength, false));
  auto regions = j.find("regions");
  if (regions == j.end() || !regions->is_array()) {
    return InvalidArgument("agent metadata lacks a 'regions' array");
  }
  if (regions->size() > kMaxRegions)
    return InvalidArgument("agent metadata lists too many regions");
  for (const auto& r : *regions) {
    if (!r.is_object()) return InvalidArgument("agent metadata region is not an object");
    RegionInfo info;
    ECX_ASSIGN_OR_RETURN(uint64_t id, get_uint(r, "id", UINT32_MAX));
    info.id = static_cast<uint32_t>(id);
    ECX_ASSIGN_OR_RETURN(info.length, get_uint(r, "length", kMaxRegionLength));
    ECX_ASSIGN_OR_RETURN(std::string kind, get_string(r, "kind", 16, true));
    if (kind == "host") {
      info.kind = MemoryKind::kHost;
    } else if (kind == "cuda") {
      info.kind = MemoryKind::kCuda;
    } else {
      return InvalidArgument("agent metadata region has unknown kind '" + kind + "'");
    }
    auto rw = r.find("remote_write");
    info.remote_write = rw != r.end() && rw->is_boolean() && rw->get<bool>();
    auto sh = r.find("shareable");
    info.shareable = sh != r.end() && sh->is_boolean() && sh->get<bool>();
    m.regions.push_back(info);
  }
  return m;
}

std::string local_host_id() {
  std::string boot;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::getline(in, boot);
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  return boot + "/" + host;
}

std::string_view memory_kind_name(MemoryKind kind) {
  return kind == MemoryKind::kCuda ? "cuda" : "host";
}

std::string_view backend_name(Backend backend) {
  switch (backend) {
    case Backend::kAuto:
      return "auto";
    case Backend::kShm:
      return "shm";
    case Backend::kTcp:
      return "tcp";
  }
  return "?";
}

Result<Backend> parse_backend(std::string_view name) {
  if (name == "auto") return Backend::kAuto;
  if (name == "shm") return Backend::kShm;
  if (name == "tcp") return Backend::kTcp;
  return InvalidArgument("unknown backend '" + std::string(name) + "' (expected auto, shm or tcp)");
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
