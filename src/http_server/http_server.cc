#include "http_server/http_server.h"

#include <malloc.h>
#include <signal.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>
#include <thread>

#include "ecx/common/json_reader.h"
#include "ecx/common/log.h"
#include "http_server/http_connection.h"
#include "http_server/metric_families.h"

namespace ecx::serve {

namespace net = boost::asio;
using tcp = net::ip::tcp;
// The listening socket runs on a strand of its own: its accept chain (each accept, the
// retry timer) and stop()'s close, which come from different I/O threads, never overlap.
using Acceptor = net::basic_socket_acceptor<tcp, net::strand<net::io_context::executor_type>>;
using nlohmann::json;

std::string HttpRequest::header(std::string_view name) const {
  for (const auto& [key, value] : headers) {
    if (key.size() == name.size() &&
        std::equal(key.begin(), key.end(), name.begin(),
                   [](char a, char b) { return std::tolower(a) == std::tolower(b); })) {
      return value;
    }
  }
  return "";
}

void send_error(HttpResponse& res, int http_status, const std::string& type,
                const std::string& message) {
  res.status = http_status;
  res.set_content(
      safe_dump(json{{"error", {{"message", message}, {"type", type}, {"code", http_status}}}}),
      "application/json");
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

void send_status(HttpResponse& res, const Status& s) {
  send_error(res, http_status_for(s), std::string(status_code_name(s.code())), s.message());
}

HttpServer::HttpServer(const CommonServiceConfig& config, std::string role, int role_workers)
    : state_(std::make_unique<ServerState>(config, std::move(role),
                                           config.workers > 0 ? config.workers : role_workers)) {
  max_queued_ = config.max_queued;
  max_connections_ = config.max_connections;
  host_ = config.host;
  port_ = config.port;
}

HttpServer::~HttpServer() {
  stop();
  if (leak_state_) static_cast<void>(state_.release());
}

void HttpServer::fast(const std::string& method, const std::string& path, HttpHandler handler) {
  state_->routes[{method, path}] = HttpRoute{true, std::move(handler), {}};
}

void HttpServer::work(const std::string& method, const std::string& path, HttpHandler handler) {
  state_->routes[{method, path}] = HttpRoute{false, std::move(handler), {}};
}

void HttpServer::async_work(const std::string& method, const std::string& path,
                            AsyncHandler handler) {
  state_->routes[{method, path}] = HttpRoute{false, {}, std::move(handler)};
}

namespace {

// The threads of this process, from /proc/self/status; -1 when unreadable.
int process_threads() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::atoi(line.c_str() + 8);
  }
  return -1;
}

}  // namespace

std::optional<std::string> HttpServer::stuck(std::chrono::milliseconds after) const {
  const ServerState& s = *state_;
  if (!s.queue) return std::nullopt;
  size_t busy = s.queue->busy_longer_than(after);
  // Busy but keeping up is not stuck: it takes requests waiting behind them too.
  if (busy < static_cast<size_t>(s.queue->workers()) || s.queue->waiting() == 0) {
    return std::nullopt;
  }
  return "all " + std::to_string(busy) + " workers have been on one request each for over " +
         std::to_string(after.count() / 1000) + " s; " + std::to_string(s.queue->waiting()) +
         " requests wait";
}

std::string HttpServer::render_metrics() const {
  using namespace metric;
  const ServerState& s = *state_;
  Metrics m;
  auto set = [&m](const MetricFamily& family, auto value) {
    m.set(family, static_cast<double>(value));
  };
  set(kHttpAbandoned, s.abandoned.load());
  set(kHttpRejected, s.rejected.load());
  set(kHttpQueueDepth, (s.queue ? s.queue->waiting() : 0) + (s.slots ? s.slots->waiting() : 0));
  set(kHttpRequestsRunning,
      (s.queue ? s.queue->running() : 0) + (s.slots ? s.slots->running() : 0));
  set(kHttpMaxQueued, max_queued_);
  set(kHttpWorkers, s.workers);
  set(kHttpIoThreads, s.io_threads);
  set(kHttpOpenConnections, s.open_connections.load());
  set(kHttpMaxConnections, s.max_connections);
  set(kHttpConnectionsRefused, s.connections_refused.load());
  set(kHttpConnectionsYielded, s.connections_yielded.load());
  set(kHttpBufferedBytes, s.buffered_bytes());
  set(kHttpMaxBufferedBytes, s.max_buffered_bytes);
  set(kHttpBufferedRejected, s.buffered_rejected.load());
  set(kHttpAcceptErrors, s.accept_errors.load());
  set(kProcessThreads, process_threads());
  return m.render();
}

