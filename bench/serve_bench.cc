#include "serve_bench.h"
#include "ecx/common/json_reader.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <thread>

#include "ecx/common/mutex.h"
#include "ecx/engine/image.h"
#include "http/http_client.h"
#include "progress.h"

namespace ecx::bench {
namespace {

using nlohmann::json;
struct Workload {
  int images = 3, width = 560, height = 560, distinct = 0;  // distinct 0 = every image new
  double repeat = 0;  // the share of images that are ones sent before (distinct 0 only)
};

Workload workload_for(const std::string& name) {
  if (name == "heavy") return {4, 1920, 1080, 0};
  if (name == "shared") return {3, 560, 560, 20};
  if (name == "repeat") return {3, 560, 560, 0, 0.5};
  return {3, 560, 560, 0};
}

struct Sample {
  bool ok = false;
  std::string error;
  double start_s = 0, ttft_ms = 0, latency_ms = 0, ec_load_ms = 0;
  int prompt_tokens = 0, output_tokens = 0;
  std::vector<double> itl_ms;
  std::vector<double> token_times_s;  // since the benchmark start
};

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(v.size())));
  return v[std::min(v.size() - 1, i == 0 ? 0 : i - 1)];
}
double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / static_cast<double>(v.size());
}

// What one SSE event of a chat completion stream says.
struct StreamEvent {
  std::string error;
  std::optional<int> prompt_tokens;
  std::optional<double> ec_load_ms;
  std::string content;  // of the first choice's delta
};

Result<StreamEvent> parse_event(std::string_view payload) {
  ECX_ASSIGN_OR_RETURN(json j, parse_json_object(payload, "stream event"));
  JsonReader r(j, "stream event");
  StreamEvent e;
  if (r.has("error")) {
    auto error = r.child("error");
    auto message = error.ok() ? error->string("message", Presence::kOptional, 4096, "")
                              : Result<std::string>(error.status());
    e.error = message.ok() && !message->empty() ? *message : "error in stream";
  }
  if (auto usage = r.child("usage"); usage.ok() && r.has("usage")) {
    auto n = usage->i64("prompt_tokens", 0, INT32_MAX);
    e.prompt_tokens = n.ok() ? static_cast<int>(*n) : 0;
  }
  if (auto timings = r.child("ecx_timings"); timings.ok() && r.has("ecx_timings")) {
    auto ms = timings->number("ec_load_ms");
    e.ec_load_ms = ms.ok() ? *ms : 0.0;
  }
  auto choices = r.array("choices", Presence::kOptional);
  if (choices.ok() && *choices != nullptr && !(*choices)->empty()) {
    auto delta = JsonReader((**choices)[0], "choice").child("delta");
    auto content = delta.ok() ? delta->string("content", Presence::kOptional, size_t{1} << 24)
                              : Result<std::string>(delta.status());
    if (content.ok()) e.content = *content;
  }
  return e;
}

Sample run_one(http::HttpClient& client, const std::string& host, int port, const std::string& body,
               Clock::time_point t0) {
  Sample s;
  auto start = Clock::now();
  s.start_s = std::chrono::duration<double>(start - t0).count();
  http::ClientRequest request;
  request.target = "/v1/chat/completions";
  request.body = body;
  request.timeout = std::chrono::seconds(600);
  std::string buffer;
  bool done = false;
  Clock::time_point last;
  int status = 0;
  http::ClientStreaming streaming;
  streaming.on_headers = [&status](int code) {
    status = code;
    return true;
  };
  streaming.on_body = [&](std::string_view piece, const std::function<void()>&) {
    buffer.append(piece);
    size_t end;
    while ((end = buffer.find("\n\n")) != std::string::npos) {
      std::string event = buffer.substr(0, end);
      buffer.erase(0, end + 2);
      if (event.rfind("data: ", 0) != 0) continue;
      std::string payload = event.substr(6);
      if (payload == "[DONE]") {
        done = true;
        continue;
      }
      auto parsed = parse_event(payload);
      if (!parsed.ok()) continue;
      if (!parsed->error.empty()) s.error = parsed->error;
      if (parsed->prompt_tokens) s.prompt_tokens = *parsed->prompt_tokens;
      if (parsed->ec_load_ms) s.ec_load_ms = *parsed->ec_load_ms;
      if (parsed->content.empty()) continue;
      auto now = Clock::now();
      if (s.output_tokens == 0) {
        s.ttft_ms = std::chrono::duration<double, std::milli>(now - start).count();
      } else {
        s.itl_ms.push_back(std::chrono::duration<double, std::milli>(now - last).count());
      }
      s.token_times_s.push_back(std::chrono::duration<double>(now - t0).count());
      last = now;
      s.output_tokens++;
    }
    return http::BodyFlow::kContinue;
  };
  http::ClientResult res = client.call(host, port, std::move(request), std::move(streaming));
  s.latency_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  if (!res.ok()) {
    s.error = res.message;
  } else if (status != 200) {
    s.error = "HTTP " + std::to_string(status) + ": " + buffer.substr(0, 300);
  } else if (!done && s.error.empty()) {
    s.error = "stream ended without [DONE]";
  }
  s.ok = s.error.empty();
  return s;
}

