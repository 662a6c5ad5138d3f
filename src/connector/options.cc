#include "connector/options.h"

#include <unistd.h>

#include <filesystem>
#include <set>

#include "ecx/common/auth.h"
#include "ecx/common/bytes.h"

namespace ecx::connector {
namespace {

using nlohmann::json;

const std::set<std::string> kKnownKeys = {"engine_id",
                                          "compat_hash",
                                          "failure_policy",
                                          "load_timeout_ms",
                                          "pool_bytes",
                                          "lease_ms",
                                          "consumer_pin_ms",
                                          "save_wait_ms",
                                          "loader_threads",
                                          "mode",
                                          "backend",
                                          "tcp_host",
                                          "tcp_port",
                                          "root",
                                          "ttl_s",
                                          "max_bytes",
                                          "delete_on_release",
                                          "redis",
                                          "auth_token",
                                          "auth_token_file",
                                          "max_connections",
                                          "idle_timeout_ms",
                                          "require_grants"};

Status get_string(const json& extra, const char* key, std::string* out) {
  auto it = extra.find(key);
  if (it == extra.end()) return Status::Ok();
  if (!it->is_string())
    return InvalidArgument(std::string("connector extra '") + key + "' must be a string");
  *out = it->get<std::string>();
  return Status::Ok();
}

Status get_int(const json& extra, const char* key, int64_t min, int64_t max, int64_t* out) {
  auto it = extra.find(key);
  if (it == extra.end()) return Status::Ok();
  if (!it->is_number_integer())
    return InvalidArgument(std::string("connector extra '") + key + "' must be an integer");
  int64_t v = it->get<int64_t>();
  if (v < min || v > max) {
    return OutOfRange(std::string("connector extra '") + key + "' = " + std::to_string(v) +
                      " is outside [" + std::to_string(min) + ", " + std::to_string(max) + "]");
  }
  *out = v;
  return Status::Ok();
}

Status get_bytes(const json& extra, const char* key, uint64_t* out) {
  auto it = extra.find(key);
  if (it == extra.end()) return Status::Ok();
  if (it->is_number_unsigned()) {
    *out = it->get<uint64_t>();
    return Status::Ok();
  }
  if (!it->is_string())
    return InvalidArgument(std::string("connector extra '") + key + "' must be a size");
  ECX_ASSIGN_OR_RETURN(*out, parse_bytes(it->get<std::string>()));
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
  ECX_RETURN_IF_ERROR(get_string(extra, "engine_id", &o.engine_id));
  std::string token, token_file;
  ECX_RETURN_IF_ERROR(get_string(extra, "auth_token", &token));
  ECX_RETURN_IF_ERROR(get_string(extra, "auth_token_file", &token_file));
  ECX_ASSIGN_OR_RETURN(o.auth_secret, load_secret(token, token_file));
  int64_t max_connections = o.max_connections;
  ECX_RETURN_IF_ERROR(get_int(extra, "max_connections", 1, 65536, &max_connections));
  o.max_connections = static_cast<int>(max_connections);
  ECX_RETURN_IF_ERROR(get_int(extra, "idle_timeout_ms", 100, 86'400'000, &o.idle_timeout_ms));
  ECX_RETURN_IF_ERROR(get_string(extra, "compat_hash", &o.compat_hash));
  std::string policy = "recompute";
  ECX_RETURN_IF_ERROR(get_string(extra, "failure_policy", &policy));
  if (policy == "recompute") {
    o.failure_policy = FailurePolicy::kRecompute;
  } else if (policy == "fail") {
    o.failure_policy = FailurePolicy::kFail;
  } else {
    return InvalidArgument("failure_policy must be 'recompute' or 'fail', not '" + policy + "'");
  }
  ECX_RETURN_IF_ERROR(get_int(extra, "load_timeout_ms", 1, 3'600'000, &o.load_timeout_ms));
  ECX_RETURN_IF_ERROR(get_bytes(extra, "pool_bytes", &o.pool_bytes));
  ECX_RETURN_IF_ERROR(get_int(extra, "lease_ms", 1, 86'400'000, &o.lease_ms));
  ECX_RETURN_IF_ERROR(get_int(extra, "consumer_pin_ms", 1, 86'400'000, &o.consumer_pin_ms));
  ECX_RETURN_IF_ERROR(get_int(extra, "save_wait_ms", 0, 3'600'000, &o.save_wait_ms));
  int64_t threads = o.loader_threads;
  ECX_RETURN_IF_ERROR(get_int(extra, "loader_threads", 1, 64, &threads));
  o.loader_threads = static_cast<int>(threads);
  ECX_RETURN_IF_ERROR(get_string(extra, "mode", &o.mode));
  if (o.mode != "pull" && o.mode != "pull-2step" && o.mode != "push") {
    return InvalidArgument("p2p mode must be pull, pull-2step or push, not '" + o.mode + "'");
  }
  std::string backend = "auto";
  ECX_RETURN_IF_ERROR(get_string(extra, "backend", &backend));
  ECX_ASSIGN_OR_RETURN(o.backend, transfer::parse_backend(backend));
  ECX_RETURN_IF_ERROR(get_string(extra, "tcp_host", &o.tcp_host));
  int64_t port = 0;
  ECX_RETURN_IF_ERROR(get_int(extra, "tcp_port", 0, 65535, &port));
  o.tcp_port = static_cast<uint16_t>(port);
  ECX_RETURN_IF_ERROR(get_string(extra, "root", &o.root));
  ECX_RETURN_IF_ERROR(get_int(extra, "ttl_s", 1, 365 * 86400, &o.ttl_s));
  ECX_RETURN_IF_ERROR(get_bytes(extra, "max_bytes", &o.max_bytes));
  if (auto it = extra.find("require_grants"); it != extra.end()) {
    if (!it->is_boolean()) {
      return InvalidArgument("connector extra 'require_grants' must be a boolean");
    }
    o.require_grants = it->get<bool>();
  }
  if (auto it = extra.find("delete_on_release"); it != extra.end()) {
    if (!it->is_boolean())
      return InvalidArgument("connector extra 'delete_on_release' must be a boolean");
    o.delete_on_release = it->get<bool>();
  }
  ECX_RETURN_IF_ERROR(get_string(extra, "redis", &o.redis));
  if (o.pool_bytes < (1 << 20)) return InvalidArgument("pool_bytes must be at least 1MiB");
  return o;
}

}  // namespace ecx::connector
