// The proxy: the OpenAI-compatible front. Sends a request's images to encode
// instances concurrently (rendezvous hashing on the image bytes, so a repeated image
// lands on the E that has it cached), merges their ec_transfer_params into the request,
// forwards it to the least-loaded PD and streams the answer back.
//
// Availability: a prober keeps a reachable flag per upstream (serve/upstream.h). An
// image whose encoder fails goes to the next live encoder; when none can encode it,
// the request goes to the PD without params for it and the PD encodes it itself. A PD
// that refuses the connection is skipped for the next one. /health reads the flags only.
//
// Membership: the upstreams are one snapshot (serve/upstream_set.h) that each request
// reads once. With --etcd, the encoders and PDs registered for the proxy's model join and
// leave it as etcd says (directory/membership.h), the prober following; GET /v1/upstreams
// lists them.
//
// Pins: every params an encoder issued pins its block there until the PD that reads it
// releases it. A request abandoned before a PD took it (no PD reachable, the PD
// answered an error, a bad image among its others) gives its params back to their
// encoders (encoder_client.h).
//
// --upstream-api vllm: each image goes to its encoder as the chat completion vLLM's EPD
// proxy sends, keyed by a uuid the PD's copy of the image carries too; the entries of the
// answer's ec_transfer_params travel to the PD unchanged. Everything else is the same.
#include <algorithm>
#include <chrono>
#include <future>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "ecx/common/checksum.h"
#include "ecx/common/json_reader.h"
#include "ecx/common/log.h"
#include "ecx/common/mm_hash.h"
#include "ecx/directory/membership.h"
#include "ecx/engine/image.h"
#include "ecx/engine/model.h"
#include "serve/encoder_client.h"
#include "serve/http_server.h"
#include "serve/metrics.h"
#include "serve/openai_request.h"
#include "serve/upstream.h"
#include "serve/upstream_set.h"

namespace ecx::serve {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

// Bounds the TCP connect to a PD (the library's default is 300 s).
constexpr std::chrono::milliseconds kPdConnectTimeout{3000};
// Bounds each call that gives params back to an encoder.
constexpr std::chrono::milliseconds kReleaseTimeout{2000};
// Bounds each call to etcd, and how long start-up waits for the first read of members.
constexpr std::chrono::milliseconds kEtcdTimeout{2000};
constexpr std::chrono::milliseconds kEtcdSyncWait{3000};

bool connect_failed(httplib::Error e) {
  return e == httplib::Error::Connection || e == httplib::Error::ConnectionTimeout;
}

double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

// A streamed answer on its way from a PD to the client, on one proxy worker: the PD's
// status decides whether the client gets a stream (200) or the PD's error as is.
struct StreamRelay {
  HttpResponse& res;
  int status = 0;                  // the PD's
  StreamWriter* writer = nullptr;  // once the PD answered 200
  std::string error_body;          // the PD's answer when it was not 200
  bool client_gone = false;        // the client closed its connection mid-stream
};

// A streamed POST of `body` whose answer goes through `relay`.
httplib::Request stream_request(StreamRelay& relay, const std::string& body) {
  httplib::Request r;
  r.method = "POST";
  r.path = "/v1/chat/completions";
  r.body = body;
  r.set_header("Content-Type", "application/json");
  r.response_handler = [&relay](const httplib::Response& resp) {
    relay.status = resp.status;
    if (resp.status == 200) relay.writer = &relay.res.start_stream("text/event-stream");
    return true;
  };
  r.content_receiver = [&relay](const char* data, size_t n, uint64_t, uint64_t) {
    if (relay.writer == nullptr) {
      relay.error_body.append(data, n);
      return true;
    }
    // A client gone: stop reading, which closes the PD's connection and so stops it too.
    relay.client_gone = !relay.writer->write(std::string_view(data, n));
    return !relay.client_gone;
  };
  return r;
}

// What encoding a request's images came to.
struct EncodedImages {
  json params = json::object();       // ec_transfer_params for the PD: {mm_hash: params}
  IssuedParams issued;                // the same params, by the encoder that issued them
  std::optional<RequestError> error;  // the client sent a bad image
  double ms = 0;                      // the slowest image
};

class Proxy {
 public:
  Proxy(const ProxyServiceConfig& config, UpstreamList encoders, UpstreamList pds)
      : config_(config),
        upstreams_(std::move(encoders), std::move(pds)),
        use_encoders_(config.connector != "local"),
        releaser_(kReleaseTimeout,
                  [this](int n) { metrics_.add("ecx_proxy_params_released_total", "", n); }) {}

