// The OpenAI chat completion request, as the proxy and the PD accept it: parsed once,
// strictly, through ecx/common/json_reader.h, and validated against the service's limits.
// Images are resolved to their bytes here (data: URLs, or files under --allowed-root).
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ecx/engine/image.h"
#include "ecx/serve/services.h"

namespace ecx::serve {

// An error to answer a request with: the HTTP status, the OpenAI error type, a message.
struct RequestError {
  int http_status;
  std::string type;
  std::string message;
};

struct ContentPart {
  // kText: text (under PartPolicy::kVllm also input_text, output_text and refusal).
  // kImage, kVideo, kAudio: an encoder's input (image_url; under PartPolicy::kVllm also
  // input_image, video_url, audio_url and input_audio).
  enum Kind { kText, kImage, kVideo, kAudio } kind = kText;
  std::string text;
  // Resolved (data: URL or input_audio data decoded, or file read). The part as given
  // stays in ChatRequest::raw only: a large item is not held twice.
  std::string media_bytes;
  std::string type = "text";  // the part's "type", as sent

  bool is_media() const { return kind != kText; }
  // "image", "video" or "audio" (vLLM's modality names). REQUIRES: is_media()
  std::string_view modality() const;
  // The key that holds the part's text ("text", or "refusal"). REQUIRES: !is_media()
  std::string_view text_key() const { return type == "refusal" ? "refusal" : "text"; }
  // The key that holds the part's media (its URL, or input_audio's data and format):
  // "image_url" for input_image, else the type. REQUIRES: is_media()
  std::string_view media_key() const {
    return type == "input_image" ? std::string_view("image_url") : std::string_view(type);
  }
};

// Which content parts a request may hold.
enum class PartPolicy {
  // What ecx's reference engine encodes: text and images; anything else is a 400.
  kReferenceEngine,
  // What a vLLM engine takes (a proxy in front of vLLM encoders and PDs): video and audio
  // resolved like images, and vLLM's other text parts. Parts that carry embeddings are
  // refused (a client does not choose embeddings: it sends the media).
  kVllm,
};

struct ChatMessage {
  std::string role;  // system, user or assistant
  std::vector<ContentPart> parts;
};

struct ChatRequest {
  std::string model;
  std::vector<ChatMessage> messages;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  int max_tokens = 16;
  bool ignore_eos = false;
  // Keyed by mm_hash; each value is read by EcTransferParams::from_json where it is used.
  nlohmann::json ec_transfer_params = nlohmann::json::object();
  nlohmann::json raw;  // the request as received (the proxy forwards it, rewritten)
  int media_count() const;
};

// Parses and validates a chat completion body against `config` (model name, limits);
// resolves media to bytes. Errors carry the HTTP status to answer with: 400 for a
// malformed request or a part `policy` does not take, 413 past a limit (max_images counts
// every media item; max_image_bytes bounds each).
// `model`: kServed refuses a model other than config.model (400 model_not_found); kAny
// leaves the check to the caller.
enum class ModelCheck { kServed, kAny };
std::optional<RequestError> parse_chat_request(const std::string& body,
                                               const CommonServiceConfig& config, ChatRequest* out,
                                               PartPolicy policy = PartPolicy::kReferenceEngine,
                                               ModelCheck model = ModelCheck::kServed);

// The body as a JSON object, within the service's size and nesting limits: the first
// half of parse_chat_request, for a caller that adjusts the document before the second.
Result<nlohmann::json> parse_chat_body(const std::string& body, const CommonServiceConfig& config);
// The second half: validates an object from parse_chat_body.
std::optional<RequestError> parse_chat_document(nlohmann::json body,
                                                const CommonServiceConfig& config, ChatRequest* out,
                                                PartPolicy policy = PartPolicy::kReferenceEngine,
                                                ModelCheck model = ModelCheck::kServed);

// The size of every image part of `chat` (each occurrence), read from its header under
// `config`'s limits: what the chat's images cost the context before any is decoded. An
// image whose header cannot be read is left out (decoding it names the error).
std::vector<engine::ImageSize> image_sizes(const ChatRequest& chat,
                                           const CommonServiceConfig& config);

}  // namespace ecx::serve
