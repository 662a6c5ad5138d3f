// The HTTP side every service shares: an event-driven server (Boost.Beast on Asio: a
// few I/O threads hold every connection; no thread per connection or per stream), one
// FIFO of work per service with admission control, JSON error answers, the common
// routes (/health, /v1/models, /metrics), and the run-until-signal loop.
//
// Two kinds of route:
//   fast  answered on an I/O thread, ahead of any queued work (/health, /metrics,
//         /v1/models): the handler must not block.
//   work  queued in the service's one FIFO (http_server/request_queue.h) and run by a worker
//         thread; past --max-queued waiting requests, an immediate 503 with Retry-After.
//   async queued the same way, but run on an I/O thread without blocking it: the handler
//         answers later through an AsyncReply (the proxy's, which waits on the network).
//         At most `workers` run at once; they hold no thread while they wait.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>

#include "ecx/common/status.h"
#include "ecx/serve/services.h"
#include "http_server/http_types.h"

namespace ecx::serve {

// {"error":{"message","type","code"}} with the status.
void send_error(HttpResponse& res, int http_status, const std::string& type,
                const std::string& message);
// Maps a Status to an HTTP status: invalid_argument 400, resource_exhausted 413,
// not_found 404, deadline 504, unavailable 502, others 500.
int http_status_for(const Status& s);
void send_status(HttpResponse& res, const Status& s);

// What GET /health answers: 200 when the service can serve, else 503 with a reason.
struct HealthReport {
  int http_status = 200;
  nlohmann::json body;  // {"status", "role", ...}
};

struct ServerState;  // http_server/http_connection.h

// What a service does around serve_until_signal: once it listens (on the port it got;
// before the listening line is printed), and once a signal asks it to stop, before it
// drains (an instance registered in etcd deregisters there, so the proxies send it
// nothing new). Each must be bounded in time.
struct ServeHooks {
  std::function<void(int port)> on_listening;
  std::function<void()> on_signal;
};

class HttpServer {
 public:
  // `config` gives the limits and threads; `role_workers` is the worker count when
  // config.workers is 0 (each role knows what its work costs).
  HttpServer(const CommonServiceConfig& config, std::string role, int role_workers);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  void fast(const std::string& method, const std::string& path, HttpHandler handler);
  void work(const std::string& method, const std::string& path, HttpHandler handler);
  void async_work(const std::string& method, const std::string& path, AsyncHandler handler);

  // Binds, prints the listening line, serves until SIGTERM/SIGINT, then stop(); returns
  // the exit code. `hooks` run once bound and before stop().
  int serve_until_signal(const ServeHooks& hooks = {});
  // Binds and starts serving on the I/O and worker threads; returns the port.
  Result<int> start();
  // Stops accepting, finishes every admitted request, joins every thread. Idempotent.
  void stop();

  // ecx_http_* lines for /metrics: rejected requests, queue depth, threads, connections.
  std::string render_metrics() const;
  // Why the service is stuck, when every worker has been on one request for longer than
  // `after` (what /health reports as degraded); nullopt otherwise.
  std::optional<std::string> stuck(std::chrono::milliseconds after) const;

 private:
  struct Running;
  std::unique_ptr<ServerState> state_;
  // stop() gave up waiting for answers still in flight: the state stays, as the I/O
  // context does, until the process exits.
  bool leak_state_ = false;
  std::unique_ptr<Running> running_;  // while serving
  uint64_t max_queued_ = 0;
  uint64_t max_connections_ = 0;  // as configured; start() applies the open-files limit
  std::string host_;
  int port_ = 0;
};

// Whether a service runs with a deployment secret: ECX_AUTH_TOKEN, --auth-token-file,
// or one in the connector config (`ec_config`'s extra.auth_token / auth_token_file).
// When not, it says so at once, as its first log line (secure by default: an operator
// who forgot the secret sees it), and returns false for add_common_routes.
bool announce_secret(const std::string& role, const std::string& token,
                     const std::string& token_file, const std::string& ec_config = "");

// Installs /health, /v1/models and /metrics as fast routes, with one log line per
// request. Without `health`, /health answers 200 {"status":"ok","role":ROLE}; with it,
// what it reports (it must not block). `metrics` must not block either. Without a
// deployment secret (`secured` false) /health says so ("auth": "none", and a warning)
// and /metrics reports ecx_auth_secret_configured 0.
void add_common_routes(HttpServer& server, const CommonServiceConfig& config,
                       const std::string& role, bool secured,
                       const std::function<std::string()>& metrics,
                       std::function<HealthReport()> health = {});

// Blocks SIGTERM/SIGINT in the calling thread (and so in every thread it creates later);
// call first in a service's main, before any thread starts. serve_until_signal takes
// them synchronously.
void block_shutdown_signals();

// "http://host:port" -> host, port.
Result<std::pair<std::string, int>> parse_url(const std::string& url);

// A unique id like "chatcmpl-<hex>".
std::string make_id(const std::string& prefix);

}  // namespace ecx::serve
