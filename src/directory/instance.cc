#include "ecx/directory/instance.h"

#include <charconv>
#include <nlohmann/json.hpp>

#include "ecx/common/auth.h"
#include "ecx/common/bytes.h"
#include "ecx/common/json_reader.h"

namespace ecx::directory {

using nlohmann::json;

std::string instances_prefix(const std::string& root, const std::string& model) {
  std::string r = root;
  while (!r.empty() && r.back() == '/') r.pop_back();
  return r + "/" + model + "/instances/";
}

std::string instance_key(const std::string& root, const Instance& instance) {
  return instances_prefix(root, instance.model) + instance.role + "/" + instance.id;
}

std::string instance_value(const Instance& i) {
  json j = {{"id", i.id},
            {"url", i.url},
            {"role", i.role},
            {"model", i.model},
            {"compat_hash", i.compat_hash}};
  if (!i.prove_url.empty()) j["prove_url"] = i.prove_url;
  if (!i.nonce.empty()) j["nonce"] = i.nonce;
  if (!i.mac.empty()) j["mac"] = i.mac;
  return j.dump();
}

namespace {

Mac record_mac(const Instance& i, const std::string& key, const std::string& secret) {
  if (i.prove_url.empty()) {
    return hmac_sha256(
        secret, {"ecx-member-v1", key, i.id, i.url, i.role, i.model, i.compat_hash, i.nonce});
  }
  return hmac_sha256(secret, {"ecx-member-v2", key, i.id, i.url, i.role, i.model, i.compat_hash,
                              i.prove_url, i.nonce});
}

}  // namespace

void sign_instance(Instance& instance, const std::string& key, const std::string& secret) {
  std::string nonce = random_bytes(16);
  instance.nonce = hex_encode(nonce.data(), nonce.size());
  instance.mac = mac_hex(record_mac(instance, key, secret));
}

Status verify_instance(const Instance& instance, const std::string& key,
                       const std::string& secret) {
  Status denied = PermissionDenied("etcd key " + key +
                                   ": the record is not signed with this deployment's secret");
  if (instance.nonce.empty() || instance.mac.empty()) return denied;
  auto mac = parse_mac_hex(instance.mac);
  if (!mac.ok() || !macs_equal(*mac, record_mac(instance, key, secret))) return denied;
  return Status::Ok();
}

std::string prove_instance(const Instance& instance, const std::string& challenge,
                           const std::string& secret) {
  return mac_hex(hmac_sha256(secret, {"ecx-prove-v1", challenge, instance.id, instance.url}));
}

Status check_http_url(const std::string& url) {
  auto bad = [&] { return InvalidArgument("url '" + url + "' is not http://host:port"); };
  if (url.rfind("http://", 0) != 0) return bad();
  std::string rest = url.substr(7);
  if (!rest.empty() && rest.back() == '/') rest.pop_back();
  size_t colon = rest.rfind(':');
  if (colon == std::string::npos || colon == 0) return bad();
  std::string host = rest.substr(0, colon);
  if (host.find_first_of("/?#@ \t") != std::string::npos) return bad();
  int port = 0;
  const char* first = rest.data() + colon + 1;
  const char* last = rest.data() + rest.size();
  auto [end, ec] = std::from_chars(first, last, port);
  if (first == last || ec != std::errc() || end != last || port <= 0 || port > 65535) return bad();
  return Status::Ok();
}

Result<Instance> parse_instance(std::string_view key, std::string_view value,
                                const std::string& prefix) {
  std::string where = "etcd key " + std::string(key);
  ECX_ASSIGN_OR_RETURN(json doc, parse_json_object(value, where, JsonLimits{1 << 16, 8}));
  JsonReader r(doc, where);
  Instance out;
  ECX_ASSIGN_OR_RETURN(out.id, r.string("id", Presence::kRequired, 256));
  ECX_ASSIGN_OR_RETURN(out.url, r.string("url", Presence::kRequired, 1024));
  ECX_ASSIGN_OR_RETURN(out.role, r.string("role", Presence::kRequired, 32));
  ECX_ASSIGN_OR_RETURN(out.model, r.string("model", Presence::kRequired, 256));
  ECX_ASSIGN_OR_RETURN(out.compat_hash, r.string("compat_hash", Presence::kRequired, 256));
  ECX_ASSIGN_OR_RETURN(out.prove_url, r.string("prove_url", Presence::kOptional, 1024));
  ECX_ASSIGN_OR_RETURN(out.nonce, r.string("nonce", Presence::kOptional, 64));
  ECX_ASSIGN_OR_RETURN(out.mac, r.string("mac", Presence::kOptional, 64));
  if (out.role != "encoder" && out.role != "pd") {
    return InvalidArgument(where + ": role '" + out.role + "' is neither encoder nor pd");
  }
  if (out.id.empty()) return InvalidArgument(where + ": empty id");
  ECX_RETURN_IF_ERROR(check_http_url(out.url).with_context(where));
  if (!out.prove_url.empty()) {
    ECX_RETURN_IF_ERROR(check_http_url(out.prove_url).with_context(where + ": prove_url"));
  }
  std::string expected = prefix + out.role + "/" + out.id;
  if (key != expected) {
    return InvalidArgument(where + ": the value says role " + out.role + " id " + out.id +
                           ", which belongs at " + expected);
  }
  return out;
}

}  // namespace ecx::directory
