// `ecx demo`: proxy + 1 E + 1 PD on loopback, a few multimodal requests, their answers
// and per-stage timings, then a short load run. Everything stops on exit or Ctrl-C.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <numeric>

#include "ecx/common/auth.h"
#include "ecx/common/bytes.h"
#include "ecx/common/json_reader.h"
#include "ecx/common/subprocess.h"
#include "ecx/engine/image.h"
#include "http/http_client.h"
#include "http_server/http_server.h"
#include "wire/socket.h"

namespace ecx::serve {
namespace {

using nlohmann::json;

struct Service {
  std::string name;
  std::optional<Subprocess> process;
  std::string url;
};

Status launch(Service& s, const std::vector<std::string>& argv) {
  ECX_ASSIGN_OR_RETURN(RunningService r, spawn_service(argv, Deadline::after_ms(60000)));
  s.process.emplace(std::move(r.process));
  s.url = r.url;
  return Status::Ok();
}

void shut_down(Service& s) {
  if (!s.process) return;
  stop_service(*s.process, Deadline::after_ms(10000));
  s.process.reset();
}

}  // namespace

// Lines a service may print before its "listening on" line.
constexpr int kMaxLinesBeforeListening = 64;

Result<RunningService> spawn_service(const std::vector<std::string>& argv, Deadline deadline) {
  ECX_ASSIGN_OR_RETURN(Subprocess p, Subprocess::spawn(argv));
  // Log lines may come first (a warning, etcd registration): skip up to a few of them.
  std::string seen;
  for (int i = 0; i < kMaxLinesBeforeListening; ++i) {
    ECX_ASSIGN_OR_RETURN(std::string line, p.read_line(deadline));
    auto at = line.find("listening on http://");
    if (at != std::string::npos) return RunningService{std::move(p), line.substr(at + 13), seen};
    seen += line + "\n";
  }
  return Internal((argv.size() > 2 ? argv[2] : argv[0]) + " did not start: " + seen);
}

Result<StackSecret> StackSecret::create() {
  std::string templ = (std::filesystem::temp_directory_path() / "ecx-secret.XXXXXX").string();
  if (::mkdtemp(templ.data()) == nullptr) return ErrnoError("mkdtemp for a stack secret", errno);
  StackSecret secret(templ, templ + "/token");
  const std::string bytes = random_bytes(32);
  const std::string hex = hex_encode(bytes.data(), bytes.size());
  transfer::UniqueFd file(
      ::open(secret.path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!file.valid()) return ErrnoError("create " + secret.path_, errno);
  if (::write(file.get(), hex.data(), hex.size()) != static_cast<ssize_t>(hex.size())) {
    return ErrnoError("write " + secret.path_, errno);
  }
  return secret;
}

StackSecret::StackSecret(StackSecret&& other) noexcept
    : dir_(std::exchange(other.dir_, {})), path_(std::exchange(other.path_, {})) {}

StackSecret& StackSecret::operator=(StackSecret&& other) noexcept {
  if (this != &other) {
    std::error_code ec;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
    dir_ = std::exchange(other.dir_, {});
    path_ = std::exchange(other.path_, {});
  }
  return *this;
}

StackSecret::~StackSecret() {
  std::error_code ec;
  if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
}

void stop_service(Subprocess& process, Deadline deadline) {
  process.kill(SIGTERM).ignore_error();
  if (!process.wait(deadline).ok()) {
    process.kill(SIGKILL).ignore_error();
    process.wait(Deadline::after_ms(10000)).status().ignore_error();
  }
}

std::string sample_chat_request(const std::string& text, const std::vector<uint64_t>& image_seeds,
                                int max_tokens) {
  json content = json::array({{{"type", "text"}, {"text", text}}});
  for (uint64_t seed : image_seeds) {
    auto png = engine::encode_png(engine::synthetic_image(560, 560, seed)).value();
    content.push_back(
        {{"type", "image_url"}, {"image_url", {{"url", engine::make_data_url(png, "image/png")}}}});
  }
  return json{{"model", "ecx-tiny-vl"},
              {"messages", json::array({{{"role", "user"}, {"content", content}}})},
              {"max_tokens", max_tokens},
              {"ignore_eos", true}}
      .dump();
}

namespace {

// The demo's encoder, PD and proxy, on free loopback ports.
struct DemoStack {
  Service encoder{"encoder"}, pd{"pd"}, proxy{"proxy"};

  // Every service gets the stack's secret (`secret.flags()`).
  Status start(const std::string& exe, const std::string& connector, const StackSecret& secret) {
    auto with_secret = [&secret](std::vector<std::string> argv) {
      for (const std::string& flag : secret.flags()) argv.push_back(flag);
      return argv;
    };
    ECX_RETURN_IF_ERROR(
        launch(encoder, with_secret({exe, "serve", "encoder", "--port", "0", "--connector",
                                     connector, "--log-level", "warn"})));
    ECX_RETURN_IF_ERROR(launch(pd, with_secret({exe, "serve", "pd", "--port", "0", "--connector",
                                                connector, "--log-level", "warn"})));
    return launch(proxy,
                  with_secret({exe, "serve", "proxy", "--port", "0", "--connector", connector,
                               "--encoders", encoder.url, "--pd", pd.url, "--log-level", "warn"}));
  }
  void stop() {
    for (auto* s : {&proxy, &pd, &encoder}) shut_down(*s);
  }
};

// Prints one answer of the proxy and its per-stage timings.
Status print_answer(int index, const DemoOptions& o, const std::string& body, double ms) {
  ECX_ASSIGN_OR_RETURN(json out, parse_json_object(body, "proxy answer"));
  JsonReader answer(out, "proxy answer");
  ECX_ASSIGN_OR_RETURN(const json* choices, answer.array("choices", Presence::kRequired));
  if (choices->empty()) return Internal("proxy answer has no choices");
  ECX_ASSIGN_OR_RETURN(
      JsonReader message,
      JsonReader(choices->front(), "choice").child("message", Presence::kRequired));
  ECX_ASSIGN_OR_RETURN(std::string content,
                       message.string("content", Presence::kRequired, 1 << 20));
  ECX_ASSIGN_OR_RETURN(JsonReader t, answer.child("ecx_timings"));
  auto timing = [&t](const char* key) {
    auto ms = t.number(key);
    return ms.ok() ? *ms : 0.0;
  };
  std::printf("request %d (%d images of 560x560): \"%s\"\n", index + 1, o.images_per_request,
              content.c_str());
  std::printf(
      "  encode %.1f ms | EC load %.2f ms | prefill %.1f ms | decode %.1f ms | total %.1f ms\n",
      timing("proxy_encode_ms"), timing("ec_load_ms"), timing("prefill_ms"), timing("decode_ms"),
      ms);
  return Status::Ok();
}

// The sample requests, one after the other (images repeat every other request).
Status send_sample_requests(const DemoOptions& o, const std::string& proxy_url) {
  auto hp = parse_url(proxy_url).value();
  http::HttpClient client(http::HttpClient::Options{.threads = 1});
  double total_ms = 0;
  for (int r = 0; r < o.requests; ++r) {
    std::vector<uint64_t> seeds;
    for (int i = 0; i < o.images_per_request; ++i)
      seeds.push_back(static_cast<uint64_t>(r % 2 * 10 + i));
    std::string body = sample_chat_request("What is in these pictures?", seeds, o.max_tokens);
    auto t0 = std::chrono::steady_clock::now();
    http::ClientRequest request;
    request.target = "/v1/chat/completions";
    request.body = std::move(body);
    request.timeout = std::chrono::seconds(120);
    http::ClientResult res = client.call(hp.first, hp.second, std::move(request));
    double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (!res.ok()) return Unavailable("proxy: " + res.message);
    if (res.status != 200) return Internal("HTTP " + std::to_string(res.status) + ": " + res.body);
    if (Status s = print_answer(r, o, res.body, ms); !s.ok()) {
      return Internal("HTTP " + std::to_string(res.status) + ": " + s.message());
    }
    total_ms += ms;
  }
  std::printf("\n%d requests, mean latency %.1f ms (repeated images hit the encoder's cache)\n",
              o.requests, total_ms / std::max(1, o.requests));
  return Status::Ok();
}

// A short load run through the stack (`ecx bench serve`, the seed workload's shape),
// its output passed through.
Status run_short_bench(const std::string& exe, const std::string& proxy_url, int prompts) {
  std::printf("\nshort load run: ecx bench serve --num-prompts %d --output-len 32\n", prompts);
  ECX_ASSIGN_OR_RETURN(
      Subprocess bench,
      Subprocess::spawn({exe, "bench", "serve", "--base-url", proxy_url, "--num-prompts",
                         std::to_string(prompts), "--output-len", "32"}));
  while (true) {
    auto line = bench.read_line(Deadline::after_ms(300000));
    if (!line.ok()) break;  // the bench closed its output
    std::printf("%s\n", line->c_str());
  }
  auto code = bench.wait(Deadline::after_ms(60000));
  if (!code.ok() || *code != 0) return Internal("bench serve failed");
  return Status::Ok();
}

}  // namespace

int run_demo(const DemoOptions& o, const std::string& exe) {
  // Ctrl-C reaches the children too (same process group); they drain and exit, and
  // the Subprocess destructors reap them.
  DemoStack stack;
  std::printf("ecx demo: connector %s; starting encoder, pd and proxy on loopback...\n",
              o.connector.c_str());
  std::printf(
      "model: ecx-tiny-vl, a small reference vision-language model (ViT-style encoder, decoder "
      "LM) with seeded weights: its text is deterministic noise; what matters is that every "
      "connector gives the same text (ecx eval)\n");
  // E and PD authenticate each other with a secret of this run.
  Result<StackSecret> secret = StackSecret::create();
  Status s = secret.ok() ? stack.start(exe, o.connector, *secret) : secret.status();
  if (s.ok()) {
    std::printf("  encoder %s\n  pd      %s\n  proxy   %s\n\n", stack.encoder.url.c_str(),
                stack.pd.url.c_str(), stack.proxy.url.c_str());
    s = send_sample_requests(o, stack.proxy.url);
  }
  if (s.ok() && o.bench_prompts > 0) s = run_short_bench(exe, stack.proxy.url, o.bench_prompts);
  if (!s.ok()) {
    std::cerr << "ecx demo: " << s.to_string() << "\n";
    stack.stop();
    return 1;
  }
  auto hp = parse_url(stack.proxy.url).value();
  http::HttpClient client(http::HttpClient::Options{.threads = 1});
  http::ClientRequest get_metrics;
  get_metrics.method = "GET";
  get_metrics.target = "/metrics";
  auto metrics = client.call(hp.first, hp.second, std::move(get_metrics));
  if (metrics.ok() && metrics.status == 200)
    std::printf("proxy /metrics: %zu bytes of Prometheus text\n", metrics.body.size());
  stack.stop();
  std::printf("ecx demo: stopped all services cleanly\n");
  return 0;
}

}  // namespace ecx::serve
