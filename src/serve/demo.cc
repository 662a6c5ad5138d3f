// `ecx demo`: proxy + 1 E + 1 PD on loopback, a few multimodal requests, their answers
// and per-stage timings, then a short load run. Everything stops on exit or Ctrl-C.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <numeric>

#include "ecx/common/auth.h"
#include "ecx/common/subprocess.h"
#include "ecx/engine/image.h"
#include "serve/http_util.h"

namespace ecx::serve {
namespace {

using nlohmann::json;

struct Service {
  std::string name;
  std::optional<Subprocess> process;
  std::string url;
};

Status start(Service& s, const std::vector<std::string>& argv) {
  ECX_ASSIGN_OR_RETURN(RunningService r, spawn_service(argv, Deadline::after_ms(60000)));
  s.process.emplace(std::move(r.process));
  s.url = r.url;
  return Status::Ok();
}

void stop(Service& s) {
  if (!s.process) return;
  stop_service(*s.process, Deadline::after_ms(10000));
  s.process.reset();
}

}  // namespace

Result<RunningService> spawn_service(const std::vector<std::string>& argv, Deadline deadline) {
  ECX_ASSIGN_OR_RETURN(Subprocess p, Subprocess::spawn(argv));
  ECX_ASSIGN_OR_RETURN(std::string line, p.read_line(deadline));
  auto at = line.find("listening on http://");
  if (at == std::string::npos) {
    return Internal((argv.size() > 2 ? argv[2] : argv[0]) + " did not start: " + line);
  }
  return RunningService{std::move(p), line.substr(at + 13)};
}

void use_new_stack_secret() {
  std::string secret;
  for (unsigned char c : random_bytes(32)) {
    static const char* kDigits = "0123456789abcdef";
    secret.push_back(kDigits[c >> 4]);
    secret.push_back(kDigits[c & 15]);
  }
  ::setenv("ECX_AUTH_TOKEN", secret.c_str(), /*overwrite=*/1);
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

int run_demo(const DemoOptions& o, const std::string& exe) {
  // Ctrl-C reaches the children too (same process group); they drain and exit, and
  // the Subprocess destructors reap them.
  Service e{"encoder"}, pd{"pd"}, proxy{"proxy"};
  std::vector<Service*> all = {&e, &pd, &proxy};
  auto fail = [&](const Status& s) {
    std::cerr << "ecx demo: " << s.to_string() << "\n";
    for (auto* svc : all) stop(*svc);
    return 1;
  };
  std::printf("ecx demo: connector %s; starting encoder, pd and proxy on loopback...\n",
              o.connector.c_str());
  use_new_stack_secret();  // E and PD authenticate each other with a secret of this run
  if (Status s = start(e, {exe, "serve", "encoder", "--port", "0", "--connector", o.connector,
                           "--log-level", "warn"});
      !s.ok())
    return fail(s);
  if (Status s = start(pd, {exe, "serve", "pd", "--port", "0", "--connector", o.connector,
                            "--log-level", "warn"});
      !s.ok())
    return fail(s);
  if (Status s = start(proxy, {exe, "serve", "proxy", "--port", "0", "--connector", o.connector,
                               "--encoders", e.url, "--pd", pd.url, "--log-level", "warn"});
      !s.ok()) {
    return fail(s);
  }
  std::printf("  encoder %s\n  pd      %s\n  proxy   %s\n\n", e.url.c_str(), pd.url.c_str(),
              proxy.url.c_str());
  auto hp = parse_url(proxy.url).value();
  httplib::Client cli(hp.first, hp.second);
  cli.set_read_timeout(std::chrono::seconds(120));
  std::vector<double> latencies;
  for (int r = 0; r < o.requests; ++r) {
    std::vector<uint64_t> seeds;
    for (int i = 0; i < o.images_per_request; ++i)
      seeds.push_back(static_cast<uint64_t>(r % 2 * 10 + i));
    std::string body = sample_chat_request("What is in these pictures?", seeds, o.max_tokens);
    auto t0 = std::chrono::steady_clock::now();
    auto res = cli.Post("/v1/chat/completions", body, "application/json");
    double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (!res) return fail(Unavailable("proxy: " + httplib::to_string(res.error())));
    json out = json::parse(res->body, nullptr, false);
    if (res->status != 200 || out.is_discarded())
      return fail(Internal("HTTP " + std::to_string(res->status) + ": " + res->body));
    latencies.push_back(ms);
    const json& t = out["ecx_timings"];
    std::printf("request %d (%d images of 560x560): \"%s\"\n", r + 1, o.images_per_request,
                out["choices"][0]["message"]["content"].get<std::string>().c_str());
    std::printf(
        "  encode %.1f ms | EC load %.2f ms | prefill %.1f ms | decode %.1f ms | total %.1f ms\n",
        t.value("proxy_encode_ms", 0.0), t.value("ec_load_ms", 0.0), t.value("prefill_ms", 0.0),
        t.value("decode_ms", 0.0), ms);
  }
  double mean = std::accumulate(latencies.begin(), latencies.end(), 0.0) /
                std::max<size_t>(1, latencies.size());
  std::printf("\n%d requests, mean latency %.1f ms (repeated images hit the encoder's cache)\n",
              o.requests, mean);
  // A short load run through the same stack (`ecx bench serve`, the seed workload's shape).
  if (o.bench_prompts > 0) {
    std::printf("\nshort load run: ecx bench serve --num-prompts %d --output-len 32\n",
                o.bench_prompts);
    auto bench = Subprocess::spawn({exe, "bench", "serve", "--base-url", proxy.url, "--num-prompts",
                                    std::to_string(o.bench_prompts), "--output-len", "32"});
    if (!bench.ok()) return fail(bench.status());
    while (true) {
      auto line = bench->read_line(Deadline::after_ms(300000));
      if (!line.ok()) break;  // the bench closed its output
      std::printf("%s\n", line->c_str());
    }
    auto bench_code = bench->wait(Deadline::after_ms(60000));
    if (!bench_code.ok() || *bench_code != 0) return fail(Internal("bench serve failed"));
  }
  auto metrics = cli.Get("/metrics");
  if (metrics && metrics->status == 200)
    std::printf("proxy /metrics: %zu bytes of Prometheus text\n", metrics->body.size());
  for (auto* svc : {&proxy, &pd, &e}) stop(*svc);
  std::printf("ecx demo: stopped all services cleanly\n");
  return 0;
}

}  // namespace ecx::serve
