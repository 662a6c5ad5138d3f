// The proxy: the OpenAI-compatible front. Sends a request's images to encode
// instances concurrently (rendezvous hashing on the image bytes, so a repeated image
// lands on the E that has it cached), merges their ec_transfer_params into the request,
// forwards it to the least-loaded PD and streams the answer back.
//
// Availability: a prober keeps a reachable flag per upstream (serve/upstream.h). An
// image whose encoder fails goes to the next live encoder; when none can encode it,
// the request goes to the PD without params for it and the PD encodes it itself. A PD
// that refuses the connection is skipped for the next one. /health reads the flags only.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <future>
#include <mutex>
#include <set>
#include <thread>

#include "ecx/common/checksum.h"
#include "ecx/common/log.h"
#include "ecx/engine/image.h"
#include "serve/http_util.h"
#include "serve/upstream.h"

namespace ecx::serve {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
using UpstreamList = std::vector<std::shared_ptr<Upstream>>;

// Bounds the TCP connect to a PD (the library's default is 300 s).
constexpr std::chrono::milliseconds kPdConnectTimeout{3000};

bool connect_failed(httplib::Error e) {
  return e == httplib::Error::Connection || e == httplib::Error::ConnectionTimeout;
}

double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

struct EncodeResult {
  int http_status = 0;  // 200 on success; 0 = no HTTP answer (see transport)
  httplib::Error transport = httplib::Error::Success;
  bool timed_out = false;
  json body;
  std::string error;
};

EncodeResult call_encoder(Upstream& e, const std::string& data_url, int64_t timeout_ms) {
  EncodeResult r;
  auto t0 = Clock::now();
  httplib::Client cli(e.host, e.port);
  cli.set_connection_timeout(std::chrono::milliseconds(std::min<int64_t>(timeout_ms, 5000)));
  cli.set_read_timeout(std::chrono::milliseconds(timeout_ms));
  cli.set_write_timeout(std::chrono::milliseconds(timeout_ms));
  e.in_flight++;
  auto res = cli.Post("/v1/encode", json{{"image", data_url}}.dump(), "application/json");
  e.in_flight--;
  if (!res) {
    r.transport = res.error();
    r.timed_out = ms_since(t0) >= static_cast<double>(timeout_ms) * 0.95;
    r.error = "encoder " + e.url + ": " + httplib::to_string(res.error());
    if (connect_failed(r.transport)) e.mark_down(httplib::to_string(r.transport));
    return r;
  }
  r.http_status = res->status;
  r.body = json::parse(res->body, nullptr, false);
  if (res->status != 200) {
    r.error = "encoder " + e.url + " answered " + std::to_string(res->status) + ": " +
              (r.body.is_object() && r.body.contains("error") && r.body["error"].is_object()
                   ? r.body["error"].value("message", res->body)
                   : res->body.substr(0, 500));
  }
  return r;
}

bool is_client_error(int http_status) {
  return http_status == 400 || http_status == 413 || http_status == 422;
}

// What encoding one image came to.
struct ImageEncode {
  enum Outcome { kEncoded, kClientError, kFallback } outcome = kFallback;
  EncodeResult result;       // the encoder's answer (kEncoded, kClientError)
  std::string why;           // kFallback: the last failure
  std::string reason_label;  // kFallback: no_live_encoder | encoder_failed | timeout
  int failed_attempts = 0;
  double ms = 0;
};

// The live encoders for an image, best first: rendezvous hashing, so the same bytes
// reach the same encoder while it lives, and the next-best one when it does not.
UpstreamList encoder_order(const UpstreamList& encoders, uint64_t key) {
  std::vector<std::pair<uint64_t, std::shared_ptr<Upstream>>> scored;
  for (const auto& e : encoders) {
    if (!e->reachable()) continue;
    std::string s = e->url + "/" + std::to_string(key);
    scored.emplace_back(checksum64(s.data(), s.size()), e);
  }
  std::sort(scored.begin(), scored.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  UpstreamList order;
  for (auto& [score, e] : scored) order.push_back(std::move(e));
  return order;
}

// Tries the live encoders in order until one encodes the image, all within one
// encode deadline. A client error (bad image) ends the search: another encoder would
// say the same.
ImageEncode encode_with_failover(const UpstreamList& order, const std::string& data_url,
                                 int64_t timeout_ms) {
  ImageEncode out;
  auto t0 = Clock::now();
  Deadline deadline = Deadline::after_ms(timeout_ms);
  out.why = "no reachable encoder";
  out.reason_label = "no_live_encoder";
  for (const auto& e : order) {
    int64_t left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline.remaining()).count();
    if (left <= 0) {
      out.reason_label = "timeout";
      break;
    }
    EncodeResult r = call_encoder(*e, data_url, left);
    if (r.http_status == 200 && r.body.is_object() && r.body.contains("mm_hash") &&
        r.body["mm_hash"].is_string() && r.body.contains("ec_transfer_params")) {
      out.outcome = ImageEncode::kEncoded;
      out.result = std::move(r);
      break;
    }
    if (is_client_error(r.http_status)) {
      out.outcome = ImageEncode::kClientError;
      out.result = std::move(r);
      break;
    }
    out.failed_attempts++;
    out.why = r.error.empty() ? "encoder " + e->url + ": malformed answer" : r.error;
    out.reason_label = r.timed_out ? "timeout" : "encoder_failed";
  }
  out.ms = ms_since(t0);
  return out;
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

// Fetches a streamed answer from the first PD of `order` that accepts the connection,
// into `pipe`. Runs on its own thread; owns everything it touches.
void fetch_stream(std::shared_ptr<StreamPipe> pipe, UpstreamList order, std::string body,
                  int64_t timeout_ms) {
  std::string errors;
  for (const auto& pd : order) {
    httplib::Client cli(pd->host, pd->port);
    cli.set_connection_timeout(kPdConnectTimeout);
    cli.set_read_timeout(std::chrono::milliseconds(timeout_ms));
    cli.set_write_timeout(std::chrono::milliseconds(timeout_ms));
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
    pd->in_flight++;
    auto result = cli.send(r);
    pd->in_flight--;
    if (!result && connect_failed(result.error())) {
      pd->mark_down(httplib::to_string(result.error()));
      errors += (errors.empty() ? "" : "; ") + pd->url + ": " + httplib::to_string(result.error());
      continue;  // nothing was sent: the next PD may take it
    }
    std::lock_guard lock(pipe->mu);
    if (!result && pipe->error.empty())
      pipe->error = "pd " + pd->url + ": " + httplib::to_string(result.error());
    pipe->done = true;
    pipe->cv.notify_all();
    return;
  }
  std::lock_guard lock(pipe->mu);
  pipe->error = "no PD could be reached (" + errors + ")";
  pipe->done = true;
  pipe->cv.notify_all();
}

class Proxy {
 public:
  Proxy(const ServiceConfig& config, UpstreamList encoders, UpstreamList pds)
      : config_(config),
        encoders_(std::move(encoders)),
        pds_(std::move(pds)),
        use_encoders_(config.connector != "local" && !encoders_.empty()) {}

  // The upstreams the prober watches: every PD, and the encoders when they are used.
  UpstreamList probed() const {
    UpstreamList all = pds_;
    if (use_encoders_) all.insert(all.end(), encoders_.begin(), encoders_.end());
    return all;
  }

  void handle_chat(const httplib::Request& req, httplib::Response& res);
  HealthReport health() const;
  std::string render_metrics();

 private:
  // Encodes every image of `chat` (concurrently), rewrites image URLs in `forward` as
  // data URLs, and puts the encoders' params in forward["ec_transfer_params"]. An
  // image no encoder could encode gets no params (the PD encodes it). Returns the
  // error to answer with, if the client sent a bad image.
  std::optional<RequestError> encode_images(const ChatRequest& chat, json& forward,
                                            double* encode_ms);
  // PDs to try, in order: the reachable ones by fewest requests in flight, then the
  // others (their flag may be stale; a refused connect costs little).
  UpstreamList pd_order() const;
  void forward_blocking(const std::string& body, Clock::time_point t0, double encode_ms,
                        httplib::Response& res);
  void forward_streaming(const std::string& body, httplib::Response& res);
  void count_answer(int http_status) {
    metrics_.add("ecx_proxy_requests_total", "status=\"" + std::to_string(http_status) + "\"", 1);
  }

  const ServiceConfig& config_;
  const UpstreamList encoders_;
  const UpstreamList pds_;
  const bool use_encoders_;
  Metrics metrics_;
};

std::optional<RequestError> Proxy::encode_images(const ChatRequest& chat, json& forward,
                                                 double* encode_ms) {
  std::vector<std::future<ImageEncode>> pending;
  std::set<uint64_t> sent;  // each distinct image is encoded once per request
  for (size_t m = 0; m < chat.messages.size(); ++m) {
    const auto& parts = chat.messages[m].parts;
    for (size_t p = 0; p < parts.size(); ++p) {
      const ContentPart& part = parts[p];
      if (part.kind != ContentPart::kImage) continue;
      // Data URLs, so PD can decode images that came from local files.
      std::string data_url = part.image_url.rfind("data:", 0) == 0
                                 ? part.image_url
                                 : engine::make_data_url(part.image_bytes, "image/png");
      forward["messages"][m]["content"][p]["image_url"] = {{"url", data_url}};
      uint64_t key = checksum64(part.image_bytes.data(), part.image_bytes.size());
      if (!use_encoders_ || !sent.insert(key).second) continue;
      pending.push_back(std::async(
          std::launch::async,
          [order = encoder_order(encoders_, key), data_url, timeout = config_.encode_timeout_ms] {
            return encode_with_failover(order, data_url, timeout);
          }));
    }
  }
  // Only params from our encoders travel on: a client must not choose what PD reads.
  json params = json::object();
  std::optional<RequestError> error;
  *encode_ms = 0;
  for (auto& f : pending) {
    ImageEncode r = f.get();
    *encode_ms = std::max(*encode_ms, r.ms);
    if (r.failed_attempts > 0)
      metrics_.add("ecx_proxy_encoder_errors_total", "", r.failed_attempts);
    switch (r.outcome) {
      case ImageEncode::kEncoded:
        params[r.result.body["mm_hash"].get<std::string>()] = r.result.body["ec_transfer_params"];
        break;
      case ImageEncode::kClientError:
        // The client's fault (bad image) keeps its 4xx.
        if (!error) error = RequestError{r.result.http_status, "invalid_image", r.result.error};
        break;
      case ImageEncode::kFallback:
        metrics_.add("ecx_proxy_encoder_fallbacks_total", "reason=\"" + r.reason_label + "\"", 1);
        spdlog::warn("event=encoder_fallback reason={} detail=\"{}\": the PD encodes the image",
                     r.reason_label, r.why);
        break;
    }
  }
  forward["ec_transfer_params"] = params;
  return error;
}

UpstreamList Proxy::pd_order() const {
  UpstreamList order = pds_;
  std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    if (a->reachable() != b->reachable()) return a->reachable();
    return a->in_flight.load() < b->in_flight.load();
  });
  return order;
}

