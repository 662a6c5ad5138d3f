// The OpenAI chat completion request, as the proxy and the PD accept it: parsed once,
// strictly, through ecx/common/json_reader.h, and validated against the service's limits.
// Images are resolved to their bytes here (data: URLs, or files under --allowed-root).
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "ecx/serve/services.h"
#include "serve/http_server.h"

namespace ecx::serve {

struct ContentPart {
  enum Kind { kText, kImage } kind = kText;
  std::string text;
  // Resolved (data: URL decoded, or file read). The URL as given stays in
  // ChatRequest::raw only: a large image is not held twice.
  std::string image_bytes;
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
  int image_count() const;
};

// Parses and validates a chat completion body against `config` (model name, limits);
// resolves images to bytes. Errors carry the HTTP status to answer with: 400 for a
// malformed request, 413 past a limit.
std::optional<RequestError> parse_chat_request(const std::string& body,
                                               const CommonServiceConfig& config, ChatRequest* out);

// The body as a JSON object, within the service's size and nesting limits: the first
// half of parse_chat_request, for a caller that adjusts the document before the second.
Result<nlohmann::json> parse_chat_body(const std::string& body, const CommonServiceConfig& config);
// The second half: validates an object from parse_chat_body.
std::optional<RequestError> parse_chat_document(nlohmann::json body,
                                                const CommonServiceConfig& config,
                                                ChatRequest* out);

}  // namespace ecx::serve
