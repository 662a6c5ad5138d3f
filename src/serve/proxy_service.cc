// The proxy: the OpenAI-compatible front. Sends a request's images to encode
// instances concurrently (rendezvous hashing on the image bytes, so a repeated image
// lands on the E that has it cached), merges their ec_transfer_params into the request,
// forwards it to the least-loaded PD and streams the answer back.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "ecx/common/checksum.h"
#include "ecx/common/log.h"
#include "ecx/engine/image.h"
#include "serve/http_util.h"

namespace ecx::serve {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

struct Upstream {
  std::string url;
  std::string host;
  int port = 0;
  std::atomic<int> in_flight{0};
};

struct EncodeResult {
  int http_status = 0;  // 200 on success; 0 = E unreachable
  bool timed_out = false;
  json body;
  std::string error;
  double ms = 0;
};

EncodeResult call_encoder(const Upstream& e, const std::string& data_url, int64_t timeout_ms) {
  EncodeResult r;
  auto t0 = Clock::now();
  httplib::Client cli(e.host, e.port);
  cli.set_connection_timeout(std::chrono::milliseconds(std::min<int64_t>(timeout_ms, 5000)));
  cli.set_read_timeout(std::chrono::milliseconds(timeout_ms));
  cli.set_write_timeout(std::chrono::milliseconds(timeout_ms));
  auto res = cli.Post("/v1/encode", json{{"image", data_url}}.dump(), "application/json");
  r.ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  if (!res) {
    r.timed_out = r.ms >= static_cast<double>(timeout_ms) * 0.95;
    r.error = "encoder " + e.url + ": " + httplib::to_string(res.error());
    return r;
  }
  r.http_status = res->status;
  r.body = json::parse(res->body, nullptr, false);
  if (res->status != 200) {
    r.error = r.body.is_object() && r.body.contains("error")
                  ? r.body["error"].value("message", res->body)
                  : res->body.substr(0, 500);
  }
  return r;
}

// Chunks of a streamed upstream response, handed from the fetching thread to ours.
struct StreamPipe {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::string> chunks;  // guarded by mu
  bool headers = false;            // guarded by mu
  bool done = false;               // guarded by mu
  int status = 0;                  // guarded by mu
  std::string error;               // guarded by mu
  bool reader_gone = false;        // guarded by mu
};

}  // namespace

