// `ecx bench load`: many clients at once against the proxy (issue 13's load test).
// Closed loop: N connections, each sends a chat completion (one small image), waits for
// the answer and sends the next, for --seconds; at each N in --connections. Meanwhile
// one more connection asks GET /health every 50 ms. Then --stream-connections clients
// each send one streamed request and check it ends with `data: [DONE]`.
//
// The clients are Boost.Beast on one Asio thread: no thread per connection here either.
#include "load_bench.h"

#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "ecx/engine/image.h"
#include "ecx/serve/services.h"
#include "http/http_client.h"
#include "http_server/http_server.h"
#include "stack.h"

namespace ecx::bench {
namespace {

namespace beast = boost::beast;
namespace bhttp = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using nlohmann::json;
double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(p / 100.0 * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(v.size() - 1, i)];
}

// Chat completion bodies with one image each, `count` distinct images.
std::vector<std::string> make_bodies(const LoadBenchOptions& o, bool stream) {
  std::vector<std::string> out;
  for (int i = 0; i < o.distinct_images; ++i) {
    auto png = engine::encode_png(engine::synthetic_image(o.image_size, o.image_size, 1000 + i));
    json content =
        json::array({{{"type", "text"}, {"text", "Describe:"}},
                     {{"type", "image_url"},
                      {"image_url", {{"url", engine::make_data_url(*png, "image/png")}}}}});
    out.push_back(json{
        {"model", "ecx-tiny-vl"},
        {"messages", json::array({{{"role", "user"}, {"content", content}}})},
        {"max_tokens", o.max_tokens},
        {"ignore_eos", true},
        {"stream",
         stream}}.dump());
  }
  return out;
}

// What one load level (or the streaming run) came to.
struct LevelResult {
  int connections = 0;
  bool stream = false;
  int ok = 0, rejected = 0, http_errors = 0, connection_errors = 0, incomplete_streams = 0;
  double seconds = 0;
  std::vector<double> latency_ms;
  std::vector<double> health_ms;
  int health_failures = 0;
  std::map<std::string, double> threads;           // service -> ecx_process_threads, mid-run
  std::map<std::string, double> connections_open;  // service -> ecx_http_open_connections
};

struct Run {
  const std::vector<std::string>& bodies;
  tcp::endpoint endpoint;
  std::string host;
  bool stream = false;
  bool one_each = false;  // each client sends one request, then stops
  Clock::time_point stop_at;
  LevelResult& result;
  Clock::time_point last_done;
  size_t next_body = 0;
};

// One client connection, on the bench's Asio thread.
class Client : public std::enable_shared_from_this<Client> {
 public:
  Client(net::io_context& ioc, Run& run) : stream_(ioc), run_(run) {}
  void start() {
    stream_.expires_after(std::chrono::seconds(30));
    stream_.async_connect(run_.endpoint, [self = shared_from_this()](beast::error_code ec) {
      if (ec) return self->fail();
      self->send();
    });
  }

