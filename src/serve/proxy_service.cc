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
// Threads: none per request. A request is parsed on a thread of the proxy's HTTP client
// (not the server's I/O threads, which keep answering /health) until it has sent its
// images to their encoders; every call upstream (encode, forward to a PD, release) goes through
// one asynchronous HTTP client with a pool of keep-alive connections per upstream
// (serve/http_client.h), and each answer continues the request on a client thread. A
// streamed answer is relayed piece by piece; while the client's buffer is full, the PD's
// connection is not read.
//
// --upstream-api vllm: each image goes to its encoder as the chat completion vLLM's EPD
// proxy sends, keyed by a uuid the PD's copy of the image carries too; the entries of the
// answer's ec_transfer_params travel to the PD unchanged. Everything else is the same.
#include <algorithm>
#include <chrono>
#include <iostream>
#include <memory>
#include <optional>
#include <set>

#include "ecx/common/auth.h"
#include "ecx/common/checksum.h"
#include "ecx/common/json_reader.h"
#include "ecx/common/log.h"
#include "ecx/common/mm_hash.h"
#include "ecx/common/mutex.h"
#include "ecx/directory/membership.h"
#include "ecx/engine/image.h"
#include "ecx/engine/model.h"
#include "serve/encoder_client.h"
#include "serve/http_client.h"
#include "serve/http_server.h"
#include "serve/instance_registration.h"
#include "serve/metric_families.h"
#include "serve/metrics.h"
#include "serve/openai_request.h"
#include "serve/upstream.h"
#include "serve/upstream_set.h"

namespace ecx::serve {
namespace {

using nlohmann::json;
// Bounds the TCP connect to a PD (the library's default is 300 s).
constexpr std::chrono::milliseconds kPdConnectTimeout{3000};
// Bounds each call that gives params back to an encoder.
constexpr std::chrono::milliseconds kReleaseTimeout{2000};
// Bounds each call to etcd, and how long start-up waits for the first read of members.
constexpr std::chrono::milliseconds kEtcdTimeout{2000};
constexpr std::chrono::milliseconds kEtcdSyncWait{3000};

// What encoding a request's images came to.
struct EncodedImages {
  json params = json::object();       // ec_transfer_params for the PD: {mm_hash: params}
  IssuedParams issued;                // the same params, by the encoder that issued them
  std::optional<RequestError> error;  // the client sent a bad image
  double ms = 0;                      // the slowest image
};

// One image to encode: the encoders to try, best first, and the call.
struct ImageJob {
  UpstreamList order;
  EncodeCall call;
};

// One chat completion on its way through the proxy. Shared by the callbacks that carry
// it on; the phases run one after another (encodes, then the PDs in turn).
struct ChatCall {
  ChatCall(std::shared_ptr<AsyncReply> r, std::shared_ptr<HttpRequest> q)
      : reply(std::move(r)), req(std::move(q)) {}

  std::shared_ptr<AsyncReply> reply;
  std::shared_ptr<HttpRequest> req;
  Clock::time_point t0 = Clock::now();
  size_t body_bytes = 0;  // of the request as it came
  ChatRequest chat;
  std::shared_ptr<const UpstreamMembers> members;  // one view of the members throughout
  json forward;                                    // the request as the PD gets it

  // Encoding: the answers, in the order the images were sent.
  Mutex mu;
  std::vector<ImageEncode> encodes ECX_GUARDED_BY(mu);
  size_t encodes_left ECX_GUARDED_BY(mu) = 0;
  EncodedImages encoded;

  // Forwarding: the PDs to try, in order, and what failed so far.
  std::string body;
  UpstreamList pds;
  size_t next_pd = 0;
  std::string pd_errors;

  // A streamed answer, once the PD answered 200 (on the PD connection's strand).
  AsyncStreamWriter* writer = nullptr;
  bool client_gone = false;
};

class Proxy {
 public:
  Proxy(const ProxyServiceConfig& config, UpstreamList encoders, UpstreamList pds)
      : config_(config),
        upstreams_(std::move(encoders), std::move(pds)),
        use_encoders_(config.connector != "local"),
        client_(HttpClient::Options{}),
        releaser_(client_, kReleaseTimeout,
                  [this](int n) { metrics_.add(metric::kProxyParamsReleased, n); }) {}

  // Stops in a stated order: the client's threads first (they run every callback of a
  // request, which use the members below), then the members.
  ~Proxy() { client_.stop(); }
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

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

