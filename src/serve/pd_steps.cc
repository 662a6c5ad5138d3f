#include "serve/pd_steps.h"

#include <ctime>
#include <set>

#include "ecx/common/json_reader.h"

namespace ecx::serve {

using nlohmann::json;

void PreparedImages::put(const engine::PreparedImage& image) {
  MutexLock lock(&mu_);
  auto& e = map_[image.mm_hash];
  if (e.refs++ == 0) e.image = std::make_shared<engine::PreparedImage>(image);
}

void PreparedImages::drop(const MmHash& mm_hash) {
  MutexLock lock(&mu_);
  auto it = map_.find(mm_hash);
  if (it != map_.end() && --it->second.refs == 0) map_.erase(it);
}

std::shared_ptr<engine::PreparedImage> PreparedImages::get(const MmHash& mm_hash) {
  MutexLock lock(&mu_);
  auto it = map_.find(mm_hash);
  return it == map_.end() ? nullptr : it->second.image;
}

RequestHold::RequestHold(PreparedImages& images, connector::EcConnector& connector,
                         std::string request_id)
    : images_(images), connector_(connector), request_id_(std::move(request_id)) {
  unloaded_.request_id = request_id_;
}

void RequestHold::hold_images(const std::vector<engine::PreparedImage>& images) {
  for (const auto& image : images) {
    images_.put(image);
    held_.push_back(image.mm_hash);
  }
}

void RequestHold::release() {
  if (released_.exchange(true)) return;
  if (load_started_) {
    connector_.request_finished(request_id_);
  } else if (!unloaded_.items.empty()) {
    connector_.discard(unloaded_);
  }
  for (const auto& h : held_) images_.drop(h);
}

connector::LoadRequest params_as_load(const std::string& request_id,
                                      const json& ec_transfer_params) {
  connector::LoadRequest load;
  load.request_id = request_id;
  if (!ec_transfer_params.is_object()) return load;
  for (const auto& [key, value] : ec_transfer_params.items()) {
    auto params = connector::EcTransferParams::from_json(value);
    if (!params.ok()) continue;
    load.items.push_back({params->mm_hash, params->meta, std::move(*params)});
  }
  return load;
}

namespace {

RequestError image_error(const Status& s) {
  int code = s.code() == StatusCode::kResourceExhausted ? 413 : 422;
  return {code, code == 413 ? "request_too_large" : "invalid_image", s.message()};
}

}  // namespace

std::optional<RequestError> decode_images(const ChatRequest& request,
                                          const engine::VisionEncoder& encoder,
                                          const engine::ImageLimits& limits, DecodedImages* out) {
  std::set<MmHash> seen;
  for (const auto& msg : request.messages) {
    for (const auto& part : msg.parts) {
      if (part.kind != ContentPart::kImage) continue;
      auto image = engine::decode_image(part.media_bytes, limits);
      if (!image.ok()) return image_error(image.status());
      auto prepared = encoder.prepare(*image);
      if (!prepared.ok()) return RequestError{422, "invalid_image", prepared.status().message()};
      out->slots.push_back({prepared->mm_hash, prepared->tokens()});
      if (seen.insert(prepared->mm_hash).second) out->distinct.push_back(std::move(*prepared));
    }
  }
  return std::nullopt;
}

std::optional<RequestError> plan_load(const std::string& request_id, const DecodedImages& images,
                                      const json& ec_transfer_params,
                                      const engine::VisionEncoder& encoder,
                                      connector::LoadRequest* out) {
  out->request_id = request_id;
  for (const auto& image : images.distinct) {
    connector::LoadItem item{image.mm_hash, encoder.output_meta(image), std::nullopt};
    auto p = ec_transfer_params.find(image.mm_hash.str());
    if (p != ec_transfer_params.end()) {
      auto params = connector::EcTransferParams::from_json(*p);
      if (!params.ok() || !(params->mm_hash == item.mm_hash) || !(params->meta == item.meta)) {
        return RequestError{
            400, "invalid_request_error",
            "ec_transfer_params for " + item.mm_hash.str() + ": " +
                (params.ok() ? std::string("mm_hash or tensor geometry does not match the image")
                             : params.status().message())};
      }
      item.params = std::move(*params);
    }
    out->items.push_back(std::move(item));
  }
  return std::nullopt;
}

int64_t Prompt::tokens() const {
  int64_t n = 1;  // BOS
  for (const auto& part : parts) n += static_cast<int64_t>(part.text.size()) + part.image_tokens;
  return n;
}

Prompt build_prompt(const ChatRequest& request, const std::vector<ImageSlot>& images) {
  Prompt prompt;
  size_t next_image = 0;
  for (const auto& msg : request.messages) {
    prompt.parts.push_back({msg.role + ": ", {}, 0});
    for (const auto& part : msg.parts) {
      if (part.kind == ContentPart::kText) {
        prompt.parts.push_back({part.text, {}, 0});
        continue;
      }
      const ImageSlot& image = images.at(next_image++);
      prompt.images.emplace_back(prompt.parts.size(), image.mm_hash);
      prompt.parts.push_back({"", {}, image.tokens});
    }
    prompt.parts.push_back({"\n", {}, 0});
  }
  prompt.parts.push_back({"assistant: ", {}, 0});
  return prompt;
}

std::optional<RequestError> check_prompt_length(const Prompt& prompt, int max_tokens,
                                                int64_t max_model_len) {
  int64_t tokens = prompt.tokens();
  if (tokens + max_tokens <= max_model_len) return std::nullopt;
  return RequestError{400, "context_length_exceeded",
                      "prompt of " + std::to_string(tokens) + " tokens plus max_tokens " +
                          std::to_string(max_tokens) + " exceeds the model's " +
                          std::to_string(max_model_len) + " tokens"};
}

LoadReport load_embeddings(connector::EcConnector& connector, const connector::LoadRequest& load,
                           Deadline deadline) {
  LoadReport report;
  auto t0 = Clock::now();
  if (!load.items.empty()) report.outcome = connector.load(load, deadline);
  report.load_ms = ms_since(t0);
  for (const auto& item : report.outcome.items) {
    report.encode_ms += item.recompute_ms;
    report.recomputed += item.recomputed;
  }
  return report;
}

RequestError load_error(const Status& status) {
  int code = status.code() == StatusCode::kDeadlineExceeded ? 504 : 502;
  return {code, "ec_load_failed", status.to_string()};
}

std::optional<RequestError> attach_embeddings(Prompt& prompt, const LoadedFn& loaded,
                                              int64_t embed_dim) {
  for (const auto& [index, mm_hash] : prompt.images) {
    engine::PromptPart& part = prompt.parts[index];
    auto block = loaded(mm_hash);
    if (!block.ok() ||
        static_cast<int64_t>(block->payload_length()) != part.image_tokens * embed_dim * 2) {
      return RequestError{500, "internal_error",
                          "embeddings of " + mm_hash.str() + " are not available"};
    }
    part.image = {block->payload(), block->payload_length()};
  }
  return std::nullopt;
}

Generation generate(const engine::LanguageModel& lm, const Prompt& prompt,
                    const ChatRequest& request,
                    const std::function<bool(const std::string&)>& on_token) {
  Generation g;
  auto t0 = Clock::now();
  auto prompt_tokens = lm.generate(prompt.parts, {request.max_tokens, request.ignore_eos}, on_token,
                                   &g.generated, &g.prefill_ms);
  g.total_ms = ms_since(t0);
  if (prompt_tokens.ok()) {
    g.prompt_tokens = *prompt_tokens;
  } else {
    g.status = prompt_tokens.status();
  }
  return g;
}

const char* finish_reason(const Generation& generation, int max_tokens) {
  return generation.generated >= max_tokens ? "length" : "stop";
}

json usage_json(const Generation& generation) {
  return {{"prompt_tokens", generation.prompt_tokens},
          {"completion_tokens", generation.generated},
          {"total_tokens", generation.prompt_tokens + generation.generated}};
}

json completion_json(const std::string& id, const ChatRequest& request, const std::string& text,
                     const Generation& generation, const json& timings) {
  json choice = {{"index", 0},
                 {"message", {{"role", "assistant"}, {"content", text}}},
                 {"finish_reason", finish_reason(generation, request.max_tokens)}};
  return {{"id", id},
          {"object", "chat.completion"},
          {"created", std::time(nullptr)},
          {"model", request.model},
          {"choices", json::array({choice})},
          {"usage", usage_json(generation)},
          {"ecx_timings", timings}};
}

json chunk_json(const std::string& id, const std::string& model, const json& delta,
                const json& finish_reason, const json* timings) {
  json chunk = {
      {"id", id},
      {"object", "chat.completion.chunk"},
      {"created", std::time(nullptr)},
      {"model", model},
      {"choices",
       json::array({{{"index", 0}, {"delta", delta}, {"finish_reason", finish_reason}}})}};
  if (timings) chunk["ecx_timings"] = *timings;
  return chunk;
}

json usage_chunk_json(const std::string& id, const std::string& model,
                      const Generation& generation) {
  return {{"id", id},       {"object", "chat.completion.chunk"}, {"created", std::time(nullptr)},
          {"model", model}, {"choices", json::array()},          {"usage", usage_json(generation)}};
}

std::string sse_event(const json& data) { return "data: " + safe_dump(data) + "\n\n"; }

}  // namespace ecx::serve
