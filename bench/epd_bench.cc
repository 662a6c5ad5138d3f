#include "epd_bench.h"
#include "ecx/common/json_reader.h"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "charts.h"
#include "ecx/common/subprocess.h"
#include "ecx/engine/image.h"
#include "ecx/serve/services.h"
#include "http/http_client.h"
#include "http_server/http_server.h"
#include "progress.h"
#include "stack.h"

namespace ecx::bench {
namespace {

using nlohmann::json;

struct EpdOptions {
  std::string connectors = "local,p2p,p2p:push,p2p:pull-2step,disk,store";
  std::string workload = "seed";
  int num_prompts = 50;
  int output_len = 100;
  int input_len = 400;
  std::string request_rate = "inf";
  std::string redis = "127.0.0.1:6379";
  std::string pool_bytes = "2GiB";
  std::string json_path;
  int encoders = 1;
  int pds = 1;
  std::string hosts;                        // network namespaces (scripts/hosts), comma-separated
  std::string ec_extra;                     // JSON merged into every service's connector "extra"
  std::string encoder_routing = "content";  // the proxy's, comma-separated: a row each
};

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

StackLayout layout_of(const EpdOptions& o, const std::string& routing) {
  return StackLayout{.encoders = o.encoders,
                     .pds = o.pds,
                     .hosts = split_commas(o.hosts),
                     .extra_json = o.ec_extra,
                     .encoder_routing = routing};
}

// The encoders' work: images each encoded (cache misses) and found held (hits), summed
// over the stack's encoders from their /metrics.
json encoder_work(const StackProcs& stack) {
  http::HttpClient client(http::HttpClient::Options{.threads = 1});
  double encoded = 0, held = 0;
  for (const auto& e : stack.encoders) {
    auto at = serve::parse_url(e->url);
    if (!at.ok()) continue;
    http::ClientRequest request;
    request.method = "GET";
    request.target = "/metrics";
    request.timeout = std::chrono::seconds(10);
    auto res = client.call(at->first, at->second, std::move(request));
    if (!res.ok() || res.status != 200) continue;
    std::istringstream lines(res.body);
    std::string line;
    const std::string miss = "ecx_encode_requests_total{cache=\"miss\"} ";
    const std::string hit = "ecx_encode_requests_total{cache=\"hit\"} ";
    while (std::getline(lines, line)) {
      if (line.rfind(miss, 0) == 0) encoded += std::stod(line.substr(miss.size()));
      if (line.rfind(hit, 0) == 0) held += std::stod(line.substr(hit.size()));
    }
  }
  return {{"images_encoded", encoded}, {"images_held", held}};
}

Result<json> run_connector(const EpdOptions& o, const std::string& connector,
                           const std::string& routing, const std::string& redis,
                           const std::filesystem::path& dir) {
  const std::string exe = current_executable();
  StackProcs stack;
  ECX_RETURN_IF_ERROR(
      start_stack(connector, o.pool_bytes, redis, dir, stack, layout_of(o, routing)));
  Proc& proxy = stack.proxy;
  std::string out_path =
      (dir / ("serve-" + std::to_string(std::hash<std::string>()(connector)) + ".json")).string();
  ECX_ASSIGN_OR_RETURN(
      Subprocess bench,
      Subprocess::spawn({exe, "bench", "serve", "--base-url", proxy.url, "--workload", o.workload,
                         "--num-prompts", std::to_string(o.num_prompts), "--output-len",
                         std::to_string(o.output_len), "--input-len", std::to_string(o.input_len),
                         "--request-rate", o.request_rate, "--json", out_path}));
  // Its progress lines drive this run's bar (a terminal) or lines (a log).
  Progress progress(connector, o.num_prompts);
  while (true) {
    auto line = bench.read_line(Deadline::after_ms(1800000));
    if (!line.ok()) break;
    if (auto counts = parse_progress_line(*line)) progress.set(counts->first);
  }
  progress.finish();
  ECX_ASSIGN_OR_RETURN(int code, bench.wait(Deadline::after_ms(60000)));
  std::ifstream in(out_path);
  std::string text(std::istreambuf_iterator<char>(in), {});
  auto parsed = parse_json_object(text, "bench serve results");
  if (!parsed.ok()) return Internal(connector + ": bench serve wrote no results");
  json j = std::move(*parsed);
  if (code != 0) j["note"] = "some requests failed";
  j["connector"] = connector;
  j["encoder_routing"] = routing;
  if (!stack.encoders.empty()) j["encoders_work"] = encoder_work(stack);
  return j;
}

// Median TTFT per connector with a p99 whisker, next to the JSON.
void write_chart(const EpdOptions& o, const std::vector<json>& rows) {
  BarChart chart{.title = "ecx bench epd (" + o.workload + ", " + std::to_string(o.num_prompts) +
                          " prompts): TTFT per connector (bar median, whisker p99)",
                 .y_label = "milliseconds"};
  for (const auto& r : rows) {
    if (r.contains("error")) continue;
    chart.bars.push_back({r["connector"].get<std::string>(), r["median_ttft_ms"].get<double>(),
                          r["p99_ttft_ms"].get<double>()});
  }
  if (chart.bars.empty()) return;
  std::string png = chart_path_for(o.json_path);
  Status s = write_bar_chart(chart, png);
  std::printf("%s\n", s.ok() ? ("wrote " + png).c_str() : s.message().c_str());
}

// The store row needs a Redis: the one named, or one of our own.
std::optional<RedisForBench> redis_for(const EpdOptions& o, const std::filesystem::path& dir) {
  if (o.connectors.find("store") == std::string::npos) return std::nullopt;
  auto hosts = split_commas(o.hosts);
  auto r = RedisForBench::ensure(o.redis, dir, hosts.empty() ? "" : hosts[0]);
  if (!r.ok()) return std::nullopt;
  if (r->started_here()) {
    std::printf("ecx bench epd: no Redis at %s: started one at %s\n", o.redis.c_str(),
                r->address().c_str());
  }
  return std::move(*r);
}

// One line per connector, TTFT also as a ratio to p2p:pull-2step's.
void print_table(const EpdOptions& o, const std::vector<json>& rows) {
  double ref = 0;
  for (const auto& r : rows) {
    if (r["connector"] == "p2p:pull-2step" && !r.contains("error"))
      ref = r["mean_ttft_ms"].get<double>();
  }
  std::printf("\nworkload %s, %d prompts, rate %s, %d output tokens\n", o.workload.c_str(),
              o.num_prompts, o.request_rate.c_str(), o.output_len);
  std::printf("%-15s %6s %11s %11s %11s %11s %11s %9s %8s %s\n", "connector", "ok", "mean TTFT",
              "median", "p99 TTFT", "mean EC ld", "p99 EC ld", "req/s", "E encs",
              "TTFT vs pull-2step");
  for (const auto& r : rows) {
    std::string name = r["connector"];
    if (r.contains("error")) {
      std::printf("%-15s failed: %s\n", name.c_str(), r["error"].get<std::string>().c_str());
      continue;
    }
    std::printf("%-15s %6d %11.1f %11.1f %11.1f %11.2f %11.2f %9.2f ", name.c_str(),
                r["successful_requests"].get<int>(), r["mean_ttft_ms"].get<double>(),
                r["median_ttft_ms"].get<double>(), r["p99_ttft_ms"].get<double>(),
                r["mean_ec_load_ms"].get<double>(), r["p99_ec_load_ms"].get<double>(),
                r["request_throughput"].get<double>());
    if (r.contains("encoders_work")) {
      std::printf("%8.0f ", r["encoders_work"]["images_encoded"].get<double>());
    } else {
      std::printf("%8s ", "-");
    }
    if (ref > 0) std::printf("%.2fx", r["mean_ttft_ms"].get<double>() / ref);
    std::printf("\n");
  }
}

int run_epd(const EpdOptions& o) {
  auto dir =
      std::filesystem::temp_directory_path() / ("ecx-bench-epd-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::optional<RedisForBench> redis = redis_for(o, dir);
  const std::string redis_address = redis ? redis->address() : o.redis;
  std::vector<json> rows;
  const std::vector<std::string> routings = split_commas(o.encoder_routing);
  for (const std::string& c : split_commas(o.connectors)) {
    for (const std::string& routing : routings) {
      // One row per connector and routing; named by the connector alone unless several
      // routings are compared.
      const std::string name = routings.size() > 1 ? c + " " + routing : c;
      std::printf("ecx bench epd: %s ...\n", name.c_str());
      std::fflush(stdout);
      auto r = run_connector(o, c, routing, redis_address, dir);
      if (!r.ok()) {
        std::printf("  failed: %s\n", r.status().to_string().c_str());
        rows.push_back({{"connector", name}, {"error", r.status().to_string()}});
        continue;
      }
      (*r)["connector"] = name;
      rows.push_back(*r);
    }
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  print_table(o, rows);
  if (!o.json_path.empty()) {
    std::ofstream f(o.json_path);
    f << json{{"workload", o.workload}, {"num_prompts", o.num_prompts},   {"encoders", o.encoders},
              {"pds", o.pds},           {"hosts", split_commas(o.hosts)}, {"rows", rows}}
             .dump(2)
      << "\n";
    write_chart(o, rows);
  }
  for (const auto& r : rows) {
    if (r.contains("error")) return 1;
  }
  return 0;
}

}  // namespace

void add_epd_command(CLI::App& bench, int* exit_code) {
  auto o = std::make_shared<EpdOptions>();
  CLI::App* s =
      bench.add_subcommand("epd", "A stack per connector, the same workload on each, compared");
  s->add_option("--connectors", o->connectors, "Connectors to compare")->capture_default_str();
  s->add_option("--workload", o->workload, "seed, heavy, shared or repeat")->capture_default_str();
  s->add_option("--encoder-routing", o->encoder_routing,
                "The proxy's encoder routing, comma-separated to compare (content, round-robin)")
      ->capture_default_str();
  s->add_option("--num-prompts", o->num_prompts, "Requests per connector")->capture_default_str();
  s->add_option("--output-len", o->output_len, "Generated tokens per request")
      ->capture_default_str();
  s->add_option("--input-len", o->input_len, "Text tokens per request")->capture_default_str();
  s->add_option("--request-rate", o->request_rate, "Requests per second, or inf")
      ->capture_default_str();
  s->add_option("--redis", o->redis, "Redis for the store connector")->capture_default_str();
  s->add_option("--pool-bytes", o->pool_bytes, "Connector pool size per service")
      ->capture_default_str();
  s->add_option("--json", o->json_path, "Write all results as JSON");
  s->add_option("--encoders", o->encoders, "E instances per stack")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  s->add_option("--pds", o->pds, "PD instances per stack")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  s->add_option("--hosts", o->hosts,
                "Run the services in these network namespaces (scripts/hosts up N: "
                "ecx-h1,ecx-h2,...): the proxy on the first, one E or PD per host after it");
  s->add_option("--ec-extra", o->ec_extra,
                "JSON merged into every service's connector config \"extra\" (e.g. "
                "'{\"ucx\":true}')");
  s->callback([o, exit_code] { *exit_code = run_epd(*o); });
}

}  // namespace ecx::bench