bool announce_secret(const std::string& role, const std::string& token,
                     const std::string& token_file, const std::string& ec_config) {
  bool secured = !token.empty() || !token_file.empty();
  if (!secured && !ec_config.empty()) {
    json ec = json::parse(ec_config, nullptr, false);
    const json* extra = ec.is_object() && ec.contains("extra") ? &ec["extra"] : nullptr;
    secured = extra != nullptr && extra->is_object() &&
              (extra->contains("auth_token") || extra->contains("auth_token_file"));
  }
  if (!secured) {
    spdlog::warn(
        "event=insecure service={} reason=\"no deployment secret (ECX_AUTH_TOKEN or "
        "--auth-token-file): any process that reaches its agents or the directory is "
        "trusted as part of the deployment; see docs/SECURITY.md\"",
        role);
  }
  return secured;
}

void add_common_routes(HttpServer& server, const CommonServiceConfig& config,
                       const std::string& role, bool secured,
                       const std::function<std::string()>& metrics,
                       std::function<HealthReport()> health) {
  // Structured logs: key=value, one line per request (written by the server).
  spdlog::set_pattern("ts=%Y-%m-%dT%H:%M:%S.%e level=%l service=" + role + " pid=%P %v");
  const std::chrono::seconds stuck_after{std::max(1, config.stuck_after_s)};
  server.fast("GET", "/health",
              [role, health, secured, &server, stuck_after](const HttpRequest&, HttpResponse& res) {
                HealthReport report{200, json{{"status", "ok"}, {"role", role}}};
                if (health) report = health();
                // Every worker stuck on one request: a new one would only wait. Steer traffic away.
                if (auto stuck = server.stuck(stuck_after)) {
                  report.http_status = 503;
                  report.body["status"] = "degraded";
                  report.body["reason"] = *stuck;
                }
                report.body["auth"] = secured ? "secret" : "none";
                if (!secured) {
                  report.body["warnings"].push_back(
                      "no deployment secret: any process that reaches this service's agents or "
                      "directory is trusted (set ECX_AUTH_TOKEN or --auth-token-file)");
                }
                res.status = report.http_status;
                res.set_content(safe_dump(report.body), "application/json");
              });
  server.fast("GET", "/v1/models", [model = config.model](const HttpRequest&, HttpResponse& res) {
    json entry = {{"id", model}, {"object", "model"}, {"created", 0}, {"owned_by", "ecx"}};
    res.set_content(json{{"object", "list"}, {"data", json::array({entry})}}.dump(),
                    "application/json");
  });
  server.fast("GET", "/metrics",
              [metrics, &server, secured](const HttpRequest&, HttpResponse& res) {
                Metrics auth;
                auth.set(metric::kAuthSecretConfigured, secured ? 1 : 0);
                res.set_content(metrics() + auth.render() + server.render_metrics(),
                                "text/plain; version=0.0.4");
              });
}

void block_shutdown_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

namespace {

// How long accepting pauses when the process is out of file descriptors (or memory):
// the listening socket stays readable, so retrying at once would spin.
constexpr std::chrono::milliseconds kAcceptRetry{50};

bool out_of_resources(const boost::system::error_code& ec) {
  return ec == net::error::no_descriptors || ec == net::error::no_buffer_space ||
         ec == net::error::no_memory || ec == boost::system::errc::too_many_files_open_in_system;
}

// Accepts connections until the acceptor closes; each gets its own strand.
class AcceptLoop : public std::enable_shared_from_this<AcceptLoop> {
 public:
  AcceptLoop(Acceptor& acceptor, ServerState& state)
      : acceptor_(acceptor), state_(state), retry_(acceptor.get_executor()) {}

