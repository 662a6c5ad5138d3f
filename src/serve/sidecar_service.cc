// The sidecar (`ecx serve sidecar`): puts an engine that cannot join ecx's membership
// itself (a `vllm serve` E or PD with ECXConnector) in etcd, as `ecx serve encoder|pd`
// put themselves, for as long as the engine answers.
//
//   - It checks the engine's GET /health every --health-interval-ms (serve/upstream.h's
//     prober, as a proxy checks it). While it answers 200 (or accepts the connection
//     and is slow to answer: busy), the engine is registered under a lease
//     (directory::Registration) at <prefix>/<model>/instances/<role>/<id>, its record
//     signed with the deployment secret and naming this sidecar as where it proves that
//     (prove_url). When the engine stops answering, the record is deleted at once; when
//     it answers again, it is registered again. The sidecar dying ends the lease.
//   - It answers the proxies' challenges for the engine (GET /v1/ecx/prove): only a
//     process that holds the secret can, so a record nobody in the deployment wrote is
//     never routed to. The proxy still sends the engine's traffic to the engine's URL.
//   - SIGTERM deregisters first (a Kubernetes pod stopping stops its sidecar).
#include <iostream>
#include <memory>
#include <thread>

#include "ecx/common/auth.h"
#include "ecx/common/log.h"
#include "ecx/common/mutex.h"
#include "ecx/directory/instance.h"
#include "ecx/directory/registration.h"
#include "ecx/engine/model.h"
#include "ecx/serve/services.h"
#include "http_server/http_server.h"
#include "http_server/metric_families.h"
#include "http_server/metrics.h"
#include "serve/instance_registration.h"
#include "serve/upstream.h"

namespace ecx::serve {

namespace {

Status check_sidecar(const SidecarServiceConfig& c) {
  if (c.directory.etcd.empty()) return InvalidArgument("--etcd is required: where to register");
  if (c.role != "encoder" && c.role != "pd") {
    return InvalidArgument("--role must be encoder or pd, not '" + c.role + "'");
  }
  ECX_RETURN_IF_ERROR(directory::check_http_url(c.instance_url).with_context("--instance-url"));
  if (c.health_interval_ms < 50 || c.health_interval_ms > 60000) {
    return InvalidArgument("--health-interval-ms must be 50..60000");
  }
  return check_instance_directory(c.directory, c.common);
}

// Registers the engine while the prober finds it up; deregisters while it is down.
class MembershipKeeper {
 public:
  MembershipKeeper(const SidecarServiceConfig& config, directory::Instance self,
                   std::shared_ptr<Upstream> engine, std::shared_ptr<ProvenSelf> proven,
                   std::string secret, Metrics& metrics)
      : config_(config),
        self_(std::move(self)),
        engine_(std::move(engine)),
        proven_(std::move(proven)),
        secret_(std::move(secret)),
        metrics_(metrics),
        thread_([this] { run(); }) {}

