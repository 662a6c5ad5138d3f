#include "ecx/directory/etcd_client.h"

#include <openssl/evp.h>

#include <charconv>

#include "directory/etcd_json.h"
#include "ecx/common/json_reader.h"
#include "ecx/common/mutex.h"
#include "http/http_client.h"

namespace ecx::directory {

using nlohmann::json;

// Answers of a few KiB; a range over a big prefix may be larger, not unbounded.
constexpr JsonLimits kAnswerLimits{size_t{64} << 20, 32};

std::string base64_encode(std::string_view bytes) {
  std::string out(4 * ((bytes.size() + 2) / 3), '\0');
  int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                          reinterpret_cast<const unsigned char*>(bytes.data()),
                          static_cast<int>(bytes.size()));
  out.resize(n < 0 ? 0 : static_cast<size_t>(n));
  return out;
}

Result<std::string> base64_decode(std::string_view text) {
  if (text.size() % 4 != 0) return InvalidArgument("bad base64: length is not a multiple of 4");
  size_t padding = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    char c = text[i];
    bool alphabet = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                    c == '+' || c == '/';
    if (c == '=' && i + 2 >= text.size()) {
      ++padding;
    } else if (!alphabet || padding > 0) {
      return InvalidArgument("bad base64: unexpected character at offset " + std::to_string(i));
    }
  }
  std::string out(3 * (text.size() / 4), '\0');
  int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                          reinterpret_cast<const unsigned char*>(text.data()),
                          static_cast<int>(text.size()));
  if (n < 0 || static_cast<size_t>(n) < padding) return InvalidArgument("bad base64");
  out.resize(static_cast<size_t>(n) - padding);  // EVP_DecodeBlock counts the padding in
  return out;
}

Result<int64_t> read_int64(const json& object, const char* key) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return int64_t{0};
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_string()) {
    const std::string& s = it->get_ref<const std::string&>();
    int64_t v = 0;
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec == std::errc() && end == s.data() + s.size() && !s.empty()) return v;
  }
  return InvalidArgument(std::string("etcd answer: field ") + key + " is not an int64");
}

std::string read_string(const json& object, const char* key) {
  auto it = object.find(key);
  if (it == object.end() || !it->is_string()) return "";
  return it->get<std::string>();
}

Result<KeyValue> read_key_value(const json& kv) {
  if (!kv.is_object()) return InvalidArgument("etcd answer: a key-value is not an object");
  JsonReader r(kv, "etcd key-value");
  ECX_ASSIGN_OR_RETURN(std::string key64, r.string("key", Presence::kRequired, 1 << 20));
  ECX_ASSIGN_OR_RETURN(std::string value64, r.string("value", Presence::kOptional, 64 << 20));
  KeyValue out;
  ECX_ASSIGN_OR_RETURN(out.key, base64_decode(key64));
  ECX_ASSIGN_OR_RETURN(out.value, base64_decode(value64));
  ECX_ASSIGN_OR_RETURN(out.mod_revision, read_int64(kv, "mod_revision"));
  ECX_ASSIGN_OR_RETURN(out.lease, read_int64(kv, "lease"));
  return out;
}

Result<std::vector<EtcdEndpoint>> parse_etcd_endpoints(const std::string& text) {
  std::vector<EtcdEndpoint> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    std::string url = text.substr(start, comma == std::string::npos ? comma : comma - start);
    start = comma == std::string::npos ? text.size() + 1 : comma + 1;
    if (url.empty()) continue;
    Status bad =
        InvalidArgument("etcd endpoint must be http://host:port or https://host:port: " + url);
    const bool tls = url.rfind("https://", 0) == 0;
    if (!tls && url.rfind("http://", 0) != 0) return bad;
    std::string rest = url.substr(tls ? 8 : 7);
    while (!rest.empty() && rest.back() == '/') rest.pop_back();
    size_t colon = rest.rfind(':');
    int port = 0;
    if (colon != std::string::npos) {
      auto [end, ec] = std::from_chars(rest.data() + colon + 1, rest.data() + rest.size(), port);
      if (ec != std::errc() || end != rest.data() + rest.size()) port = 0;
    }
    if (colon == std::string::npos || colon == 0 || port <= 0 || port > 65535 ||
        rest.find('/') != std::string::npos) {
      return bad;
    }
    out.push_back({rest.substr(0, colon), port, tls});
  }
  if (out.empty()) return InvalidArgument("no etcd endpoint in '" + text + "'");
  return out;
}

