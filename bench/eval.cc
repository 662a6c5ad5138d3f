// `ecx eval`: the correctness metric. A fixed set of requests goes through a stack per
// connector; each answer must be identical to the local reference (the PD encodes), and
// no item may have been recomputed: a connector that moved nothing would otherwise score
// perfectly, because the PD recomputes on failure and recomputed text is identical.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "ecx/common/json_reader.h"
#include "ecx/engine/image.h"
#include "epd_bench.h"
#include "http/http_client.h"
#include "stack.h"

namespace ecx::bench {
namespace {

using nlohmann::json;

struct EvalOptions {
  std::string connectors = "p2p,p2p:push,p2p:pull-2step,disk,store";
  int requests = 0;  // 0: all of the fixed set
  int max_tokens = 32;
  std::string redis = "127.0.0.1:6379";
};

struct EvalImage {
  int width = 560;
  int height = 560;
  uint64_t seed = 0;
};

struct EvalRequest {
  std::string text;
  std::vector<EvalImage> images;
};

// 60 fixed requests with 0 to 4 images each: square, tiny, wide, tall, 1920x1080, and
// images repeated from earlier requests (so caches and dedup are exercised).
std::vector<EvalRequest> eval_requests() {
  const EvalImage shapes[] = {{560, 560}, {32, 32}, {640, 360}, {300, 900}};
  std::vector<EvalRequest> out;
  for (int i = 0; i < 60; ++i) {
    EvalRequest r;
    r.text = "Question " + std::to_string(i) + ": what do these pictures show?";
    const int count = i % 5;
    for (int k = 0; k < count; ++k) {
      const int pick = (3 * i + k) % 5;
      if (pick == 4 && i >= 3 && !out[i - 3].images.empty()) {
        r.images.push_back(out[i - 3].images.back());  // an image seen three requests ago
        continue;
      }
      EvalImage image = shapes[pick % 4];
      if (i % 10 == 7 && k == 0) image = {1920, 1080};
      image.seed = 7919ull * i + k;
      r.images.push_back(image);
    }
    out.push_back(std::move(r));
  }
  return out;
}

std::string request_body(const EvalRequest& r, int max_tokens) {
  json content = json::array({{{"type", "text"}, {"text", r.text}}});
  for (const auto& image : r.images) {
    auto png =
        engine::encode_png(engine::synthetic_image(image.width, image.height, image.seed)).value();
    content.push_back(
        {{"type", "image_url"}, {"image_url", {{"url", engine::make_data_url(png, "image/png")}}}});
  }
  return json{{"model", "ecx-tiny-vl"},
              {"messages", json::array({{{"role", "user"}, {"content", content}}})},
              {"max_tokens", max_tokens},
              {"ignore_eos", true}}
      .dump();
}

// What one answer says: its text, how many items the PD recomputed, and the checksums
// of the embeddings it used.
struct Answer {
  std::string text;
  int64_t recomputed = 0;
  json checksums = json::array();
};

Result<Answer> parse_answer(const std::string& body) {
  ECX_ASSIGN_OR_RETURN(json j, parse_json_object(body, "chat completion"));
  ECX_ASSIGN_OR_RETURN(const json* choices, JsonReader(j, "chat completion").array("choices"));
  if (choices->empty()) return InvalidArgument("chat completion has no choices");
  ECX_ASSIGN_OR_RETURN(JsonReader message, JsonReader((*choices)[0], "choice").child("message"));
  Answer a;
  ECX_ASSIGN_OR_RETURN(a.text, message.string("content", Presence::kRequired, size_t{1} << 24));
  if (j.contains("ecx_timings") && j["ecx_timings"].is_object()) {
    const json& t = j["ecx_timings"];
    if (t.contains("items_recomputed") && t["items_recomputed"].is_number_integer()) {
      a.recomputed = t["items_recomputed"].get<int64_t>();
    }
    if (t.contains("embedding_checksums")) a.checksums = t["embedding_checksums"];
  }
  return a;
}

// Sends the fixed requests through `connector`'s stack; returns the answers.
Result<std::vector<Answer>> answers(const EvalOptions& o, const std::vector<EvalRequest>& requests,
                                    const std::string& connector, const std::string& redis,
                                    const std::filesystem::path& dir) {
  StackProcs stack;
  ECX_RETURN_IF_ERROR(start_stack(connector, "512MiB", redis, dir, stack));
  auto url = stack.proxy.url.substr(7);
  const std::string host = url.substr(0, url.rfind(':'));
  const int port = std::atoi(url.substr(url.rfind(':') + 1).c_str());
  http::HttpClient client(http::HttpClient::Options{.threads = 1});
  std::vector<Answer> out;
  for (const auto& request : requests) {
    http::ClientRequest call;
    call.target = "/v1/chat/completions";
    call.body = request_body(request, o.max_tokens);
    call.timeout = std::chrono::seconds(300);
    http::ClientResult res = client.call(host, port, std::move(call));
    if (!res.ok()) return Unavailable(connector + ": " + res.message);
    if (res.status != 200)
      return Internal(connector + ": HTTP " + std::to_string(res.status) + " " + res.body);
    ECX_ASSIGN_OR_RETURN(Answer a, parse_answer(res.body));
    out.push_back(std::move(a));
  }
  return out;
}

// Prints one connector's line; returns whether every answer was correct.
bool report(const std::string& connector, const std::vector<Answer>& got,
            const std::vector<Answer>& reference) {
  const size_t n = got.size();
  size_t same = 0, correct = 0, recomputed_items = 0, checksums_same = 0;
  for (size_t i = 0; i < n; ++i) {
    bool identical = got[i].text == reference[i].text;
    same += identical;
    correct += identical && got[i].recomputed == 0;
    recomputed_items += static_cast<size_t>(got[i].recomputed);
    checksums_same += got[i].checksums == reference[i].checksums;
  }
  std::printf(
      "%-15s %zu/%zu answers identical to local (%.3f); correct %zu/%zu (%.3f: "
      "identical, nothing recomputed; %zu items recomputed); embedding checksums "
      "match in %zu/%zu\n",
      connector.c_str(), same, n, static_cast<double>(same) / n, correct, n,
      static_cast<double>(correct) / n, recomputed_items, checksums_same, n);
  return correct == n && checksums_same == n;
}

int run_eval(const EvalOptions& o) {
  auto dir = std::filesystem::temp_directory_path() / ("ecx-eval-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto requests = eval_requests();
  if (o.requests > 0 && static_cast<size_t>(o.requests) < requests.size()) {
    requests.resize(static_cast<size_t>(o.requests));
  }
  size_t images = 0;
  for (const auto& r : requests) images += r.images.size();
  std::printf(
      "ecx eval: %zu fixed requests, %zu images (0-4 per request: square, tiny, wide, "
      "tall, 1920x1080, repeated), %d tokens, greedy; reference: local (PD encodes)\n",
      requests.size(), images, o.max_tokens);
  std::optional<RedisForBench> redis;
  if (o.connectors.find("store") != std::string::npos) {
    auto r = RedisForBench::ensure(o.redis, dir);
    if (r.ok()) {
      if (r->started_here())
        std::printf("(no Redis at %s: started one at %s)\n", o.redis.c_str(), r->address().c_str());
      redis.emplace(std::move(*r));
    } else {
      std::printf("store: %s\n", r.status().to_string().c_str());
    }
  }
  const std::string redis_address = redis ? redis->address() : o.redis;
  int bad = 0;
  auto reference = answers(o, requests, "local", redis_address, dir);
  if (!reference.ok()) {
    std::printf("local: %s\n", reference.status().to_string().c_str());
    return 1;
  }
  std::stringstream ss(o.connectors);
  std::string c;
  while (std::getline(ss, c, ',')) {
    if (c.empty()) continue;
    auto got = answers(o, requests, c, redis_address, dir);
    if (!got.ok()) {
      std::printf("%-15s failed: %s\n", c.c_str(), got.status().to_string().c_str());
      bad++;
      continue;
    }
    if (!report(c, *got, *reference)) bad++;
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
  s->add_option("--requests", o->requests, "The first N of the 60 fixed requests (0: all)")
      ->capture_default_str();
  s->add_option("--max-tokens", o->max_tokens, "Tokens per answer")->capture_default_str();
  s->add_option("--redis", o->redis,
                "Redis for the store connector (one is started when none answers there)")
      ->capture_default_str();
  s->callback([o, exit_code] { *exit_code = run_eval(*o); });
}

}  // namespace ecx::bench