  // POST /v1/chat/completions (an async route): answers through `reply`.
  void handle_chat(std::shared_ptr<HttpRequest> req, std::shared_ptr<AsyncReply> reply);
  HealthReport health() const;
  std::string render_metrics();
  // GET /v1/upstreams: {"upstreams": [{url, role, source, reachable, in_flight, last_error}]}.
  std::string upstreams_json() const;

 private:
  using Call = std::shared_ptr<ChatCall>;

  // Parses the request and sends its images to their encoders (on a client thread).
  void start_chat(const Call& call);

  // Rewrites the image URLs of `call.forward` as data URLs and lists the distinct images
  // to send to the encoders (each once per request). The parts' image bytes are let go:
  // the forwarded request holds each image.
  std::vector<ImageJob> image_jobs(ChatCall& call) const;
  // What to ask an encoder for the image part `forward_part` (whose URL is `data_url`);
  // in vllm mode it gives the part its uuid.
  EncodeCall encode_call(const ChatRequest& chat, const ContentPart& part,
                         std::string_view data_url, json& forward_part) const;
  // The image part's URL in the forwarded request, made {"url": data URL} (a file's
  // bytes become one) without copying it; the EncodeCall views it.
  static const std::string& data_url_of(json& forward_part, const ContentPart& part);
  // Every image has an outcome: merges the params into the request (an image no encoder
  // could encode gets none: the PD encodes it), then forwards it.
  void encodes_done(const Call& call);
  // PDs to try, in order: the reachable ones by fewest requests in flight, then the
  // others (their flag may be stale; a refused connect costs little).
  static UpstreamList pd_order(const UpstreamList& pds);
  // Sends the request to the next PD of call.pds; one that cannot be connected to is
  // skipped for the next. Every path answers the client once.
  void forward(const Call& call);
  void on_pd_answer(const Call& call, const std::shared_ptr<Upstream>& pd, ClientResult result);
  ClientStreaming relay_stream(const Call& call);
  void finish_stream(const Call& call, const Upstream& pd, const ClientResult& result);
  // The PD did not take the request: gives the params back, counts and sends `res`.
  void answer_not_taken(const Call& call, HttpResponse res);
  // The client hung up: its calls to E and PD were ended (closing their connections,
  // so they stop too), and its params are given back.
  void answer_abandoned(const Call& call);
  // No PD of call.pds took the request: 502 naming what was tried.
  void answer_no_pd(const Call& call);
  void answer_pd_failure(const Call& call, const Upstream& pd, const ClientResult& result);
  void count_answer(int http_status) {
    metrics_.add(metric::kProxyRequests, 1, {{"status", std::to_string(http_status)}});
  }