  // The upstreams the prober watches: every PD, and the encoders when they are used.
  UpstreamList probed() const {
    auto members = upstreams_.snapshot();
    UpstreamList all = members->pds;
    if (use_encoders_) all.insert(all.end(), members->encoders.begin(), members->encoders.end());
    return all;
  }
  // The instances registered in etcd now (all of them, each time); logged and counted.
  // True when the members changed.
  bool apply_membership(const std::vector<directory::Instance>& instances);

  void handle_chat(const HttpRequest& req, HttpResponse& res);
  HealthReport health() const;
  std::string render_metrics();
  // GET /v1/upstreams: {"upstreams": [{url, role, source, reachable, in_flight, last_error}]}.
  std::string upstreams_json() const;

 private:
  // Encodes every image of `chat` (concurrently) on `encoders` and rewrites its image
  // URLs in `forward` as data URLs. An image no encoder could encode gets no params (the
  // PD encodes it).
  EncodedImages encode_images(const ChatRequest& chat, const UpstreamList& encoders, json& forward);
  // Sends each distinct image of `chat` to its encoders, once.
  std::vector<std::future<ImageEncode>> start_encodes(const ChatRequest& chat,
                                                      const UpstreamList& encoders, json& forward);
  // What to ask an encoder for the image part `forward_part` (whose URL is `data_url`);
  // in vllm mode it gives the part its uuid.
  EncodeCall encode_call(const ChatRequest& chat, const ContentPart& part, std::string data_url,
                         json& forward_part) const;
  // PDs to try, in order: the reachable ones by fewest requests in flight, then the
  // others (their flag may be stale; a refused connect costs little).
  static UpstreamList pd_order(const UpstreamList& pds);
  // Each answers the client; true when a PD of `pds` took the request (answered 2xx).
  bool forward_blocking(const UpstreamList& pds, const std::string& body, Clock::time_point t0,
                        double encode_ms, HttpResponse& res);
  bool forward_streaming(const UpstreamList& pds, const std::string& body, HttpResponse& res);
  // No PD of `pds` took the request: 502 naming what was tried.
  void answer_no_pd(const UpstreamList& pds, const std::string& errors, HttpResponse& res);
  // After the PD's stream ended: counts it, or answers the client the PD's failure.
  bool finish_stream(StreamRelay& relay, httplib::Error error, const Upstream& pd, double pd_ms);
  void count_answer(int http_status) {
    metrics_.add("ecx_proxy_requests_total", "status=\"" + std::to_string(http_status) + "\"", 1);
  }

