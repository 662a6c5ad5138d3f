#include "openai/openai_request.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>

#include "ecx/common/json_reader.h"
#include "ecx/engine/image.h"

namespace ecx::serve {

using nlohmann::json;

std::string_view ContentPart::modality() const {
  switch (kind) {
    case kVideo:
      return "video";
    case kAudio:
      return "audio";
    default:
      return "image";
  }
}

int ChatRequest::media_count() const {
  int n = 0;
  for (const auto& m : messages) {
    for (const auto& p : m.parts) n += p.is_media();
  }
  return n;
}

namespace {

constexpr size_t kAnyLength = std::numeric_limits<size_t>::max();

RequestError bad(const std::string& message, int status = 400) {
  return RequestError{status, status == 413 ? "request_too_large" : "invalid_request_error",
                      message};
}

RequestError bad(const Status& s) { return bad(s.message()); }

// A content part that carries a media item by URL: its type, its kind, the media type its
// data: URLs must have, and the key that holds its URL.
struct MediaPart {
  std::string_view type;
  ContentPart::Kind kind;
  std::string_view media_type;
  std::string_view key;
};
constexpr MediaPart kMediaParts[] = {{"image_url", ContentPart::kImage, "image", "image_url"},
                                     {"input_image", ContentPart::kImage, "image", "image_url"},
                                     {"video_url", ContentPart::kVideo, "video", "video_url"},
                                     {"audio_url", ContentPart::kAudio, "audio", "audio_url"}};
// vLLM's text parts besides "text" (a proxy in front of vLLM forwards them rebuilt).
constexpr std::string_view kVllmTextParts[] = {"input_text", "output_text", "refusal"};

const MediaPart* media_part(std::string_view type) {
  for (const auto& m : kMediaParts) {
    if (m.type == type) return &m;
  }
  return nullptr;
}

// A local file named by a media URL: it must be a regular file under the allowed root.
std::optional<RequestError> read_local_file(const std::string& url, std::string_view type,
                                            const CommonServiceConfig& config, std::string* bytes) {
  const std::string what(type);
  std::string path = url.rfind("file://", 0) == 0 ? url.substr(7) : url;
  if (config.allowed_root.empty())
    return bad(what + ": local files are not allowed (no --allowed-root)");
  std::error_code ec;
  auto root = std::filesystem::weakly_canonical(config.allowed_root, ec);
  auto file = std::filesystem::weakly_canonical(path, ec);
  auto rel = file.lexically_relative(root);
  if (ec || rel.empty() || rel.native().rfind("..", 0) == 0 ||
      !std::filesystem::is_regular_file(file, ec)) {
    return bad(what + ": '" + path.substr(0, 200) + "' is not a file under the allowed root");
  }
  if (std::filesystem::file_size(file, ec) > config.max_image_bytes) {
    return bad(what + " file exceeds " + std::to_string(config.max_image_bytes) + " bytes", 413);
  }
  std::ifstream in(file, std::ios::binary);
  bytes->assign(std::istreambuf_iterator<char>(in), {});
  return std::nullopt;
}

std::optional<RequestError> check_size(std::string_view type, size_t size,
                                       const CommonServiceConfig& config) {
  if (size <= config.max_image_bytes) return std::nullopt;
  return bad(std::string(type) + " item of " + std::to_string(size) + " bytes exceeds " +
                 std::to_string(config.max_image_bytes),
             413);
}

// Resolves a media URL to its bytes: data: URLs and files under the allowed root.
std::optional<RequestError> resolve_media(const std::string& url, const MediaPart& type,
                                          const CommonServiceConfig& config, std::string* bytes) {
  const std::string what(type.type);
  if (url.rfind("data:", 0) == 0) {
    if (url.size() > config.max_image_bytes * 4 / 3 + 256) {
      return bad(what + " data URL exceeds " + std::to_string(config.max_image_bytes) + " bytes",
                 413);
    }
    auto decoded = engine::decode_data_url(url, type.media_type);
    if (!decoded.ok()) return bad(what + ": " + decoded.status().message());
    *bytes = std::move(*decoded);
  } else if (url.rfind("http://", 0) == 0 || url.rfind("https://", 0) == 0) {
    return bad(what + ": remote URLs are not fetched; send a data: URL or a local file");
  } else if (auto err = read_local_file(url, type.type, config, bytes)) {
    return err;
  }
  return check_size(type.type, bytes->size(), config);
}

// A media part's URL: "KEY": "URL" or "KEY": {"url": "URL"}. Null when there is none.
const std::string* media_url_of(const JsonReader& part, std::string_view key) {
  const json& doc = part.document();
  auto it = doc.find(key);
  if (it == doc.end()) return nullptr;
  if (it->is_string()) return &it->get_ref<const std::string&>();
  auto url = it->is_object() ? it->find("url") : it->end();
  if (it->is_object() && url != it->end() && url->is_string()) {
    return &url->get_ref<const std::string&>();
  }
  return nullptr;
}

// {"type": "input_audio", "input_audio": {"data": BASE64, "format": "wav"}}.
std::optional<RequestError> read_input_audio(const JsonReader& part,
                                             const CommonServiceConfig& config,
                                             std::string* bytes) {
  const char* shape = "input_audio part needs 'input_audio': {'data': base64, 'format': string}";
  auto audio = part.child("input_audio");
  if (!audio.ok() || !audio->object().ok()) return bad(shape);
  auto data = audio->string("data", Presence::kRequired, config.max_image_bytes * 4 / 3 + 4);
  auto format = audio->string("format", Presence::kRequired, 32);
  if (!data.ok() || !format.ok()) return bad(shape);
  auto decoded = engine::base64_decode(*data);
  if (!decoded.ok()) return bad("input_audio: " + decoded.status().message());
  *bytes = std::move(*decoded);
  return check_size("input_audio", bytes->size(), config);
}

// A text part: "text", or under kVllm one of vLLM's other text parts.
std::optional<RequestError> read_text_part(const JsonReader& part, std::string type,
                                           ChatMessage* msg) {
  ContentPart p;
  p.type = std::move(type);
  const std::string key(p.text_key());
  auto text = part.string(key, Presence::kRequired, kAnyLength);
  if (!text.ok()) return bad(p.type + " part needs a string '" + key + "'");
  p.text = std::move(*text);
  msg->parts.push_back(std::move(p));
  return std::nullopt;
}

bool is_vllm_text_part(std::string_view type) {
  return std::find(std::begin(kVllmTextParts), std::end(kVllmTextParts), type) !=
         std::end(kVllmTextParts);
}

std::optional<RequestError> read_content_part(const JsonReader& part,
                                              const CommonServiceConfig& config, PartPolicy policy,
                                              ChatMessage* msg) {
  if (!part.object().ok()) return bad("every content part needs a string 'type'");
  auto type = part.string("type", Presence::kRequired, kAnyLength);
  if (!type.ok()) return bad("every content part needs a string 'type'");
  const bool vllm = policy == PartPolicy::kVllm;
  if (*type == "text" || (vllm && is_vllm_text_part(*type))) {
    return read_text_part(part, std::move(*type), msg);
  }
  const MediaPart* media = media_part(*type);
  const bool audio = *type == "input_audio";
  if (!vllm && (audio || (media != nullptr && media->type != "image_url"))) {
    return bad("content part '" + *type +
               "': ecx's reference engine encodes images only; video and audio go to vLLM "
               "encoders and PDs (the proxy's --upstream-api vllm)");
  }
  if (media == nullptr && !audio) {
    if (vllm && type->find("embeds") != std::string::npos) {
      return bad("content part '" + type->substr(0, 50) +
                 "' is not forwarded: a client does not choose embeddings (send the media)");
    }
    return bad("unsupported content part type '" + type->substr(0, 50) + "'");
  }
  ContentPart p;
  p.kind = audio ? ContentPart::kAudio : media->kind;
  p.type = std::move(*type);
  if (audio) {
    if (auto err = read_input_audio(part, config, &p.media_bytes)) return err;
  } else {
    const std::string* url = media_url_of(part, media->key);
    if (url == nullptr) {
      return bad(p.type + " part needs '" + std::string(media->key) + "': {'url': string}");
    }
    if (auto err = resolve_media(*url, *media, config, &p.media_bytes)) return err;
  }
  msg->parts.push_back(std::move(p));
  return std::nullopt;
}

std::optional<RequestError> read_message(const JsonReader& m, const CommonServiceConfig& config,
                                         PartPolicy policy, ChatMessage* msg) {
  if (!m.object().ok()) return bad("every message needs a string 'role'");
  auto role = m.string("role", Presence::kRequired, kAnyLength);
  if (!role.ok()) return bad("every message needs a string 'role'");
  msg->role = std::move(*role);
  if (msg->role != "system" && msg->role != "user" && msg->role != "assistant") {
    return bad("unknown role '" + msg->role.substr(0, 50) + "'");
  }
  auto content = m.document().find("content");
  if (content != m.document().end() && content->is_string()) {
    ContentPart text;
    text.text = content->get<std::string>();
    msg->parts.push_back(std::move(text));
    return std::nullopt;
  }
  if (content == m.document().end() || !content->is_array()) {
    return bad("'content' must be a string or an array of parts");
  }
  for (size_t i = 0; i < content->size(); ++i) {
    JsonReader part((*content)[i], m.where() + ".content[" + std::to_string(i) + "]");
    if (auto err = read_content_part(part, config, policy, msg)) return err;
  }
  return std::nullopt;
}

// max_tokens, or its newer name max_completion_tokens (null = absent).
std::optional<RequestError> read_max_tokens(const JsonReader& r, int limit, ChatRequest* out) {
  for (const char* key : {"max_tokens", "max_completion_tokens"}) {
    auto it = r.document().find(key);
    if (it == r.document().end() || it->is_null()) continue;
    auto v = r.i64(key, 1, limit);
    if (!v.ok()) return bad(v.status());
    out->max_tokens = static_cast<int>(*v);
  }
  return std::nullopt;
}

// Everything but the messages: model, stream, stream_options, max_tokens, ignore_eos,
// ec_transfer_params.
std::optional<RequestError> read_options(const JsonReader& r, const CommonServiceConfig& config,
                                         ModelCheck check, ChatRequest* out) {
  auto model = r.string("model", Presence::kRequired, kAnyLength);
  if (!model.ok()) return bad(model.status());
  out->model = std::move(*model);
  if (check == ModelCheck::kServed && out->model != config.model) {
    return RequestError{400, "model_not_found",
                        "model '" + out->model.substr(0, 100) + "' is not served here (this is '" +
                            config.model + "')"};
  }
  auto stream = r.boolean("stream");
  if (!stream.ok()) return bad(stream.status());
  out->stream = *stream;
  auto stream_options = r.child("stream_options");
  if (!stream_options.ok()) return bad(stream_options.status());
  auto include_usage = stream_options->boolean("include_usage");
  if (!include_usage.ok()) return bad(include_usage.status());
  out->include_usage = *include_usage;
  if (auto err = read_max_tokens(r, config.max_tokens_limit, out)) return err;
  auto ignore_eos = r.boolean("ignore_eos");
  if (!ignore_eos.ok()) return bad(ignore_eos.status());
  out->ignore_eos = *ignore_eos;
  auto params = r.object("ec_transfer_params");
  if (!params.ok()) return bad("'ec_transfer_params' must be an object keyed by mm_hash");
  if (*params != nullptr) out->ec_transfer_params = **params;
  return std::nullopt;
}

}  // namespace

std::optional<RequestError> parse_chat_request(const std::string& body,
                                               const CommonServiceConfig& config, ChatRequest* out,
                                               PartPolicy policy, ModelCheck model) {
  auto doc = parse_chat_body(body, config);
  if (!doc.ok()) return bad(doc.status());
  return parse_chat_document(std::move(*doc), config, out, policy, model);
}

Result<json> parse_chat_body(const std::string& body, const CommonServiceConfig& config) {
  return parse_json_object(body, "request body", JsonLimits{config.max_body_bytes, 64});
}

std::optional<RequestError> parse_chat_document(json body, const CommonServiceConfig& config,
                                                ChatRequest* out, PartPolicy policy,
                                                ModelCheck model) {
  out->raw = std::move(body);
  JsonReader request(out->raw, "request");
  if (auto err = read_options(request, config, model, out)) return err;
  auto messages = request.array("messages", Presence::kRequired);
  if (!messages.ok() || (*messages)->empty()) return bad("'messages' must be a non-empty array");
  for (size_t i = 0; i < (*messages)->size(); ++i) {
    ChatMessage msg;
    JsonReader m((**messages)[i], "request.messages[" + std::to_string(i) + "]");
    if (auto err = read_message(m, config, policy, &msg)) return err;
    out->messages.push_back(std::move(msg));
    if (out->media_count() > config.max_images) {
      return bad("more than " + std::to_string(config.max_images) +
                     " media items (images, videos, audio) in one request",
                 413);
    }
  }
  return std::nullopt;
}

std::vector<engine::ImageSize> image_sizes(const ChatRequest& chat,
                                           const CommonServiceConfig& config) {
  const engine::ImageLimits limits{config.max_image_bytes, config.max_image_pixels};
  std::vector<engine::ImageSize> sizes;
  for (const auto& message : chat.messages) {
    for (const auto& part : message.parts) {
      if (part.kind != ContentPart::kImage) continue;
      auto size = engine::read_image_size(part.media_bytes, limits);
      if (size.ok()) sizes.push_back(*size);
    }
  }
  return sizes;
}

}  // namespace ecx::serve
