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

#include <httplib.h>

#include "ecx/common/subprocess.h"
#include "ecx/engine/image.h"
#include "ecx/serve/services.h"

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
};

struct Proc {
  std::optional<Subprocess> p;
  std::string url;
  ~Proc() {
    if (p) serve::stop_service(*p, Deadline::after_ms(15000));
  }
};

Status launch(Proc& proc, std::vector<std::string> argv) {
  ECX_ASSIGN_OR_RETURN(serve::RunningService r,
                       serve::spawn_service(argv, Deadline::after_ms(120000)));
  proc.p.emplace(std::move(r.process));
  proc.url = r.url;
  return Status::Ok();
}

struct StackProcs {
  Proc e, pd, proxy;
};

// Starts proxy + E + PD (PD alone for local) for `connector`.
Status start_stack(const std::string& connector, const std::string& pool_bytes,
                   const std::string& redis, const std::filesystem::path& dir, StackProcs& s) {
  const std::string exe = current_executable();
  bool local = connector == "local";
  serve::use_new_stack_secret();  // each stack's E and PD share a secret of their own
  json ec = {{"connector", connector.substr(0, connector.find(':'))},
             {"extra", {{"pool_bytes", pool_bytes}}}};
  if (connector.find(':') != std::string::npos)
    ec["extra"]["mode"] = connector.substr(connector.find(':') + 1);
  if (connector == "disk") ec["extra"]["root"] = (dir / "disk").string();
  if (connector == "store") ec["extra"]["redis"] = redis;
  std::vector<std::string> common = {"--port",  "0",           "--ec-config",
                                     ec.dump(), "--log-level", "error"};
  if (!local) {
    std::vector<std::string> argv = {exe, "serve", "encoder"};
    argv.insert(argv.end(), common.begin(), common.end());
    ECX_RETURN_IF_ERROR(launch(s.e, argv).with_context(connector + " encoder"));
  }
  std::vector<std::string> pd_argv = {exe, "serve", "pd"};
  pd_argv.insert(pd_argv.end(), common.begin(), common.end());
  ECX_RETURN_IF_ERROR(launch(s.pd, pd_argv).with_context(connector + " pd"));
  std::vector<std::string> proxy_argv = {exe,           "serve",       "proxy",
                                         "--port",      "0",           "--pd",
                                         s.pd.url,      "--connector", local ? "local" : "p2p",
                                         "--log-level", "error"};
  if (!local) proxy_argv.insert(proxy_argv.end(), {"--encoders", s.e.url});
  return launch(s.proxy, proxy_argv).with_context(connector + " proxy");
}

Result<json> run_connector(const EpdOptions& o, const std::string& connector,
                           const std::filesystem::path& dir) {
  const std::string exe = current_executable();
  StackProcs stack;
  ECX_RETURN_IF_ERROR(start_stack(connector, o.pool_bytes, o.redis, dir, stack));
  Proc& proxy = stack.proxy;
  std::string out_path =
      (dir / ("serve-" + std::to_string(std::hash<std::string>()(connector)) + ".json")).string();
  ECX_ASSIGN_OR_RETURN(
      Subprocess bench,
      Subprocess::spawn({exe, "bench", "serve", "--base-url", proxy.url, "--workload", o.workload,
                         "--num-prompts", std::to_string(o.num_prompts), "--output-len",
                         std::to_string(o.output_len), "--input-len", std::to_string(o.input_len),
                         "--request-rate", o.request_rate, "--json", out_path}));
  while (bench.read_line(Deadline::after_ms(1800000)).ok()) {
  }
  ECX_ASSIGN_OR_RETURN(int code, bench.wait(Deadline::after_ms(60000)));
  std::ifstream in(out_path);
  std::string text(std::istreambuf_iterator<char>(in), {});
  auto parsed = parse_json_object(text, "bench serve results");
  if (!parsed.ok()) return Internal(connector + ": bench serve wrote no results");
  json j = std::move(*parsed);
  if (code != 0) j["note"] = "some requests failed";
  j["connector"] = connector;
  return j;
}

