// The prefill/decode instance (PD): decodes each image (for its mm_hash and token
// count), loads the embeddings through the connector instead of encoding them (or
// encodes on a failed load, per the failure policy), and runs the language model. The
// chat handler runs the steps of serve/pd_steps.h in order.
#include <unistd.h>

#include <iostream>

#include "ecx/common/checksum.h"
#include "ecx/common/json_reader.h"
#include "ecx/common/log.h"
#include "http_server/http_server.h"
#include "http_server/metric_families.h"
#include "http_server/metrics.h"
#include "openai/openai_request.h"
#include "serve/instance_registration.h"
#include "serve/model_setup.h"
#include "serve/pd_steps.h"
#include "serve/request_error.h"

namespace ecx::serve {
namespace {

using nlohmann::json;

// One chat completion, from the handler to the end of its answer (a stream outlives
// the handler).
struct Job {
  Job(PreparedImages& images, connector::EcConnector& connector, std::string id)
      : id(std::move(id)), hold(images, connector, this->id) {}

  const std::string id;  // the answer's id, and the connector's request id
  const Clock::time_point start = Clock::now();
  ChatRequest request;
  Prompt prompt;
  json timings = json::object();  // ecx_timings
  RequestHold hold;               // gives back what the request holds, on every path
  std::shared_ptr<const http::Cancellation> client_gone;  // HttpRequest::client_gone

  bool abandoned() const { return client_gone && client_gone->cancelled(); }
};

class PdService {
 public:
  // `config` must outlive the service.
  static Result<std::unique_ptr<PdService>> create(const PdServiceConfig& config);
  // Stops in a stated order: the connector first (its loaders may still recompute an
  // item, which reads the prepared images and runs the encoder), then the rest.
  ~PdService() { connector_.reset(); }
  PdService(const PdService&) = delete;
  PdService& operator=(const PdService&) = delete;

  void handle_chat(const HttpRequest& req, HttpResponse& res);
  std::string render_metrics();
  const std::string& compat_hash() const { return connector_->compat_hash(); }

 private:
  explicit PdService(const PdServiceConfig& config) : config_(config) {}
  // decode_images -> plan_load -> build_prompt -> load -> attach_embeddings.
  std::optional<RequestError> prepare_prompt(Job& job);
  std::optional<RequestError> load(Job& job, const connector::LoadRequest& load);
  void answer(Job& job, HttpResponse& res);
  void answer_streaming(const std::shared_ptr<Job>& job, HttpResponse& res);
  // Writes the whole stream; false when it ended early (client gone, or a failure).
  bool stream(Job& job, StreamWriter& writer);
  void record(Job& job, const Generation& generation, bool ok);