 private:
  void send() {
    if (Clock::now() >= run_.stop_at || (run_.one_each && sent_ > 0)) return close();
    sent_++;
    req_ = {bhttp::verb::post, "/v1/chat/completions", 11};
    req_.set(bhttp::field::host, run_.host);
    req_.set(bhttp::field::content_type, "application/json");
    req_.keep_alive(true);
    req_.body() = run_.bodies[run_.next_body++ % run_.bodies.size()];
    req_.prepare_payload();
    t_sent_ = Clock::now();
    stream_.expires_after(std::chrono::seconds(300));
    bhttp::async_write(stream_, req_, [self = shared_from_this()](beast::error_code ec, size_t) {
      if (ec) return self->fail();
      self->read();
    });
  }
  void read() {
    parser_.emplace();
    parser_->body_limit(64 << 20);
    bhttp::async_read(stream_, buffer_, *parser_,
                      [self = shared_from_this()](beast::error_code ec, size_t) {
                        if (ec) return self->fail();
                        self->done();
                      });
  }
  void done() {
    auto now = Clock::now();
    auto& res = parser_->get();
    LevelResult& r = run_.result;
    run_.last_done = now;
    if (res.result_int() == 503) {
      r.rejected++;
    } else if (res.result_int() != 200) {
      r.http_errors++;
    } else if (run_.stream && res.body().find("data: [DONE]\n\n") == std::string::npos) {
      r.incomplete_streams++;
    } else {
      r.ok++;
      r.latency_ms.push_back(ms_between(t_sent_, now));
    }
    if (!res.keep_alive()) {  // a streamed answer closes its connection: open the next
      beast::error_code ignored;
      stream_.socket().close(ignored);
      if (Clock::now() < run_.stop_at && !run_.one_each) return start();
      return;
    }
    send();
  }
  void fail() {
    run_.result.connection_errors++;
    close();
  }
  void close() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.socket().close(ignored);
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  bhttp::request<bhttp::string_body> req_;
  std::optional<bhttp::response_parser<bhttp::string_body>> parser_;
  Run& run_;
  Clock::time_point t_sent_;
  int sent_ = 0;
};

// GET /health every 50 ms on its own connection until `stop`; once, halfway, each
// service's thread count and open connections.
void watch_health(const std::string& proxy,
                  const std::vector<std::pair<std::string, std::string>>& services,
                  std::atomic<bool>& stop, Clock::time_point sample_at, LevelResult& r) {
  auto hp = serve::parse_url(proxy).value();
  ecx::http::HttpClient client(ecx::http::HttpClient::Options{.threads = 1});
  auto get = [&client](const std::pair<std::string, int>& at, const std::string& target) {
    ecx::http::ClientRequest request;
    request.method = "GET";
    request.target = target;
    request.timeout = std::chrono::seconds(10);
    return client.call(at.first, at.second, std::move(request));
  };
  bool sampled = false;
  while (!stop) {
    auto t0 = Clock::now();
    auto res = get(hp, "/health");
    r.health_ms.push_back(ms_between(t0, Clock::now()));
    if (!res.ok() || res.status != 200) r.health_failures++;
    if (!sampled && Clock::now() >= sample_at) {
      sampled = true;
      for (const auto& [name, url] : services) {
        auto shp = serve::parse_url(url).value();
        auto m = get(shp, "/metrics");
        if (!m.ok()) continue;
        std::istringstream lines(m.body);
        std::string line;
        while (std::getline(lines, line)) {
          if (line.rfind("ecx_process_threads ", 0) == 0)
            r.threads[name] = std::stod(line.substr(20));
          if (line.rfind("ecx_http_open_connections ", 0) == 0)
            r.connections_open[name] = std::stod(line.substr(26));
        }
      }
    }
    std::this_thread::sleep_until(t0 + std::chrono::milliseconds(50));  // the sampling period
  }
}

LevelResult run_level(const LoadBenchOptions& o, const std::string& proxy,
                      const std::vector<std::pair<std::string, std::string>>& services,
                      const std::vector<std::string>& bodies, int connections, bool stream) {
  LevelResult r;
  r.connections = connections;
  r.stream = stream;
  net::io_context ioc;
  auto hp = serve::parse_url(proxy).value();
  tcp::resolver resolver(ioc);
  Run run{bodies,
          *resolver.resolve(hp.first, std::to_string(hp.second)).begin(),
          hp.first,
          stream,
          stream,
          Clock::now() + std::chrono::duration_cast<Clock::duration>(
                             std::chrono::duration<double>(stream ? 3600 : o.seconds)),
          r,
          Clock::now()};
  auto start = Clock::now();
  std::atomic<bool> stop{false};
  auto sample_at = start + std::chrono::milliseconds(static_cast<int64_t>(o.seconds * 500));
  std::thread health([&] { watch_health(proxy, services, stop, sample_at, r); });
  for (int i = 0; i < connections; ++i) std::make_shared<Client>(ioc, run)->start();
  ioc.run();
  stop = true;
  health.join();
  r.seconds = std::chrono::duration<double>(run.last_done - start).count();
  return r;
}

json level_json(const LevelResult& r) {
  double throughput = r.seconds > 0 ? r.ok / r.seconds : 0;
  double bound_ms = throughput > 0 ? r.connections / throughput * 1000 : 0;
  return {{"connections", r.connections},
          {"stream", r.stream},
          {"ok", r.ok},
          {"rejected_503", r.rejected},
          {"http_errors", r.http_errors},
          {"connection_errors", r.connection_errors},
          {"incomplete_streams", r.incomplete_streams},
          {"seconds", r.seconds},
          {"throughput_rps", throughput},
          {"p50_ms", percentile(r.latency_ms, 50)},
          {"p99_ms", percentile(r.latency_ms, 99)},
          {"max_ms", percentile(r.latency_ms, 100)},
          {"fair_bound_ms", bound_ms},
          {"health_samples", r.health_ms.size()},
          {"health_failures", r.health_failures},
          {"health_p99_ms", percentile(r.health_ms, 99)},
          {"health_max_ms", percentile(r.health_ms, 100)},
          {"threads", r.threads},
          {"open_connections", r.connections_open}};
}

void print_row(const json& j) {
  std::printf("%6d %6s %6d %5d %5d %5d %8.1f %8.1f %8.1f %8.1f %9.1f %8.1f  ",
              j["connections"].get<int>(), j["stream"].get<bool>() ? "stream" : "chat",
              j["ok"].get<int>(), j["rejected_503"].get<int>(),
              j["http_errors"].get<int>() + j["incomplete_streams"].get<int>(),
              j["connection_errors"].get<int>(), j["throughput_rps"].get<double>(),
              j["p50_ms"].get<double>(), j["p99_ms"].get<double>(), j["max_ms"].get<double>(),
              j["fair_bound_ms"].get<double>(), j["health_max_ms"].get<double>());
  for (auto& [name, n] : j["threads"].items()) std::printf("%s=%g ", name.c_str(), n.get<double>());
  std::printf("\n");
  std::fflush(stdout);
}

void raise_fd_limit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;  // the services started from here inherit it
    setrlimit(RLIMIT_NOFILE, &limit);
  }
}

}  // namespace

