// The PD's chat completion as named steps, each a function with a test of its own
// (tests/serve/pd_steps_test.cc). The handler (pd_service.cc) runs them in order:
//
//   parse_chat_request (openai_request.h)
//   -> decode_images        each image decoded, for its mm_hash and token count
//   -> plan_load            one load item per distinct image, with E's params for it
//   -> build_prompt         the prompt's parts; its token count is checked here
//   -> load_embeddings      through the connector (or encoded here, per the policy)
//   -> attach_embeddings    the loaded bytes into the prompt's image parts
//   -> generate             the language model
//   -> respond              completion_json, or the SSE chunks of a stream
//
// What a request holds on the PD is given back by one RequestHold, whatever step it
// stops at.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "ecx/common/mutex.h"
#include "ecx/connector/ec_connector.h"
#include "ecx/engine/model.h"
#include "openai/openai_request.h"

namespace ecx::serve {

// Images prepared for the requests in flight, so a recompute can encode them. Counted
// per mm_hash: two requests with the same image share one entry. Thread-safe.
class PreparedImages {
 public:
  void put(const engine::PreparedImage& image) ECX_EXCLUDES(mu_);
  void drop(const MmHash& mm_hash) ECX_EXCLUDES(mu_);
  std::shared_ptr<engine::PreparedImage> get(const MmHash& mm_hash) ECX_EXCLUDES(mu_);

 private:
  struct Entry {
    std::shared_ptr<engine::PreparedImage> image;
    int refs = 0;
  };
  Mutex mu_;
  std::map<MmHash, Entry> map_ ECX_GUARDED_BY(mu_);
};

// What one request holds on the PD, given back exactly once, on every path (the
// destructor, or release() as soon as the answer is generated): its prepared images,
// and its connector state. Once its load has started the connector's request_finished
// ends it; before that, discard() gives back the producers' pins its params carry.
class RequestHold {
 public:
  RequestHold(PreparedImages& images, connector::EcConnector& connector, std::string request_id);
  ~RequestHold() { release(); }
  RequestHold(const RequestHold&) = delete;
  RequestHold& operator=(const RequestHold&) = delete;

  // What to discard if the request ends before its load starts.
  void discard_on_failure(connector::LoadRequest load) { unloaded_ = std::move(load); }
  // Registers the request's images for a recompute, until release.
  void hold_images(const std::vector<engine::PreparedImage>& images);
  void load_started() { load_started_ = true; }
  // Thread-safe and idempotent.
  void release();

 private:
  PreparedImages& images_;
  connector::EcConnector& connector_;
  const std::string request_id_;
  connector::LoadRequest unloaded_;
  std::vector<MmHash> held_;
  bool load_started_ = false;
  std::atomic<bool> released_{false};
};

// Every ec_transfer_params value of a request that parses, as a load request: what its
// params pin at producers, for RequestHold::discard_on_failure before its images are
// known. Values that do not parse are ignored (they pin nothing).
connector::LoadRequest params_as_load(const std::string& request_id,
                                      const nlohmann::json& ec_transfer_params);

// One image part of a request: its mm_hash and its token count.
struct ImageSlot {
  MmHash mm_hash;
  int64_t tokens = 0;
};

struct DecodedImages {
  std::vector<ImageSlot> slots;                 // every image part, in prompt order
  std::vector<engine::PreparedImage> distinct;  // each distinct image once, first seen first
};

// Decodes and prepares every image of `request`. Errors: 413 past the image limits, 422
// for an image that cannot be decoded.
std::optional<RequestError> decode_images(const ChatRequest& request,
                                          const engine::VisionEncoder& encoder,
                                          const engine::ImageLimits& limits, DecodedImages* out);

// The load: one item per distinct image, with the request's ec_transfer_params for its
// mm_hash when there are any. Params that do not parse, or name another image or tensor
// geometry, are a 400; params for an mm_hash the request does not contain are ignored.
std::optional<RequestError> plan_load(const std::string& request_id, const DecodedImages& images,
                                      const nlohmann::json& ec_transfer_params,
                                      const engine::VisionEncoder& encoder,
                                      connector::LoadRequest* out);

// The prompt the language model reads: "<role>: <text and images>\n" per message, then
// "assistant: ". Built once, before the load: its length is checked from the same parts
// generation reads.
struct Prompt {
  std::vector<engine::PromptPart> parts;
  // Each image part: its index in `parts` and its mm_hash (embeddings attached later).
  std::vector<std::pair<size_t, MmHash>> images;
  // Tokens the language model sees: BOS, one per text byte, each image's tokens.
  int64_t tokens() const;
};
// `images`: the request's image slots, in prompt order (DecodedImages::slots).
Prompt build_prompt(const ChatRequest& request, const std::vector<ImageSlot>& images);
// 400 context_length_exceeded when the prompt plus max_tokens exceeds max_model_len.
std::optional<RequestError> check_prompt_length(const Prompt& prompt, int max_tokens,
                                                int64_t max_model_len);

// What a load came to, with this request's own timings.
struct LoadReport {
  connector::LoadOutcome outcome;
  double load_ms = 0;    // the whole load, including encoding on this PD
  double encode_ms = 0;  // of which items encoded here (recomputed)
  int recomputed = 0;
  double ec_load_ms() const { return load_ms - encode_ms; }
};
// Loads `load`'s embeddings through the connector (or encodes them, per its failure
// policy). Nothing to load: an ok report at once.
LoadReport load_embeddings(connector::EcConnector& connector, const connector::LoadRequest& load,
                           Deadline deadline);
// The answer to a failed load: 504 on a deadline, else 502; type ec_load_failed.
RequestError load_error(const Status& status);

// Points each image part of `prompt` at its loaded embeddings (valid until the request
// is finished). 500 when one is missing or not bf16 [tokens, embed_dim].
using LoadedFn = std::function<Result<cache::BlockRef>(const MmHash&)>;
std::optional<RequestError> attach_embeddings(Prompt& prompt, const LoadedFn& loaded,
                                              int64_t embed_dim);

struct Generation {
  Status status;              // prompt_tokens is set when ok
  int64_t prompt_tokens = 0;  // as the language model counted them
  int generated = 0;
  double prefill_ms = 0;
  double total_ms = 0;
};
// Greedy generation for `request` (max_tokens, ignore_eos); `on_token` gets each token's
// text and returns false to stop.
Generation generate(const engine::LanguageModel& lm, const Prompt& prompt,
                    const ChatRequest& request,
                    const std::function<bool(const std::string&)>& on_token);

// "length" when generation stopped at max_tokens, else "stop".
const char* finish_reason(const Generation& generation, int max_tokens);
// {"prompt_tokens", "completion_tokens", "total_tokens"}.
nlohmann::json usage_json(const Generation& generation);
// The non-streamed answer: a chat.completion with usage and ecx_timings.
nlohmann::json completion_json(const std::string& id, const ChatRequest& request,
                               const std::string& text, const Generation& generation,
                               const nlohmann::json& timings);
// One chat.completion.chunk with one choice; ecx_timings when `timings` is given.
nlohmann::json chunk_json(const std::string& id, const std::string& model,
                          const nlohmann::json& delta, const nlohmann::json& finish_reason,
                          const nlohmann::json* timings = nullptr);
// The last chunk when include_usage: no choices, the usage.
nlohmann::json usage_chunk_json(const std::string& id, const std::string& model,
                                const Generation& generation);
// One server-sent event: "data: <json>\n\n".
std::string sse_event(const nlohmann::json& data);

}  // namespace ecx::serve
