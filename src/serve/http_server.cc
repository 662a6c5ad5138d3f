#include "serve/http_server.h"

#include <signal.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <iostream>
#include <random>
#include <thread>

#include "ecx/common/json_reader.h"
#include "ecx/common/log.h"

namespace ecx::serve {

using nlohmann::json;

void send_error(httplib::Response& res, int http_status, const std::string& type,
                const std::string& message) {
  res.status = http_status;
  res.set_content(
      safe_dump(json{{"error", {{"message", message}, {"type", type}, {"code", http_status}}}}),
      "application/json");
}

void send_error(httplib::Response& res, const RequestError& error) {
  send_error(res, error.http_status, error.type, error.message);
}

int http_status_for(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
      return 400;
    case StatusCode::kNotFound:
      return 404;
    case StatusCode::kResourceExhausted:
      return 413;
    case StatusCode::kDeadlineExceeded:
      return 504;
    case StatusCode::kUnavailable:
    case StatusCode::kIncompatible:
    case StatusCode::kEvicted:
    case StatusCode::kNotReady:
      return 502;
    default:
      return 500;
  }
}

void send_status(httplib::Response& res, const Status& s) {
  send_error(res, http_status_for(s), std::string(status_code_name(s.code())), s.message());
}

namespace {

// Errors the library answers by itself (404, 413, ...) and exceptions out of a handler
// get the same JSON error body as ours.
void install_error_handlers(httplib::Server& server) {
  server.set_error_handler([](const httplib::Request&, httplib::Response& res) {
    if (res.body.empty()) {
      std::string type = res.status == 404   ? "not_found"
                         : res.status == 413 ? "request_too_large"
                                             : "error";
      send_error(res, res.status, type, "HTTP " + std::to_string(res.status));
    }
  });
  server.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "internal error";
        try {
          if (ep) std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        send_error(res, 500, "internal_error", what);
      });
}

}  // namespace

void add_common_routes(httplib::Server& server, const CommonServiceConfig& config,
                       const std::string& role, const std::function<std::string()>& metrics,
                       std::function<HealthReport()> health) {
  // Structured logs: key=value, one line per request.
  spdlog::set_pattern("ts=%Y-%m-%dT%H:%M:%S.%e level=%l service=" + role + " pid=%P %v");
  server.set_logger([](const httplib::Request& req, const httplib::Response& res) {
    spdlog::info("method={} path={} status={} bytes_in={} bytes_out={}", req.method, req.path,
                 res.status, req.body.size(), res.body.size());
  });
  server.Get("/health", [role, health](const httplib::Request&, httplib::Response& res) {
    HealthReport report{200, json{{"status", "ok"}, {"role", role}}};
    if (health) report = health();
    res.status = report.http_status;
    res.set_content(safe_dump(report.body), "application/json");
  });
  server.Get("/v1/models", [model = config.model](const httplib::Request&, httplib::Response& res) {
    json entry = {{"id", model}, {"object", "model"}, {"created", 0}, {"owned_by", "ecx"}};
    res.set_content(json{{"object", "list"}, {"data", json::array({entry})}}.dump(),
                    "application/json");
  });
  server.Get("/metrics", [metrics](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics(), "text/plain; version=0.0.4");
  });
  install_error_handlers(server);
}

void block_shutdown_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

namespace {

// Binds config.host:config.port (0 = any free port). Returns the port, or 0 when it
// cannot listen there.
int bind_listener(httplib::Server& server, const CommonServiceConfig& config) {
  // The distribution's cpp-httplib listens with a backlog of 5: a burst of concurrent
  // clients (a proxy encoding 24 images at once) overflows it and connections fail.
  // Keep the listening socket and raise its backlog after bind. SO_REUSEADDR only: two
  // servers must never share a port by accident (the library default is SO_REUSEPORT).
  int listen_fd = -1;
  server.set_socket_options([&listen_fd](int sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    listen_fd = sock;
  });
  int port = config.port;
  if (port == 0) {
    port = std::max(0, server.bind_to_any_port(config.host));
  } else if (!server.bind_to_port(config.host, port)) {
    port = 0;
  }
  if (port != 0 && listen_fd >= 0) ::listen(listen_fd, 1024);
  return port;
}

}  // namespace

int serve_until_signal(httplib::Server& server, const CommonServiceConfig& config,
                       const std::string& role) {
  // Signals are taken synchronously by this thread; every other thread blocks them.
  block_shutdown_signals();
  int threads = std::max(1, config.threads);
  server.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  server.set_payload_max_length(config.max_body_bytes);
  int port = bind_listener(server, config);
  if (port == 0) {
    std::cerr << "ecx serve " << role << ": cannot listen on " << config.host << ":" << config.port
              << "\n";
    return 1;
  }
  std::thread listener([&] { server.listen_after_bind(); });
  std::cout << "ecx serve " << role << " listening on http://" << config.host << ":" << port
            << std::endl;
  spdlog::info("{} listening on {}:{}", role, config.host, port);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  int sig = 0;
  sigwait(&set, &sig);
  spdlog::info("{}: signal {}, draining in-flight requests", role, sig);
  server.stop();  // stops accepting; the thread pool finishes the requests it has
  listener.join();
  return 0;
}

Result<std::pair<std::string, int>> parse_url(const std::string& url) {
  std::string rest = url;
  if (rest.rfind("http://", 0) == 0) rest = rest.substr(7);
  if (rest.rfind("https://", 0) == 0) return InvalidArgument("https is not supported: " + url);
  while (!rest.empty() && rest.back() == '/') rest.pop_back();
  auto colon = rest.rfind(':');
  if (colon == std::string::npos) return InvalidArgument("URL needs a port: " + url);
  std::string port_text = rest.substr(colon + 1);
  char* end = nullptr;
  long port = std::strtol(port_text.c_str(), &end, 10);
  if (port_text.empty() || *end != '\0' || port <= 0 || port > 65535) {
    return InvalidArgument("bad port in URL: " + url);
  }
  return std::make_pair(rest.substr(0, colon), static_cast<int>(port));
}

std::string make_id(const std::string& prefix) {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = std::random_device{}();
  char buf[32];
  std::snprintf(
      buf, sizeof(buf), "%016llx",
      static_cast<unsigned long long>(salt ^ (counter.fetch_add(1) * 0x9e3779b97f4a7c15ULL)));
  return prefix + "-" + buf;
}

}  // namespace ecx::serve
