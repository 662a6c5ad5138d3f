// Fuzz target: parse_chat_request (src/openai/openai_request.h), the proxy's and PD's parser
// of an OpenAI chat completion body, with the default CommonServiceConfig (no local files).
// Invariants: it never throws; an error is a 400 or 413 with a message; an accepted
// request is within the configured limits, and its parts line up with the raw JSON the
// proxy rewrites by index (raw["messages"][m]["content"][p]); the raw JSON nests no
// deeper than json_too_deep allows (a recursive dump of it must not overflow the stack).
#include <string>
#include <utility>
#include <vector>

#include "ecx/common/json_reader.h"
#include "ecx/serve/services.h"
#include "fuzz/fuzz_target.h"
#include "openai/openai_request.h"

namespace {

using ecx::safe_dump;
using nlohmann::json;

// Nesting depth of a JSON value, without recursion.
int depth_of(const json& root) {
  int deepest = 0;
  std::vector<std::pair<const json*, int>> stack{{&root, 1}};
  while (!stack.empty()) {
    auto [j, depth] = stack.back();
    stack.pop_back();
    if (!j->is_structured()) continue;
    deepest = std::max(deepest, depth);
    for (const auto& child : *j) stack.push_back({&child, depth + 1});
  }
  return deepest;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ecx::serve;
  static const CommonServiceConfig config;
  std::string body(reinterpret_cast<const char*>(data), size);
  ChatRequest chat;
  auto err = parse_chat_request(body, config, &chat);
  if (err) {
    ECX_FUZZ_CHECK(err->http_status == 400 || err->http_status == 413, "unexpected HTTP status");
    ECX_FUZZ_CHECK(!err->message.empty() && !err->type.empty(), "error without a message");
    return 0;
  }
  ECX_FUZZ_CHECK(chat.model == config.model, "accepted another model");
  ECX_FUZZ_CHECK(!chat.messages.empty(), "accepted a request without messages");
  ECX_FUZZ_CHECK(chat.max_tokens >= 1 && chat.max_tokens <= config.max_tokens_limit,
                 "max_tokens outside 1..max_tokens_limit");
  ECX_FUZZ_CHECK(chat.media_count() <= config.max_images, "more images than max_images");
  ECX_FUZZ_CHECK(chat.ec_transfer_params.is_object(), "ec_transfer_params is not an object");
  ECX_FUZZ_CHECK(depth_of(chat.raw) <= 64, "accepted JSON nested deeper than 64 levels");

  const json& raw_messages = chat.raw.at("messages");
  ECX_FUZZ_CHECK(raw_messages.size() == chat.messages.size(), "messages lost or added");
  for (size_t m = 0; m < chat.messages.size(); ++m) {
    const ChatMessage& msg = chat.messages[m];
    ECX_FUZZ_CHECK(msg.role == "system" || msg.role == "user" || msg.role == "assistant",
                   "accepted an unknown role");
    const json& content = raw_messages.at(m).at("content");
    ECX_FUZZ_CHECK(content.is_string() ? msg.parts.size() == 1 : msg.parts.size() == content.size(),
                   "parts do not line up with the raw content");
    for (size_t p = 0; p < msg.parts.size(); ++p) {
      const ContentPart& part = msg.parts[p];
      if (part.kind != ContentPart::kImage) continue;
      ECX_FUZZ_CHECK(part.media_bytes.size() <= config.max_image_bytes, "image over max bytes");
      ECX_FUZZ_CHECK(content.at(p).at("type") == "image_url", "image part is not at its index");
    }
  }
  // What the proxy does with the raw request: copy it and dump it.
  json forward = chat.raw;
  ECX_FUZZ_CHECK(!safe_dump(forward).empty(), "empty dump of an accepted request");
  return 0;
}
