// The proxy's side of its encoders: encoding an image on the best live encoder, with
// failover, and giving back the params of a request abandoned before a PD read them.
// Encoders speak ecx's API (POST /v1/encode) or vLLM's (a chat completion holding the
// image, answered with ec_transfer_params), as the proxy's --upstream-api says. Every
// call is asynchronous, on the proxy's pooled HTTP client (http/http_client.h).
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "ecx/engine/image.h"
#include "ecx/serve/services.h"
#include "http/http_client.h"
#include "serve/upstream.h"

namespace ecx::serve {

// What the proxy asks an encoder for one media item (an image; with vllm, also a video
// or an audio clip).
struct EncodeCall {
  UpstreamApi api = UpstreamApi::kEcx;
  // The item, as a view of the request the proxy forwards (which outlives the call): a
  // large item is held once, not once more per call. A data URL, or (input_audio) the
  // audio's base64 data.
  std::string_view data_url;
  // vllm: the content part type that carries the item (image_url, video_url, audio_url,
  // input_audio) and, for input_audio, its format.
  std::string part_type = "image_url";
  std::string audio_format;
  // vllm: the request's model, and the image's key (the part's own "uuid", else one
  // derived from its bytes), which the PD's copy of the image carries too.
  std::string model;
  std::string uuid;
  // ecx: the size of every image of the chat (from their headers), so E refuses a chat
  // whose images could never fit the context before it encodes any of them.
  std::shared_ptr<const std::vector<engine::ImageSize>> chat_image_sizes;
  // The request's client hung up: the call ends (http::ClientRequest::cancel), and no other
  // encoder is tried.
  std::shared_ptr<http::Cancellation> cancel;
};

// One encode call: POST /v1/encode (ecx) or POST /v1/chat/completions (vllm).
struct EncodeResult {
  int http_status = 0;  // 200 on success; 0 = no HTTP answer (see transport)
  http::ClientError transport = http::ClientError::kNone;
  bool timed_out = false;
  // A 200 with a well-formed answer: the image's mm_hash and E's ec_transfer_params for
  // it. A vLLM encoder whose connector hands nothing over (shared storage) answers no
  // params: encoded, with mm_hash empty.
  bool encoded = false;
  std::string mm_hash;
  nlohmann::json params;
  std::string error;       // why not encoded
  std::string error_type;  // an error answer's type (context_length_exceeded, ...), if any
};
// Calls `done` once, on a client thread.
void call_encoder(http::HttpClient& client, std::shared_ptr<Upstream> encoder,
                  const EncodeCall& call, int64_t timeout_ms,
                  std::function<void(EncodeResult)> done);

// What encoding one image came to.
struct ImageEncode {
  enum Outcome { kEncoded, kClientError, kFallback } outcome = kFallback;
  EncodeResult result;                // the encoder's answer (kEncoded, kClientError)
  std::shared_ptr<Upstream> encoder;  // kEncoded: the encoder that holds the params' pin
  std::string why;                    // kFallback: the last failure
  std::string reason_label;  // kFallback: no_live_encoder | encoder_failed | timeout | cancelled
  int failed_attempts = 0;
  double ms = 0;
};

// The live encoders for an image, best first: rendezvous hashing, so the same bytes
// reach the same encoder while it lives, and the next-best one when it does not.
UpstreamList encoder_order(const UpstreamList& encoders, uint64_t key);

// The live encoders in turn, starting at the turn-th (modulo their number), whatever the
// image: round robin (the others follow in order, for failover).
UpstreamList encoder_turn(const UpstreamList& encoders, uint64_t turn);

// Tries the encoders of `order` until one encodes the image, all within one encode
// deadline, and calls `done` once with the outcome. A client error (bad image) ends the
// search: another encoder would say the same.
void encode_with_failover(http::HttpClient& client, UpstreamList order, EncodeCall call,
                          int64_t timeout_ms, std::function<void(ImageEncode)> done);

// The ec_transfer_params a request got from its encoders, per encoder: {mm_hash: params}.
using IssuedParams = std::map<std::shared_ptr<Upstream>, nlohmann::json>;

// Gives the params of abandoned requests back to the encoders that issued them
// (POST /v1/ec/release), so their pins end now rather than when their lease runs out.
// Nothing waits for it; each call is bounded by `timeout`. Best effort: an encoder that
// cannot be reached keeps its pins until the lease ends them. An encoder without that
// endpoint (404: vLLM's) has nothing to release.
class ParamsReleaser {
 public:
  // `on_released(n)`: an encoder confirmed n released params (on a client thread).
  ParamsReleaser(http::HttpClient& client, std::chrono::milliseconds timeout,
                 std::function<void(int)> on_released);

  void release(const IssuedParams& issued);

 private:
  http::HttpClient& client_;
  const std::chrono::milliseconds timeout_;
  const std::function<void(int)> on_released_;
};

}  // namespace ecx::serve