  void next() {
    acceptor_.async_accept(
        net::make_strand(acceptor_.get_executor().get_inner_executor()),
        [self = shared_from_this()](boost::system::error_code ec, tcp::socket socket) {
          self->on_accept(ec, std::move(socket));
        });
  }

 private:
  void on_accept(boost::system::error_code ec, tcp::socket socket) {
    if (ec == net::error::operation_aborted || !acceptor_.is_open()) return;
    if (!ec) {
      serve_connection(state_, std::move(socket));
      return next();
    }
    state_.accept_errors++;
    if (!out_of_resources(ec)) return next();  // (a client that left before its accept)
    auto now = std::chrono::steady_clock::now();
    if (now - last_warning_ >= std::chrono::seconds(10)) {
      last_warning_ = now;
      spdlog::warn(
          "event=accept_failed error=\"{}\" open_connections={}: new connections wait "
          "(raise the open-files limit, or lower --max-connections)",
          ec.message(), state_.open_connections.load());
    }
    retry_.expires_after(kAcceptRetry);
    retry_.async_wait([self = shared_from_this()](boost::system::error_code e) {
      if (!e) self->next();
    });
  }

  Acceptor& acceptor_;  // on its strand, where each of this loop's handlers runs
  ServerState& state_;
  // The accept chain has one handler at a time: these are touched by it alone.
  net::steady_timer retry_;
  std::chrono::steady_clock::time_point last_warning_{};
};

// --max-connections, lowered so that the connections leave file descriptors for the rest
// (upstream connections, peers, files): a quarter of the open-files limit, at most 1024.
int64_t connection_limit(uint64_t configured, const std::string& role) {
  int64_t wanted = configured == 0
                       ? INT64_MAX  // 0: what the open-files limit leaves
                       : static_cast<int64_t>(std::min<uint64_t>(configured, INT64_MAX));
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return wanted;
  auto open_files = static_cast<int64_t>(limit.rlim_cur);
  int64_t room = std::max<int64_t>(1, open_files - std::min<int64_t>(1024, open_files / 4));
  if (room >= wanted) return wanted;
  spdlog::warn(
      "{}: --max-connections {} lowered to {}: the open-files limit is {} (ulimit -n); past "
      "it, work requests get 503",
      role, configured, room, open_files);
  return room;
}

// Binds host:port (0 = any free port) with a deep backlog. Returns the port, or 0.
int bind_listener(Acceptor& acceptor, const std::string& host, int port) {
  boost::system::error_code ec;
  net::io_context resolve_ctx;
  tcp::resolver resolver(resolve_ctx);
  auto endpoints = resolver.resolve(host, std::to_string(port), ec);
  if (ec || endpoints.empty()) return 0;
  tcp::endpoint endpoint = *endpoints.begin();
  acceptor.open(endpoint.protocol(), ec);
  // SO_REUSEADDR only: two servers must never share a port by accident.
  if (!ec) acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) acceptor.bind(endpoint, ec);
  if (!ec) acceptor.listen(4096, ec);
  if (ec) return 0;
  return acceptor.local_endpoint().port();
}

// A service holds a connection per client: the soft open-files limit (often 1024) goes up
// to the hard one, as nginx's worker_rlimit_nofile or Go's runtime do.
void raise_open_files_limit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur >= limit.rlim_max) return;
  rlim_t before = limit.rlim_cur;
  limit.rlim_cur = limit.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &limit) == 0) {
    spdlog::info("event=open_files_limit from={} to={}", before, limit.rlim_cur);
  }
}

int wait_for_signal() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  int sig = 0;
  sigwait(&set, &sig);
  return sig;
}

}  // namespace

// The I/O side while serving.
struct HttpServer::Running {
  explicit Running(int threads)
      : ioc(threads), work(net::make_work_guard(ioc)), acceptor(net::make_strand(ioc)) {}
  net::io_context ioc;
  // Keeps the I/O threads running while no socket operation is pending (every connection
  // waiting on a worker, the acceptor closed by stop()): a worker's answer is posted to
  // them. Released by stop() once everything admitted has been answered.
  net::executor_work_guard<net::io_context::executor_type> work;
  Acceptor acceptor;  // touched on its strand only, once the I/O threads run
  std::vector<std::thread> io;
};

