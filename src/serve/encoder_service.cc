// The encode instance (E): decodes an image, runs the vision encoder straight into the
// connector's block (no extra copy), and answers with the params PD needs. A request
// that will not reach a PD gives those params back (POST /v1/ec/release), so their pins
// end at once instead of at the lease.
//
// Two request shapes reach the same path: ecx's own POST /v1/encode (one image), and the
// chat completion vLLM's EPD proxy sends an encode-only instance (POST
// /v1/chat/completions holding the request's images; its text is ignored), answered with
// a top-level ec_transfer_params {mm_hash: params + modality, item_indices, metadata}.
#include <unistd.h>

#include <ctime>
#include <iostream>
#include <limits>
#include <map>

#include "ecx/common/json_reader.h"
#include "ecx/common/log.h"
#include "ecx/engine/image.h"
#include "http_server/http_server.h"
#include "http_server/metric_families.h"
#include "http_server/metrics.h"
#include "openai/openai_request.h"
#include "serve/instance_registration.h"
#include "serve/model_setup.h"
#include "serve/request_error.h"

namespace ecx::serve {
namespace {

using nlohmann::json;
// A /v1/encode body {"image": "data:image/...;base64,...", "chat_image_sizes": [[w, h],
// ...]}: the image's data URL and, when a proxy sends it, the size of every image of the
// chat it belongs to (its own included), read from their headers.
struct EncodeBody {
  std::string data_url;
  std::vector<engine::ImageSize> chat_image_sizes;
};

constexpr int64_t kMaxImageSide = 1 << 20;
// Sizes one encode call may list: the proxy's --max-images may be above this E's.
constexpr size_t kMaxChatImageSizes = 4096;

Result<std::vector<engine::ImageSize>> read_image_sizes(const json* sizes) {
  std::vector<engine::ImageSize> out;
  if (sizes == nullptr) return out;
  if (sizes->size() > kMaxChatImageSizes) {
    return InvalidArgument("chat_image_sizes lists " + std::to_string(sizes->size()) +
                           " images; at most " + std::to_string(kMaxChatImageSizes));
  }
  for (const json& size : *sizes) {
    const bool pair = size.is_array() && size.size() == 2 && size[0].is_number_integer() &&
                      size[1].is_number_integer();
    if (!pair || size[0].get<int64_t>() < 1 || size[0].get<int64_t>() > kMaxImageSide ||
        size[1].get<int64_t>() < 1 || size[1].get<int64_t>() > kMaxImageSide) {
      return InvalidArgument("chat_image_sizes must be [[width, height], ...] of 1 to " +
                             std::to_string(kMaxImageSide) + " pixels each");
    }
    out.push_back({size[0].get<int>(), size[1].get<int>()});
  }
  return out;
}

Result<EncodeBody> read_encode_body(const std::string& body) {
  static const std::string kShape =
      "body must be {\"image\": \"data:image/...;base64,...\"} (and optionally "
      "\"chat_image_sizes\": [[width, height], ...])";
  auto doc = parse_json_object(body, "encode body");
  if (!doc.ok()) return InvalidArgument(kShape);
  JsonReader reader(*doc, "encode body");
  auto image = reader.string("image", Presence::kRequired, std::numeric_limits<size_t>::max());
  if (!image.ok()) return InvalidArgument(kShape);
  auto sizes = reader.array("chat_image_sizes", Presence::kOptional);
  if (!sizes.ok()) return InvalidArgument(kShape);
  ECX_ASSIGN_OR_RETURN(auto chat_image_sizes, read_image_sizes(*sizes));
  return EncodeBody{std::move(*image), std::move(chat_image_sizes)};
}

// The params of a /v1/ec/release body {"ec_transfer_params": {<mm_hash>: <params>, ...}}:
// each must parse and be keyed by its own mm_hash.
Result<std::vector<connector::EcTransferParams>> read_release_body(const std::string& body) {
  ECX_ASSIGN_OR_RETURN(json doc, parse_json_object(body, "release body"));
  JsonReader reader(doc, "release body");
  ECX_ASSIGN_OR_RETURN(const json* by_hash,
                       reader.object("ec_transfer_params", Presence::kRequired));
  std::vector<connector::EcTransferParams> out;
  for (const auto& [key, value] : by_hash->items()) {
    auto params = connector::EcTransferParams::from_json(value);
    if (!params.ok()) return params.status().with_context("ec_transfer_params for " + key);
    if (params->mm_hash.str() != key) {
      return InvalidArgument("ec_transfer_params for " + key + " name mm_hash " +
                             params->mm_hash.str());
    }
    out.push_back(std::move(*params));
  }
  return out;
}

// A chat completion body as vLLM's EPD proxy sends it to an encoder: it may leave out the
// model (null), which then means the one served here.
std::optional<RequestError> read_chat_body(const std::string& body,
                                           const CommonServiceConfig& config, ChatRequest* out) {
  auto doc = parse_chat_body(body, config);
  if (!doc.ok()) return RequestError{400, "invalid_request_error", doc.status().message()};
  auto model = doc->find("model");
  if (model == doc->end() || model->is_null()) (*doc)["model"] = config.model;
  if (auto err = parse_chat_document(std::move(*doc), config, out)) return err;
  if (out->stream) {
    return RequestError{400, "invalid_request_error",
                        "the encoder answers chat completions with stream=false only"};
  }
  return std::nullopt;
}

// What saving one image's embeddings came to.
struct Saved {
  connector::EcTransferParams params;
  bool cached = false;  // already held, or encoded by a concurrent request: not encoded here
};

// One distinct image of a chat request, and where it occurs among the request's images.
struct ChatImage {
  engine::PreparedImage prepared;
  std::vector<int> item_indices;  // positions among the request's image parts, from 0
};

// The answer to a chat completion: an OpenAI chat.completion with no generated text,
// `ec_transfer_params` at the top level (what vLLM's encode-only instance answers).
json chat_answer(const std::string& model, int64_t image_tokens, json ec_transfer_params) {
  json message = {{"role", "assistant"}, {"content", ""}};
  return {
      {"id", make_id("chatcmpl")},
      {"object", "chat.completion"},
      {"created", static_cast<int64_t>(std::time(nullptr))},
      {"model", model},
      {"choices", json::array({{{"index", 0},
                                {"message", message},
                                {"logprobs", nullptr},
                                {"finish_reason", "stop"}}})},
      {"usage",
       {{"prompt_tokens", image_tokens}, {"completion_tokens", 0}, {"total_tokens", image_tokens}}},
      {"ec_transfer_params", std::move(ec_transfer_params)}};
}

class EncoderService {
 public:
  // `config` must outlive the service.
  static Result<std::unique_ptr<EncoderService>> create(const EncoderServiceConfig& config);

