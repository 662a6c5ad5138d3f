#include "serve/encoder_client.h"

#include <algorithm>

#include "ecx/common/checksum.h"
#include "ecx/common/deadline.h"
#include "ecx/common/json_reader.h"
#include "ecx/common/log.h"

namespace ecx::serve {

using nlohmann::json;
namespace {

bool is_client_error(int http_status) {
  return http_status == 400 || http_status == 413 || http_status == 422;
}

// A 200 answer: {"mm_hash": string, "ec_transfer_params": object, ...}.
void read_encode_answer(const std::string& body, EncodeResult& r, const std::string& url) {
  auto doc = parse_json_object(body, "encoder " + url + " answer");
  if (!doc.ok()) {
    r.error = doc.status().message();
    return;
  }
  JsonReader answer(*doc, "encoder " + url + " answer");
  auto mm_hash = answer.string("mm_hash", Presence::kRequired);
  auto params = answer.object("ec_transfer_params", Presence::kRequired);
  if (!mm_hash.ok() || !params.ok()) {
    r.error = (mm_hash.ok() ? params.status() : mm_hash.status()).message();
    return;
  }
  r.encoded = true;
  r.mm_hash = std::move(*mm_hash);
  r.params = **params;
}

// The entry of a vLLM-shaped ec_transfer_params {mm_hash: params} that is the one image
// sent: the one whose item_indices hold 0, else the only one. Entries that are not
// objects are not params.
const nlohmann::json::object_t::value_type* entry_for_the_image(const json& by_hash) {
  const json::object_t& entries = by_hash.get_ref<const json::object_t&>();
  const json::object_t::value_type* only = nullptr;
  int objects = 0;
  for (const auto& entry : entries) {
    if (!entry.second.is_object()) continue;
    ++objects;
    only = &entry;
    auto indices = entry.second.find("item_indices");
    if (indices == entry.second.end() || !indices->is_array()) continue;
    for (const auto& i : *indices) {
      if (i.is_number_integer() && i.get<int64_t>() == 0) return &entry;
    }
  }
  return objects == 1 ? only : nullptr;
}

// A 200 answer of a vLLM-shaped encoder to a chat completion holding one image: its
// top-level ec_transfer_params, absent or empty when its connector hands nothing over.
void read_chat_answer(const std::string& body, EncodeResult& r, const std::string& url) {
  std::string what = "encoder " + url + " answer";
  auto doc = parse_json_object(body, what);
  if (!doc.ok()) {
    r.error = doc.status().message();
    return;
  }
  auto params = JsonReader(*doc, what).object("ec_transfer_params");
  if (!params.ok()) {
    r.error = params.status().message();
    return;
  }
  if (*params == nullptr || (*params)->empty()) {
    r.encoded = true;
    return;
  }
  const auto* entry = entry_for_the_image(**params);
  if (entry == nullptr) {
    r.error = what + ": no ec_transfer_params entry is the image (item_indices [0])";
    return;
  }
  r.encoded = true;
  r.mm_hash = entry->first;
  r.params = entry->second;
}

// The body of a vLLM encode call: the item alone (no text), with its uuid, not streamed
// and with no max_tokens (an encode-only instance stops once the item is encoded).
std::string chat_body(const EncodeCall& call) {
  json part = {{"type", call.part_type}};
  if (call.part_type == "input_audio") {
    part["input_audio"] = {{"data", call.data_url}, {"format", call.audio_format}};
  } else {
    part[call.part_type] = {{"url", call.data_url}};
  }
  if (!call.uuid.empty()) part["uuid"] = call.uuid;
  json message = {{"role", "user"}, {"content", json::array({part})}};
  return safe_dump(
      {{"model", call.model}, {"messages", json::array({message})}, {"stream", false}});
}

// {"image": URL, "chat_image_sizes": [[w, h], ...]}: written straight from the URL when it
// needs no escaping (a data URL is base64), so a large image is not copied into a JSON
// document first.
std::string encode_body(const EncodeCall& call) {
  json sizes = json::array();
  if (call.chat_image_sizes) {
    for (const auto& size : *call.chat_image_sizes) sizes.push_back({size.width, size.height});
  }
  std::string_view data_url = call.data_url;
  const bool plain = std::all_of(data_url.begin(), data_url.end(), [](char c) {
    return c != '"' && c != '\\' && static_cast<unsigned char>(c) >= 0x20;
  });
  if (!plain) return safe_dump(json{{"image", data_url}, {"chat_image_sizes", sizes}});
  std::string tail = sizes.dump();
  std::string body;
  body.reserve(data_url.size() + tail.size() + 40);
  body.append(R"({"image":")").append(data_url).append(R"(","chat_image_sizes":)");
  body.append(tail).append("}");
  return body;
}

// The message and type of an error answer {"error": {"message": ..., "type": ...}}, or its
// first 500 bytes and no type.
std::pair<std::string, std::string> error_of(const std::string& body) {
  auto doc = parse_json_object(body, "error answer");
  if (doc.ok()) {
    auto error = JsonReader(*doc, "error answer").child("error");
    auto message = error.ok() ? error->string("message", Presence::kRequired, 4096)
                              : Result<std::string>(error.status());
    auto type = error.ok() ? error->string("type", Presence::kOptional, 64)
                           : Result<std::string>(error.status());
    if (message.ok()) return {*message, type.ok() ? *type : ""};
  }
  return {body.substr(0, 500), ""};
}

}  // namespace

void call_encoder(http::HttpClient& client, std::shared_ptr<Upstream> e, const EncodeCall& call,
                  int64_t timeout_ms, std::function<void(EncodeResult)> done) {
  bool vllm = call.api == UpstreamApi::kVllm;
  http::ClientRequest request;
  request.target = vllm ? "/v1/chat/completions" : "/v1/encode";
  request.body = vllm ? chat_body(call) : encode_body(call);
  request.connect_timeout = std::chrono::milliseconds(std::min<int64_t>(timeout_ms, 5000));
  request.timeout = std::chrono::milliseconds(timeout_ms);
  request.cancel = call.cancel;
  e->in_flight++;
  client.send(e->host, e->port, std::move(request),
              [e, vllm, done = std::move(done)](http::ClientResult res) {
                e->in_flight--;
                EncodeResult r;
                if (!res.ok()) {
                  r.transport = res.error;
                  r.timed_out = res.error == http::ClientError::kTimeout;
                  r.error = "encoder " + e->url + ": " + res.message;
                  if (res.error == http::ClientError::kConnect) e->mark_down(res.message);
                  return done(std::move(r));
                }
                r.http_status = res.status;
                if (res.status == 200) {
                  vllm ? read_chat_answer(res.body, r, e->url)
                       : read_encode_answer(res.body, r, e->url);
                } else {
                  auto [message, type] = error_of(res.body);
                  r.error = "encoder " + e->url + " answered " + std::to_string(res.status) + ": " +
                            message;
                  r.error_type = std::move(type);
                }
                done(std::move(r));
              });
}

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

UpstreamList encoder_turn(const UpstreamList& encoders, uint64_t turn) {
  UpstreamList live;
  for (const auto& e : encoders) {
    if (e->reachable()) live.push_back(e);
  }
  if (!live.empty()) {
    std::rotate(live.begin(), live.begin() + static_cast<ptrdiff_t>(turn % live.size()),
                live.end());
  }
  return live;
}

namespace {

// One image's way through its encoders, one call at a time.
struct Failover : std::enable_shared_from_this<Failover> {
  Failover(http::HttpClient& c, UpstreamList o, EncodeCall ca, int64_t timeout_ms,
           std::function<void(ImageEncode)> d)
      : client(c),
        order(std::move(o)),
        call(std::move(ca)),
        deadline(Deadline::after_ms(timeout_ms)),
        done(std::move(d)) {
    out.why = "no reachable encoder";
    out.reason_label = "no_live_encoder";
  }