// host:port of --base-url ("http://host:port[/v1][/]"); nullopt if it names no port.
struct Target {
  std::string host;
  int port = 0;
};

std::optional<Target> parse_base_url(const std::string& base_url) {
  std::string rest = base_url;
  if (rest.rfind("http://", 0) == 0) rest = rest.substr(7);
  while (!rest.empty() && rest.back() == '/') rest.pop_back();
  if (rest.size() > 3 && rest.substr(rest.size() - 3) == "/v1") rest.resize(rest.size() - 3);
  auto colon = rest.rfind(':');
  if (colon == std::string::npos) return std::nullopt;
  return Target{rest.substr(0, colon), std::atoi(rest.substr(colon + 1).c_str())};
}

// Every request body, built before the clock starts (image encoding is not measured).
Result<std::vector<std::string>> build_requests(const ServeBenchOptions& o, const Workload& w,
                                                std::mt19937_64& rng) {
  std::vector<std::string> pool;  // image data URLs
  int distinct = w.distinct > 0 ? w.distinct : o.num_prompts * w.images;
  for (int i = 0; i < distinct; ++i) {
    ECX_ASSIGN_OR_RETURN(auto png,
                         engine::encode_png(engine::synthetic_image(
                             w.width, w.height, o.seed * 1000003 + static_cast<uint64_t>(i) + 1)));
    pool.push_back(engine::make_data_url(png, "image/png"));
  }
  std::vector<std::string> bodies;
  // repeat: the images sent so far; an image is a repeat (one of them, at random) while
  // the repeats are fewer than `repeat` of the images so far, so the share is exact.
  std::vector<size_t> sent;
  int repeats = 0, slots = 0;
  auto pick = [&](int r, int i) -> size_t {
    if (w.distinct > 0) return rng() % pool.size();
    if (w.repeat <= 0) return static_cast<size_t>(r * w.images + i);
    ++slots;
    if (!sent.empty() && repeats < w.repeat * slots) {
      ++repeats;
      return sent[rng() % sent.size()];
    }
    sent.push_back(sent.size());  // the next new image
    return sent.back();
  };
  for (int r = 0; r < o.num_prompts; ++r) {
    std::string text;
    for (int i = 0; i < o.input_len; ++i) text.push_back(static_cast<char>('a' + rng() % 26));
    json content = json::array({{{"type", "text"}, {"text", text}}});
    for (int i = 0; i < w.images; ++i) {
      size_t idx = pick(r, i);
      content.push_back({{"type", "image_url"}, {"image_url", {{"url", pool[idx]}}}});
    }
    bodies.push_back(json{{"model", o.model},
                          {"messages", json::array({{{"role", "user"}, {"content", content}}})},
                          {"max_tokens", o.output_len},
                          {"ignore_eos", true},
                          {"stream", true},
                          {"stream_options", {{"include_usage", true}}}}
                         .dump());
  }
  return bodies;
}

// Arrival times in seconds from the start: all at once (rate 0, "inf") or Poisson at `rate`.
std::vector<double> arrival_times(size_t count, double rate, std::mt19937_64& rng) {
  std::vector<double> arrival(count, 0.0);
  std::exponential_distribution<double> gap(rate > 0 ? rate : 1.0);
  for (size_t i = 1; i < arrival.size() && rate > 0; ++i) arrival[i] = arrival[i - 1] + gap(rng);
  return arrival;
}

struct Run {
  std::vector<Sample> samples;
  double duration_s = 0;
  int peak_concurrent = 0;
};

