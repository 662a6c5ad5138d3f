// A small client of etcd's v3 API through its JSON gateway (etcd 3.4: POST /v3/...):
// leases, put, range and delete of keys, which is all membership needs. Keys and values
// are bytes; the gateway carries them base64-encoded, and its int64 fields as strings.
// The streaming watch is in ecx/directory/etcd_watch.h.
//
// Every call is one HTTP request bounded by the client's timeout. With several
// endpoints, a call that cannot connect to one tries the next; the one that answered is
// used first from then on. Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ecx/common/status.h"

namespace ecx::http {
class HttpClient;
struct ClientRequest;
}  // namespace ecx::http

namespace ecx::directory {

// Where an etcd member answers: http://host:port, or https://host:port (tls).
struct EtcdEndpoint {
  std::string host;
  int port = 0;
  bool tls = false;
  std::string url() const {
    return std::string(tls ? "https://" : "http://") + host + ":" + std::to_string(port);
  }
};

// "http(s)://host:port[,http(s)://host:port...]" -> endpoints. A scheme and a port each.
Result<std::vector<EtcdEndpoint>> parse_etcd_endpoints(const std::string& text);

// How to reach etcd beyond its endpoints: whom to trust for https://, and who we are
// when etcd's authentication is on (etcd 3.4's JSON gateway takes a user and password,
// not a client certificate's identity: etcd-io/etcd#10392).
struct EtcdAccess {
  std::string ca_file;  // PEM bundle of the CA that signed etcd's certificate; empty: system's
  std::string user;     // empty: no authentication
  std::string password;
};

// One key as etcd holds it.
struct KeyValue {
  std::string key;
  std::string value;
  int64_t mod_revision = 0;
  int64_t lease = 0;  // 0 = none
};

struct RangeResult {
  std::vector<KeyValue> kvs;
  int64_t revision = 0;  // the store's revision when read: a watch goes on from revision + 1
};

// The end of the key range holding every key that starts with `prefix` (etcd's
// range_end: the prefix with its last byte incremented).
std::string prefix_range_end(const std::string& prefix);

class EtcdClient {
 public:
  // `endpoints` as parse_etcd_endpoints reads them; `timeout` bounds each call (connect
  // and answer).
  static Result<EtcdClient> create(const std::string& endpoints, std::chrono::milliseconds timeout,
                                   EtcdAccess access = {});

  // A lease of `ttl_s` seconds; its id.
  Result<int64_t> grant_lease(int64_t ttl_s);
  // Renews the lease; the TTL it has again. NotFound when the lease has ended (expired
  // or revoked): whatever was put under it is gone.
  Result<int64_t> keep_alive(int64_t lease);
  // Ends the lease now, deleting its keys. Ok when it had ended already.
  Status revoke_lease(int64_t lease);

  // Sets `key` to `value`, attached to `lease` (0 = none).
  Status put(const std::string& key, const std::string& value, int64_t lease = 0);
  // The key `key` alone (no kvs when absent).
  Result<RangeResult> get(const std::string& key);
  // Every key starting with `prefix`, in key order.
  Result<RangeResult> range_prefix(const std::string& prefix);
  // Deletes `key`; how many keys went (0 or 1).
  Result<int64_t> delete_key(const std::string& key);
  // Deletes every key starting with `prefix`; how many went.
  Result<int64_t> delete_prefix(const std::string& prefix);

  // The endpoint calls go to first (the last one that answered).
  EtcdEndpoint endpoint() const;
  std::chrono::milliseconds timeout() const { return timeout_; }
  const EtcdAccess& access() const { return access_; }

  // The token etcd issued to our user (authenticating when there is none yet): what
  // requests carry in their Authorization header. Empty without a user. etcd's tokens
  // expire (300 s by default): a call refused for its token authenticates again and is
  // retried once.
  Result<std::string> token();

  // One POST of `body` (JSON) to `path` (e.g. "/v3/kv/put"); the answer's JSON text.
  // Connection failures try the next endpoint. Errors: Unavailable (no answer, or a
  // gateway error), NotFound (etcd's gRPC code 5), InvalidArgument (code 3).
  Result<std::string> post(const std::string& path, const std::string& body);

 private:
  struct TokenState;
  EtcdClient(std::vector<EtcdEndpoint> endpoints, std::chrono::milliseconds timeout,
             EtcdAccess access);
  Result<RangeResult> range(const std::string& key, const std::string& range_end);
  Result<int64_t> delete_range(const std::string& key, const std::string& range_end);
  // One POST to the endpoints in turn, with `token` (if any) as its Authorization.
  Result<std::string> post_once(const std::string& path, const std::string& body,
                                const std::string& token);
  Result<std::string> authenticate();
  // A POST of `body` to `path` at `at`, with this client's CA, timeouts and `token`.
  http::ClientRequest request(const EtcdEndpoint& at, const std::string& path,
                              const std::string& body, const std::string& token) const;

  std::vector<EtcdEndpoint> endpoints_;
  std::chrono::milliseconds timeout_;
  EtcdAccess access_;
  std::shared_ptr<TokenState> token_;  // shared by copies of this client
  // The index of the endpoint to try first; shared by copies of this client.
  std::shared_ptr<std::atomic<size_t>> preferred_;
  std::shared_ptr<http::HttpClient> http_;  // its connections, shared by copies
};

}  // namespace ecx::directory
