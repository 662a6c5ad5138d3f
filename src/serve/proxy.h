// Inside serve/proxy_service: the proxy. proxy_service.cc runs it (its health, membership
// and metrics); proxy_chat.cc takes one chat completion through it.
#pragma once

#include <algorithm>
#include <atomic>
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
#include "http/http_client.h"
#include "http_server/http_server.h"
#include "http_server/metric_families.h"
#include "http_server/metrics.h"
#include "openai/openai_request.h"
#include "serve/coroutine.h"
#include "serve/encoder_client.h"
#include "serve/instance_registration.h"
#include "serve/upstream.h"
#include "serve/upstream_set.h"

namespace ecx::serve {

// Bounds each call that gives params back to an encoder.
inline constexpr std::chrono::milliseconds kReleaseTimeout{2000};

// What encoding a request's images came to.
struct EncodedImages {
  nlohmann::json params =
      nlohmann::json::object();       // ec_transfer_params for the PD: {mm_hash: params}
  IssuedParams issued;                // the same params, by the encoder that issued them
  std::optional<RequestError> error;  // the client sent a bad image
  double ms = 0;                      // the slowest image
};

// One image to encode: the encoders to try, best first, and the call.
struct ImageJob {
  UpstreamList order;
  EncodeCall call;
};

// One chat completion on its way through the proxy: what its coroutine (Proxy::chat)
// keeps from step to step.
struct ChatCall {
  ChatCall(std::shared_ptr<AsyncReply> r, std::shared_ptr<HttpRequest> q)
      : reply(std::move(r)), req(std::move(q)) {}

  std::shared_ptr<AsyncReply> reply;
  std::shared_ptr<HttpRequest> req;
  Clock::time_point t0 = Clock::now();
  size_t body_bytes = 0;  // of the request as it came
  ChatRequest chat;
  std::shared_ptr<const UpstreamMembers> members;  // one view of the members throughout
  nlohmann::json forward;                          // the request as the PD gets it
};

// What a PD made of a forwarded request. `writer` is set once the PD answered 200 to a
// streamed request (the client has its stream); both are written by the relay's callbacks
// on the PD connection's strand, before the call ends and the coroutine reads them.
struct PdAnswer {
  http::ClientResult result;
  AsyncStreamWriter* writer = nullptr;
  bool client_gone = false;
};

// The params a request got from its encoders go back to them when the request ends,
// unless a PD took it (dismiss()): one guard, on every path out of Proxy::chat.
class IssuedGuard {
 public:
  IssuedGuard(ParamsReleaser& releaser, std::weak_ptr<void> proxy_alive)
      : releaser_(releaser), alive_(std::move(proxy_alive)) {}
  ~IssuedGuard() {
    // A coroutine destroyed while the proxy itself goes (its client stopped) releases
    // nothing: the releaser goes with the proxy.
    if (!dismissed_ && !issued_.empty() && !alive_.expired()) releaser_.release(issued_);
  }
  IssuedGuard(const IssuedGuard&) = delete;
  IssuedGuard& operator=(const IssuedGuard&) = delete;

  void hold(IssuedParams issued) { issued_ = std::move(issued); }
  void dismiss() { dismissed_ = true; }

 private:
  ParamsReleaser& releaser_;
  const std::weak_ptr<void> alive_;
  IssuedParams issued_;
  bool dismissed_ = false;
};

class Proxy {
 public:
  Proxy(const ProxyServiceConfig& config, UpstreamList encoders, UpstreamList pds)
      : config_(config),
        upstreams_(std::move(encoders), std::move(pds)),
        use_encoders_(config.connector != "local"),
        client_(http::HttpClient::Options{}),
        releaser_(client_, kReleaseTimeout,
                  [this](int n) { metrics_.add(metric::kProxyParamsReleased, n); }) {}

  // Stops in a stated order: the client's threads first (they run every callback of a
  // request, which use the members below), then the members.
  ~Proxy() {
    alive_.reset();  // a request's coroutine destroyed from here on releases nothing
    client_.stop();
  }
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

  // The models the PDs of `members` said they serve (learn_model), each once.
  static std::vector<std::string> served_models(const UpstreamMembers& members);
  std::vector<std::string> served_models() const { return served_models(*upstreams_.snapshot()); }
  // POST /v1/chat/completions (an async route): answers through `reply`.
  void handle_chat(std::shared_ptr<HttpRequest> req, std::shared_ptr<AsyncReply> reply);
  HealthReport health() const;
  std::string render_metrics();
  // GET /v1/upstreams: {"upstreams": [{url, role, source, reachable, in_flight, last_error}]}.
  std::string upstreams_json() const;