void Proxy::handle_chat(const httplib::Request& req, httplib::Response& res) {
  auto t0 = Clock::now();
  ChatRequest chat;
  if (auto err = parse_chat_request(req.body, config_, &chat)) {
    metrics_.add("ecx_proxy_failures_total", "reason=\"bad_request\"", 1);
    return send_error(res, err->http_status, err->type, err->message);
  }
  json forward = chat.raw;
  double encode_ms = 0;
  if (auto err = encode_images(chat, forward, &encode_ms)) {
    metrics_.add("ecx_proxy_failures_total", "reason=\"invalid_image\"", 1);
    return send_error(res, err->http_status, err->type, err->message);
  }
  metrics_.observe("ecx_proxy_encode_seconds", "", encode_ms / 1000);
  std::string body = forward.dump();
  if (chat.stream) return forward_streaming(body, res);
  forward_blocking(body, t0, encode_ms, res);
}

void Proxy::forward_blocking(const std::string& body, Clock::time_point t0, double encode_ms,
                             httplib::Response& res) {
  std::string errors;
  for (const auto& pd : pd_order()) {
    httplib::Client cli(pd->host, pd->port);
    cli.set_connection_timeout(kPdConnectTimeout);
    cli.set_read_timeout(std::chrono::milliseconds(config_.request_timeout_ms));
    cli.set_write_timeout(std::chrono::milliseconds(config_.request_timeout_ms));
    auto t_pd = Clock::now();
    pd->in_flight++;
    auto up = cli.Post("/v1/chat/completions", body, "application/json");
    pd->in_flight--;
    if (!up && connect_failed(up.error())) {
      pd->mark_down(httplib::to_string(up.error()));
      errors += (errors.empty() ? "" : "; ") + pd->url + ": " + httplib::to_string(up.error());
      continue;  // nothing was sent: the next PD may take it
    }
    if (!up) {
      bool timeout = ms_since(t_pd) >= static_cast<double>(config_.request_timeout_ms) * 0.95;
      metrics_.add("ecx_proxy_failures_total", "reason=\"pd\"", 1);
      send_error(res, timeout ? 504 : 502, timeout ? "pd_timeout" : "pd_failed",
                 "pd " + pd->url + ": " + httplib::to_string(up.error()));
      return count_answer(res.status);
    }
    json out = json::parse(up->body, nullptr, false);
    if (up->status == 200 && out.is_object()) {
      out["ecx_timings"]["proxy_encode_ms"] = encode_ms;
      out["ecx_timings"]["proxy_total_ms"] = ms_since(t0);
      res.status = 200;  // set here, not by the library after we return: the metric needs it
      res.set_content(safe_dump(out), "application/json");
    } else {
      res.status = up->status;
      res.set_content(up->body, "application/json");
    }
    return count_answer(res.status);
  }
  metrics_.add("ecx_proxy_failures_total", "reason=\"no_pd\"", 1);
  send_error(res, 502, "pd_failed", "no PD could be reached (" + errors + ")");
  count_answer(res.status);
}

