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
// Threads: none per request. A request is one C++20 coroutine (Proxy::chat) on the
// threads of the proxy's HTTP client, not the server's I/O threads (which keep answering
// /health): it reads in order, parse -> encode_all -> forward_to_pd -> relay, and each
// co_await gives its thread back until an answer comes. Every call upstream (encode,
// forward to a PD, release) goes through one asynchronous HTTP client with a pool of
// keep-alive connections per upstream (http/http_client.h). A streamed answer is relayed
// piece by piece; while the client's buffer is full, the PD's connection is not read.
//
// --upstream-api vllm: each image goes to its encoder as the chat completion vLLM's EPD
// proxy sends, keyed by a uuid the PD's copy of the image carries too; the entries of the
// answer's ec_transfer_params travel to the PD unchanged. Everything else is the same.
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
#include "serve/coroutine.h"
#include "serve/encoder_client.h"
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
  json forward;                                    // the request as the PD gets it
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

  // Rebuilds every content part of `call.forward` from what was read (a part's type and
  // its data, media as data URLs: a client's other keys, a uuid above all, never reach a
  // PD) and lists the distinct media items (images; with vllm, videos and audio too) to
  // send to the encoders, each once per request. The parts' bytes are let go: the
  // forwarded request holds each item.
  std::vector<ImageJob> image_jobs(ChatCall& call) const;
  // What to ask an encoder for the media part `forward_part`; in vllm mode it gives the
  // part its uuid (the item's content hash).
  EncodeCall encode_call(const ChatRequest& chat, const ContentPart& part,
                         json& forward_part) const;
  // The media part rebuilt in the forwarded request, {"type", KEY: {"url": data URL}} (a
  // file's bytes become one; input_image becomes image_url) or input_audio's {"data",
  // "format"}, the data moved, not copied; the EncodeCall views the data.
  static const std::string& data_of(json& forward_part, const ContentPart& part);
  // Every image on its encoders at once (each with failover); their outcomes, in order.
  Await<std::vector<ImageEncode>> encode_all(std::vector<ImageJob> jobs);
  // The params per image (an image no encoder could encode gets none: the PD encodes
  // it), the params per encoder that issued them, and a client error if an image was bad.
  EncodedImages merge(const std::vector<ImageEncode>& encodes);
  // Counts failed attempts and fallbacks (the PD encodes those images), logging each.
  void count_encodes(const std::vector<ImageEncode>& encodes);
  // PDs to try, in order: the reachable ones by fewest requests in flight, then the
  // others (their flag may be stale; a refused connect costs little).
  static UpstreamList pd_order(const UpstreamList& pds);
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

std::vector<ImageJob> Proxy::image_jobs(ChatCall& call) const {
  std::vector<ImageJob> jobs;
  const UpstreamList& encoders = call.members->encoders;
  std::set<std::pair<uint64_t, std::string>> sent;  // each distinct image once per request
  // Every encode call carries the chat's image sizes: E refuses a chat that could never
  // fit before it encodes any image of it.
  auto sizes = std::make_shared<const std::vector<engine::ImageSize>>(
      config_.upstream_api == UpstreamApi::kVllm ? std::vector<engine::ImageSize>{}
                                                 : image_sizes(call.chat, config_.common));
  for (size_t m = 0; m < call.chat.messages.size(); ++m) {
    auto& parts = call.chat.messages[m].parts;
    for (size_t p = 0; p < parts.size(); ++p) {
      ContentPart& part = parts[p];
      json& content = call.forward["messages"][m]["content"];
      if (!content.is_array()) continue;  // a string: no parts
      json& forward_part = content[p];
      if (!part.is_media()) {
        const std::string key(part.text_key());
        forward_part = json{{"type", part.type}, {key, std::move(part.text)}};
        continue;
      }
      EncodeCall encode = encode_call(call.chat, part, forward_part);
      encode.cancel = call.req->client_gone;
      encode.chat_image_sizes = sizes;
      uint64_t key = checksum64(part.media_bytes.data(), part.media_bytes.size());
      std::string().swap(part.media_bytes);  // hashed: the forwarded request holds the image
      // (In vllm mode an image is its bytes and its uuid: E must see each uuid the PD does.)
      if (!use_encoders_ || encoders.empty() || !sent.emplace(key, encode.uuid).second) continue;
      jobs.push_back({config_.encoder_routing == EncoderRouting::kRoundRobin
                          ? encoder_turn(encoders, encoder_turns_.fetch_add(1))
                          : encoder_order(encoders, key),
                      std::move(encode)});
    }
  }
  return jobs;
}

