#include "serve/encoder_client.h"

#include <algorithm>

#include "ecx/common/checksum.h"
#include "ecx/common/deadline.h"
#include "ecx/common/json_reader.h"
#include "ecx/common/log.h"

namespace ecx::serve {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

bool connect_failed(httplib::Error e) {
  return e == httplib::Error::Connection || e == httplib::Error::ConnectionTimeout;
}

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

// The body of a vLLM encode call: the image alone (no text), with its uuid, not streamed
// and with no max_tokens (an encode-only instance stops once the image is encoded).
std::string chat_body(const EncodeCall& call) {
  json part = {{"type", "image_url"}, {"image_url", {{"url", call.data_url}}}};
  if (!call.uuid.empty()) part["uuid"] = call.uuid;
  json message = {{"role", "user"}, {"content", json::array({part})}};
  return safe_dump(
      {{"model", call.model}, {"messages", json::array({message})}, {"stream", false}});
}

// The message of an error answer {"error": {"message": ...}}, or its first 500 bytes.
std::string error_message(const std::string& body) {
  auto doc = parse_json_object(body, "error answer");
  if (doc.ok()) {
    auto error = JsonReader(*doc, "error answer").child("error");
    auto message = error.ok() ? error->string("message", Presence::kRequired, 4096)
                              : Result<std::string>(error.status());
    if (message.ok()) return *message;
  }
  return body.substr(0, 500);
}

}  // namespace

EncodeResult call_encoder(Upstream& e, const EncodeCall& call, int64_t timeout_ms) {
  bool vllm = call.api == UpstreamApi::kVllm;
  EncodeResult r;
  auto t0 = Clock::now();
  httplib::Client cli(e.host, e.port);
  cli.set_connection_timeout(std::chrono::milliseconds(std::min<int64_t>(timeout_ms, 5000)));
  cli.set_read_timeout(std::chrono::milliseconds(timeout_ms));
  cli.set_write_timeout(std::chrono::milliseconds(timeout_ms));
  e.in_flight++;
  auto res =
      vllm ? cli.Post("/v1/chat/completions", chat_body(call), "application/json")
           : cli.Post("/v1/encode", json{{"image", call.data_url}}.dump(), "application/json");
  e.in_flight--;
  if (!res) {
    r.transport = res.error();
    r.timed_out = ms_since(t0) >= static_cast<double>(timeout_ms) * 0.95;
    r.error = "encoder " + e.url + ": " + httplib::to_string(res.error());
    if (connect_failed(r.transport)) e.mark_down(httplib::to_string(r.transport));
    return r;
  }
  r.http_status = res->status;
  if (res->status == 200) {
    vllm ? read_chat_answer(res->body, r, e.url) : read_encode_answer(res->body, r, e.url);
  } else {
    r.error = "encoder " + e.url + " answered " + std::to_string(res->status) + ": " +
              error_message(res->body);
  }
  return r;
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

ImageEncode encode_with_failover(const UpstreamList& order, const EncodeCall& call,
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
    EncodeResult r = call_encoder(*e, call, left);
    if (r.encoded) {
      out.outcome = ImageEncode::kEncoded;
      out.result = std::move(r);
      out.encoder = e;
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

ParamsReleaser::ParamsReleaser(std::chrono::milliseconds timeout,
                               std::function<void(int)> on_released)
    : timeout_(timeout), on_released_(std::move(on_released)) {
  thread_ = std::thread([this] { run(); });
}

ParamsReleaser::~ParamsReleaser() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
    if (!queue_.empty()) {
      spdlog::info("event=release_skipped encoders={}: left to the lease", queue_.size());
    }
  }
  cv_.notify_all();
  thread_.join();
}

void ParamsReleaser::release(const IssuedParams& issued) {
  {
    std::lock_guard lock(mu_);
    for (const auto& [encoder, params] : issued) {
      queue_.push_back({encoder, safe_dump(json{{"ec_transfer_params", params}})});
    }
  }
  cv_.notify_all();
}

void ParamsReleaser::run() {
  std::unique_lock lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    Release next = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    int released = post(next);
    if (released > 0) on_released_(released);
    lock.lock();
  }
}

int ParamsReleaser::post(const Release& release) const {
  httplib::Client cli(release.encoder->host, release.encoder->port);
  cli.set_connection_timeout(timeout_);
  cli.set_read_timeout(timeout_);
  cli.set_write_timeout(timeout_);
  auto res = cli.Post("/v1/ec/release", release.body, "application/json");
  if (res && res->status == 404) {
    spdlog::debug("event=release_skipped encoder={}: no release endpoint (a vLLM encoder)",
                  release.encoder->url);
    return 0;
  }
  if (!res || res->status != 200) {
    spdlog::warn("event=release_failed encoder={} error=\"{}\"", release.encoder->url,
                 res ? std::to_string(res->status) + ": " + error_message(res->body)
                     : httplib::to_string(res.error()));
    return 0;
  }
  auto doc = parse_json_object(res->body, "release answer");
  if (!doc.ok()) return 0;
  auto released = JsonReader(*doc, "release answer").u64("released", Presence::kRequired, 1 << 20);
  return released.ok() ? static_cast<int>(*released) : 0;
}

}  // namespace ecx::serve