  const ProxyServiceConfig& config_;
  UpstreamSet upstreams_;
  const bool use_encoders_;  // false with --connector local: the PDs encode
  Metrics metrics_;
  ParamsReleaser releaser_;  // counts into metrics_: declared after it
};

std::vector<std::future<ImageEncode>> Proxy::start_encodes(const ChatRequest& chat,
                                                           const UpstreamList& encoders,
                                                           json& forward) {
  std::vector<std::future<ImageEncode>> pending;
  std::set<std::pair<uint64_t, std::string>> sent;  // each distinct image once per request
  for (size_t m = 0; m < chat.messages.size(); ++m) {
    const auto& parts = chat.messages[m].parts;
    for (size_t p = 0; p < parts.size(); ++p) {
      const ContentPart& part = parts[p];
      if (part.kind != ContentPart::kImage) continue;
      // Data URLs, so PD can decode images that came from local files.
      std::string data_url = part.image_url.rfind("data:", 0) == 0
                                 ? part.image_url
                                 : engine::make_data_url(part.image_bytes, "image/png");
      json& forward_part = forward["messages"][m]["content"][p];
      forward_part["image_url"] = {{"url", data_url}};
      EncodeCall call = encode_call(chat, part, std::move(data_url), forward_part);
      uint64_t key = checksum64(part.image_bytes.data(), part.image_bytes.size());
      // (In vllm mode an image is its bytes and its uuid: E must see each uuid the PD does.)
      if (!use_encoders_ || encoders.empty() || !sent.emplace(key, call.uuid).second) continue;
      pending.push_back(std::async(std::launch::async,
                                   [order = encoder_order(encoders, key), call = std::move(call),
                                    timeout = config_.encode_timeout_ms] {
                                     return encode_with_failover(order, call, timeout);
                                   }));
    }
  }
  return pending;
}

EncodeCall Proxy::encode_call(const ChatRequest& chat, const ContentPart& part,
                              std::string data_url, json& forward_part) const {
  EncodeCall call{config_.upstream_api, std::move(data_url), "", ""};
  if (call.api != UpstreamApi::kVllm) return call;
  // vLLM keys an item by its uuid when it has one: E and PD must see the same.
  auto own = forward_part.find("uuid");
  call.uuid = own != forward_part.end() && own->is_string()
                  ? own->get<std::string>()
                  : MmHash::sha256_of({"image", part.image_bytes}).str();
  forward_part["uuid"] = call.uuid;
  call.model = chat.model;
  return call;
}

EncodedImages Proxy::encode_images(const ChatRequest& chat, const UpstreamList& encoders,
                                   json& forward) {
  EncodedImages out;
  for (auto& f : start_encodes(chat, encoders, forward)) {
    ImageEncode r = f.get();
    out.ms = std::max(out.ms, r.ms);
    if (r.failed_attempts > 0)
      metrics_.add("ecx_proxy_encoder_errors_total", "", r.failed_attempts);
    switch (r.outcome) {
      case ImageEncode::kEncoded:
        if (r.result.mm_hash.empty()) break;  // the encoder handed nothing over
        out.params[r.result.mm_hash] = r.result.params;
        out.issued[r.encoder][r.result.mm_hash] = r.result.params;
        break;
      case ImageEncode::kClientError:
        // The client's fault (bad image) keeps its 4xx.
        if (!out.error)
          out.error = RequestError{r.result.http_status, "invalid_image", r.result.error};
        break;
      case ImageEncode::kFallback:
        metrics_.add("ecx_proxy_encoder_fallbacks_total", "reason=\"" + r.reason_label + "\"", 1);
        spdlog::warn("event=encoder_fallback reason={} detail=\"{}\": the PD encodes the image",
                     r.reason_label, r.why);
        break;
    }
  }
  // Only params from our encoders travel on: a client must not choose what PD reads.
  forward["ec_transfer_params"] = out.params;
  return out;
}

UpstreamList Proxy::pd_order(const UpstreamList& pds) {
  UpstreamList order = pds;
  std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    if (a->reachable() != b->reachable()) return a->reachable();
    return a->in_flight.load() < b->in_flight.load();
  });
  return order;
}

void Proxy::handle_chat(const HttpRequest& req, HttpResponse& res) {
  auto t0 = Clock::now();
  ChatRequest chat;
  if (auto err = parse_chat_request(req.body, config_.common, &chat)) {
    metrics_.add("ecx_proxy_failures_total", "reason=\"bad_request\"", 1);
    return send_error(res, *err);
  }
  // One view of the members for the whole request.
  std::shared_ptr<const UpstreamMembers> members = upstreams_.snapshot();
  json forward = chat.raw;
  EncodedImages encoded = encode_images(chat, members->encoders, forward);
  if (encoded.error) {
    releaser_.release(encoded.issued);  // the images that did encode
    metrics_.add("ecx_proxy_failures_total", "reason=\"invalid_image\"", 1);
    return send_error(res, *encoded.error);
  }
  metrics_.observe("ecx_proxy_encode_seconds", "", encoded.ms / 1000);
  std::string body = safe_dump(forward);
  bool taken = chat.stream ? forward_streaming(members->pds, body, res)
                           : forward_blocking(members->pds, body, t0, encoded.ms, res);
  // Abandoned between E and PD: no PD will read these params.
  if (!taken) releaser_.release(encoded.issued);
}

