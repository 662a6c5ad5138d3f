// The encode instance (E): decodes an image, runs the vision encoder straight into the
// connector's block (no extra copy), and answers with the params PD needs.
#include <unistd.h>

#include <chrono>

#include "ecx/common/log.h"
#include "ecx/engine/image.h"
#include "serve/http_util.h"
#include "serve/model_setup.h"

namespace ecx::serve {

using nlohmann::json;

int run_encoder_service(const ServiceConfig& config) {
  block_shutdown_signals();
  auto model = load_model(config);
  if (!model.ok()) {
    std::cerr << "ecx serve encoder: " << model.status().to_string() << "\n";
    return 1;
  }
  auto encoder = engine::VisionEncoder::create(model->config, model->weights);
  std::string engine_id = "e-" + std::to_string(::getpid());
  auto cc = connector_config(config, connector::Role::kProducer, model->config, engine_id);
  auto conn = cc.ok() ? connector::create_connector(*cc)
                      : Result<std::unique_ptr<connector::EcConnector>>(cc.status());
  if (!encoder.ok() || !conn.ok()) {
    std::cerr << "ecx serve encoder: "
              << (encoder.ok() ? conn.status() : encoder.status()).to_string() << "\n";
    return 1;
  }
  Metrics metrics;
  engine::ImageLimits limits{config.max_image_bytes, config.max_image_pixels};
  httplib::Server server;

  server.Post("/v1/encode", [&](const httplib::Request& req, httplib::Response& res) {
    auto t0 = std::chrono::steady_clock::now();
    json body = json_too_deep(req.body) ? json() : json::parse(req.body, nullptr, false);
    if (body.is_discarded() || !body.is_object() || !body.contains("image") ||
        !body["image"].is_string()) {
      metrics.add("ecx_encode_failures_total", "reason=\"bad_request\"", 1);
      return send_error(res, 400, "invalid_request_error",
                        "body must be {\"image\": \"data:image/...;base64,...\"}");
    }
    auto bytes = engine::decode_data_url(body["image"].get<std::string>());
    if (!bytes.ok()) return send_error(res, 400, "invalid_request_error", bytes.status().message());
    auto image = engine::decode_image(*bytes, limits);
    if (!image.ok()) {
      metrics.add("ecx_encode_failures_total", "reason=\"bad_image\"", 1);
      int code = image.status().code() == StatusCode::kResourceExhausted ? 413 : 422;
      return send_error(res, code, code == 413 ? "request_too_large" : "invalid_image",
                        image.status().message());
    }
    auto prepared = (*encoder)->prepare(*image);
    if (!prepared.ok()) return send_error(res, 422, "invalid_image", prepared.status().message());
    TensorMeta meta = (*encoder)->output_meta(*prepared);
    bool cached = true;
    auto params = (*conn)->saved_params(prepared->mm_hash);
    if (!params.ok()) {
      cached = false;
      auto slot = (*conn)->begin_save(prepared->mm_hash, meta);
      if (!slot.ok() && slot.status().code() == StatusCode::kAlreadyExists) {
        params = (*conn)->saved_params(prepared->mm_hash);  // encoded concurrently
      } else if (!slot.ok()) {
        params = slot.status();
      } else {
        Status s = (*encoder)->encode(*prepared, slot->payload);
        if (s.ok()) {
          params = (*conn)->commit_save(*slot);
        } else {
          (*conn)->abort_save(*slot);
          params = s;
        }
      }
    }
    if (!params.ok()) {
      metrics.add("ecx_encode_failures_total",
                  "reason=\"" + std::string(status_code_name(params.status().code())) + "\"", 1);
      // A full pool is this server's condition, not the client's: 503, not 413.
      if (params.status().code() == StatusCode::kResourceExhausted) {
        return send_error(res, 503, "encoder_busy", params.status().message());
      }
      return send_status(res, params.status());
    }
    double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    metrics.add("ecx_encode_requests_total", cached ? "cache=\"hit\"" : "cache=\"miss\"", 1);
    metrics.observe("ecx_encode_seconds", "", ms / 1000);
    metrics.add("ecx_ec_bytes_saved_total", "", cached ? 0 : static_cast<double>(meta.byte_size()));
    res.set_content(json{{"mm_hash", prepared->mm_hash.str()},
                         {"num_tokens", prepared->tokens()},
                         {"ec_transfer_params", params->to_json()},
                         {"encode_ms", ms},
                         {"cached", cached}}
                        .dump(),
                    "application/json");
  });
  add_common_routes(server, config, "encoder", [&] {
    json s = connector::to_json((*conn)->stats());
    if (s.contains("producer_pool")) {
      for (const char* k : {"capacity_bytes", "used_bytes", "entries", "pins", "evictions"}) {
        metrics.set(std::string("ecx_pool_") + k, "", s["producer_pool"][k].get<double>());
      }
    }
    return metrics.render("ecx encoder service");
  });
  int rc = serve_until_signal(server, config, "encoder");
  // Graceful: let consumers finish reading what we handed out (bounded).
  (*conn)->wait_for_readers(Deadline::after_ms(5000)).ignore_error();
  return rc;
}

}  // namespace ecx::serve