  void handle_encode(const HttpRequest& req, HttpResponse& res);
  void handle_chat(const HttpRequest& req, HttpResponse& res);
  void handle_release(const HttpRequest& req, HttpResponse& res);
  std::string render_metrics();
  // Lets consumers finish reading what this encoder handed out (bounded).
  void drain() { connector_->wait_for_readers(Deadline::after_ms(5000)).ignore_error(); }
  const std::string& compat_hash() const { return connector_->compat_hash(); }

 private:
  explicit EncoderService(const EncoderServiceConfig& config) : config_(config) {}
  // The image's params: those of the block this encoder holds, or a new block encoded
  // straight into the connector's pool.
  Result<Saved> save(const engine::PreparedImage& image, const TensorMeta& meta,
                     const HttpRequest& req);
  // The two steps both request shapes take, each counting its failures: decode and
  // prepare an image from its bytes; then encode it into the connector (or find it held).
  std::optional<RequestError> prepare(std::string_view bytes, engine::PreparedImage* out);
  // Stops at its next step when `req`'s client has gone (abandoned()).
  std::optional<RequestError> encode(const engine::PreparedImage& image, const HttpRequest& req,
                                     Saved* out);
  // 400 context_length_exceeded for images whose `tokens` (each counted as often as the
  // request uses it) could never fit the model's context: nothing is encoded for them.
  std::optional<RequestError> check_fits(int64_t tokens);
  // check_fits for a chat's images of these sizes (their grids, from the sizes alone).
  std::optional<RequestError> check_chat_fits(const std::vector<engine::ImageSize>& sizes);
  // Every image part of `chat`, prepared, each distinct image once.
  std::optional<RequestError> prepare_all(const ChatRequest& chat, std::vector<ChatImage>* out);
  // Ends the pins of params issued to a request that then failed.
  void release_all(const std::vector<connector::EcTransferParams>& issued);