  const ProxyServiceConfig& config_;
  UpstreamSet upstreams_;
  const bool use_encoders_;  // false with --connector local: the PDs encode
  Metrics metrics_;
  HttpClient client_;        // stopped first, by ~Proxy
  ParamsReleaser releaser_;  // sends through client_
};

std::vector<ImageJob> Proxy::image_jobs(ChatCall& call) const {
  std::vector<ImageJob> jobs;
  const UpstreamList& encoders = call.members->encoders;
  std::set<std::pair<uint64_t, std::string>> sent;  // each distinct image once per request
  for (size_t m = 0; m < call.chat.messages.size(); ++m) {
    auto& parts = call.chat.messages[m].parts;
    for (size_t p = 0; p < parts.size(); ++p) {
      ContentPart& part = parts[p];
      if (part.kind != ContentPart::kImage) continue;
      json& forward_part = call.forward["messages"][m]["content"][p];
      EncodeCall encode =
          encode_call(call.chat, part, data_url_of(forward_part, part), forward_part);
      encode.cancel = call.req->client_gone;
      uint64_t key = checksum64(part.image_bytes.data(), part.image_bytes.size());
      std::string().swap(part.image_bytes);  // hashed: the forwarded request holds the image
      // (In vllm mode an image is its bytes and its uuid: E must see each uuid the PD does.)
      if (!use_encoders_ || encoders.empty() || !sent.emplace(key, encode.uuid).second) continue;
      jobs.push_back({encoder_order(encoders, key), std::move(encode)});
    }
  }
  return jobs;
}

const std::string& Proxy::data_url_of(json& forward_part, const ContentPart& part) {
  json& image = forward_part["image_url"];
  std::string url = image.is_string() ? std::move(image.get_ref<std::string&>())
                                      : std::move(image["url"].get_ref<std::string&>());
  // Data URLs, so PD can decode images that came from local files.
  if (url.rfind("data:", 0) != 0) url = engine::make_data_url(part.image_bytes, "image/png");
  json only_url = json::object();
  only_url["url"] = std::move(url);  // moved, as it was taken: never copied
  image = std::move(only_url);
  return image["url"].get_ref<const std::string&>();
}

EncodeCall Proxy::encode_call(const ChatRequest& chat, const ContentPart& part,
                              std::string_view data_url, json& forward_part) const {
  EncodeCall call{config_.upstream_api, data_url, "", "", {}};
  if (call.api != UpstreamApi::kVllm) return call;
  // vLLM keys an item by its uuid when it has one: E and PD must see the same. It is
  // the image's content hash, never the client's own uuid: vLLM trusts a uuid as the
  // item's identity, so a chosen one would let one user's image stand for another's in
  // E's and PD's caches (docs/SECURITY.md).
  call.uuid = MmHash::sha256_of({"image", part.image_bytes}).str();
  forward_part["uuid"] = call.uuid;
  call.model = chat.model;
  return call;
}

void Proxy::encodes_done(const Call& call) {
  // Every encode has answered (or there was none): nothing writes them any more.
  std::vector<ImageEncode> encodes;
  {
    MutexLock lock(&call->mu);
    encodes.swap(call->encodes);
  }
  EncodedImages& out = call->encoded;
  for (ImageEncode& r : encodes) {
    out.ms = std::max(out.ms, r.ms);
    if (r.outcome == ImageEncode::kEncoded && !r.result.mm_hash.empty()) {
      out.issued[r.encoder][r.result.mm_hash] = r.result.params;
    }
  }
  if (call->req->abandoned()) return answer_abandoned(call);
  for (ImageEncode& r : encodes) {
    if (r.failed_attempts > 0) metrics_.add(metric::kProxyEncoderErrors, r.failed_attempts);
    switch (r.outcome) {
      case ImageEncode::kEncoded:
        if (r.result.mm_hash.empty()) break;  // the encoder handed nothing over
        out.params[r.result.mm_hash] = r.result.params;
        break;
      case ImageEncode::kClientError:
        // The client's fault (bad image) keeps its 4xx.
        if (!out.error)
          out.error = RequestError{r.result.http_status, "invalid_image", r.result.error};
        break;
      case ImageEncode::kFallback:
        metrics_.add(metric::kProxyEncoderFallbacks, 1, {{"reason", r.reason_label}});
        spdlog::warn("event=encoder_fallback reason={} detail=\"{}\": the PD encodes the image",
                     r.reason_label, r.why);
        break;
    }
  }
  if (out.error) {
    releaser_.release(out.issued);  // the images that did encode
    metrics_.add(metric::kProxyFailures, 1, {{"reason", "invalid_image"}});
    HttpResponse res;
    send_error(res, *out.error);
    return call->reply->respond(std::move(res));
  }
  metrics_.observe(metric::kProxyEncodeSeconds, out.ms / 1000);
  // Only params from our encoders travel on: a client must not choose what PD reads.
  call->forward["ec_transfer_params"] = out.params;
  // About the request as it came (its images as they were), and the params added.
  call->body = safe_dump(call->forward, call->body_bytes + (64 << 10));
  call->forward = json();  // no longer needed: the body holds it
  call->pds = pd_order(call->members->pds);
  forward(call);
}

UpstreamList Proxy::pd_order(const UpstreamList& pds) {
  UpstreamList order;
  for (const auto& pd : pds) {
    if (!pd->must_prove() || pd->proven()) order.push_back(pd);  // never an unproven member
  }
  std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    if (a->reachable() != b->reachable()) return a->reachable();
    return a->in_flight.load() < b->in_flight.load();
  });
  return order;
}

void Proxy::handle_chat(std::shared_ptr<HttpRequest> req, std::shared_ptr<AsyncReply> reply) {
  // Parsing and re-encoding the request (images included) runs on a client thread: the
  // server's I/O threads stay free for reading, writing and /health.
  client_.post([this, call = std::make_shared<ChatCall>(std::move(reply), std::move(req))] {
    start_chat(call);
  });
}