namespace {

// Request bodies (and what is made of them: a proxy's forwarded request, the calls to
// E) are large blocks that live as long as one request. Mapped on their own, each goes
// back to the system when it is freed. Left to malloc's default, its threshold for that
// grows to 32 MiB once such blocks are freed, and the freed ones then stay in its heaps,
// so memory under large bodies grew well past the body budget's multiple (docs/SECURITY.md).
constexpr int kLargeBlockBytes = 4 << 20;

void map_large_blocks_on_their_own() {
#ifdef __GLIBC__
  static const bool done = [] { return ::mallopt(M_MMAP_THRESHOLD, kLargeBlockBytes) == 1; }();
  (void)done;
#endif
}

}  // namespace

Result<int> HttpServer::start() {
  map_large_blocks_on_their_own();
  ServerState& s = *state_;
  running_ = std::make_unique<Running>(s.io_threads);
  int port = bind_listener(running_->acceptor, host_, port_);
  if (port == 0) {
    running_.reset();
    return Unavailable("cannot listen on " + host_ + ":" + std::to_string(port_));
  }
  bool blocking = false, async = false;
  for (const auto& [key, route] : s.routes) {
    blocking |= static_cast<bool>(route.handler) && !route.fast;
    async |= static_cast<bool>(route.async);
  }
  if (blocking) s.queue = std::make_unique<RequestQueue>(s.workers, max_queued_);
  if (async) {
    s.slots = std::make_unique<SlotQueue>(
        s.workers, max_queued_,
        [ioc = &running_->ioc](std::function<void()> job) { net::post(*ioc, std::move(job)); });
  }
  s.max_connections = connection_limit(max_connections_, s.role);
  std::make_shared<AcceptLoop>(running_->acceptor, s)->next();
  for (int i = 0; i < s.io_threads; ++i) {
    running_->io.emplace_back([ioc = &running_->ioc] { ioc->run(); });
  }
  return port;
}

void HttpServer::stop() {
  if (!running_) return;
  ServerState& s = *state_;
  // Stop accepting; answer what was admitted (queued, running, streaming); then go.
  s.begin_stopping();
  net::post(running_->acceptor.get_executor(), [acceptor = &running_->acceptor] {
    boost::system::error_code ignored;
    acceptor->close(ignored);
  });
  bool idle = s.wait_idle(Deadline::after(std::chrono::minutes(10)));
  running_->work.reset();
  running_->ioc.stop();
  for (auto& t : running_->io) t.join();
  if (s.queue) s.queue->stop();
  if (!idle) {
    // What is still in flight may yet post to the I/O context (an async answer from
    // another thread): it stays, stopped, until the process exits.
    spdlog::warn("{}: requests still in flight after 10 minutes; stopping anyway", s.role);
    static_cast<void>(running_.release());
    leak_state_ = true;  // their answers, whenever they come, still count in it
    return;
  }
  running_.reset();
}

int HttpServer::serve_until_signal(const ServeHooks& hooks) {
  // Signals are taken synchronously by this thread; every other thread blocks them.
  block_shutdown_signals();
  raise_open_files_limit();
  const std::string& role = state_->role;
  auto port = start();
  if (!port.ok()) {
    std::cerr << "ecx serve " << role << ": " << port.status().message() << "\n";
    return 1;
  }
  // Before the listening line: who reads it may count on what the hook did.
  if (hooks.on_listening) hooks.on_listening(*port);
  // One write, newline included: the request log (spdlog, other threads) shares stdout,
  // and a line cut by one of its lines would give who reads it a wrong URL.
  const std::string line =
      "ecx serve " + role + " listening on http://" + host_ + ":" + std::to_string(*port) + "\n";
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fflush(stdout);
  spdlog::info("{} listening on {}:{}", role, host_, *port);
  int sig = wait_for_signal();
  spdlog::info("{}: signal {}, draining in-flight requests", role, sig);
  if (hooks.on_signal) hooks.on_signal();
  stop();
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
