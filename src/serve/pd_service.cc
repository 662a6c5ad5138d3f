// The prefill/decode instance (PD): decodes each image (for its mm_hash and token
// count), loads the embeddings through the connector instead of encoding them (or
// encodes on a failed load, per the failure policy), and runs the language model.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>

#include "ecx/common/log.h"
#include "ecx/engine/image.h"
#include "serve/http_util.h"
#include "serve/model_setup.h"

namespace ecx::serve {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

// Images prepared for the requests in flight, so a recompute can encode them.
class PreparedImages {
 public:
  void put(const engine::PreparedImage& img) {
    std::lock_guard lock(mu_);
    auto& e = map_[img.mm_hash];
    if (e.refs++ == 0) e.image = std::make_shared<engine::PreparedImage>(img);
  }

  void drop(const MmHash& h) {
    std::lock_guard lock(mu_);
    auto it = map_.find(h);
    if (it != map_.end() && --it->second.refs == 0) map_.erase(it);
  }
  std::shared_ptr<engine::PreparedImage> get(const MmHash& h) {
    std::lock_guard lock(mu_);
    auto it = map_.find(h);
    return it == map_.end() ? nullptr : it->second.image;
  }

 private:
  struct Entry {
    std::shared_ptr<engine::PreparedImage> image;
    int refs = 0;
  };
  std::mutex mu_;
  std::map<MmHash, Entry> map_;  // guarded by mu_
};

// Everything one chat completion needs after the handler returns (streaming).
struct Job {
  ChatRequest request;
  std::string id;
  std::string request_id;
  std::vector<engine::PromptPart> prompt;
  std::vector<MmHash> images;
  json timings = json::object();
  Clock::time_point start;
  std::atomic<bool> finished{false};
};

}  // namespace

