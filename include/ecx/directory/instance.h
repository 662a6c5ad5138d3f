// A serving instance (E or PD) as the directory lists it, and where it is kept in etcd:
//   <root>/<model>/instances/<role>/<id>  ->  {"id","url","role","model","compat_hash"}
//   (and "prove_url" for an instance a sidecar registered)
// (root "/ecx" by default). A proxy watches <root>/<model>/instances/.
#pragma once

#include <string>
#include <string_view>

#include "ecx/common/status.h"

namespace ecx::directory {

struct Instance {
  std::string id;           // unique per process: "<role>-<hex>"
  std::string url;          // where it serves: http://host:port
  std::string role;         // "encoder" or "pd"
  std::string model;        // the served model name
  std::string compat_hash;  // the connector's compatibility hash
  // Where the instance answers proxies' challenges (GET /v1/ecx/prove), when that is not
  // `url`: the sidecar (`ecx serve sidecar`) that registers an engine which cannot answer
  // them itself (a vLLM instance). Empty: `url`.
  std::string prove_url;
  // The proof that the deployment wrote the record (sign_instance): a fresh random nonce
  // (hex) and an HMAC (hex) under the deployment secret over the key, every field above
  // and the nonce. Empty in a record nobody signed.
  std::string nonce;
  std::string mac;
};

// Signs `instance`'s record for `key` (instance_key) with `secret`: a new nonce and mac.
void sign_instance(Instance& instance, const std::string& key, const std::string& secret);
// Ok when `instance` (as found at `key`) was signed with `secret`; PermissionDenied if not.
Status verify_instance(const Instance& instance, const std::string& key, const std::string& secret);
// What an instance answers a proxy's challenge (GET /v1/ecx/prove?nonce=N, N 64 hex
// digits) with: an HMAC (hex) under `secret` over N and the instance's id and url. Only
// a process that holds the secret can answer, so a record pointing at a service that
// does not (or at the proxy itself) is never routed to.
std::string prove_instance(const Instance& instance, const std::string& challenge,
                           const std::string& secret);

// "<root>/<model>/instances/".
std::string instances_prefix(const std::string& root, const std::string& model);
// "<root>/<model>/instances/<role>/<id>".
std::string instance_key(const std::string& root, const Instance& instance);

// The value kept in etcd.
std::string instance_value(const Instance& instance);

// Reads the value found at `key` under `prefix`, strictly: a JSON object whose fields are
// all strings, role encoder|pd, url http://host:port, and a key that names the same role
// and id. Anything else is InvalidArgument, naming the key and the field.
Result<Instance> parse_instance(std::string_view key, std::string_view value,
                                const std::string& prefix);

// Ok when `url` is http://host:port (host non-empty, port 1-65535, nothing after it
// but an optional '/').
Status check_http_url(const std::string& url);

}  // namespace ecx::directory