  void next() {
    if (index >= order.size()) return end();
    int64_t left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline.remaining()).count();
    if (left <= 0) {
      out.reason_label = "timeout";
      return end();
    }
    std::shared_ptr<Upstream> e = order[index++];
    call_encoder(client, e, call, left, [self = shared_from_this(), e](EncodeResult r) {
      self->on_answer(e, std::move(r));
    });
  }

  void on_answer(const std::shared_ptr<Upstream>& e, EncodeResult r) {
    if (r.encoded) {
      out.outcome = ImageEncode::kEncoded;
      out.result = std::move(r);
      out.encoder = e;
      return end();
    }
    if (is_client_error(r.http_status)) {
      out.outcome = ImageEncode::kClientError;
      out.result = std::move(r);
      return end();
    }
    if (r.transport == http::ClientError::kCancelled) {
      out.why = r.error;
      out.reason_label = "cancelled";
      return end();
    }
    out.failed_attempts++;
    out.why = r.error.empty() ? "encoder " + e->url + ": malformed answer" : r.error;
    out.reason_label = r.timed_out ? "timeout" : "encoder_failed";
    next();
  }

  void end() {
    out.ms = ms_since(t0);
    done(std::move(out));
  }

  http::HttpClient& client;
  const UpstreamList order;
  const EncodeCall call;
  const Deadline deadline;
  const Clock::time_point t0 = Clock::now();
  std::function<void(ImageEncode)> done;
  size_t index = 0;
  ImageEncode out;
};

}  // namespace

void encode_with_failover(http::HttpClient& client, UpstreamList order, EncodeCall call,
                          int64_t timeout_ms, std::function<void(ImageEncode)> done) {
  std::make_shared<Failover>(client, std::move(order), std::move(call), timeout_ms, std::move(done))
      ->next();
}

ParamsReleaser::ParamsReleaser(http::HttpClient& client, std::chrono::milliseconds timeout,
                               std::function<void(int)> on_released)
    : client_(client), timeout_(timeout), on_released_(std::move(on_released)) {}

void ParamsReleaser::release(const IssuedParams& issued) {
  for (const auto& entry : issued) {
    const auto& encoder = entry.first;  // not a structured binding: clang 14 cannot capture one
    const auto& params = entry.second;
    http::ClientRequest request;
    request.target = "/v1/ec/release";
    request.body = safe_dump(json{{"ec_transfer_params", params}});
    request.connect_timeout = timeout_;
    request.timeout = timeout_;
    client_.send(
        encoder->host, encoder->port, std::move(request),
        [encoder, on_released = on_released_](http::ClientResult res) {
          if (res.ok() && res.status == 404) {
            spdlog::debug(
                "event=release_skipped encoder={}: no release endpoint (a vLLM "
                "encoder)",
                encoder->url);
            return;
          }
          if (!res.ok() || res.status != 200) {
            spdlog::warn("event=release_failed encoder={} error=\"{}\"", encoder->url,
                         res.ok() ? std::to_string(res.status) + ": " + error_of(res.body).first
                                  : res.message);
            return;
          }
          auto doc = parse_json_object(res.body, "release answer");
          if (!doc.ok()) return;
          auto released =
              JsonReader(*doc, "release answer").u64("released", Presence::kRequired, 1 << 20);
          if (released.ok() && *released > 0) on_released(static_cast<int>(*released));
        });
  }
}

}  // namespace ecx::serve