std::string prefix_range_end(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    auto last = static_cast<unsigned char>(end.back());
    if (last < 0xff) {
      end.back() = static_cast<char>(last + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key (etcd's convention)
}

struct EtcdClient::TokenState {
  Mutex mu;
  std::string token ECX_GUARDED_BY(mu);  // empty: authenticate before the next call
};

EtcdClient::EtcdClient(std::vector<EtcdEndpoint> endpoints, std::chrono::milliseconds timeout,
                       EtcdAccess access)
    : endpoints_(std::move(endpoints)),
      timeout_(timeout),
      access_(std::move(access)),
      token_(std::make_shared<TokenState>()),
      preferred_(std::make_shared<std::atomic<size_t>>(0)),
      http_(std::make_shared<http::HttpClient>(http::HttpClient::Options{
          .threads = 1, .max_idle_per_upstream = 4, .max_body_bytes = kAnswerLimits.max_bytes})) {}

Result<EtcdClient> EtcdClient::create(const std::string& endpoints,
                                      std::chrono::milliseconds timeout, EtcdAccess access) {
  ECX_ASSIGN_OR_RETURN(auto parsed, parse_etcd_endpoints(endpoints));
  if (!access.user.empty() && access.password.empty()) {
    return InvalidArgument("etcd user '" + access.user + "' has no password");
  }
  return EtcdClient(std::move(parsed), timeout, std::move(access));
}

EtcdEndpoint EtcdClient::endpoint() const {
  return endpoints_[preferred_->load() % endpoints_.size()];
}

namespace {

// The status of a gateway error answer {"error","message","code"}.
Status gateway_error(const EtcdEndpoint& at, const std::string& path, int http_status,
                     const std::string& body) {
  std::string message = body.substr(0, 300);
  int64_t code = -1;
  auto doc = parse_json_object(body, "etcd error", kAnswerLimits);
  if (doc.ok()) {
    JsonReader r(*doc, "etcd error");
    auto m = r.string("message");
    auto c = r.i64("code", 0, 100, Presence::kOptional, -1);
    if (m.ok() && !m->empty()) message = *m;
    if (c.ok()) code = *c;
  }
  std::string what =
      "etcd " + at.url() + path + " answered " + std::to_string(http_status) + ": " + message;
  if (code == 5) return NotFound(what);  // gRPC NOT_FOUND (a lease that ended)
  // gRPC UNAUTHENTICATED (a token that expired) and PERMISSION_DENIED.
  if (code == 16 || code == 7) return PermissionDenied(what);
  if (code == 3) return InvalidArgument(what);  // gRPC INVALID_ARGUMENT
  return Unavailable(what);
}

// Whether etcd refused a call for its token (expired, or none sent while auth is on).
bool token_refused(const Status& s) {
  const std::string& m = s.message();
  return m.find("invalid auth token") != std::string::npos ||
         m.find("user name is empty") != std::string::npos;
}

}  // namespace

Result<std::string> EtcdClient::authenticate() {
  json body = {{"name", access_.user}, {"password", access_.password}};
  auto answer = post_once("/v3/auth/authenticate", body.dump(), "");
  if (!answer.ok()) return answer.status().with_context("etcd user '" + access_.user + "'");
  auto doc = parse_json_object(*answer, "etcd authenticate answer", kAnswerLimits);
  if (!doc.ok()) return doc.status();
  std::string token = read_string(*doc, "token");
  if (token.empty()) return Unavailable("etcd authenticate: no token in the answer");
  return token;
}

Result<std::string> EtcdClient::token() {
  if (access_.user.empty()) return std::string();
  MutexLock lock(&token_->mu);  // one authentication at a time; the others wait for it
  if (token_->token.empty()) {
    ECX_ASSIGN_OR_RETURN(token_->token, authenticate());
  }
  return token_->token;
}

Result<std::string> EtcdClient::post(const std::string& path, const std::string& body) {
  ECX_ASSIGN_OR_RETURN(std::string token, this->token());
  auto answer = post_once(path, body, token);
  if (answer.ok() || access_.user.empty() || !token_refused(answer.status())) return answer;
  {
    MutexLock lock(&token_->mu);
    if (token_->token == token) token_->token.clear();  // unless another call renewed it
  }
  ECX_ASSIGN_OR_RETURN(token, this->token());
  return post_once(path, body, token);
}

http::ClientRequest EtcdClient::request(const EtcdEndpoint& at, const std::string& path,
                                        const std::string& body, const std::string& token) const {
  http::ClientRequest request;
  request.target = path;
  request.body = body;
  request.connect_timeout = timeout_;
  request.timeout = 2 * timeout_;  // connect, then the answer
  if (!token.empty()) request.headers.emplace_back("Authorization", token);
  request.tls = at.tls;
  request.ca_file = access_.ca_file;
  return request;
}

Result<std::string> EtcdClient::post_once(const std::string& path, const std::string& body,
                                          const std::string& token) {
  std::string errors;
  size_t first = preferred_->load();
  for (size_t i = 0; i < endpoints_.size(); ++i) {
    size_t index = (first + i) % endpoints_.size();
    const EtcdEndpoint& at = endpoints_[index];
    auto answer = http_->call(at.host, at.port, request(at, path, body, token));
    if (!answer.ok()) {
      errors += (errors.empty() ? "" : "; ") + at.url() + ": " + answer.message;
      if (answer.status != 0) break;  // it answered, badly: the next endpoint would not do better
      continue;                       // the next endpoint, if any
    }
    preferred_->store(index);
    if (answer.status != 200) return gateway_error(at, path, answer.status, answer.body);
    return std::move(answer.body);
  }
  return Unavailable("etcd " + path + ": no endpoint answered (" + errors + ")");
}

namespace {

Result<json> answer_object(const Result<std::string>& text, const std::string& path) {
  if (!text.ok()) return text.status();
  return parse_json_object(*text, "etcd " + path + " answer", kAnswerLimits);
}

}  // namespace

Result<int64_t> EtcdClient::grant_lease(int64_t ttl_s) {
  const std::string path = "/v3/lease/grant";
  ECX_ASSIGN_OR_RETURN(json doc, answer_object(post(path, json{{"TTL", ttl_s}}.dump()), path));
  ECX_ASSIGN_OR_RETURN(int64_t id, read_int64(doc, "ID"));
  if (id == 0) return Unavailable("etcd " + path + ": no lease id in the answer");
  return id;
}

Result<int64_t> EtcdClient::keep_alive(int64_t lease) {
  const std::string path = "/v3/lease/keepalive";
  // A stream in gRPC; through the gateway one request, one {"result": ...}.
  ECX_ASSIGN_OR_RETURN(json doc,
                       answer_object(post(path, json{{"ID", std::to_string(lease)}}.dump()), path));
  auto result = doc.find("result");
  if (result == doc.end() || !result->is_object()) {
    return Unavailable("etcd " + path + ": no result in the answer");
  }
  ECX_ASSIGN_OR_RETURN(int64_t ttl, read_int64(*result, "TTL"));
  // An ended lease is answered with no TTL (0), not an error.
  if (ttl <= 0) return NotFound("etcd lease " + std::to_string(lease) + " has ended");
  return ttl;
}

Status EtcdClient::revoke_lease(int64_t lease) {
  auto text = post("/v3/lease/revoke", json{{"ID", std::to_string(lease)}}.dump());
  if (!text.ok() && text.status().code() == StatusCode::kNotFound) return Status::Ok();
  return text.status();
}

Status EtcdClient::put(const std::string& key, const std::string& value, int64_t lease) {
  json body = {{"key", base64_encode(key)}, {"value", base64_encode(value)}};
  if (lease != 0) body["lease"] = std::to_string(lease);
  return post("/v3/kv/put", body.dump()).status();
}

Result<RangeResult> EtcdClient::range(const std::string& key, const std::string& range_end) {
  const std::string path = "/v3/kv/range";
  json body = {{"key", base64_encode(key)}};
  if (!range_end.empty()) body["range_end"] = base64_encode(range_end);
  ECX_ASSIGN_OR_RETURN(json doc, answer_object(post(path, body.dump()), path));
  RangeResult out;
  auto header = doc.find("header");
  if (header == doc.end() || !header->is_object()) {
    return Unavailable("etcd " + path + ": no header in the answer");
  }
  ECX_ASSIGN_OR_RETURN(out.revision, read_int64(*header, "revision"));
  auto kvs = doc.find("kvs");
  if (kvs != doc.end() && !kvs->is_null()) {
    if (!kvs->is_array()) return Unavailable("etcd " + path + ": kvs is not an array");
    for (const auto& kv : *kvs) {
      ECX_ASSIGN_OR_RETURN(KeyValue item, read_key_value(kv));
      out.kvs.push_back(std::move(item));
    }
  }
  return out;
}

Result<RangeResult> EtcdClient::get(const std::string& key) { return range(key, ""); }

Result<RangeResult> EtcdClient::range_prefix(const std::string& prefix) {
  return range(prefix, prefix_range_end(prefix));
}

Result<int64_t> EtcdClient::delete_range(const std::string& key, const std::string& range_end) {
  const std::string path = "/v3/kv/deleterange";
  json body = {{"key", base64_encode(key)}};
  if (!range_end.empty()) body["range_end"] = base64_encode(range_end);
  ECX_ASSIGN_OR_RETURN(json doc, answer_object(post(path, body.dump()), path));
  return read_int64(doc, "deleted");
}

Result<int64_t> EtcdClient::delete_key(const std::string& key) { return delete_range(key, ""); }

Result<int64_t> EtcdClient::delete_prefix(const std::string& prefix) {
  return delete_range(prefix, prefix_range_end(prefix));
}

}  // namespace ecx::directory
