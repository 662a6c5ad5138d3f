// One chat completion's way through the proxy (proxy.h; proxy_service.cc states the
// design): parse, encode_all (the images on their encoders, concurrently, with failover),
// forward_to_pd (the next PD while one cannot be connected to), relay the answer.
#include "serve/proxy.h"
#include "serve/request_error.h"

namespace ecx::serve {

using nlohmann::json;

namespace {

// Bounds the TCP connect to a PD (the library's default is 300 s).
constexpr std::chrono::milliseconds kPdConnectTimeout{3000};

}  // namespace

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

UpstreamList Proxy::pd_order(const UpstreamList& pds, const std::string* model) {
  UpstreamList order;
  for (const auto& pd : pds) {
    if (pd->must_prove() && !pd->proven()) continue;  // never an unproven member
    if (model != nullptr) {
      const std::vector<std::string> served = pd->models();
      if (!served.empty() && std::find(served.begin(), served.end(), *model) == served.end())
        continue;
    }
    order.push_back(pd);
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
  if (auto error = parse(*call)) {
    co_return answer_error(*call, *error,
                           error->http_status == 503 ? "model_not_known_yet" : "bad_request");
  }
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
  const std::string* model = config_.learn_model ? &call->chat.model : nullptr;
  for (const auto& pd : pd_order(call->members->pds, model)) {
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
  const ModelCheck check = config_.learn_model ? ModelCheck::kAny : ModelCheck::kServed;
  if (auto err = parse_chat_request(body, config_.common, &call.chat, parts, check)) return err;
  call.members = upstreams_.snapshot();
  if (config_.learn_model) {
    if (auto err = check_learnt_model(call.chat.model, *call.members)) return err;
  }
  call.forward = std::move(call.chat.raw);
  return std::nullopt;
}

std::vector<std::string> Proxy::served_models(const UpstreamMembers& members) {
  std::vector<std::string> out;
  for (const auto& pd : members.pds) {
    for (auto& m : pd->models()) {
      if (std::find(out.begin(), out.end(), m) == out.end()) out.push_back(std::move(m));
    }
  }
  return out;
}

// A model one of the PDs said it serves (GET /v1/models, asked by the prober); a 503
// while none has said yet.
std::optional<RequestError> Proxy::check_learnt_model(const std::string& model,
                                                      const UpstreamMembers& members) {
  const std::vector<std::string> served = served_models(members);
  if (served.empty()) {
    return RequestError{503, "model_not_known_yet",
                        "no PD has answered GET /v1/models yet, so the proxy does not know the "
                        "served model; retry, or start the proxy with --model"};
  }
  if (std::find(served.begin(), served.end(), model) != served.end()) return std::nullopt;
  return RequestError{400, "model_not_found",
                      "model '" + model.substr(0, 100) + "' is not served here (the PDs serve " +
                          nlohmann::json(served).dump() + ")"};
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

}  // namespace ecx::serve