namespace {

// The MIME type of a local media file sent on as a data URL: by its extension, for
// video and audio (an image is sent as image/png: decoders read its kind from its bytes).
std::string mime_of(const std::string& path, const ContentPart& part) {
  if (part.kind == ContentPart::kImage) return "image/png";
  auto dot = path.rfind('.');
  std::string ext = dot == std::string::npos ? "" : path.substr(dot + 1);
  for (auto& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (part.kind == ContentPart::kVideo) return ext == "webm" ? "video/webm" : "video/mp4";
  if (ext == "mp3") return "audio/mpeg";
  if (ext == "flac" || ext == "ogg") return "audio/" + ext;
  return "audio/wav";
}

}  // namespace

const std::string& Proxy::data_of(json& forward_part, const ContentPart& part) {
  const std::string key(part.media_key());
  json& media = forward_part[key];
  json rebuilt = json::object();
  if (part.type == "input_audio") {
    rebuilt["type"] = "input_audio";
    rebuilt[key] = {{"data", std::move(media["data"].get_ref<std::string&>())},
                    {"format", media["format"]}};
    forward_part = std::move(rebuilt);
    return forward_part[key]["data"].get_ref<const std::string&>();
  }
  std::string url = media.is_string() ? std::move(media.get_ref<std::string&>())
                                      : std::move(media["url"].get_ref<std::string&>());
  // Data URLs, so PD can decode items that came from local files.
  if (url.rfind("data:", 0) != 0) url = engine::make_data_url(part.media_bytes, mime_of(url, part));
  rebuilt["type"] = key;  // input_image: image_url
  rebuilt[key] = json::object();
  rebuilt[key]["url"] = std::move(url);  // moved, as it was taken: never copied
  forward_part = std::move(rebuilt);
  return forward_part[key]["url"].get_ref<const std::string&>();
}

EncodeCall Proxy::encode_call(const ChatRequest& chat, const ContentPart& part,
                              json& forward_part) const {
  EncodeCall call;
  call.api = config_.upstream_api;
  call.data_url = data_of(forward_part, part);
  if (call.api != UpstreamApi::kVllm) return call;
  call.part_type = forward_part["type"].get<std::string>();
  if (call.part_type == "input_audio") {
    call.audio_format = forward_part["input_audio"]["format"].get<std::string>();
  }
  // vLLM keys an item by its uuid when it has one: E and PD must see the same. It is
  // the item's content hash, never the client's own uuid: vLLM trusts a uuid as the
  // item's identity, so a chosen one would let one user's image stand for another's in
  // E's and PD's caches (docs/SECURITY.md).
  call.uuid = MmHash::sha256_of({part.modality(), part.media_bytes}).str();
  forward_part["uuid"] = call.uuid;
  call.model = chat.model;
  return call;
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
  // The request runs on the client's threads: the server's I/O threads stay free for
  // reading, writing and /health.
  client_.post(
      [this, call = std::make_shared<ChatCall>(std::move(reply), std::move(req))] { chat(call); });
}

Detached Proxy::chat(Call call) {
  IssuedGuard issued(releaser_, alive_);
  if (call->req->abandoned()) co_return answer_abandoned(*call);  // left while it waited
  if (auto error = parse(*call)) co_return answer_error(*call, *error, "bad_request");
  std::vector<ImageEncode> encodes = co_await encode_all(image_jobs(*call));
  EncodedImages encoded = merge(encodes);
  issued.hold(std::move(encoded.issued));
  if (call->req->abandoned()) co_return answer_abandoned(*call);
  count_encodes(encodes);
  if (encoded.error) co_return answer_error(*call, *encoded.error, "invalid_image");
  metrics_.observe(metric::kProxyEncodeSeconds, encoded.ms / 1000);
  // Only params from our encoders travel on: a client must not choose what PD reads.
  call->forward["ec_transfer_params"] = std::move(encoded.params);
  // About the request as it came (its images as they were), and the params added.
  const std::string body = safe_dump(call->forward, call->body_bytes + (64 << 10));
  call->forward = json();  // no longer needed: the body holds it
  std::string pd_errors;
  for (const auto& pd : pd_order(call->members->pds)) {
    if (call->req->abandoned()) co_return answer_abandoned(*call);
    PdAnswer answer = co_await forward_to_pd(call, pd, body);
    if (answer.result.error == http::ClientError::kConnect) {  // nothing was sent: try the next
      pd->mark_down(answer.result.message);
      pd_errors += (pd_errors.empty() ? "" : "; ") + pd->url + ": " + answer.result.message;
      continue;
    }
    if (answer_from_pd(*call, *pd, answer, encoded.ms)) issued.dismiss();
    co_return;
  }
  answer_no_pd(*call, pd_errors);
}

std::optional<RequestError> Proxy::parse(ChatCall& call) {
  // The body is let go once parsed (its parsed form holds the request from here on).
  const std::string body = std::move(call.req->body);
  call.body_bytes = body.size();
  const PartPolicy parts =
      config_.upstream_api == UpstreamApi::kVllm ? PartPolicy::kVllm : PartPolicy::kReferenceEngine;
  if (auto err = parse_chat_request(body, config_.common, &call.chat, parts)) return err;
  call.members = upstreams_.snapshot();
  call.forward = std::move(call.chat.raw);
  return std::nullopt;
}

Await<std::vector<ImageEncode>> Proxy::encode_all(std::vector<ImageJob> jobs) {
  return Await<std::vector<ImageEncode>>(
      [this, jobs = std::move(jobs)](std::function<void(std::vector<ImageEncode>)> done) mutable {
        if (jobs.empty()) return done({});
        // Each outcome in its slot; the last to arrive (on any client thread) hands over all.
        struct Gather {
          std::vector<ImageEncode> outcomes;
          std::atomic<size_t> left;
          std::function<void(std::vector<ImageEncode>)> done;
        };
        auto gather = std::make_shared<Gather>();
        gather->outcomes.resize(jobs.size());
        gather->left = jobs.size();
        gather->done = std::move(done);
        for (size_t i = 0; i < jobs.size(); ++i) {
          encode_with_failover(client_, std::move(jobs[i].order), std::move(jobs[i].call),
                               config_.encode_timeout_ms, [gather, i](ImageEncode r) {
                                 gather->outcomes[i] = std::move(r);
                                 if (gather->left.fetch_sub(1, std::memory_order_acq_rel) == 1) {
                                   gather->done(std::move(gather->outcomes));
                                 }
                               });
        }
      });
}

EncodedImages Proxy::merge(const std::vector<ImageEncode>& encodes) {
  EncodedImages out;
  for (const ImageEncode& r : encodes) {
    out.ms = std::max(out.ms, r.ms);
    if (r.outcome == ImageEncode::kEncoded && !r.result.mm_hash.empty()) {
      out.issued[r.encoder][r.result.mm_hash] = r.result.params;
      out.params[r.result.mm_hash] = r.result.params;
    } else if (r.outcome == ImageEncode::kClientError && !out.error) {
      // The client's fault (a bad image, a chat that cannot fit) keeps its 4xx and type.
      const std::string& type = r.result.error_type;
      out.error =
          RequestError{r.result.http_status, type.empty() ? "invalid_image" : type, r.result.error};
    }
  }
  return out;
}

void Proxy::count_encodes(const std::vector<ImageEncode>& encodes) {
  for (const ImageEncode& r : encodes) {
    if (r.failed_attempts > 0) metrics_.add(metric::kProxyEncoderErrors, r.failed_attempts);
    if (r.outcome != ImageEncode::kFallback) continue;
    metrics_.add(metric::kProxyEncoderFallbacks, 1, {{"reason", r.reason_label}});
    spdlog::warn("event=encoder_fallback reason={} detail=\"{}\": the PD encodes the image",
                 r.reason_label, r.why);
  }
}

Await<PdAnswer> Proxy::forward_to_pd(const Call& call, std::shared_ptr<Upstream> pd,
                                     const std::string& body) {
  http::ClientRequest request;
  request.target = "/v1/chat/completions";
  request.body = body;
  request.connect_timeout = kPdConnectTimeout;
  request.timeout = std::chrono::milliseconds(config_.request_timeout_ms);
  request.cancel = call->req->client_gone;
  auto answer = std::make_shared<PdAnswer>();
  http::ClientStreaming relay;
  if (call->chat.stream) {
    relay.on_headers = [call, answer](int status) {
      if (status != 200) return false;  // an error answer: collected, answered as it is
      HttpResponse head;
      answer->writer = &call->reply->start_stream(head, "text/event-stream");
      return true;
    };
    relay.on_body = [answer](std::string_view piece, std::function<void()> resume) {
      // A client gone: stop reading, which closes the PD's connection and so stops it too.
      if (!answer->writer->push(piece)) {
        answer->client_gone = true;
        return http::BodyFlow::kStop;
      }
      if (answer->writer->has_room()) return http::BodyFlow::kContinue;
      answer->writer->when_room(std::move(resume));
      return http::BodyFlow::kPause;
    };
  }
  return Await<PdAnswer>([this, pd, answer, request = std::move(request),
                          relay = std::move(relay)](std::function<void(PdAnswer)> done) mutable {
    pd->in_flight++;
    client_.send(
        pd->host, pd->port, std::move(request),
        [pd, answer, done = std::move(done)](http::ClientResult result) {
          pd->in_flight--;
          answer->result = std::move(result);
          done(std::move(*answer));
        },
        std::move(relay));
  });
}

bool Proxy::answer_from_pd(ChatCall& call, const Upstream& pd, PdAnswer& answer, double encode_ms) {
  http::ClientResult& result = answer.result;
  if (result.error == http::ClientError::kCancelled) {
    if (answer.writer == nullptr) {
      answer_abandoned(call);
      return false;
    }
    answer.client_gone = true;  // a streamed answer: ends as one whose client left
  }
  if (call.chat.stream) return answer_stream_end(call, pd, answer);
  if (!result.ok()) {
    answer_pd_failure(call, pd, result);
    return false;
  }
  HttpResponse res;
  auto out = parse_json_object(result.body, "pd answer");
  if (result.status == 200 && out.ok()) {
    (*out)["ecx_timings"]["proxy_encode_ms"] = encode_ms;
    (*out)["ecx_timings"]["proxy_total_ms"] = ms_since(call.t0);
    res.set_content(safe_dump(*out), "application/json");
  } else {
    res.status = result.status;
    res.set_content(std::move(result.body), "application/json");
  }
  const bool taken = res.status >= 200 && res.status < 300;
  respond(call, std::move(res));
  return taken;
}

bool Proxy::answer_stream_end(ChatCall& call, const Upstream& pd, PdAnswer& answer) {
  const http::ClientResult& result = answer.result;
  if (answer.writer != nullptr) {  // the client has its stream: the PD took the request
    count_answer(200);
    if (answer.client_gone) {
      metrics_.add(metric::kProxyClientDisconnects, 1);
    } else if (!result.ok()) {
      // PD failed mid-stream: say so instead of ending as if complete.
      std::string message = "pd " + pd.url + ": " + result.message;
      answer.writer->push(
          "data: " + safe_dump(json{{"error", {{"message", message}, {"type", "pd_failed"}}}}) +
          "\n\n");
    }
    call.reply->end_stream();
    return true;
  }
  if (!result.ok()) {
    answer_pd_failure(call, pd, result);
    return false;
  }
  HttpResponse res;  // the PD's own error answer
  res.status = result.status;
  res.set_content(result.body, "application/json");
  respond(call, std::move(res));
  return false;
}

void Proxy::answer_error(ChatCall& call, const RequestError& error, const char* reason) {
  metrics_.add(metric::kProxyFailures, 1, {{"reason", reason}});
  HttpResponse res;
  send_error(res, error);
  respond(call, std::move(res));
}

void Proxy::answer_abandoned(ChatCall& call) {
  metrics_.add(metric::kProxyClientDisconnects, 1);
  HttpResponse res;
  send_error(res, 499, "client_closed_request", "the client closed its connection");
  respond(call, std::move(res));
}

void Proxy::answer_no_pd(ChatCall& call, const std::string& pd_errors) {
  metrics_.add(metric::kProxyFailures, 1, {{"reason", "no_pd"}});
  HttpResponse res;
  send_error(res, 502, "pd_failed",
             call.members->pds.empty()
                 ? std::string("no PD is known (none given, none registered in etcd)")
                 : "no PD could be reached (" + pd_errors + ")");
  respond(call, std::move(res));
}

void Proxy::answer_pd_failure(ChatCall& call, const Upstream& pd,
                              const http::ClientResult& result) {
  bool timeout = result.error == http::ClientError::kTimeout;
  metrics_.add(metric::kProxyFailures, 1, {{"reason", "pd"}});
  HttpResponse res;
  send_error(res, timeout ? 504 : 502, timeout ? "pd_timeout" : "pd_failed",
             "pd " + pd.url + ": " + result.message);
  respond(call, std::move(res));
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
