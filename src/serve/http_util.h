// Shared pieces of the HTTP services: JSON errors, Prometheus metrics, OpenAI chat
// request parsing and validation, image resolution, graceful run-until-signal.
#pragma once

#include <httplib.h>

#include <atomic>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "ecx/common/json_reader.h"
#include "ecx/common/status.h"
#include "ecx/serve/services.h"

namespace ecx::serve {

// {"error":{"message","type","code"}} with the status.
void send_error(httplib::Response& res, int http_status, const std::string& type,
                const std::string& message);
// Maps a Status to an HTTP status: invalid_argument 400, resource_exhausted 413,
// not_found 404, deadline 504, unavailable 502, others 500.
int http_status_for(const Status& s);
void send_status(httplib::Response& res, const Status& s);

// Prometheus text-format counters and gauges with labels.
class Metrics {
 public:
  void add(const std::string& name, const std::string& labels, double value);
  void set(const std::string& name, const std::string& labels, double value);
  // Counts one observation: <name>_sum and <name>_count.
  void observe(const std::string& name, const std::string& labels, double value);
  std::string render(const std::string& help_prefix) const;

 private:
  mutable std::mutex mu_;
  std::map<std::string, std::map<std::string, double>> values_;  // guarded by mu_
};

struct ContentPart {
  enum Kind { kText, kImage } kind = kText;
  std::string text;
  std::string image_url;    // as given
  std::string image_bytes;  // resolved (data: URL decoded, or file read)
};

struct ChatMessage {
  std::string role;
  std::vector<ContentPart> parts;
};

struct ChatRequest {
  std::string model;
  std::vector<ChatMessage> messages;
  bool stream = false;
  bool include_usage = false;
  int max_tokens = 16;
  bool ignore_eos = false;
  nlohmann::json ec_transfer_params = nlohmann::json::object();
  nlohmann::json raw;  // the request as received
  int image_count() const;
};

// Parses and validates a chat completion body; resolves images to bytes (data: URLs,
// or files under config.allowed_root). Errors carry the HTTP status to answer with.
struct RequestError {
  int http_status;
  std::string type;
  std::string message;
};
std::optional<RequestError> parse_chat_request(const std::string& body, const ServiceConfig& config,
                                               ChatRequest* out);

// What GET /health answers: 200 when the service can serve, else 503 with a reason.
struct HealthReport {
  int http_status = 200;
  nlohmann::json body;  // {"status", "role", ...}
};

// Installs /health, /v1/models and /metrics. Without `health`, /health answers 200
// {"status":"ok","role":ROLE}; with it, what it reports (it must not block).
void add_common_routes(httplib::Server& server, const ServiceConfig& config,
                       const std::string& role, const std::function<std::string()>& metrics,
                       std::function<HealthReport()> health = {});

// Blocks SIGTERM/SIGINT in the calling thread (and so in every thread it creates later);
// call first in a service's main, before any thread starts. serve_until_signal takes
// them synchronously.
void block_shutdown_signals();

// Binds, prints the listening line, serves until SIGTERM/SIGINT, then stops accepting
// and waits for in-flight requests. Returns the exit code.
int serve_until_signal(httplib::Server& server, const ServiceConfig& config,
                       const std::string& role);

// "http://host:port" -> host, port.
Result<std::pair<std::string, int>> parse_url(const std::string& url);

// A unique id like "chatcmpl-<hex>".
std::string make_id(const std::string& prefix);

}  // namespace ecx::serve