// Sends every request at its arrival time, at most `workers` in flight.
Run send_requests(const Target& target, const std::vector<std::string>& bodies,
                  const std::vector<double>& arrival, int workers) {
  std::vector<Sample> samples(bodies.size());
  std::atomic<size_t> next{0};
  std::atomic<int> in_flight{0}, peak{0};
  // A bar on a terminal, "progress: ..." lines otherwise (bench epd reads them).
  Mutex progress_mu;
  bench::Progress progress("bench serve", static_cast<int>(bodies.size()));
  // Keep-alive connections, as an OpenAI client's session keeps them.
  http::HttpClient client(http::HttpClient::Options{.threads = 2});
  auto t0 = Clock::now();
  std::vector<std::thread> threads;
  for (int t = 0; t < workers; ++t) {
    threads.emplace_back([&] {
      while (true) {
        size_t i = next.fetch_add(1);
        if (i >= bodies.size()) return;
        std::this_thread::sleep_until(
            t0 + std::chrono::duration_cast<Clock::duration>(
                     std::chrono::duration<double>(arrival[i])));  // the arrival schedule
        int now = ++in_flight;
        int seen = peak.load();
        while (now > seen && !peak.compare_exchange_weak(seen, now)) {
        }
        samples[i] = run_one(client, target.host, target.port, bodies[i], t0);
        --in_flight;
        MutexLock lock(&progress_mu);
        progress.advance();
      }
    });
  }
  for (auto& t : threads) t.join();
  progress.finish();
  double duration = std::chrono::duration<double>(Clock::now() - t0).count();
  return Run{std::move(samples), duration, peak.load()};
}

// A latency's three figures, in milliseconds.
struct Latency {
  double mean = 0, median = 0, p99 = 0;
};
Latency latency(const std::vector<double>& v) {
  return {mean(v), percentile(v, 50), percentile(v, 99)};
}

// The figures `vllm bench serve` prints, over the successful requests.
struct Figures {
  int ok = 0, failed = 0;
  long total_in = 0, total_out = 0;
  double duration_s = 0;
  int peak_tokens = 0;  // most tokens generated in one second
  int peak_concurrent = 0;
  Latency ttft, tpot, itl;
  double mean_ec_load_ms = 0, p99_ec_load_ms = 0;
  std::string first_error;
};

Figures figures_of(const Run& run) {
  Figures f;
  f.duration_s = run.duration_s;
  f.peak_concurrent = run.peak_concurrent;
  std::vector<double> ttft, tpot, itl, ec_load;
  std::map<long, int> per_second;
  for (const auto& s : run.samples) {
    if (!s.ok) {
      f.failed++;
      if (f.first_error.empty()) f.first_error = s.error;
      continue;
    }
    f.ok++;
    f.total_in += s.prompt_tokens;
    f.total_out += s.output_tokens;
    ttft.push_back(s.ttft_ms);
    if (s.output_tokens > 1) tpot.push_back((s.latency_ms - s.ttft_ms) / (s.output_tokens - 1));
    itl.insert(itl.end(), s.itl_ms.begin(), s.itl_ms.end());
    ec_load.push_back(s.ec_load_ms);
    for (double t : s.token_times_s) per_second[static_cast<long>(t)]++;
  }
  for (const auto& [sec, n] : per_second) f.peak_tokens = std::max(f.peak_tokens, n);
  f.ttft = latency(ttft);
  f.tpot = latency(tpot);
  f.itl = latency(itl);
  f.mean_ec_load_ms = mean(ec_load);
  f.p99_ec_load_ms = percentile(ec_load, 99);
  return f;
}

json figures_json(const Figures& f, const ServeBenchOptions& o) {
  const double d = f.duration_s;
  json out = {{"successful_requests", f.ok},
              {"failed_requests", f.failed},
              {"duration_s", d},
              {"total_input_tokens", f.total_in},
              {"total_output_tokens", f.total_out},
              {"request_throughput", f.ok / d},
              {"output_throughput", static_cast<double>(f.total_out) / d},
              {"peak_output_throughput", f.peak_tokens},
              {"peak_concurrent_requests", f.peak_concurrent},
              {"total_token_throughput", static_cast<double>(f.total_in + f.total_out) / d},
              {"mean_ec_load_ms", f.mean_ec_load_ms},
              {"p99_ec_load_ms", f.p99_ec_load_ms},
              {"workload", o.workload},
              {"num_prompts", o.num_prompts},
              {"request_rate", o.request_rate}};
  auto add_latency = [&out](const std::string& name, const Latency& l) {
    out["mean_" + name + "_ms"] = l.mean;
    out["median_" + name + "_ms"] = l.median;
    out["p99_" + name + "_ms"] = l.p99;
  };
  add_latency("ttft", f.ttft);
  add_latency("tpot", f.tpot);
  add_latency("itl", f.itl);
  if (!f.first_error.empty()) out["first_error"] = f.first_error;
  return out;
}

void print_line(const char* label, double v) { std::printf("%-40s %.2f\n", label, v); }

// "-----Title-----" then "Mean NAME (ms):", "Median NAME (ms):", "P99 NAME (ms):".
void print_latency(const char* rule, const std::string& name, const Latency& l) {
  std::printf("%s\n", rule);
  print_line(("Mean " + name + " (ms):").c_str(), l.mean);
  print_line(("Median " + name + " (ms):").c_str(), l.median);
  print_line(("P99 " + name + " (ms):").c_str(), l.p99);
}