int run_pd_service(const ServiceConfig& config) {
  block_shutdown_signals();
  auto model = load_model(config);
  if (!model.ok()) {
    std::cerr << "ecx serve pd: " << model.status().to_string() << "\n";
    return 1;
  }
  auto encoder = engine::VisionEncoder::create(model->config, model->weights);
  auto lm = engine::LanguageModel::create(model->config, model->weights);
  if (!encoder.ok() || !lm.ok()) {
    std::cerr << "ecx serve pd: " << (encoder.ok() ? lm.status() : encoder.status()).to_string()
              << "\n";
    return 1;
  }
  PreparedImages prepared_images;
  connector::ConnectorContext ctx;
  ctx.recompute = [&](const MmHash& h, const TensorMeta&, std::span<std::byte> out) -> Status {
    auto img = prepared_images.get(h);
    if (!img) return NotFound("no prepared image for " + h.str());
    return (*encoder)->encode(*img, out);
  };
  std::string engine_id = "pd-" + std::to_string(::getpid());
  auto cc = connector_config(config, connector::Role::kConsumer, model->config, engine_id);
  auto conn = cc.ok() ? connector::create_connector(*cc, ctx)
                      : Result<std::unique_ptr<connector::EcConnector>>(cc.status());
  if (!conn.ok()) {
    std::cerr << "ecx serve pd: " << conn.status().to_string() << "\n";
    return 1;
  }
  Metrics metrics;
  engine::ImageLimits limits{config.max_image_bytes, config.max_image_pixels};
  const int64_t embed_dim = model->config.embed_dim;
  httplib::Server server;

  auto finish = [&](const std::shared_ptr<Job>& job) {
    if (job->finished.exchange(true)) return;
    (*conn)->request_finished(job->request_id);
    for (const auto& h : job->images) prepared_images.drop(h);
  };

  server.Post("/v1/chat/completions", [&](const httplib::Request& req, httplib::Response& res) {
    auto job = std::make_shared<Job>();
    job->start = Clock::now();
    if (auto err = parse_chat_request(req.body, config, &job->request)) {
      metrics.add("ecx_request_failures_total", "reason=\"bad_request\"", 1);
      return send_error(res, err->http_status, err->type, err->message);
    }
    job->id = make_id("chatcmpl");
    job->request_id = job->id;
    // Decode every image: PD needs its mm_hash and token count even when not encoding.
    auto t_decode = Clock::now();
    connector::LoadRequest load;
    load.request_id = job->request_id;
    std::map<MmHash, size_t> item_of;
    std::vector<std::pair<MmHash, int64_t>> image_parts;
    for (const auto& msg : job->request.messages) {
      for (const auto& part : msg.parts) {
        if (part.kind != ContentPart::kImage) continue;
        auto image = engine::decode_image(part.image_bytes, limits);
        if (!image.ok()) {
          for (const auto& h : job->images) prepared_images.drop(h);
          int code = image.status().code() == StatusCode::kResourceExhausted ? 413 : 422;
          return send_error(res, code, code == 413 ? "request_too_large" : "invalid_image",
                            image.status().message());
        }
        auto prepared = (*encoder)->prepare(*image);
        if (!prepared.ok()) {
          for (const auto& h : job->images) prepared_images.drop(h);
          return send_error(res, 422, "invalid_image", prepared.status().message());
        }
        image_parts.push_back({prepared->mm_hash, prepared->tokens()});
        if (item_of.count(prepared->mm_hash)) continue;
        prepared_images.put(*prepared);
        job->images.push_back(prepared->mm_hash);
        connector::LoadItem item{prepared->mm_hash, (*encoder)->output_meta(*prepared),
                                 std::nullopt};
        auto p = job->request.ec_transfer_params.find(prepared->mm_hash.str());
        if (p != job->request.ec_transfer_params.end()) {
          auto params = connector::EcTransferParams::from_json(*p);
          if (!params.ok() || !(params->mm_hash == item.mm_hash) || !(params->meta == item.meta)) {
            for (const auto& h : job->images) prepared_images.drop(h);
            return send_error(
                res, 400, "invalid_request_error",
                "ec_transfer_params for " + item.mm_hash.str() + ": " +
                    (params.ok()
                         ? std::string("mm_hash or tensor geometry does not match the image")
                         : params.status().message()));
          }
          item.params = *params;
        }
        item_of[item.mm_hash] = load.items.size();
        load.items.push_back(std::move(item));
      }
    }
    job->timings["decode_image_ms"] = ms_since(t_decode);
    // The prompt must fit the model before anything is loaded or allocated.
    int64_t estimated_tokens = 1;
    for (const auto& msg : job->request.messages) {
      estimated_tokens += static_cast<int64_t>(msg.role.size()) + 3;
      for (const auto& part : msg.parts) estimated_tokens += static_cast<int64_t>(part.text.size());
    }
    for (const auto& [hash, tokens] : image_parts) estimated_tokens += tokens;
    estimated_tokens += 11;  // "assistant: "
    if (estimated_tokens + job->request.max_tokens > config.max_model_len) {
      for (const auto& h : job->images) prepared_images.drop(h);
      return send_error(res, 400, "context_length_exceeded",
                        "prompt of " + std::to_string(estimated_tokens) +
                            " tokens plus max_tokens " + std::to_string(job->request.max_tokens) +
                            " exceeds the model's " + std::to_string(config.max_model_len) +
                            " tokens");
    }
    // Load the embeddings (or encode them, per the failure policy).
    auto t_load = Clock::now();
    connector::LoadOutcome outcome;
    if (!load.items.empty())
      outcome = (*conn)->load(load, Deadline::after_ms(config.request_timeout_ms));
    double load_ms = ms_since(t_load);
    double encode_ms = 0;
    for (const auto& item : outcome.items) encode_ms += item.recompute_ms;
    job->timings["ec_load_ms"] = load_ms - encode_ms;
    job->timings["encode_ms"] = encode_ms;
    int recomputed = 0;
    for (const auto& it : outcome.items) recomputed += it.recomputed;
    job->timings["items_recomputed"] = recomputed;
    metrics.observe("ecx_ec_load_seconds", "", (load_ms - encode_ms) / 1000);
    metrics.add("ecx_ec_bytes_loaded_total", "", static_cast<double>(outcome.bytes));
    metrics.add("ecx_items_recomputed_total", "", recomputed);
    if (!outcome.status.ok()) {
      finish(job);
      metrics.add("ecx_request_failures_total",
                  "reason=\"" + std::string(status_code_name(outcome.status.code())) + "\"", 1);
      int code = outcome.status.code() == StatusCode::kDeadlineExceeded ? 504 : 502;
      return send_error(res, code, "ec_load_failed", outcome.status.to_string());
    }
    // Prompt: "<role>: <text and images>\n" per message, then "assistant: ".
    size_t next_image = 0;
    for (const auto& msg : job->request.messages) {
      job->prompt.push_back({msg.role + ": ", {}, 0});
      for (const auto& part : msg.parts) {
        if (part.kind == ContentPart::kText) {
          job->prompt.push_back({part.text, {}, 0});
          continue;
        }
        const auto& [hash, tokens] = image_parts[next_image++];
        auto block = (*conn)->loaded(job->request_id, hash);
        if (!block.ok() ||
            static_cast<int64_t>(block->payload_length()) != tokens * embed_dim * 2) {
          finish(job);
          return send_error(res, 500, "internal_error",
                            "embeddings of " + hash.str() + " are not available");
        }
        job->prompt.push_back({"", {block->payload(), block->payload_length()}, tokens});
      }
      job->prompt.push_back({"\n", {}, 0});
    }
    job->prompt.push_back({"assistant: ", {}, 0});

    const auto& r = job->request;
    engine::GenerateOptions gen{r.max_tokens, r.ignore_eos};
    auto chunk = [job](const json& delta, const json& finish_reason) {
      json c = {
          {"id", job->id},
          {"object", "chat.completion.chunk"},
          {"created", std::time(nullptr)},
          {"model", job->request.model},
          {"choices",
           json::array({{{"index", 0}, {"delta", delta}, {"finish_reason", finish_reason}}})}};
      return "data: " + c.dump() + "\n\n";
    };
    auto record = [&metrics, job](bool ok, int generated, double prefill_ms, double total_ms) {
      job->timings["prefill_ms"] = prefill_ms;
      job->timings["decode_ms"] = total_ms - prefill_ms;
      metrics.add("ecx_requests_total", ok ? "status=\"ok\"" : "status=\"error\"", 1);
      metrics.observe("ecx_request_seconds", "", ms_since(job->start) / 1000);
      metrics.add("ecx_generated_tokens_total", "", generated);
    };
    if (!r.stream) {
      std::string text;
      int generated = 0;
      double prefill_ms = 0;
      auto t_gen = Clock::now();
      auto prompt_tokens = (*lm)->generate(
          job->prompt, gen,
          [&](const std::string& t) {
            text += t;
            return true;
          },
          &generated, &prefill_ms);
      record(prompt_tokens.ok(), generated, prefill_ms, ms_since(t_gen));
      finish(job);
      if (!prompt_tokens.ok()) return send_status(res, prompt_tokens.status());
      json out = {
          {"id", job->id},
          {"object", "chat.completion"},
          {"created", std::time(nullptr)},
          {"model", r.model},
          {"choices",
           json::array({{{"index", 0},
                         {"message", {{"role", "assistant"}, {"content", text}}},
                         {"finish_reason", generated >= r.max_tokens ? "length" : "stop"}}})},
          {"usage",
           {{"prompt_tokens", *prompt_tokens},
            {"completion_tokens", generated},
            {"total_tokens", *prompt_tokens + generated}}},
          {"ecx_timings", job->timings}};
      res.set_content(safe_dump(out), "application/json");
      return;
    }
    // Streaming: generate inside the content provider, one SSE event per token.
    auto engine_lm = lm->get();
    res.set_chunked_content_provider(
        "text/event-stream",
        [job, gen, chunk, record, finish, engine_lm](size_t, httplib::DataSink& sink) {
          auto write = [&sink](const std::string& s) { return sink.write(s.data(), s.size()); };
          bool open = write(chunk({{"role", "assistant"}, {"content", ""}}, nullptr));
          int generated = 0;
          double prefill_ms = 0;
          auto t_gen = Clock::now();
          auto prompt_tokens = engine_lm->generate(
              job->prompt, gen,
              [&](const std::string& t) {
                return open = open && write(chunk({{"content", t}}, nullptr));
              },
              &generated, &prefill_ms);
          record(prompt_tokens.ok() && open, generated, prefill_ms, ms_since(t_gen));
          finish(job);
          if (open && !prompt_tokens.ok()) {
            // Headers are sent: report the failure in the stream, and do not claim success.
            json err = {{"error",
                         {{"message", prompt_tokens.status().message()},
                          {"type", std::string(status_code_name(prompt_tokens.status().code()))}}}};
            write("data: " + safe_dump(err) + "\n\n");
            return false;
          }
          if (open) {
            json last = json::parse(
                chunk(json::object(), generated >= job->request.max_tokens ? "length" : "stop")
                    .substr(6));
            last["ecx_timings"] = job->timings;
            write("data: " + last.dump() + "\n\n");
            if (job->request.include_usage && prompt_tokens.ok()) {
              json usage = {{"id", job->id},
                            {"object", "chat.completion.chunk"},
                            {"created", std::time(nullptr)},
                            {"model", job->request.model},
                            {"choices", json::array()},
                            {"usage",
                             {{"prompt_tokens", *prompt_tokens},
                              {"completion_tokens", generated},
                              {"total_tokens", *prompt_tokens + generated}}}};
              write("data: " + usage.dump() + "\n\n");
            }
            write("data: [DONE]\n\n");
            sink.done();
          }
          return open;
        },
        // Also runs when the client went away before streaming began: nothing stays pinned.
        [job, finish](bool) { finish(job); });
  });
  add_common_routes(server, config, "pd", [&] {
    json s = connector::to_json((*conn)->stats());
    if (s.contains("consumer_cache")) {
      for (const char* k : {"capacity_bytes", "used_bytes", "entries", "pins", "evictions"}) {
        metrics.set(std::string("ecx_cache_") + k, "", s["consumer_cache"][k].get<double>());
      }
    }
    if (s.contains("nacks")) {
      for (const auto& [code, n] : s["nacks"].items())
        metrics.set("ecx_ec_nacks", "code=\"" + code + "\"", n.get<double>());
    }
    // ec_transfer_params refused: unsigned, not signed by this deployment, or not this item's.
    if (s.contains("params_rejected")) {
      metrics.set("ecx_ec_params_rejected_total", "", s["params_rejected"].get<double>());
    }
    return metrics.render("ecx prefill/decode service");
  });
  return serve_until_signal(server, config, "pd");
}

}  // namespace ecx::serve
