#include "connector/options.h"

#include <arpa/inet.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <set>

#include "connector/offers.h"
#include "ecx/common/auth.h"
#include "ecx/common/bytes.h"
#include "ecx/common/enum_names.h"
#include "ecx/common/json_reader.h"

namespace ecx::connector {
namespace {

using nlohmann::json;

constexpr EnumName<P2pMode> kModes[] = {
    {P2pMode::kPull, "pull"}, {P2pMode::kPull2Step, "pull-2step"}, {P2pMode::kPush, "push"}};

const std::set<std::string> kKnownKeys = {"engine_id",
                                          "compat_hash",
                                          "failure_policy",
                                          "load_timeout_ms",
                                          "pool_bytes",
                                          "lease_ms",
                                          "consumer_pin_ms",
                                          "save_wait_ms",
                                          "loader_threads",
                                          "keep_loaded",
                                          "mode",
                                          "backend",
                                          "ucx",
                                          "ucx_tls",
                                          "ucx_library",
                                          "ucx_error_mode",
                                          "tcp_host",
                                          "tcp_port",
                                          "tcp_advertise_host",
                                          "root",
                                          "ttl_s",
                                          "max_bytes",
                                          "delete_on_release",
                                          "redis",
                                          "auth_token",
                                          "auth_token_file",
                                          "max_connections",
                                          "max_pins_per_holder",
                                          "idle_timeout_ms",
                                          "require_grants",
                                          "checksum",
                                          "zero_copy",
                                          "copy_threads",
                                          "offer_to"};

// A size: a byte count, or a string such as "512MiB".
Result<uint64_t> read_bytes(const JsonReader& r, const char* key, uint64_t fallback) {
  if (!r.has(key) || r.document()[key].is_number_unsigned())
    return r.u64(key, Presence::kOptional, UINT64_MAX, fallback);
  if (!r.document()[key].is_string()) return r.wrong(key, "a size");
  return parse_bytes(r.document()[key].get<std::string>());
}

constexpr EnumName<ChecksumPolicy> kChecksums[] = {
    {ChecksumPolicy::kAuto, "auto"}, {ChecksumPolicy::kOn, "on"}, {ChecksumPolicy::kOff, "off"}};

constexpr EnumName<FailurePolicy> kPolicies[] = {{FailurePolicy::kRecompute, "recompute"},
                                                 {FailurePolicy::kFail, "fail"}};

// `text` as it can go into a message: characters other than printable ASCII as '?'.
std::string printable(std::string_view text) {
  std::string out(text.substr(0, 100));
  for (char& c : out) {
    if (c < 0x20 || c > 0x7e) c = '?';
  }
  return out;
}

// An engine id names this connector's agent to its peers (and its unix socket): 1 to 255
// letters, digits and . _ : - @ +.
Status check_engine_id(const std::string& id) {
  const bool ok = !id.empty() && id.size() <= 255 && std::all_of(id.begin(), id.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) ||
           (c != '\0' && std::strchr("._:-@+", c) != nullptr);
  });
  if (ok) return Status::Ok();
  return InvalidArgument("engine_id '" + printable(id) +
                         "' must be 1 to 255 letters, digits and . _ : - @ +");
}

// tcp_host: an IPv4 or IPv6 address, or a host name (RFC 1123 labels). A dotted
// quad that is not an address ("999.1.2.3") is refused, not looked up as a name.
Status check_tcp_host(const std::string& host) {
  unsigned char addr[sizeof(in6_addr)];
  if (::inet_pton(AF_INET, host.c_str(), addr) == 1 ||
      ::inet_pton(AF_INET6, host.c_str(), addr) == 1) {
    return Status::Ok();
  }
  const Status bad = InvalidArgument("tcp_host '" + printable(host) +
                                     "' is neither an IP address nor a host name");
  if (host.empty() || host.size() > 253 ||
      host.find_first_not_of("0123456789.") == std::string::npos)
    return bad;
  size_t start = 0;
  while (start <= host.size()) {
    size_t end = host.find('.', start);
    if (end == std::string::npos) end = host.size();
    std::string_view label(host.data() + start, end - start);
    if (label.empty() || label.size() > 63 || label.front() == '-' || label.back() == '-' ||
        !std::all_of(label.begin(), label.end(), [](char c) {
          return std::isalnum(static_cast<unsigned char>(c)) || c == '-';
        })) {
      return bad;
    }
    start = end + 1;
  }
  return Status::Ok();
}