int run_proxy_service(const ServiceConfig& config) {
  block_shutdown_signals();
  // Shared: a streaming fetch thread may outlive the handler that started it.
  std::vector<std::shared_ptr<Upstream>> encoders, pds;
  for (auto* list : {&config.encoders, &config.pd}) {
    for (const auto& url : *list) {
      auto hp = parse_url(url);
      if (!hp.ok()) {
        std::cerr << "ecx serve proxy: " << hp.status().message() << "\n";
        return 2;
      }
      auto u = std::make_shared<Upstream>();
      u->url = url;
      u->host = hp->first;
      u->port = hp->second;
      (list == &config.encoders ? encoders : pds).push_back(std::move(u));
    }
  }
  if (pds.empty()) {
    std::cerr << "ecx serve proxy: --pd needs at least one URL\n";
    return 2;
  }
  const bool use_encoders = config.connector != "local" && !encoders.empty();
  Metrics metrics;
  httplib::Server server;

  server.Post("/v1/chat/completions", [&](const httplib::Request& req, httplib::Response& res) {
    auto t0 = Clock::now();
    ChatRequest chat;
    if (auto err = parse_chat_request(req.body, config, &chat)) {
      metrics.add("ecx_proxy_failures_total", "reason=\"bad_request\"", 1);
      return send_error(res, err->http_status, err->type, err->message);
    }
    json forward = chat.raw;
    // 1. Encode every image on an E instance, concurrently; rewrite image URLs as data
    //    URLs so PD can decode images that came from local files.
    std::vector<std::future<EncodeResult>> pending;
    std::set<uint64_t> sent;  // each distinct image is encoded once per request
    size_t m = 0;
    for (const auto& msg : chat.messages) {
      size_t p = 0;
      for (const auto& part : msg.parts) {
        if (part.kind == ContentPart::kImage) {
          std::string data_url = part.image_url.rfind("data:", 0) == 0
                                     ? part.image_url
                                     : engine::make_data_url(part.image_bytes, "image/png");
          json& content = forward["messages"][m]["content"][p];
          content["image_url"] = {{"url", data_url}};
          uint64_t key = checksum64(part.image_bytes.data(), part.image_bytes.size());
          if (use_encoders && sent.insert(key).second) {
            // Rendezvous hashing: the E with the highest score for these bytes.
            Upstream* best = nullptr;
            uint64_t best_score = 0;
            for (const auto& e : encoders) {
              std::string s = e->url + "/" + std::to_string(key);
              uint64_t score = checksum64(s.data(), s.size());
              if (!best || score > best_score) best = e.get(), best_score = score;
            }
            int64_t timeout = config.encode_timeout_ms;
            pending.push_back(std::async(std::launch::async, [best, data_url, timeout] {
              return call_encoder(*best, data_url, timeout);
            }));
          }
        }
        ++p;
      }
      ++m;
    }
    // Only params from our encoders travel on: a client must not choose what PD reads.
    json params = json::object();
    double encode_ms = 0;
    for (auto& f : pending) {
      EncodeResult r = f.get();
      encode_ms = std::max(encode_ms, r.ms);
      if (r.http_status == 200 && r.body.is_object() && r.body.contains("mm_hash") &&
          r.body.contains("ec_transfer_params")) {
        params[r.body["mm_hash"].get<std::string>()] = r.body["ec_transfer_params"];
        continue;
      }
      // The client's fault (bad image) keeps its 4xx; an E failure is 502, a timeout 504.
      metrics.add("ecx_proxy_failures_total", "reason=\"encoder\"", 1);
      if (r.http_status == 400 || r.http_status == 413 || r.http_status == 422) {
        return send_error(res, r.http_status, "invalid_image", r.error);
      }
      if (r.timed_out) return send_error(res, 504, "encoder_timeout", r.error);
      return send_error(
          res, 502, "encoder_failed",
          r.error.empty() ? "encoder answered " + std::to_string(r.http_status) : r.error);
    }
    forward["ec_transfer_params"] = params;
    metrics.observe("ecx_proxy_encode_seconds", "", encode_ms / 1000);
    // 2. The least-loaded PD.
    std::shared_ptr<Upstream> pd = pds.front();
    for (const auto& u : pds) {
      if (u->in_flight.load() < pd->in_flight.load()) pd = u;
    }
    std::string body = forward.dump();
    if (!chat.stream) {
      pd->in_flight++;
      httplib::Client cli(pd->host, pd->port);
      cli.set_read_timeout(std::chrono::milliseconds(config.request_timeout_ms));
      cli.set_write_timeout(std::chrono::milliseconds(config.request_timeout_ms));
      auto t_pd = Clock::now();
      auto up = cli.Post("/v1/chat/completions", body, "application/json");
      pd->in_flight--;
      if (!up) {
        bool timeout =
            Clock::now() - t_pd >= std::chrono::milliseconds(config.request_timeout_ms * 95 / 100);
        metrics.add("ecx_proxy_failures_total", "reason=\"pd\"", 1);
        return send_error(res, timeout ? 504 : 502, timeout ? "pd_timeout" : "pd_failed",
                          "pd " + pd->url + ": " + httplib::to_string(up.error()));
      }
      json out = json::parse(up->body, nullptr, false);
      if (up->status == 200 && out.is_object()) {
        out["ecx_timings"]["proxy_encode_ms"] = encode_ms;
        out["ecx_timings"]["proxy_total_ms"] =
            std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        res.set_content(safe_dump(out), "application/json");
      } else {
        res.status = up->status;
        res.set_content(up->body, "application/json");
      }
      metrics.add("ecx_proxy_requests_total", "status=\"" + std::to_string(res.status) + "\"", 1);
      return;
    }
    // Streaming: fetch on a helper thread; answer with PD's status if it is an error,
    // else relay the SSE stream chunk by chunk.
    auto pipe = std::make_shared<StreamPipe>();
    pd->in_flight++;
    std::string host = pd->host;
    int port = pd->port;
    int64_t timeout_ms = config.request_timeout_ms;
    std::thread([pipe, host, port, body, timeout_ms, pd] {
      httplib::Client cli(host, port);
      cli.set_read_timeout(std::chrono::milliseconds(timeout_ms));
      httplib::Request r;
      r.method = "POST";
      r.path = "/v1/chat/completions";
      r.body = body;
      r.set_header("Content-Type", "application/json");
      r.response_handler = [pipe](const httplib::Response& resp) {
        std::lock_guard lock(pipe->mu);
        pipe->status = resp.status;
        pipe->headers = true;
        pipe->cv.notify_all();
        return true;
      };
      r.content_receiver = [pipe](const char* data, size_t n, uint64_t, uint64_t) {
        std::lock_guard lock(pipe->mu);
        if (pipe->reader_gone) return false;
        pipe->chunks.emplace_back(data, n);
        pipe->cv.notify_all();
        return true;
      };
      auto result = cli.send(r);
      std::lock_guard lock(pipe->mu);
      if (!result && pipe->error.empty()) pipe->error = "pd: " + httplib::to_string(result.error());
      pipe->done = true;
      pd->in_flight--;
      pipe->cv.notify_all();
    }).detach();
    {
      std::unique_lock lock(pipe->mu);
      bool ok = pipe->cv.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                                  [&] { return pipe->headers || pipe->done; });
      if (!ok || !pipe->headers) {
        pipe->reader_gone = true;
        metrics.add("ecx_proxy_failures_total", "reason=\"pd\"", 1);
        return send_error(res, ok ? 502 : 504, ok ? "pd_failed" : "pd_timeout",
                          pipe->error.empty() ? "pd did not answer" : pipe->error);
      }
      if (pipe->status != 200) {
        pipe->cv.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return pipe->done; });
        std::string all;
        for (auto& c : pipe->chunks) all += c;
        res.status = pipe->status;
        res.set_content(all, "application/json");
        return;
      }
    }
    metrics.add("ecx_proxy_requests_total", "status=\"200\"", 1);
    res.set_chunked_content_provider(
        "text/event-stream",
        [pipe, timeout_ms](size_t, httplib::DataSink& sink) {
          std::unique_lock lock(pipe->mu);
          while (true) {
            if (!pipe->cv.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                                   [&] { return !pipe->chunks.empty() || pipe->done; })) {
              pipe->reader_gone = true;
              return false;  // upstream stalled past the deadline
            }
            while (!pipe->chunks.empty()) {
              std::string c = std::move(pipe->chunks.front());
              pipe->chunks.pop_front();
              lock.unlock();
              bool ok = sink.write(c.data(), c.size());
              lock.lock();
              if (!ok) {
                pipe->reader_gone = true;
                return false;
              }
            }
            if (pipe->done) {
              if (!pipe->error.empty()) {
                // PD failed mid-stream: say so instead of ending as if complete.
                std::string err =
                    "data: " +
                    safe_dump(nlohmann::json{
                        {"error", {{"message", pipe->error}, {"type", "pd_failed"}}}}) +
                    "\n\n";
                lock.unlock();
                sink.write(err.data(), err.size());
                return false;
              }
              sink.done();
              return true;
            }
          }
        },
        [pipe](bool) {
          std::lock_guard lock(pipe->mu);
          pipe->reader_gone = true;
        });
  });
  add_common_routes(server, config, "proxy", [&] { return metrics.render("ecx proxy"); });
  return serve_until_signal(server, config, "proxy");
}

}  // namespace ecx::serve