void Proxy::answer_no_pd(const UpstreamList& pds, const std::string& errors, HttpResponse& res) {
  metrics_.add("ecx_proxy_failures_total", "reason=\"no_pd\"", 1);
  send_error(res, 502, "pd_failed",
             pds.empty() ? std::string("no PD is known (none given, none registered in etcd)")
                         : "no PD could be reached (" + errors + ")");
  count_answer(res.status);
}

bool Proxy::forward_blocking(const UpstreamList& pds, const std::string& body, Clock::time_point t0,
                             double encode_ms, HttpResponse& res) {
  std::string errors;
  for (const auto& pd : pd_order(pds)) {
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
      count_answer(res.status);
      return false;
    }
    auto out = parse_json_object(up->body, "pd answer");
    if (up->status == 200 && out.ok()) {
      (*out)["ecx_timings"]["proxy_encode_ms"] = encode_ms;
      (*out)["ecx_timings"]["proxy_total_ms"] = ms_since(t0);
      res.status = 200;  // set here, not by the library after we return: the metric needs it
      res.set_content(safe_dump(*out), "application/json");
    } else {
      res.status = up->status;
      res.set_content(up->body, "application/json");
    }
    count_answer(res.status);
    return up->status >= 200 && up->status < 300;
  }
  answer_no_pd(pds, errors, res);
  return false;
}

// Relays the PD's SSE stream chunk by chunk as it comes (no helper thread), or the PD's
// error as it answered it.
bool Proxy::forward_streaming(const UpstreamList& pds, const std::string& body, HttpResponse& res) {
  std::string errors;
  for (const auto& pd : pd_order(pds)) {
    httplib::Client cli(pd->host, pd->port);
    cli.set_connection_timeout(kPdConnectTimeout);
    cli.set_read_timeout(std::chrono::milliseconds(config_.request_timeout_ms));
    cli.set_write_timeout(std::chrono::milliseconds(config_.request_timeout_ms));
    StreamRelay relay{res};
    auto t_pd = Clock::now();
    pd->in_flight++;
    auto result = cli.send(stream_request(relay, body));
    pd->in_flight--;
    if (!result && relay.status == 0 && connect_failed(result.error())) {
      pd->mark_down(httplib::to_string(result.error()));
      errors += (errors.empty() ? "" : "; ") + pd->url + ": " + httplib::to_string(result.error());
      continue;  // nothing was sent: the next PD may take it
    }
    return finish_stream(relay, result.error(), *pd, ms_since(t_pd));
  }
  answer_no_pd(pds, errors, res);
  return false;
}

bool Proxy::finish_stream(StreamRelay& relay, httplib::Error error, const Upstream& pd,
                          double pd_ms) {
  if (relay.writer != nullptr) {  // the client has its stream
    count_answer(200);
    if (relay.client_gone) {
      metrics_.add("ecx_proxy_client_disconnects_total", "", 1);
    } else if (error != httplib::Error::Success) {
      // PD failed mid-stream: say so instead of ending as if complete.
      std::string message = "pd " + pd.url + ": " + httplib::to_string(error);
      relay.writer->write(
          "data: " + safe_dump(json{{"error", {{"message", message}, {"type", "pd_failed"}}}}) +
          "\n\n");
    }
    return true;
  }
  if (relay.status != 0 && error == httplib::Error::Success) {  // the PD's own error answer
    relay.res.status = relay.status;
    relay.res.set_content(relay.error_body, "application/json");
    count_answer(relay.status);
    return false;
  }
  bool timeout = pd_ms >= static_cast<double>(config_.request_timeout_ms) * 0.95;
  metrics_.add("ecx_proxy_failures_total", "reason=\"pd\"", 1);
  send_error(relay.res, timeout ? 504 : 502, timeout ? "pd_timeout" : "pd_failed",
             "pd " + pd.url + ": " + httplib::to_string(error));
  count_answer(relay.res.status);
  return false;
}

