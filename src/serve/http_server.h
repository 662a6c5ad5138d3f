// The HTTP side every service shares: JSON error answers, the common routes (/health,
// /v1/models, /metrics), and the run-until-signal server loop.
#pragma once

#include <httplib.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "ecx/common/status.h"
#include "ecx/serve/services.h"

namespace ecx::serve {

// An error to answer a request with: the HTTP status, the OpenAI error type, a message.
struct RequestError {
  int http_status;
  std::string type;
  std::string message;
};

// {"error":{"message","type","code"}} with the status.
void send_error(httplib::Response& res, int http_status, const std::string& type,
                const std::string& message);
void send_error(httplib::Response& res, const RequestError& error);
// Maps a Status to an HTTP status: invalid_argument 400, resource_exhausted 413,
// not_found 404, deadline 504, unavailable 502, others 500.
int http_status_for(const Status& s);
void send_status(httplib::Response& res, const Status& s);

// What GET /health answers: 200 when the service can serve, else 503 with a reason.
struct HealthReport {
  int http_status = 200;
  nlohmann::json body;  // {"status", "role", ...}
};

// Installs /health, /v1/models and /metrics, and one log line per request. Without
// `health`, /health answers 200 {"status":"ok","role":ROLE}; with it, what it reports (it
// must not block).
void add_common_routes(httplib::Server& server, const CommonServiceConfig& config,
                       const std::string& role, const std::function<std::string()>& metrics,
                       std::function<HealthReport()> health = {});

// Blocks SIGTERM/SIGINT in the calling thread (and so in every thread it creates later);
// call first in a service's main, before any thread starts. serve_until_signal takes
// them synchronously.
void block_shutdown_signals();

// Binds, prints the listening line, serves until SIGTERM/SIGINT, then stops accepting
// and waits for in-flight requests. Returns the exit code.
int serve_until_signal(httplib::Server& server, const CommonServiceConfig& config,
                       const std::string& role);

// "http://host:port" -> host, port.
Result<std::pair<std::string, int>> parse_url(const std::string& url);

// A unique id like "chatcmpl-<hex>".
std::string make_id(const std::string& prefix);

}  // namespace ecx::serve
