// One streaming watch of a key prefix through etcd's JSON gateway (POST /v3/watch: an
// HTTP answer that never ends, one JSON message per line).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ecx/common/mutex.h"
#include "ecx/common/status.h"
#include "ecx/directory/etcd_client.h"

namespace ecx::http {
class HttpClient;
class Cancellation;
struct ClientRequest;
struct ClientResult;
}  // namespace ecx::http

namespace ecx::directory {

struct WatchEvent {
  enum Type { kPut, kDelete } type = kPut;
  KeyValue kv;  // a delete carries the key (and its mod_revision) alone
};

// Watches every key under `prefix` from `start_revision` on. run() streams the events to
// a callback until the stream ends; cancel() ends it from another thread. One run() per
// object.
class EtcdWatch {
 public:
  // `events(batch, revision)`: the events of one message, and the store's revision after
  // them. Called on the thread of run().
  using OnEvents = std::function<void(const std::vector<WatchEvent>&, int64_t revision)>;

  // `idle_timeout`: a stream silent for that long ends (DeadlineExceeded); the caller
  // re-reads and watches again, which also notices an etcd that vanished without
  // closing the connection.
  // `token` (EtcdClient::token()) when etcd's auth is on; `ca_file` for https://.
  EtcdWatch(EtcdEndpoint endpoint, std::string prefix, int64_t start_revision,
            std::chrono::milliseconds connect_timeout, std::chrono::milliseconds idle_timeout,
            std::string token = {}, std::string ca_file = {});
  ~EtcdWatch();
  EtcdWatch(const EtcdWatch&) = delete;
  EtcdWatch& operator=(const EtcdWatch&) = delete;

  // Streams until the watch ends. Returns Ok after cancel(); otherwise why it ended:
  // Unavailable (connection lost, etcd error), DeadlineExceeded (idle), NotFound (the
  // revision was compacted, or etcd cancelled the watch). Either way the caller re-reads.
  Status run(const OnEvents& events);
  // Makes run() return soon; waits (at most `wait`) until it has. Callable before run(),
  // during it, or after it; any number of times.
  void cancel(std::chrono::milliseconds wait = std::chrono::milliseconds(3000));

 private:
  // One line of the stream; false when the watch ends (why in `ended`).
  bool handle_line(const std::string& line, const OnEvents& events, Status* ended);
  struct Stream;  // one run()'s stream
  // The POST that opens the stream.
  http::ClientRequest watch_request() const;
  // A piece of the stream: false ends it.
  bool receive(Stream& stream, const char* data, size_t n, const OnEvents& events);
  // Why run() ends, given how its call ended.
  Status outcome(const Stream& stream, const http::ClientResult& result) const;

  const EtcdEndpoint endpoint_;
  const std::string prefix_;
  const int64_t start_revision_;
  const std::chrono::milliseconds connect_timeout_;
  const std::chrono::milliseconds idle_timeout_;
  const std::string token_;
  const std::string ca_file_;

  std::atomic<bool> cancelled_{false};
  Mutex mu_;
  CondVar cv_;
  std::unique_ptr<http::HttpClient> client_;
  // run()'s call, while it streams: cancel() ends it.
  std::shared_ptr<http::Cancellation> in_flight_ ECX_GUARDED_BY(mu_);
  bool running_ ECX_GUARDED_BY(mu_) = false;
  bool created_ = false;  // etcd confirmed the watch (run()'s thread only)
};

}  // namespace ecx::directory