int run_epd(const EpdOptions& o) {
  auto dir =
      std::filesystem::temp_directory_path() / ("ecx-bench-epd-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::vector<json> rows;
  std::stringstream ss(o.connectors);
  std::string c;
  while (std::getline(ss, c, ',')) {
    if (c.empty()) continue;
    std::printf("ecx bench epd: %s ...\n", c.c_str());
    std::fflush(stdout);
    auto r = run_connector(o, c, dir);
    if (!r.ok()) {
      std::printf("  skipped: %s\n", r.status().to_string().c_str());
      rows.push_back({{"connector", c}, {"error", r.status().to_string()}});
      continue;
    }
    rows.push_back(*r);
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  double ref = 0;
  for (const auto& r : rows) {
    if (r["connector"] == "p2p:pull-2step" && !r.contains("error"))
      ref = r["mean_ttft_ms"].get<double>();
  }
  std::printf("\nworkload %s, %d prompts, rate %s, %d output tokens\n", o.workload.c_str(),
              o.num_prompts, o.request_rate.c_str(), o.output_len);
  std::printf("%-15s %6s %11s %11s %11s %11s %11s %9s %s\n", "connector", "ok", "mean TTFT",
              "median", "p99 TTFT", "mean EC ld", "p99 EC ld", "req/s", "TTFT vs pull-2step");
  for (const auto& r : rows) {
    std::string name = r["connector"];
    if (r.contains("error")) {
      std::printf("%-15s skipped: %s\n", name.c_str(), r["error"].get<std::string>().c_str());
      continue;
    }
    std::printf("%-15s %6d %11.1f %11.1f %11.1f %11.2f %11.2f %9.2f ", name.c_str(),
                r["successful_requests"].get<int>(), r["mean_ttft_ms"].get<double>(),
                r["median_ttft_ms"].get<double>(), r["p99_ttft_ms"].get<double>(),
                r["mean_ec_load_ms"].get<double>(), r["p99_ec_load_ms"].get<double>(),
                r["request_throughput"].get<double>());
    if (ref > 0) std::printf("%.2fx", r["mean_ttft_ms"].get<double>() / ref);
    std::printf("\n");
  }
  if (!o.json_path.empty()) {
    std::ofstream f(o.json_path);
    f << json{{"workload", o.workload}, {"num_prompts", o.num_prompts}, {"rows", rows}}.dump(2)
      << "\n";
  }
  for (const auto& r : rows) {
    if (r.contains("error") && r["connector"] != "store") return 1;
  }
  return 0;
}

struct EvalOptions {
  std::string connectors = "p2p,p2p:push,p2p:pull-2step,disk,store";
  int requests = 8;
  int max_tokens = 32;
  std::string redis = "127.0.0.1:6379";
};
// The text of a chat completion's first choice.
Result<std::string> answer_text(const std::string& body) {
  ECX_ASSIGN_OR_RETURN(json j, parse_json_object(body, "chat completion"));
  ECX_ASSIGN_OR_RETURN(const json* choices, JsonReader(j, "chat completion").array("choices"));
  if (choices->empty()) return InvalidArgument("chat completion has no choices");
  ECX_ASSIGN_OR_RETURN(JsonReader message, JsonReader((*choices)[0], "choice").child("message"));
  return message.string("content", Presence::kRequired, size_t{1} << 24);
}

// Sends the same fixed requests through `connector`'s stack; returns the answers.
Result<std::vector<std::string>> answers(const EvalOptions& o, const std::string& connector,
                                         const std::filesystem::path& dir) {
  StackProcs stack;
  ECX_RETURN_IF_ERROR(start_stack(connector, "512MiB", o.redis, dir, stack));
  auto url = stack.proxy.url.substr(7);
  httplib::Client cli(url.substr(0, url.rfind(':')),
                      std::atoi(url.substr(url.rfind(':') + 1).c_str()));
  cli.set_read_timeout(std::chrono::seconds(300));
  std::vector<std::string> out;
  for (int r = 0; r < o.requests; ++r) {
    std::vector<uint64_t> seeds;
    for (int i = 0; i < 3; ++i) seeds.push_back(static_cast<uint64_t>(7919 * r + i));
    std::string body = serve::sample_chat_request("Question " + std::to_string(r) + ": describe.",
                                                  seeds, o.max_tokens);
    auto res = cli.Post("/v1/chat/completions", body, "application/json");
    if (!res) return Unavailable(connector + ": " + httplib::to_string(res.error()));
    if (res->status != 200)
      return Internal(connector + ": HTTP " + std::to_string(res->status) + " " + res->body);
    ECX_ASSIGN_OR_RETURN(std::string content, answer_text(res->body));
    out.push_back(std::move(content));
  }
  return out;
}

int run_eval(const EvalOptions& o) {
  auto dir = std::filesystem::temp_directory_path() / ("ecx-eval-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::printf(
      "ecx eval: %d requests x 3 images of 560x560, %d tokens, greedy; reference: local (PD "
      "encodes)\n",
      o.requests, o.max_tokens);
  auto reference = answers(o, "local", dir);
  if (!reference.ok()) {
    std::printf("local: %s\n", reference.status().to_string().c_str());
    return 1;
  }
  int bad = 0;
  std::stringstream ss(o.connectors);
  std::string c;
  while (std::getline(ss, c, ',')) {
    if (c.empty()) continue;
    auto got = answers(o, c, dir);
    if (!got.ok()) {
      std::printf("%-15s skipped: %s\n", c.c_str(), got.status().to_string().c_str());
      if (c != "store") bad++;
      continue;
    }
    int same = 0;
    for (size_t i = 0; i < got->size(); ++i) same += (*got)[i] == (*reference)[i];
    std::printf("%-15s %d/%d answers identical to local (%.3f)\n", c.c_str(), same, o.requests,
                static_cast<double>(same) / o.requests);
    if (same != o.requests) bad++;
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return bad == 0 ? 0 : 1;
}

}  // namespace

void add_eval_command(CLI::App& app, int* exit_code) {
  auto o = std::make_shared<EvalOptions>();
  CLI::App* s =
      app.add_subcommand("eval", "Correctness: the same requests through every connector vs local");
  s->add_option("--connectors", o->connectors, "Connectors to check")->capture_default_str();
  s->add_option("--requests", o->requests, "Requests")->capture_default_str();
  s->add_option("--max-tokens", o->max_tokens, "Tokens per answer")->capture_default_str();
  s->add_option("--redis", o->redis, "Redis for the store connector")->capture_default_str();
  s->callback([o, exit_code] { *exit_code = run_eval(*o); });
}

void add_epd_command(CLI::App& bench, int* exit_code) {
  auto o = std::make_shared<EpdOptions>();
  CLI::App* s =
      bench.add_subcommand("epd", "A stack per connector, the same workload on each, compared");
  s->add_option("--connectors", o->connectors, "Connectors to compare")->capture_default_str();
  s->add_option("--workload", o->workload, "seed, heavy or shared")->capture_default_str();
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
  s->callback([o, exit_code] { *exit_code = run_epd(*o); });
}

}  // namespace ecx::bench