// Fetches on a helper thread; answers with PD's status if it is an error, else relays
// the SSE stream chunk by chunk.
void Proxy::forward_streaming(const std::string& body, httplib::Response& res) {
  auto pipe = std::make_shared<StreamPipe>();
  int64_t timeout_ms = config_.request_timeout_ms;
  std::thread(fetch_stream, pipe, pd_order(), body, timeout_ms).detach();
  {
    std::unique_lock lock(pipe->mu);
    bool ok = pipe->cv.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                                [&] { return pipe->headers || pipe->done; });
    if (!ok || !pipe->headers) {
      pipe->reader_gone = true;
      metrics_.add("ecx_proxy_failures_total", "reason=\"pd\"", 1);
      send_error(res, ok ? 502 : 504, ok ? "pd_failed" : "pd_timeout",
                 pipe->error.empty() ? "pd did not answer" : pipe->error);
      return count_answer(res.status);
    }
    if (pipe->status != 200) {
      pipe->cv.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return pipe->done; });
      std::string all;
      for (auto& c : pipe->chunks) all += c;
      res.status = pipe->status;
      res.set_content(all, "application/json");
      return count_answer(res.status);
    }
  }
  count_answer(200);
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
                  safe_dump(json{{"error", {{"message", pipe->error}, {"type", "pd_failed"}}}}) +
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
}