int run_load_bench(const LoadBenchOptions& o) {
  raise_fd_limit();
  StackProcs stack;
  auto dir =
      std::filesystem::temp_directory_path() / ("ecx-bench-load-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::string proxy = o.base_url;
  std::vector<std::pair<std::string, std::string>> services;
  if (proxy.empty()) {
    Status s = start_stack("p2p", "512MiB", "", dir, stack);
    if (!s.ok()) {
      std::fprintf(stderr, "ecx bench load: %s\n", s.to_string().c_str());
      return 1;
    }
    proxy = stack.proxy.url;
    services = {{"proxy", stack.proxy.url}, {"encoder", stack.e().url}, {"pd", stack.pd().url}};
  } else {
    services = {{"proxy", proxy}};
  }
  auto bodies = make_bodies(o, false);
  auto stream_bodies = make_bodies(o, true);
  std::printf("%6s %6s %6s %5s %5s %5s %8s %8s %8s %8s %9s %8s  %s\n", "conns", "kind", "ok", "503",
              "err", "conn", "req/s", "p50 ms", "p99 ms", "max ms", "N/X ms", "health", "threads");
  json levels = json::array();
  int bad = 0;
  for (int n : o.connections) {
    json j = level_json(run_level(o, proxy, services, bodies, n, false));
    print_row(j);
    bad += j["connection_errors"].get<int>() + j["http_errors"].get<int>();
    levels.push_back(j);
  }
  if (o.stream_connections > 0) {
    json j = level_json(run_level(o, proxy, services, stream_bodies, o.stream_connections, true));
    print_row(j);
    bad += j["connection_errors"].get<int>() + j["incomplete_streams"].get<int>() +
           j["http_errors"].get<int>();
    levels.push_back(j);
  }
  if (!o.json_path.empty()) std::ofstream(o.json_path) << json{{"levels", levels}}.dump(2) << "\n";
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  return bad == 0 ? 0 : 1;
}

void add_load_command(CLI::App& bench, int* exit_code) {
  auto options = std::make_shared<LoadBenchOptions>();
  CLI::App* c = bench.add_subcommand(
      "load", "Many connections at once against the proxy: throughput, latency, 503s, /health");
  c->add_option("--base-url", options->base_url,
                "A running proxy (default: start proxy + E + PD on loopback)");
  c->add_option("--connections", options->connections, "Closed-loop clients per level")
      ->delimiter(',')
      ->capture_default_str();
  c->add_option("--seconds", options->seconds, "Seconds per level")->capture_default_str();
  c->add_option("--stream-connections", options->stream_connections,
                "Clients of the streaming run, one streamed request each (0 = none)")
      ->capture_default_str();
  c->add_option("--image-size", options->image_size, "Image width and height")
      ->capture_default_str();
  c->add_option("--distinct-images", options->distinct_images, "Distinct images sent")
      ->capture_default_str();
  c->add_option("--max-tokens", options->max_tokens, "Tokens per answer")->capture_default_str();
  c->add_option("--json", options->json_path, "Write the figures here");
  c->callback([options, exit_code] { *exit_code = run_load_bench(*options); });
}

}  // namespace ecx::bench
