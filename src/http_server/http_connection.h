// Inside the HTTP server (http_server/http_server.h): what the server shares with its connections,
// and the connection itself (one per accepted socket, living on its strand). Not for services.
#pragma once

#include <atomic>
#include <boost/asio/ip/tcp.hpp>
#include <chrono>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ecx/common/deadline.h"
#include "ecx/common/mutex.h"
#include "ecx/serve/services.h"
#include "http_server/http_types.h"
#include "http_server/request_queue.h"

namespace ecx::serve {

struct HttpRoute {
  bool fast = false;  // answered on the I/O thread
  HttpHandler handler;
  AsyncHandler async;  // set for an async route (handler is then empty)
};

// A connection as admission sees it: one that is only waiting for a request can be asked
// to make room for a client that holds few connections.
class AdmittedConnection {
 public:
  virtual ~AdmittedConnection() = default;
  // From any thread: closes the connection (on its strand) if it is waiting for a
  // request's headers or idle between requests; one reading a body or serving stays.
  virtual void yield_if_waiting() = 0;
};

// Where a connection stands once admitted (ServerState::admit).
struct Admission {
  bool over_share = false;     // its client holds more than its share
  bool over_capacity = false;  // one request, work refused, then closed
  std::list<std::weak_ptr<AdmittedConnection>>::iterator slot;  // for leave()
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
  std::atomic<uint64_t> abandoned{0};            // queued work dropped: its client had left

  // One client (source address) may hold this many connections: a quarter of
  // max_connections, at least 256, so one busy client is not refused while there is room
  // and one greedy client cannot take every connection. Past it, it is refused work.
  int64_t client_share() const;
  // Connections past max_connections kept for clients that hold few (newcomers).
  int64_t newcomer_room() const;
  // Counts `conn` of `client` (leave() when it closes) and says how it is served. A
  // client past its share is refused work once the service is half full. Past
  // max_connections, a client that holds at most kNewcomerConnections is still served
  // (within newcomer_room()) when another client holds more, and the client holding the
  // most connections is asked to give waiting ones up: many addresses that each hold
  // their share cannot keep a new client out.
  Admission admit(const std::string& client, std::weak_ptr<AdmittedConnection> conn)
      ECX_EXCLUDES(clients_mu_);
  void leave(const std::string& client, const Admission& admission) ECX_EXCLUDES(clients_mu_);
  std::atomic<uint64_t> connections_yielded{0};  // closed, waiting, to make room

  // The budget of request bodies held at once (max_buffered_bytes): takes `bytes` of it,
  // or nothing and false when they would pass it. A body is charged as it arrives (in
  // steps, kBodyCopies times each byte: its parsed and re-encoded copies count too).
  bool reserve_body(uint64_t bytes);
  void release_body(uint64_t bytes);
  // Whether `bytes` more would fit now (nothing is taken).
  bool has_room(uint64_t bytes) const;
  uint64_t buffered_bytes() const { return buffered_bytes_.load(); }

  // Admitted work routes not yet answered (queued, running or streaming).
  void begin_request() ECX_EXCLUDES(mu_);
  // begin_request(), unless the server is stopping (false): checked and counted at once,
  // so that a request admitted as stop() begins is one that stop() waits for.
  bool try_begin_request() ECX_EXCLUDES(mu_);
  // Sets `stopping`; from then on try_begin_request() admits nothing.
  void begin_stopping() ECX_EXCLUDES(mu_);
  void end_request() ECX_EXCLUDES(mu_);
  // Until none is in flight or `deadline`; false on the deadline.
  bool wait_idle(Deadline deadline) ECX_EXCLUDES(mu_);

 private:
  Mutex mu_;
  CondVar idle_cv_;
  int64_t in_flight_ ECX_GUARDED_BY(mu_) = 0;
  // Up to a few connections of the client holding the most (other than `newcomer`), to
  // ask to yield, rotating through them; none when no other client holds more than a
  // newcomer may (nobody to make room from: the newcomer is not let in).
  std::optional<std::vector<std::shared_ptr<AdmittedConnection>>> room_makers_locked(
      const std::string& newcomer) ECX_REQUIRES(clients_mu_);

  Mutex clients_mu_;
  std::unordered_map<std::string, std::list<std::weak_ptr<AdmittedConnection>>>
      connections_by_client_ ECX_GUARDED_BY(clients_mu_);
  std::atomic<uint64_t> buffered_bytes_{0};
};

// Serves `socket` (whose executor is its own strand) until the client goes, the idle
// timeout passes or the server stops. Past state.max_connections the connection answers
// one request, within a few seconds, and closes: a fast route as usual, work with 503.
void serve_connection(ServerState& state, boost::asio::ip::tcp::socket socket);

}  // namespace ecx::serve