// The options every connector shares.
Status read_common(const JsonReader& r, ConnectorOptions& o) {
  ECX_ASSIGN_OR_RETURN(o.engine_id, r.string("engine_id", Presence::kOptional, 4096, o.engine_id));
  ECX_RETURN_IF_ERROR(check_engine_id(o.engine_id));
  ECX_ASSIGN_OR_RETURN(std::string token, r.string("auth_token"));
  ECX_ASSIGN_OR_RETURN(std::string token_file, r.string("auth_token_file"));
  ECX_ASSIGN_OR_RETURN(o.auth_secret, load_secret(token, token_file));
  ECX_ASSIGN_OR_RETURN(int64_t max_connections,
                       r.i64("max_connections", 1, 65536, Presence::kOptional, o.max_connections));
  o.max_connections = static_cast<int>(max_connections);
  ECX_ASSIGN_OR_RETURN(o.max_pins_per_holder, r.i64("max_pins_per_holder", 1, 1 << 20,
                                                    Presence::kOptional, o.max_pins_per_holder));
  ECX_ASSIGN_OR_RETURN(o.idle_timeout_ms, r.i64("idle_timeout_ms", 100, 86'400'000,
                                                Presence::kOptional, o.idle_timeout_ms));
  ECX_ASSIGN_OR_RETURN(o.compat_hash,
                       r.string("compat_hash", Presence::kOptional, 4096, o.compat_hash));
  ECX_ASSIGN_OR_RETURN(std::string policy,
                       r.string("failure_policy", Presence::kOptional, 64, "recompute"));
  ECX_ASSIGN_OR_RETURN(o.failure_policy,
                       parse_name<FailurePolicy>(kPolicies, policy, "failure_policy"));
  ECX_ASSIGN_OR_RETURN(std::string checksum, r.string("checksum", Presence::kOptional, 16, "auto"));
  ECX_ASSIGN_OR_RETURN(o.checksum, parse_name<ChecksumPolicy>(kChecksums, checksum, "checksum"));
  ECX_ASSIGN_OR_RETURN(o.load_timeout_ms, r.i64("load_timeout_ms", 1, 3'600'000,
                                                Presence::kOptional, o.load_timeout_ms));
  ECX_ASSIGN_OR_RETURN(o.pool_bytes, read_bytes(r, "pool_bytes", o.pool_bytes));
  ECX_ASSIGN_OR_RETURN(o.lease_ms,
                       r.i64("lease_ms", 1, 86'400'000, Presence::kOptional, o.lease_ms));
  ECX_ASSIGN_OR_RETURN(o.consumer_pin_ms, r.i64("consumer_pin_ms", 1, 86'400'000,
                                                Presence::kOptional, o.consumer_pin_ms));
  ECX_ASSIGN_OR_RETURN(o.save_wait_ms,
                       r.i64("save_wait_ms", 0, 3'600'000, Presence::kOptional, o.save_wait_ms));
  ECX_ASSIGN_OR_RETURN(int64_t threads,
                       r.i64("loader_threads", 1, 64, Presence::kOptional, o.loader_threads));
  o.loader_threads = static_cast<int>(threads);
  ECX_ASSIGN_OR_RETURN(o.keep_loaded, r.boolean("keep_loaded", Presence::kOptional, o.keep_loaded));
  ECX_ASSIGN_OR_RETURN(o.require_grants,
                       r.boolean("require_grants", Presence::kOptional, o.require_grants));
  return Status::Ok();
}

// offer_to: the consumers' addresses, each as parse_offer_address gives it.
Status read_offer_to(const JsonReader& r, ConnectorOptions& o) {
  ECX_ASSIGN_OR_RETURN(const json* list, r.array("offer_to", Presence::kOptional, 4096));
  if (list == nullptr) return Status::Ok();
  for (size_t i = 0; i < list->size(); ++i) {
    const json& entry = (*list)[i];
    if (!entry.is_string())
      return InvalidArgument("offer_to: entry " + std::to_string(i) + " is not a string");
    auto address = parse_offer_address(entry.get<std::string>());
    if (!address.ok()) return address.status().with_context("offer_to entry " + std::to_string(i));
    o.offer_to.push_back(std::move(*address));
  }
  return Status::Ok();
}