  // Deregisters (the record is deleted at once) and stops.
  ~MembershipKeeper() {
    {
      MutexLock lock(&mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  MembershipKeeper(const MembershipKeeper&) = delete;
  MembershipKeeper& operator=(const MembershipKeeper&) = delete;

 private:
  void run() {
    std::unique_ptr<directory::Registration> registration;
    const auto interval = std::chrono::milliseconds(config_.health_interval_ms);
    while (true) {
      const bool up = engine_->reachable();
      metrics_.set(metric::kSidecarInstanceUp, up ? 1 : 0);
      if (up && !registration) {
        registration = register_engine();
      } else if (!up && registration) {
        spdlog::warn("event=instance_down url={} error=\"{}\": deregistering", self_.url,
                     engine_->last_error());
        registration.reset();  // deletes the key now
      }
      metrics_.set(metric::kSidecarRegistered, registration ? 1 : 0);
      MutexLock lock(&mu_);
      if (cv_.wait_until(&mu_, Clock::now() + interval,
                         [this]() ECX_REQUIRES(mu_) { return stop_; })) {
        break;
      }
    }
    if (registration) {
      spdlog::info("event=deregistering key={}", registration->key());
      registration.reset();
    }
  }

  std::unique_ptr<directory::Registration> register_engine() {
    auto client = etcd_client(config_.directory);
    if (!client.ok()) {  // checked at start-up; kept as a message, not a crash
      spdlog::error("event=etcd_config error=\"{}\"", client.status().message());
      return nullptr;
    }
    directory::Instance signed_self = self_;
    std::string key = directory::instance_key(config_.directory.etcd_prefix, signed_self);
    directory::sign_instance(signed_self, key, secret_);
    {
      MutexLock lock(&proven_->mu);
      proven_->self = signed_self;
    }
    spdlog::info("event=registering key={} url={} prove_url={} etcd={}", key, signed_self.url,
                 signed_self.prove_url, config_.directory.etcd);
    metrics_.add(metric::kSidecarRegistrations, 1);
    return std::make_unique<directory::Registration>(std::move(*client), key,
                                                     directory::instance_value(signed_self),
                                                     config_.directory.etcd_ttl_s);
  }

  const SidecarServiceConfig& config_;
  const directory::Instance self_;
  const std::shared_ptr<Upstream> engine_;
  const std::shared_ptr<ProvenSelf> proven_;
  const std::string secret_;
  Metrics& metrics_;
  Mutex mu_;
  CondVar cv_;
  bool stop_ ECX_GUARDED_BY(mu_) = false;
  std::thread thread_;  // started last
};

}  // namespace

int run_sidecar_service(const SidecarServiceConfig& config) {
  block_shutdown_signals();
  auto fail = [](const Status& s) {
    std::cerr << "ecx serve sidecar: " << s.message() << "\n";
    return 2;
  };
  set_log_level(config.common.log_level).ignore_error();
  if (Status s = check_sidecar(config); !s.ok()) return fail(s);
  auto secret = load_secret(config.auth_token, config.auth_token_file);
  if (!secret.ok()) return fail(secret.status());
  if (secret->empty()) {
    return fail(InvalidArgument(
        "the deployment secret is required (--auth-token-file or ECX_AUTH_TOKEN): proxies "
        "route only to members that prove it"));
  }
  auto at = parse_url(config.instance_url);
  if (!at.ok()) return fail(at.status());
  auto engine = std::make_shared<Upstream>(config.role, config.instance_url, at->first, at->second);
  UpstreamProber::Options probe;
  probe.interval = std::chrono::milliseconds(config.health_interval_ms);
  probe.threads = 1;
  UpstreamProber prober({engine}, probe);

  Metrics metrics;
  auto proven = std::make_shared<ProvenSelf>();
  HttpServer server(config.common, "sidecar", 1);
  add_prove_route(server, proven, *secret);
  add_common_routes(
      server, config.common, "sidecar", true,
      [&] { return metrics.render() + server.render_metrics(); },
      [&] {
        return HealthReport{200,
                            {{"status", "ok"},
                             {"role", "sidecar"},
                             {"instance_url", config.instance_url},
                             {"instance_reachable", engine->reachable()}}};
      });
  std::string compat_hash = config.compat_hash;
  if (compat_hash.empty()) {
    engine::ModelConfig reference;
    reference.model_id = config.common.model;
    compat_hash = reference.compat_hash();
  }
  std::unique_ptr<MembershipKeeper> keeper;
  ServeHooks hooks;
  hooks.on_listening = [&](int port) {
    directory::Instance self{make_id(config.role), config.instance_url, config.role,
                             config.common.model, compat_hash};
    self.prove_url = advertised_url(config.directory, config.common, port);
    keeper = std::make_unique<MembershipKeeper>(config, self, engine, proven, *secret, metrics);
  };
  hooks.on_signal = [&] { keeper.reset(); };
  return server.serve_until_signal(hooks);
}

}  // namespace ecx::serve