HealthReport Proxy::health() const {
  auto members = upstreams_.snapshot();
  const UpstreamList& pds = members->pds;
  const UpstreamList& encoders = members->encoders;
  bool use_encoders = use_encoders_ && !encoders.empty();
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
  for (const auto& pd : pds) {
    auto [up, error] = describe(*pd);
    pd_up += up;
    if (!up) pd_errors += (pd_errors.empty() ? "" : "; ") + pd->url + ": " + error;
  }
  if (use_encoders) {
    for (const auto& e : encoders) encoders_up += describe(*e).first;
  }
  json body = {{"role", "proxy"},
               {"pd_reachable", pd_up},
               {"pd_total", pds.size()},
               {"encoders_reachable", encoders_up},
               {"encoders_total", use_encoders ? encoders.size() : 0},
               {"upstreams", upstreams}};
  if (pd_up == 0) {
    body["status"] = "unavailable";
    body["reason"] = pds.empty() ? std::string("no PD is known (none registered in etcd yet)")
                                 : "no reachable PD (" + pd_errors + ")";
    return {503, body};
  }
  if (use_encoders && encoders_up == 0) {
    body["status"] = "degraded";
    body["reason"] = "no reachable encoder: PDs encode images themselves";
  } else {
    body["status"] = "ok";
  }
  return {200, body};
}

bool Proxy::apply_membership(const std::vector<directory::Instance>& instances) {
  MembershipChange change = upstreams_.set_discovered(instances);
  for (const auto& [list, what] :
       {std::pair<const UpstreamList*, const char*>{&change.added, "added"},
        std::pair<const UpstreamList*, const char*>{&change.removed, "removed"}}) {
    for (const auto& u : *list) {
      spdlog::info("event=upstream_{} role={} url={} source={}", what, u->role, u->url, u->source);
      metrics_.add("ecx_proxy_membership_changes_total",
                   "role=\"" + u->role + "\",change=\"" + what + "\"", 1);
    }
  }
  if (!change.empty()) {
    auto members = upstreams_.snapshot();
    spdlog::info("event=membership encoders={} pds={}", members->encoders.size(),
                 members->pds.size());
  }
  return !change.empty();
}

std::string Proxy::render_metrics() {
  // The members now, rendered here (not kept in metrics_): one that left leaves no series.
  auto members = upstreams_.snapshot();
  std::string out = metrics_.render("ecx proxy");
  out += "# HELP ecx_proxy_upstreams upstreams the proxy routes over now, by role\n";
  out += "# TYPE ecx_proxy_upstreams gauge\n";
  out += "ecx_proxy_upstreams{role=\"encoder\"} " + std::to_string(members->encoders.size()) + "\n";
  out += "ecx_proxy_upstreams{role=\"pd\"} " + std::to_string(members->pds.size()) + "\n";
  out += "# HELP ecx_proxy_upstream_up 1 when the upstream is reachable\n";
  out += "# TYPE ecx_proxy_upstream_up gauge\n";
  for (const auto* list : {&members->pds, &members->encoders}) {
    for (const auto& u : *list) {
      out += "ecx_proxy_upstream_up{role=\"" + u->role + "\",url=\"" + u->url + "\"} " +
             (u->reachable() ? "1" : "0") + "\n";
    }
  }
  return out;
}

std::string Proxy::upstreams_json() const {
  auto members = upstreams_.snapshot();
  json list = json::array();
  for (const auto* role : {&members->encoders, &members->pds}) {
    for (const auto& u : *role) {
      list.push_back({{"url", u->url},
                      {"role", u->role},
                      {"source", u->source},
                      {"reachable", u->reachable()},
                      {"in_flight", u->in_flight.load()},
                      {"last_error", u->last_error()}});
    }
  }
  return safe_dump(json{{"upstreams", list}});
}

