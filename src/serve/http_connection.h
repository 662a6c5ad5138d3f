// Inside serve/http_server: what the server shares with its connections, and the
// connection itself (one per accepted socket, living on its strand). Not for services.
#pragma once

#include <atomic>
#include <boost/asio/ip/tcp.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "ecx/common/deadline.h"
#include "ecx/serve/services.h"
#include "serve/http_types.h"
#include "serve/request_queue.h"

namespace ecx::serve {

struct HttpRoute {
  bool fast = false;  // answered on the I/O thread
  HttpHandler handler;
  AsyncHandler async;  // set for an async route (handler is then empty)
};

// Settings and figures of one server; connections hold a reference (the server
// outlives them: it joins its I/O threads before it goes).
struct ServerState {
  ServerState(const CommonServiceConfig& config, std::string role, int workers);

  const std::string role;
  const int io_threads;
  const int workers;
  const uint64_t max_body_bytes;
  const uint64_t max_buffered_bytes;  // --max-buffered-bytes, resolved (never 0)
  const std::chrono::seconds idle_timeout;
  const std::chrono::seconds write_timeout{60};  // a client that stops reading
  const size_t stream_buffer_bytes = 1 << 20;    // per streamed answer, before write blocks
  std::map<std::pair<std::string, std::string>, HttpRoute> routes;  // set before serving
  // Made when serving starts: the worker threads (when there are work routes) and the
  // slots of async routes (when there are async routes).
  std::unique_ptr<RequestQueue> queue;
  std::unique_ptr<SlotQueue> slots;

  // Client connections held at once before new ones are refused work (set by start():
  // --max-connections, lowered to what the open-files limit leaves).
  int64_t max_connections = 0;

  std::atomic<bool> stopping{false};
  std::atomic<uint64_t> rejected{0};  // 503 for a full queue
  std::atomic<int64_t> open_connections{0};
  std::atomic<uint64_t> connections_refused{0};  // work refused: too many connections
  std::atomic<uint64_t> accept_errors{0};        // accept() failed (out of file descriptors)
  std::atomic<uint64_t> buffered_rejected{0};    // 503: the bodies held reached the budget

  // The budget of request bodies held at once (max_buffered_bytes): takes `bytes` of it,
  // or nothing and false when they would pass it.
  bool reserve_body(uint64_t bytes);
  void release_body(uint64_t bytes);
  uint64_t buffered_bytes() const { return buffered_bytes_.load(); }

  // Admitted work routes not yet answered (queued, running or streaming).
  void begin_request();
  void end_request();
  // Until none is in flight or `deadline`; false on the deadline.
  bool wait_idle(Deadline deadline);

 private:
  std::mutex mu_;
  std::condition_variable idle_cv_;
  int64_t in_flight_ = 0;  // guarded by mu_
  std::atomic<uint64_t> buffered_bytes_{0};
};

// Serves `socket` (whose executor is its own strand) until the client goes, the idle
// timeout passes or the server stops. Past state.max_connections the connection answers
// one request, within a few seconds, and closes: a fast route as usual, work with 503.
void serve_connection(ServerState& state, boost::asio::ip::tcp::socket socket);

}  // namespace ecx::serve