// The options of one connector kind (p2p, disk, store); each ignores the others'.
Status read_specific(const JsonReader& r, ConnectorOptions& o) {
  ECX_ASSIGN_OR_RETURN(std::string mode, r.string("mode", Presence::kOptional, 64, "pull"));
  ECX_ASSIGN_OR_RETURN(o.mode, parse_p2p_mode(mode));
  ECX_ASSIGN_OR_RETURN(std::string backend, r.string("backend", Presence::kOptional, 64, "auto"));
  ECX_ASSIGN_OR_RETURN(o.backend, transfer::parse_backend(backend));
  ECX_ASSIGN_OR_RETURN(o.ucx.enable,
                       r.boolean("ucx", Presence::kOptional, o.backend == transfer::Backend::kUcx));
  ECX_ASSIGN_OR_RETURN(o.ucx.tls, r.string("ucx_tls", Presence::kOptional, 256, o.ucx.tls));
  ECX_ASSIGN_OR_RETURN(o.ucx.library,
                       r.string("ucx_library", Presence::kOptional, 4096, o.ucx.library));
  ECX_ASSIGN_OR_RETURN(o.ucx.error_mode,
                       r.string("ucx_error_mode", Presence::kOptional, 16, o.ucx.error_mode));
  ECX_ASSIGN_OR_RETURN(o.zero_copy, r.boolean("zero_copy", Presence::kOptional, o.zero_copy));
  ECX_ASSIGN_OR_RETURN(int64_t copy_threads,
                       r.i64("copy_threads", 1, 16, Presence::kOptional, o.copy_threads));
  o.copy_threads = static_cast<int>(copy_threads);
  ECX_RETURN_IF_ERROR(read_offer_to(r, o));
  ECX_ASSIGN_OR_RETURN(o.tcp_host, r.string("tcp_host", Presence::kOptional, 4096, o.tcp_host));
  ECX_RETURN_IF_ERROR(check_tcp_host(o.tcp_host));
  ECX_ASSIGN_OR_RETURN(o.tcp_advertise_host, r.string("tcp_advertise_host", Presence::kOptional,
                                                      4096, o.tcp_advertise_host));
  if (!o.tcp_advertise_host.empty()) {
    ECX_RETURN_IF_ERROR(check_tcp_host(o.tcp_advertise_host).with_context("tcp_advertise_host"));
  }
  ECX_ASSIGN_OR_RETURN(int64_t port, r.i64("tcp_port", 0, 65535));
  o.tcp_port = static_cast<uint16_t>(port);
  ECX_ASSIGN_OR_RETURN(o.root, r.string("root", Presence::kOptional, 4096, o.root));
  ECX_ASSIGN_OR_RETURN(o.ttl_s, r.i64("ttl_s", 1, 365 * 86400, Presence::kOptional, o.ttl_s));
  ECX_ASSIGN_OR_RETURN(o.max_bytes, read_bytes(r, "max_bytes", o.max_bytes));
  ECX_ASSIGN_OR_RETURN(o.delete_on_release,
                       r.boolean("delete_on_release", Presence::kOptional, o.delete_on_release));
  ECX_ASSIGN_OR_RETURN(o.redis, r.string("redis", Presence::kOptional, 4096, o.redis));
  return Status::Ok();
}

}  // namespace

Result<ConnectorOptions> ConnectorOptions::parse(const std::string& connector, const json& extra) {
  if (!extra.is_object()) return InvalidArgument("connector 'extra' must be an object");
  for (const auto& [key, value] : extra.items()) {
    if (!kKnownKeys.count(key)) return InvalidArgument("unknown connector option '" + key + "'");
  }
  ConnectorOptions o;
  o.engine_id = connector + "-" + std::to_string(::getpid());
  o.root = (std::filesystem::temp_directory_path() / "ecx-disk-cache").string();
  JsonReader r(extra, "connector extra");
  ECX_RETURN_IF_ERROR(read_common(r, o));
  ECX_RETURN_IF_ERROR(read_specific(r, o));
  if (o.pool_bytes < (1 << 20)) return InvalidArgument("pool_bytes must be at least 1MiB");
  return o;
}

Result<P2pMode> parse_p2p_mode(std::string_view name) {
  return parse_name<P2pMode>(kModes, name, "p2p mode");
}

std::string_view p2p_mode_name(P2pMode mode) { return name_of<P2pMode>(kModes, mode); }

}  // namespace ecx::connector