// One Upstream per URL. Shared: a streaming fetch thread may outlive the handler that
// started it.
Result<UpstreamList> make_upstreams(const std::vector<std::string>& urls, const std::string& role) {
  UpstreamList out;
  for (const auto& url : urls) {
    ECX_ASSIGN_OR_RETURN(auto host_port, parse_url(url));
    out.push_back(std::make_shared<Upstream>(role, url, host_port.first, host_port.second));
  }
  return out;
}

// The instances of the proxy's model registered in etcd, followed into `proxy` and
// `prober` from the first read on (waited for, at most kEtcdSyncWait: without etcd the
// proxy starts with its static upstreams and takes the others when etcd answers).
std::unique_ptr<directory::MembershipWatcher> watch_membership(const ProxyServiceConfig& config,
                                                               directory::EtcdClient etcd,
                                                               Proxy& proxy,
                                                               UpstreamProber& prober) {
  directory::MembershipOptions options;
  options.root = config.directory.etcd_prefix;
  options.model = config.common.model;
  options.compat_hash = config.compat_hash;
  if (options.compat_hash.empty()) {
    engine::ModelConfig reference;
    reference.model_id = config.common.model;
    options.compat_hash = reference.compat_hash();
  }
  spdlog::info("event=watching prefix={} compat_hash={} etcd={}",
               directory::instances_prefix(options.root, options.model), options.compat_hash,
               config.directory.etcd);
  auto watcher = std::make_unique<directory::MembershipWatcher>(
      std::move(etcd), options, [&proxy, &prober](const std::vector<directory::Instance>& all) {
        if (proxy.apply_membership(all)) prober.update(proxy.probed());
      });
  if (!watcher->wait_synced(Deadline::after(kEtcdSyncWait))) {
    spdlog::warn(
        "event=etcd_unreachable etcd={}: serving with the static upstreams until it "
        "answers",
        config.directory.etcd);
  }
  return watcher;
}

}  // namespace

int run_proxy_service(const ProxyServiceConfig& config) {
  block_shutdown_signals();
  set_log_level(config.common.log_level).ignore_error();
  auto encoders = make_upstreams(config.encoders, "encoder");
  auto pds = make_upstreams(config.pd, "pd");
  if (!encoders.ok() || !pds.ok()) {
    std::cerr << "ecx serve proxy: " << (encoders.ok() ? pds.status() : encoders.status()).message()
              << "\n";
    return 2;
  }
  if (pds->empty() && config.directory.etcd.empty()) {
    std::cerr << "ecx serve proxy: --pd needs at least one URL (or --etcd, to find PDs there)\n";
    return 2;
  }
  std::optional<directory::EtcdClient> etcd;
  if (!config.directory.etcd.empty()) {
    auto client = directory::EtcdClient::create(config.directory.etcd, kEtcdTimeout);
    if (!client.ok()) {
      std::cerr << "ecx serve proxy: --etcd: " << client.status().message() << "\n";
      return 2;
    }
    etcd.emplace(std::move(*client));
  }
  Proxy proxy(config, std::move(*encoders), std::move(*pds));
  // Probed every 250 ms until the server has stopped (the prober is destroyed after it),
  // following membership.
  UpstreamProber prober(proxy.probed(), UpstreamProber::Options{});
  // Workers mostly wait on E and PD: many, so the queue, not the pool, is the bound.
  HttpServer server(config.common, "proxy", 64);
  server.work("POST", "/v1/chat/completions",
              [&](const HttpRequest& req, HttpResponse& res) { proxy.handle_chat(req, res); });
  server.fast("GET", "/v1/upstreams", [&](const HttpRequest&, HttpResponse& res) {
    res.set_content(proxy.upstreams_json(), "application/json");
  });
  add_common_routes(
      server, config.common, "proxy", [&] { return proxy.render_metrics(); },
      [&] { return proxy.health(); });
  // Declared after what its callback uses: it stops first.
  std::unique_ptr<directory::MembershipWatcher> watcher;
  if (etcd) watcher = watch_membership(config, std::move(*etcd), proxy, prober);
  // Probed once before listening, so /health is right from the first request.
  prober.wait_first_round(Deadline::after_ms(2000));
  return server.serve_until_signal();
}

}  // namespace ecx::serve