  const PdServiceConfig& config_;
  ModelBundle model_;  // the encoder and the language model read its weights
  std::unique_ptr<engine::VisionEncoder> encoder_;
  std::unique_ptr<engine::LanguageModel> lm_;
  PreparedImages prepared_images_;                     // read by the connector's recompute
  std::unique_ptr<connector::EcConnector> connector_;  // stopped first, by ~PdService
  Metrics metrics_;
};

Result<std::unique_ptr<PdService>> PdService::create(const PdServiceConfig& config) {
  std::unique_ptr<PdService> pd(new PdService(config));
  ECX_ASSIGN_OR_RETURN(pd->model_, load_model(config.common, config.engine));
  const ModelBundle& model = pd->model_;
  ECX_ASSIGN_OR_RETURN(pd->encoder_, engine::VisionEncoder::create(model.config, model.weights));
  ECX_ASSIGN_OR_RETURN(pd->lm_, engine::LanguageModel::create(model.config, model.weights));
  connector::ConnectorContext ctx;
  PdService* self = pd.get();
  ctx.recompute = [self](const MmHash& h, const TensorMeta&, std::span<std::byte> out) -> Status {
    auto image = self->prepared_images_.get(h);
    if (!image) return NotFound("no prepared image for " + h.str());
    return self->encoder_->encode(*image, out);
  };
  std::string engine_id = "pd-" + std::to_string(::getpid());
  ECX_ASSIGN_OR_RETURN(auto cc, connector_config(config.engine, connector::Role::kConsumer,
                                                 model.config, engine_id));
  ECX_ASSIGN_OR_RETURN(pd->connector_, connector::create_connector(cc, ctx));
  return pd;
}

void PdService::handle_chat(const HttpRequest& req, HttpResponse& res) {
  auto job = std::make_shared<Job>(prepared_images_, *connector_, make_id("chatcmpl"));
  job->client_gone = req.client_gone;
  if (auto err = parse_chat_request(req.body, config_.common, &job->request)) {
    metrics_.add(metric::kRequestFailures, 1, {{"reason", "bad_request"}});
    return send_error(res, *err);
  }
  if (auto err = prepare_prompt(*job)) return send_error(res, *err);
  if (job->request.stream) return answer_streaming(job, res);
  answer(*job, res);
}

std::optional<RequestError> PdService::prepare_prompt(Job& job) {
  // Until the load starts, a failure gives back the pins the request's params carry.
  job.hold.discard_on_failure(params_as_load(job.id, job.request.ec_transfer_params));
  auto t_decode = Clock::now();
  DecodedImages images;
  engine::ImageLimits limits{config_.common.max_image_bytes, config_.common.max_image_pixels};
  if (auto err = decode_images(job.request, *encoder_, limits, &images)) return err;
  job.hold.hold_images(images.distinct);
  connector::LoadRequest load_request;
  if (auto err =
          plan_load(job.id, images, job.request.ec_transfer_params, *encoder_, &load_request)) {
    return err;
  }
  job.timings["decode_image_ms"] = ms_since(t_decode);
  // The prompt must fit the model before anything is loaded or allocated.
  job.prompt = build_prompt(job.request, images.slots);
  if (auto err = check_prompt_length(job.prompt, job.request.max_tokens, config_.max_model_len)) {
    return err;
  }
  if (auto err = load(job, load_request)) return err;
  auto loaded = [&](const MmHash& h) { return connector_->loaded(job.id, h); };
  if (auto err = attach_embeddings(job.prompt, loaded, model_.config.embed_dim)) return err;
  // What the model will read, per distinct image: `ecx eval` compares it across
  // connectors.
  json checksums = json::array();
  for (const auto& image : images.distinct) {
    auto ref = loaded(image.mm_hash);
    checksums.push_back(ref.ok() ? checksum64(ref->payload(), ref->meta.byte_size()) : 0);
  }
  job.timings["embedding_checksums"] = std::move(checksums);
  return std::nullopt;
}

std::optional<RequestError> PdService::load(Job& job, const connector::LoadRequest& load_request) {
  job.hold.load_started();
  LoadReport report =
      load_embeddings(*connector_, load_request, Deadline::after_ms(config_.request_timeout_ms));
  job.timings["ec_load_ms"] = report.ec_load_ms();
  job.timings["encode_ms"] = report.encode_ms;
  job.timings["items_recomputed"] = report.recomputed;
  metrics_.observe(metric::kEcLoadSeconds, report.ec_load_ms() / 1000);
  metrics_.add(metric::kEcBytesLoaded, static_cast<double>(report.outcome.bytes));
  metrics_.add(metric::kItemsRecomputed, report.recomputed);
  const Status& status = report.outcome.status;
  if (status.ok()) return std::nullopt;
  metrics_.add(metric::kRequestFailures, 1,
               {{"reason", std::string(status_code_name(status.code()))}});
  return load_error(status);
}

void PdService::record(Job& job, const Generation& generation, bool ok) {
  job.timings["prefill_ms"] = generation.prefill_ms;
  job.timings["decode_ms"] = generation.total_ms - generation.prefill_ms;
  metrics_.add(metric::kRequests, 1, {{"status", ok ? "ok" : "error"}});
  const double request_ms = ms_since(job.start);
  metrics_.observe(metric::kRequestSeconds, request_ms / 1000);
  // The first token comes when prefill ends: all but the decode steps.
  if (ok && generation.generated > 0) {
    metrics_.observe(metric::kTimeToFirstToken,
                     (request_ms - (generation.total_ms - generation.prefill_ms)) / 1000);
  }
  metrics_.add(metric::kGeneratedTokens, generation.generated);
}

void PdService::answer(Job& job, HttpResponse& res) {
  std::string text;
  // A client that has gone stops the generation at its next token.
  Generation generation = generate(*lm_, job.prompt, job.request, [&](const std::string& t) {
    text += t;
    return !job.abandoned();
  });
  record(job, generation, generation.status.ok());
  job.hold.release();
  if (!generation.status.ok()) return send_status(res, generation.status);
  res.set_content(safe_dump(completion_json(job.id, job.request, text, generation, job.timings)),
                  "application/json");
}

// Generates on this worker, one SSE event per token, each handed to the client's
// connection as it comes; a client that goes away stops the generation at its next token.
void PdService::answer_streaming(const std::shared_ptr<Job>& job, HttpResponse& res) {
  StreamWriter& writer = res.start_stream("text/event-stream");
  stream(*job, writer);
  job->hold.release();  // also when the stream ended early: nothing stays held
}

bool PdService::stream(Job& job, StreamWriter& writer) {
  auto write = [&writer](const std::string& event) { return writer.write(event); };
  const std::string& model = job.request.model;
  bool open = write(
      sse_event(chunk_json(job.id, model, {{"role", "assistant"}, {"content", ""}}, nullptr)));
  Generation generation = generate(*lm_, job.prompt, job.request, [&](const std::string& t) {
    return open = open && write(sse_event(chunk_json(job.id, model, {{"content", t}}, nullptr)));
  });
  record(job, generation, generation.status.ok() && open);
  job.hold.release();
  if (!open) {
    metrics_.add(metric::kClientDisconnects, 1);
    return false;
  }
  if (!generation.status.ok()) {
    // Headers are sent: report the failure in the stream, and do not claim success.
    const Status& s = generation.status;
    write(sse_event(
        {{"error",
          {{"message", s.message()}, {"type", std::string(status_code_name(s.code()))}}}}));
    return false;
  }
  write(sse_event(chunk_json(job.id, model, json::object(),
                             finish_reason(generation, job.request.max_tokens), &job.timings)));
  if (job.request.include_usage) write(sse_event(usage_chunk_json(job.id, model, generation)));
  write("data: [DONE]\n\n");
  return true;
}

std::string PdService::render_metrics() {
  set_consumer_metrics(connector_->stats(), metrics_);
  return metrics_.render();
}

}  // namespace

int run_pd_service(const PdServiceConfig& config) {
  block_shutdown_signals();
  set_log_level(config.common.log_level).ignore_error();
  const bool secured = announce_secret("pd", config.engine.auth_token,
                                       config.engine.auth_token_file, config.engine.ec_config);
  if (Status s = check_instance_directory(config.directory, config.common); !s.ok()) {
    std::cerr << "ecx serve pd: " << s.message() << "\n";
    return 2;
  }
  auto pd = PdService::create(config);
  if (!pd.ok()) {
    std::cerr << "ecx serve pd: " << pd.status().to_string() << "\n";
    return 1;
  }
  // Prefill and decode are CPU-bound: a few workers; the rest wait in the queue.
  HttpServer server(config.common, "pd", 4);
  server.work("POST", "/v1/chat/completions",
              [&](const HttpRequest& req, HttpResponse& res) { (*pd)->handle_chat(req, res); });
  add_common_routes(server, config.common, "pd", secured, [&] { return (*pd)->render_metrics(); });
  return serve_registered(server, config.directory, config.common, config.engine, "pd",
                          (*pd)->compat_hash());
}

}  // namespace ecx::serve