  const EncoderServiceConfig& config_;
  ModelBundle model_;  // the encoder reads its weights
  std::unique_ptr<engine::VisionEncoder> encoder_;
  std::unique_ptr<connector::EcConnector> connector_;
  Metrics metrics_;
};

Result<std::unique_ptr<EncoderService>> EncoderService::create(const EncoderServiceConfig& config) {
  std::unique_ptr<EncoderService> e(new EncoderService(config));
  ECX_ASSIGN_OR_RETURN(e->model_, load_model(config.common, config.engine));
  const ModelBundle& model = e->model_;
  std::string engine_id = "e-" + std::to_string(::getpid());
  ECX_ASSIGN_OR_RETURN(auto cc, connector_config(config.engine, connector::Role::kProducer,
                                                 model.config, engine_id));
  ECX_ASSIGN_OR_RETURN(e->connector_, connector::create_connector(cc));
  ECX_ASSIGN_OR_RETURN(e->encoder_, engine::VisionEncoder::create(model.config, model.weights));
  return e;
}

// Times a request that finds its image being encoded by another waits for it and, when
// that one was given up, tries to encode it itself.
constexpr int kSaveAttempts = 3;

Result<Saved> EncoderService::save(const engine::PreparedImage& image, const TensorMeta& meta,
                                   const HttpRequest& req) {
  auto held = connector_->saved_params(image.mm_hash);
  if (held.ok()) return Saved{std::move(*held), true};
  auto slot = connector_->begin_save(image.mm_hash, meta);
  // Encoded concurrently by another request: its params, once ready (that request counts
  // the encode; this one encoded nothing). If that encode was given up (its client left),
  // this request encodes the image itself.
  for (int attempt = 0;
       attempt < kSaveAttempts && !slot.ok() && slot.status().code() == StatusCode::kAlreadyExists;
       ++attempt) {
    auto params = connector_->saved_params(image.mm_hash);
    if (params.ok()) return Saved{std::move(*params), true};
    if (req.abandoned()) return params.status();
    slot = connector_->begin_save(image.mm_hash, meta);
  }
  if (!slot.ok()) return slot.status();
  if (Status s = encoder_->encode(image, slot->payload, [&req] { return req.abandoned(); });
      !s.ok()) {
    connector_->abort_save(*slot);
    return s;
  }
  ECX_ASSIGN_OR_RETURN(auto params, connector_->commit_save(*slot));
  return Saved{std::move(params), false};
}

std::optional<RequestError> EncoderService::prepare(std::string_view bytes,
                                                    engine::PreparedImage* out) {
  auto image = engine::decode_image(
      bytes, {config_.common.max_image_bytes, config_.common.max_image_pixels});
  if (!image.ok()) {
    metrics_.add(metric::kEncodeFailures, 1, {{"reason", "bad_image"}});
    int code = image.status().code() == StatusCode::kResourceExhausted ? 413 : 422;
    return RequestError{code, code == 413 ? "request_too_large" : "invalid_image",
                        image.status().message()};
  }
  auto prepared = encoder_->prepare(*image);
  if (!prepared.ok()) return RequestError{422, "invalid_image", prepared.status().message()};
  *out = std::move(*prepared);
  return std::nullopt;
}

std::optional<RequestError> EncoderService::check_fits(int64_t tokens) {
  if (tokens < config_.max_model_len) return std::nullopt;
  metrics_.add(metric::kEncodeFailures, 1, {{"reason", "context_length_exceeded"}});
  return RequestError{400, "context_length_exceeded",
                      "the images take " + std::to_string(tokens) +
                          " tokens; the model's context is " +
                          std::to_string(config_.max_model_len) +
                          " (--max-model-len): they could never be served, so they are not "
                          "encoded"};
}

std::optional<RequestError> EncoderService::check_chat_fits(
    const std::vector<engine::ImageSize>& sizes) {
  int64_t tokens = 0;
  for (const engine::ImageSize& size : sizes) {
    auto grid = encoder_->grid_for(size.width, size.height);
    if (!grid.ok()) return RequestError{422, "invalid_image", grid.status().message()};
    tokens += grid->tokens();
  }
  return check_fits(tokens);
}

std::optional<RequestError> EncoderService::encode(const engine::PreparedImage& image,
                                                   const HttpRequest& req, Saved* out) {
  TensorMeta meta = encoder_->output_meta(image);
  auto saved = save(image, meta, req);
  if (!saved.ok()) {
    const Status& s = saved.status();
    metrics_.add(metric::kEncodeFailures, 1, {{"reason", std::string(status_code_name(s.code()))}});
    // A full pool is this server's condition, not the client's: 503, not 413.
    if (s.code() == StatusCode::kResourceExhausted) {
      return RequestError{503, "encoder_busy", s.message()};
    }
    return RequestError{http_status_for(s), std::string(status_code_name(s.code())), s.message()};
  }
  metrics_.add(metric::kEncodeRequests, 1, {{"cache", saved->cached ? "hit" : "miss"}});
  metrics_.add(metric::kEcBytesSaved, saved->cached ? 0 : static_cast<double>(meta.byte_size()));
  *out = std::move(*saved);
  return std::nullopt;
}

void EncoderService::handle_encode(const HttpRequest& req, HttpResponse& res) {
  auto t0 = Clock::now();
  auto body = read_encode_body(req.body);
  if (!body.ok()) {
    metrics_.add(metric::kEncodeFailures, 1, {{"reason", "bad_request"}});
    return send_error(res, 400, "invalid_request_error", body.status().message());
  }
  // The whole chat must fit the context before this image of it is even decoded.
  if (auto err = check_chat_fits(body->chat_image_sizes)) return send_error(res, *err);
  auto bytes = engine::decode_data_url(body->data_url);
  if (!bytes.ok()) return send_error(res, 400, "invalid_request_error", bytes.status().message());
  engine::PreparedImage prepared;
  if (auto err = prepare(*bytes, &prepared)) return send_error(res, *err);
  if (auto err = check_fits(prepared.tokens())) return send_error(res, *err);
  Saved saved;
  if (auto err = encode(prepared, req, &saved)) return send_error(res, *err);
  double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  metrics_.observe(metric::kEncodeSeconds, ms / 1000);
  res.set_content(json{{"mm_hash", prepared.mm_hash.str()},
                       {"num_tokens", prepared.tokens()},
                       {"ec_transfer_params", saved.params.to_json()},
                       {"encode_ms", ms},
                       {"cached", saved.cached}}
                      .dump(),
                  "application/json");
}

std::optional<RequestError> EncoderService::prepare_all(const ChatRequest& chat,
                                                        std::vector<ChatImage>* out) {
  std::map<MmHash, size_t> index_of;  // mm_hash -> its place in `out`
  int item = 0;
  for (const auto& msg : chat.messages) {
    for (const auto& part : msg.parts) {
      if (part.kind != ContentPart::kImage) continue;
      engine::PreparedImage prepared;
      if (auto err = prepare(part.media_bytes, &prepared)) return err;
      auto [at, added] = index_of.emplace(prepared.mm_hash, out->size());
      if (added) out->push_back({std::move(prepared), {}});
      (*out)[at->second].item_indices.push_back(item++);
    }
  }
  return std::nullopt;
}

void EncoderService::release_all(const std::vector<connector::EcTransferParams>& issued) {
  for (const auto& p : issued) connector_->release_params(p).ignore_error();
}

// Every image is prepared before any is encoded, so a bad image takes no pins; an encode
// that fails part way releases the params issued before it.
void EncoderService::handle_chat(const HttpRequest& req, HttpResponse& res) {
  auto t0 = Clock::now();
  ChatRequest chat;
  if (auto err = read_chat_body(req.body, config_.common, &chat)) {
    metrics_.add(metric::kEncodeFailures, 1, {{"reason", "bad_request"}});
    return send_error(res, *err);
  }
  // From the images' headers first: a chat that could never fit is refused before any
  // image is decoded.
  if (auto err = check_chat_fits(image_sizes(chat, config_.common))) return send_error(res, *err);
  std::vector<ChatImage> images;
  if (auto err = prepare_all(chat, &images)) return send_error(res, *err);
  int64_t needed = 0;
  for (const ChatImage& image : images) {
    needed += static_cast<int64_t>(image.prepared.tokens() * image.item_indices.size());
  }
  if (auto err = check_fits(needed)) return send_error(res, *err);
  json by_hash = json::object();
  std::vector<connector::EcTransferParams> issued;
  int64_t tokens = 0;
  for (const ChatImage& image : images) {
    Saved saved;
    if (auto err = encode(image.prepared, req, &saved)) {
      release_all(issued);
      return send_error(res, *err);
    }
    json entry = saved.params.to_json();
    entry["modality"] = "image";
    entry["item_indices"] = image.item_indices;
    entry["metadata"] = json::object();  // PD derives the placeholders from the image
    by_hash[image.prepared.mm_hash.str()] = std::move(entry);
    tokens += static_cast<int64_t>(image.prepared.tokens() * image.item_indices.size());
    issued.push_back(std::move(saved.params));
  }
  double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  metrics_.observe(metric::kEncodeSeconds, ms / 1000);
  metrics_.add(metric::kEncodeChatRequests, 1);
  res.set_content(safe_dump(chat_answer(chat.model, tokens, std::move(by_hash))),
                  "application/json");
}

void EncoderService::handle_release(const HttpRequest& req, HttpResponse& res) {
  auto params = read_release_body(req.body);
  if (!params.ok()) {
    return send_error(res, 400, "invalid_request_error", params.status().message());
  }
  int released = 0;
  for (const auto& p : *params) {
    Status s = connector_->release_params(p);
    if (s.ok()) {
      ++released;
    } else {
      spdlog::warn("event=release_refused mm_hash={} error=\"{}\"", p.mm_hash.str(), s.to_string());
    }
  }
  res.set_content(json{{"released", released}}.dump(), "application/json");
}

std::string EncoderService::render_metrics() {
  set_producer_metrics(connector_->stats(), metrics_);
  return metrics_.render();
}

}  // namespace

int run_encoder_service(const EncoderServiceConfig& config) {
  block_shutdown_signals();
  set_log_level(config.common.log_level).ignore_error();
  const bool secured = announce_secret("encoder", config.engine.auth_token,
                                       config.engine.auth_token_file, config.engine.ec_config);
  if (Status s = check_instance_directory(config.directory, config.common); !s.ok()) {
    std::cerr << "ecx serve encoder: " << s.message() << "\n";
    return 2;
  }
  auto encoder = EncoderService::create(config);
  if (!encoder.ok()) {
    std::cerr << "ecx serve encoder: " << encoder.status().to_string() << "\n";
    return 1;
  }
  EncoderService& e = **encoder;
  // The vision encoder is CPU-bound: a few workers; the rest wait in the queue.
  HttpServer server(config.common, "encoder", 4);
  server.work("POST", "/v1/encode",
              [&e](const HttpRequest& req, HttpResponse& res) { e.handle_encode(req, res); });
  server.work("POST", "/v1/chat/completions",
              [&e](const HttpRequest& req, HttpResponse& res) { e.handle_chat(req, res); });
  server.work("POST", "/v1/ec/release",
              [&e](const HttpRequest& req, HttpResponse& res) { e.handle_release(req, res); });
  add_common_routes(server, config.common, "encoder", secured, [&e] { return e.render_metrics(); });
  int rc = serve_registered(server, config.directory, config.common, config.engine, "encoder",
                            e.compat_hash());
  e.drain();  // graceful: consumers finish reading what we handed out
  return rc;
}

}  // namespace ecx::serve