void Proxy::start_chat(const Call& call) {
  if (call->req->abandoned()) return answer_abandoned(call);  // its client left while it waited
  // The body is let go once parsed (its parsed form holds the request from here on).
  std::optional<RequestError> err;
  {
    const std::string body = std::move(call->req->body);
    call->body_bytes = body.size();
    err = parse_chat_request(body, config_.common, &call->chat);
  }
  if (err) {
    metrics_.add(metric::kProxyFailures, 1, {{"reason", "bad_request"}});
    HttpResponse res;
    send_error(res, *err);
    return call->reply->respond(std::move(res));
  }
  call->members = upstreams_.snapshot();
  call->forward = std::move(call->chat.raw);
  std::vector<ImageJob> jobs = image_jobs(*call);
  if (jobs.empty()) return encodes_done(call);
  {
    MutexLock lock(&call->mu);
    call->encodes.resize(jobs.size());
    call->encodes_left = jobs.size();
  }
  for (size_t i = 0; i < jobs.size(); ++i) {
    encode_with_failover(client_, std::move(jobs[i].order), std::move(jobs[i].call),
                         config_.encode_timeout_ms, [this, call, i](ImageEncode r) {
                           bool last;
                           {
                             MutexLock lock(&call->mu);
                             call->encodes[i] = std::move(r);
                             last = --call->encodes_left == 0;
                           }
                           if (last) encodes_done(call);
                         });
  }
}

void Proxy::forward(const Call& call) {
  if (call->req->abandoned()) return answer_abandoned(call);
  if (call->next_pd >= call->pds.size()) return answer_no_pd(call);
  std::shared_ptr<Upstream> pd = call->pds[call->next_pd++];
  ClientRequest request;
  request.target = "/v1/chat/completions";
  request.body = call->body;
  request.connect_timeout = kPdConnectTimeout;
  request.timeout = std::chrono::milliseconds(config_.request_timeout_ms);
  request.cancel = call->req->client_gone;
  pd->in_flight++;
  client_.send(
      pd->host, pd->port, std::move(request),
      [this, call, pd](ClientResult result) {
        pd->in_flight--;
        on_pd_answer(call, pd, std::move(result));
      },
      call->chat.stream ? relay_stream(call) : ClientStreaming{});
}

void Proxy::on_pd_answer(const Call& call, const std::shared_ptr<Upstream>& pd,
                         ClientResult result) {
  if (result.error == ClientError::kCancelled) {
    if (call->writer == nullptr) return answer_abandoned(call);
    call->client_gone = true;  // a streamed answer: ends as one whose client left
  }
  if (result.error == ClientError::kConnect) {
    pd->mark_down(result.message);
    call->pd_errors += (call->pd_errors.empty() ? "" : "; ") + pd->url + ": " + result.message;
    return forward(call);  // nothing was sent: the next PD may take it
  }
  if (call->chat.stream) return finish_stream(call, *pd, result);
  if (!result.ok()) return answer_pd_failure(call, *pd, result);
  HttpResponse res;
  auto out = parse_json_object(result.body, "pd answer");
  if (result.status == 200 && out.ok()) {
    (*out)["ecx_timings"]["proxy_encode_ms"] = call->encoded.ms;
    (*out)["ecx_timings"]["proxy_total_ms"] = ms_since(call->t0);
    res.set_content(safe_dump(*out), "application/json");
  } else {
    res.status = result.status;
    res.set_content(std::move(result.body), "application/json");
  }
  if (res.status < 200 || res.status >= 300) return answer_not_taken(call, std::move(res));
  count_answer(res.status);
  call->reply->respond(std::move(res));
}

// The PD's stream, relayed piece by piece as it comes; the PD's error answer (not 200)
// is collected and answered as it is.
ClientStreaming Proxy::relay_stream(const Call& call) {
  ClientStreaming relay;
  relay.on_headers = [call](int status) {
    if (status != 200) return false;
    HttpResponse head;
    call->writer = &call->reply->start_stream(head, "text/event-stream");
    return true;
  };
  relay.on_body = [call](std::string_view piece, std::function<void()> resume) {
    // A client gone: stop reading, which closes the PD's connection and so stops it too.
    if (!call->writer->push(piece)) {
      call->client_gone = true;
      return BodyFlow::kStop;
    }
    if (call->writer->has_room()) return BodyFlow::kContinue;
    call->writer->when_room(std::move(resume));
    return BodyFlow::kPause;
  };
  return relay;
}

void Proxy::finish_stream(const Call& call, const Upstream& pd, const ClientResult& result) {
  if (call->writer != nullptr) {  // the client has its stream
    count_answer(200);
    if (call->client_gone) {
      metrics_.add(metric::kProxyClientDisconnects, 1);
    } else if (!result.ok()) {
      // PD failed mid-stream: say so instead of ending as if complete.
      std::string message = "pd " + pd.url + ": " + result.message;
      call->writer->push(
          "data: " + safe_dump(json{{"error", {{"message", message}, {"type", "pd_failed"}}}}) +
          "\n\n");
    }
    return call->reply->end_stream();
  }
  if (!result.ok()) return answer_pd_failure(call, pd, result);
  HttpResponse res;  // the PD's own error answer
  res.status = result.status;
  res.set_content(result.body, "application/json");
  answer_not_taken(call, std::move(res));
}