HealthReport Proxy::health() const {
  json upstreams = json::array();
  int pd_up = 0, encoders_up = 0;
  std::string pd_errors;
  auto describe = [&](const Upstream& u) {
    bool up = u.reachable();
    std::string error = u.last_error();
    upstreams.push_back(
        {{"role", u.role}, {"url", u.url}, {"reachable", up}, {"last_error", error}});
    return std::make_pair(up, error);
  };
  for (const auto& pd : pds_) {
    auto [up, error] = describe(*pd);
    pd_up += up;
    if (!up) pd_errors += (pd_errors.empty() ? "" : "; ") + pd->url + ": " + error;
  }
  if (use_encoders_) {
    for (const auto& e : encoders_) encoders_up += describe(*e).first;
  }
  json body = {{"role", "proxy"},
               {"pd_reachable", pd_up},
               {"pd_total", pds_.size()},
               {"encoders_reachable", encoders_up},
               {"encoders_total", use_encoders_ ? encoders_.size() : 0},
               {"upstreams", upstreams}};
  if (pd_up == 0) {
    body["status"] = "unavailable";
    body["reason"] = "no reachable PD (" + pd_errors + ")";
    return {503, body};
  }
  if (use_encoders_ && encoders_up == 0) {
    body["status"] = "degraded";
    body["reason"] = "no reachable encoder: PDs encode images themselves";
  } else {
    body["status"] = "ok";
  }
  return {200, body};
}

std::string Proxy::render_metrics() {
  for (const auto& list : {&pds_, &encoders_}) {
    for (const auto& u : *list) {
      metrics_.set("ecx_proxy_upstream_up", "role=\"" + u->role + "\",url=\"" + u->url + "\"",
                   u->reachable() ? 1 : 0);
    }
  }
  return metrics_.render("ecx proxy");
}

}  // namespace

int run_proxy_service(const ServiceConfig& config) {
  block_shutdown_signals();
  // Shared: a streaming fetch thread may outlive the handler that started it.
  UpstreamList encoders, pds;
  for (auto* list : {&config.encoders, &config.pd}) {
    bool is_pd = list == &config.pd;
    for (const auto& url : *list) {
      auto hp = parse_url(url);
      if (!hp.ok()) {
        std::cerr << "ecx serve proxy: " << hp.status().message() << "\n";
        return 2;
      }
      (is_pd ? pds : encoders)
          .push_back(
              std::make_shared<Upstream>(is_pd ? "pd" : "encoder", url, hp->first, hp->second));
    }
  }
  if (pds.empty()) {
    std::cerr << "ecx serve proxy: --pd needs at least one URL\n";
    return 2;
  }
  Proxy proxy(config, std::move(encoders), std::move(pds));
  // Probed once before listening, so /health is right from the first request; then
  // every 250 ms until the server has stopped (the prober is destroyed after it).
  UpstreamProber prober(proxy.probed(), UpstreamProber::Options{});
  prober.wait_first_round(Deadline::after_ms(2000));
  httplib::Server server;
  server.Post("/v1/chat/completions", [&](const httplib::Request& req, httplib::Response& res) {
    proxy.handle_chat(req, res);
  });
  add_common_routes(
      server, config, "proxy", [&] { return proxy.render_metrics(); },
      [&] { return proxy.health(); });
  return serve_until_signal(server, config, "proxy");
}

}  // namespace ecx::serve