 private:
  using Call = std::shared_ptr<ChatCall>;

  // One chat completion, start to end, on the client's threads: parse, encode_all,
  // forward_to_pd (the next PD while one cannot be connected to), relay the answer. Every
  // path answers the client once; IssuedGuard gives back params no PD took.
  Detached chat(Call call);
  // Parses the body into call.chat (the body is let go); a 400 for what is wrong.
  std::optional<RequestError> parse(ChatCall& call);
  // learn_model: the request's model must be one its PDs serve.
  static std::optional<RequestError> check_learnt_model(const std::string& model,
                                                        const UpstreamMembers& members);

  // Rebuilds every content part of `call.forward` from what was read (a part's type and
  // its data, media as data URLs: a client's other keys, a uuid above all, never reach a
  // PD) and lists the distinct media items (images; with vllm, videos and audio too) to
  // send to the encoders, each once per request. The parts' bytes are let go: the
  // forwarded request holds each item.
  std::vector<ImageJob> image_jobs(ChatCall& call) const;
  // What to ask an encoder for the media part `forward_part`; in vllm mode it gives the
  // part its uuid (the item's content hash).
  EncodeCall encode_call(const ChatRequest& chat, const ContentPart& part,
                         nlohmann::json& forward_part) const;
  // The media part rebuilt in the forwarded request, {"type", KEY: {"url": data URL}} (a
  // file's bytes become one; input_image becomes image_url) or input_audio's {"data",
  // "format"}, the data moved, not copied; the EncodeCall views the data.
  static const std::string& data_of(nlohmann::json& forward_part, const ContentPart& part);
  // Every image on its encoders at once (each with failover); their outcomes, in order.
  Await<std::vector<ImageEncode>> encode_all(std::vector<ImageJob> jobs);
  // The params per image (an image no encoder could encode gets none: the PD encodes
  // it), the params per encoder that issued them, and a client error if an image was bad.
  EncodedImages merge(const std::vector<ImageEncode>& encodes);
  // Counts failed attempts and fallbacks (the PD encodes those images), logging each.
  void count_encodes(const std::vector<ImageEncode>& encodes);
  // PDs to try, in order: the reachable ones by fewest requests in flight, then the
  // others (their flag may be stale; a refused connect costs little). `model` (learnt
  // models): not those that said they serve other models only.
  static UpstreamList pd_order(const UpstreamList& pds, const std::string* model = nullptr);
  // Sends the request to `pd`; a streamed answer is relayed to the client as it comes.
  Await<PdAnswer> forward_to_pd(const Call& call, std::shared_ptr<Upstream> pd,
                                const std::string& body);
  // Answers the client from what the PD said; true when the PD took the request (its
  // params are the PD's to release).
  bool answer_from_pd(ChatCall& call, const Upstream& pd, PdAnswer& answer, double encode_ms);
  bool answer_stream_end(ChatCall& call, const Upstream& pd, PdAnswer& answer);

  void respond(ChatCall& call, HttpResponse res) {
    count_answer(res.status);
    call.reply->respond(std::move(res));
  }
  void answer_error(ChatCall& call, const RequestError& error, const char* reason);
  // The client hung up: its calls to E and PD were ended (closing their connections,
  // so they stop too).
  void answer_abandoned(ChatCall& call);
  // No PD took the request: 502 naming what was tried.
  void answer_no_pd(ChatCall& call, const std::string& pd_errors);
  void answer_pd_failure(ChatCall& call, const Upstream& pd, const http::ClientResult& result);
  void count_answer(int http_status) {
    metrics_.add(metric::kProxyRequests, 1, {{"status", std::to_string(http_status)}});
  }

  const ProxyServiceConfig& config_;
  UpstreamSet upstreams_;
  const bool use_encoders_;  // false with --connector local: the PDs encode
  // --encoder-routing round-robin: the images encoded so far, each the next one's turn.
  mutable std::atomic<uint64_t> encoder_turns_{0};
  Metrics metrics_;
  std::shared_ptr<void> alive_ = std::make_shared<int>(0);  // reset first, by ~Proxy
  http::HttpClient client_;                                 // stopped next, by ~Proxy
  ParamsReleaser releaser_;                                 // sends through client_
};

}  // namespace ecx::serve