void Proxy::answer_not_taken(const Call& call, HttpResponse res) {
  // Abandoned between E and PD: no PD will read these params.
  releaser_.release(call->encoded.issued);
  count_answer(res.status);
  call->reply->respond(std::move(res));
}

void Proxy::answer_abandoned(const Call& call) {
  metrics_.add(metric::kProxyClientDisconnects, 1);
  HttpResponse res;
  send_error(res, 499, "client_closed_request", "the client closed its connection");
  answer_not_taken(call, std::move(res));
}

void Proxy::answer_no_pd(const Call& call) {
  metrics_.add(metric::kProxyFailures, 1, {{"reason", "no_pd"}});
  HttpResponse res;
  send_error(res, 502, "pd_failed",
             call->pds.empty() ? std::string("no PD is known (none given, none registered in etcd)")
                               : "no PD could be reached (" + call->pd_errors + ")");
  answer_not_taken(call, std::move(res));
}

void Proxy::answer_pd_failure(const Call& call, const Upstream& pd, const ClientResult& result) {
  bool timeout = result.error == ClientError::kTimeout;
  metrics_.add(metric::kProxyFailures, 1, {{"reason", "pd"}});
  HttpResponse res;
  send_error(res, timeout ? 504 : 502, timeout ? "pd_timeout" : "pd_failed",
             "pd " + pd.url + ": " + result.message);
  answer_not_taken(call, std::move(res));
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
      metrics_.add(metric::kProxyMembershipChanges, 1, {{"role", u->role}, {"change", what}});
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
  Metrics now;
  now.set(metric::kProxyUpstreams, static_cast<double>(members->encoders.size()),
          {{"role", "encoder"}});
  now.set(metric::kProxyUpstreams, static_cast<double>(members->pds.size()), {{"role", "pd"}});
  for (const auto* list : {&members->pds, &members->encoders}) {
    for (const auto& u : *list) {
      now.set(metric::kProxyUpstreamUp, u->reachable() ? 1 : 0,
              {{"role", u->role}, {"url", u->url}});
    }
  }
  return metrics_.render() + now.render();
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
                      {"proven", !u->must_prove() || u->proven()},
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
                                                               const std::string& secret,
                                                               Proxy& proxy,
                                                               UpstreamProber& prober) {
  directory::MembershipOptions options;
  options.secret = secret;  // only records the deployment signed
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
  const bool secured = announce_secret("proxy", config.auth_token, config.auth_token_file);
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
  auto secret = load_secret(config.auth_token, config.auth_token_file);
  if (!secret.ok()) {
    std::cerr << "ecx serve proxy: " << secret.status().message() << "\n";
    return 2;
  }
  std::optional<directory::EtcdClient> etcd;
  if (!config.directory.etcd.empty()) {
    auto access = etcd_access(config.directory);
    auto client = access.ok()
                      ? directory::EtcdClient::create(config.directory.etcd, kEtcdTimeout, *access)
                      : Result<directory::EtcdClient>(access.status());
    if (!client.ok()) {
      std::cerr << "ecx serve proxy: --etcd: " << client.status().message() << "\n";
      return 2;
    }
    etcd.emplace(std::move(*client));
  }
  Proxy proxy(config, std::move(*encoders), std::move(*pds));
  // Probed every 250 ms until the server has stopped (the prober is destroyed after it),
  // following membership.
  UpstreamProber prober(proxy.probed(), UpstreamProber::Options{.secret = *secret});
  // Requests run at once (each waits on E and PD without a thread); the rest queue.
  HttpServer server(config.common, "proxy", 64);
  server.async_work("POST", "/v1/chat/completions",
                    [&](std::shared_ptr<HttpRequest> req, std::shared_ptr<AsyncReply> reply) {
                      proxy.handle_chat(std::move(req), std::move(reply));
                    });
  server.fast("GET", "/v1/upstreams", [&](const HttpRequest&, HttpResponse& res) {
    res.set_content(proxy.upstreams_json(), "application/json");
  });
  add_common_routes(
      server, config.common, "proxy", secured, [&] { return proxy.render_metrics(); },
      [&] { return proxy.health(); });
  // Declared after what its callback uses: it stops first.
  std::unique_ptr<directory::MembershipWatcher> watcher;
  if (etcd) watcher = watch_membership(config, std::move(*etcd), *secret, proxy, prober);
  // Probed once before listening, so /health is right from the first request.
  prober.wait_first_round(Deadline::after_ms(2000));
  return server.serve_until_signal();
}

}  // namespace ecx::serve