void print_figures(const Figures& f) {
  const double d = f.duration_s;
  std::printf("============ Serving Benchmark Result ============\n");
  std::printf("%-40s %d\n", "Successful requests:", f.ok);
  std::printf("%-40s %d\n", "Failed requests:", f.failed);
  print_line("Benchmark duration (s):", d);
  std::printf("%-40s %ld\n", "Total input tokens:", f.total_in);
  std::printf("%-40s %ld\n", "Total generated tokens:", f.total_out);
  print_line("Request throughput (req/s):", f.ok / d);
  print_line("Output token throughput (tok/s):", static_cast<double>(f.total_out) / d);
  print_line("Peak output token throughput (tok/s):", f.peak_tokens);
  std::printf("%-40s %d\n", "Peak concurrent requests:", f.peak_concurrent);
  print_line("Total Token throughput (tok/s):", static_cast<double>(f.total_in + f.total_out) / d);
  print_latency("---------------Time to First Token----------------", "TTFT", f.ttft);
  print_latency("-----Time per Output Token (excl. 1st token)------", "TPOT", f.tpot);
  print_latency("---------------Inter-token Latency----------------", "ITL", f.itl);
  std::printf("----------------EC load (from PD)-----------------\n");
  print_line("Mean EC load (ms):", f.mean_ec_load_ms);
  print_line("P99 EC load (ms):", f.p99_ec_load_ms);
  std::printf("==================================================\n");
  if (!f.first_error.empty()) std::printf("first error: %s\n", f.first_error.c_str());
}

}  // namespace

int run_serve_bench(const ServeBenchOptions& o) {
  std::optional<Target> target = parse_base_url(o.base_url);
  if (!target || o.num_prompts < 1 || o.output_len < 1 || o.input_len < 0) {
    std::fprintf(
        stderr,
        "bench serve: need --base-url http://host:port, --num-prompts >= 1, --output-len >= 1\n");
    return 2;
  }
  double rate = o.request_rate == "inf" ? 0 : std::atof(o.request_rate.c_str());
  if (o.request_rate != "inf" && rate <= 0) {
    std::fprintf(stderr, "bench serve: --request-rate must be a positive number or inf\n");
    return 2;
  }
  Workload w = workload_for(o.workload);
  if (o.images_per_request >= 0) w.images = o.images_per_request;
  std::mt19937_64 rng(o.seed);
  auto bodies = build_requests(o, w, rng);
  if (!bodies.ok()) return 1;
  std::vector<double> arrival = arrival_times(bodies->size(), rate, rng);
  int workers = o.max_concurrency > 0 ? std::min(o.max_concurrency, o.num_prompts) : o.num_prompts;
  Figures f = figures_of(send_requests(*target, *bodies, arrival, workers));
  print_figures(f);
  if (!o.json_path.empty()) {
    std::ofstream out(o.json_path);
    out << figures_json(f, o).dump(2) << "\n";
  }
  return f.failed == 0 ? 0 : 1;
}

void add_serve_command(CLI::App& bench, int* exit_code) {
  auto o = std::make_shared<ServeBenchOptions>();
  CLI::App* s = bench.add_subcommand(
      "serve", "Load generator against an OpenAI-compatible URL (vllm bench serve-like)");
  s->add_option("--base-url", o->base_url, "Server URL")->capture_default_str();
  s->add_option("--model", o->model, "Model name")->capture_default_str();
  s->add_option(
       "--workload", o->workload,
       "seed (3 x 560x560), heavy (4 x 1920x1080), shared (20 images reused), repeat (half "
       "the images are ones sent before)")
      ->capture_default_str();
  s->add_option("--num-prompts", o->num_prompts, "Requests")->capture_default_str();
  s->add_option("--request-rate", o->request_rate, "Requests per second (Poisson), or inf")
      ->capture_default_str();
  s->add_option("--max-concurrency", o->max_concurrency, "In-flight limit (0 = none)")
      ->capture_default_str();
  s->add_option("--images", o->images_per_request, "Images per request (default: the workload's)");
  s->add_option("--input-len", o->input_len, "Text tokens (bytes) per request")
      ->capture_default_str();
  s->add_option("--output-len", o->output_len, "Generated tokens per request (ignore_eos)")
      ->capture_default_str();
  s->add_option("--seed", o->seed, "Workload seed")->capture_default_str();
  s->add_option("--json", o->json_path, "Write the figures as JSON");
  s->callback([o, exit_code] { *exit_code = run_serve_bench(*o); });
}

}  // namespace ecx::bench
