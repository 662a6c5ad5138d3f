#include "serve/instance_registration.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "ecx/common/auth.h"
#include "ecx/common/log.h"
#include "ecx/common/mutex.h"
#include "ecx/directory/instance.h"
#include "ecx/directory/registration.h"
#include "serve/model_setup.h"

namespace ecx::serve {

namespace {

// How long a deregistered instance keeps accepting before it drains (SERVING.md).
constexpr std::chrono::milliseconds kDeregisteredGrace{500};

bool wildcard(const std::string& host) {
  return host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]";
}

// The nonce of GET /v1/ecx/prove?nonce=N: 64 hex digits (32 random bytes).
Result<std::string> challenge_of(const std::string& query) {
  const std::string key = "nonce=";
  if (query.rfind(key, 0) != 0) return InvalidArgument("expected ?nonce=<64 hex digits>");
  std::string nonce = query.substr(key.size());
  if (nonce.size() != 64 || nonce.find_first_not_of("0123456789abcdef") != std::string::npos) {
    return InvalidArgument("nonce must be 64 lower-case hex digits");
  }
  return nonce;
}

}  // namespace

std::string advertised_url(const DirectoryConfig& directory, const CommonServiceConfig& common,
                           int port) {
  if (!directory.advertise_url.empty()) {
    std::string url = directory.advertise_url;
    while (!url.empty() && url.back() == '/') url.pop_back();
    return url;
  }
  bool v6 = common.host.find(':') != std::string::npos && common.host.front() != '[';
  return "http://" + (v6 ? "[" + common.host + "]" : common.host) + ":" + std::to_string(port);
}

void add_prove_route(HttpServer& server, std::shared_ptr<ProvenSelf> proven, std::string secret) {
  server.fast("GET", "/v1/ecx/prove", [proven, secret](const HttpRequest& req, HttpResponse& res) {
    auto nonce = challenge_of(req.query);
    if (!nonce.ok()) {
      send_error(res, 400, "invalid_request_error", nonce.status().message());
      return;
    }
    MutexLock lock(&proven->mu);
    if (!proven->self) {
      send_error(res, 503, "unavailable", "not registered yet");
      return;
    }
    const directory::Instance& self = *proven->self;
    res.set_content(nlohmann::json{{"id", self.id},
                                   {"url", self.url},
                                   {"proof", directory::prove_instance(self, *nonce, secret)}}
                        .dump(),
                    "application/json");
  });
}

Result<directory::EtcdClient> etcd_client(const DirectoryConfig& directory) {
  // Each call well inside the lease: a keep-alive must land before the TTL runs out.
  auto timeout = std::chrono::milliseconds(std::clamp(directory.etcd_ttl_s * 1000 / 3, 100, 1000));
  ECX_ASSIGN_OR_RETURN(auto access, etcd_access(directory));
  return directory::EtcdClient::create(directory.etcd, timeout, access);
}

Result<directory::EtcdAccess> etcd_access(const DirectoryConfig& directory) {
  directory::EtcdAccess access;
  access.ca_file = directory.etcd_cacert;
  access.user = directory.etcd_user;
  if (access.user.empty()) return access;
  ECX_ASSIGN_OR_RETURN(access.password,
                       load_secret(directory.etcd_password, directory.etcd_password_file));
  if (access.password.empty()) {
    return InvalidArgument("--etcd-user " + access.user +
                           " needs a password: ECX_ETCD_PASSWORD or --etcd-password-file");
  }
  return access;
}

Status check_instance_directory(const DirectoryConfig& directory,
                                const CommonServiceConfig& common) {
  if (directory.etcd.empty()) return Status::Ok();
  ECX_RETURN_IF_ERROR(directory::parse_etcd_endpoints(directory.etcd).status());
  ECX_RETURN_IF_ERROR(etcd_access(directory).status());
  if (directory.etcd_ttl_s < 1) {
    return InvalidArgument("--etcd-ttl must be at least 1 second, not " +
                           std::to_string(directory.etcd_ttl_s));
  }
  if (!directory.advertise_url.empty()) {
    return directory::check_http_url(directory.advertise_url).with_context("--advertise-url");
  }
  if (wildcard(common.host)) {
    return InvalidArgument("--advertise-url is needed with --etcd when listening on '" +
                           common.host + "' (the URL others reach this instance at)");
  }
  return Status::Ok();
}

int serve_registered(HttpServer& server, const DirectoryConfig& directory,
                     const CommonServiceConfig& common, const EngineConfig& engine,
                     const std::string& role, const std::string& compat_hash) {
  if (directory.etcd.empty()) return server.serve_until_signal();
  auto secret = deployment_secret(engine);  // the one the connector uses
  if (!secret.ok()) {  // the connector read it already; kept as a message, not a crash
    spdlog::error("event=secret_unreadable error=\"{}\"", secret.status().message());
    return 2;
  }
  auto proven = std::make_shared<ProvenSelf>();
  add_prove_route(server, proven, *secret);
  std::unique_ptr<directory::Registration> registration;
  ServeHooks hooks;
  hooks.on_listening = [&](int port) {
    auto client = etcd_client(directory);
    if (!client.ok()) {  // checked at start-up; kept as a message, not a crash
      spdlog::error("event=etcd_config error=\"{}\"", client.status().message());
      return;
    }
    directory::Instance self{make_id(role), advertised_url(directory, common, port), role,
                             common.model, compat_hash};
    std::string key = directory::instance_key(directory.etcd_prefix, self);
    directory::sign_instance(self, key, *secret);
    {
      MutexLock lock(&proven->mu);
      proven->self = self;
    }
    spdlog::info("event=registering key={} url={} compat_hash={} etcd={}", key, self.url,
                 compat_hash, directory.etcd);
    registration = std::make_unique<directory::Registration>(
        std::move(*client), key, directory::instance_value(self), directory.etcd_ttl_s);
    if (!registration->wait_registered(Deadline::after_ms(2000))) {
      spdlog::warn(
          "event=not_registered_yet key={}: serving anyway, registering in the "
          "background",
          key);
    }
  };
  hooks.on_signal = [&] {
    if (!registration) return;
    registration->deregister();
    // Proxies see the delete within milliseconds; until then they may still route here,
    // so this keeps accepting for a moment before the drain closes the port.
    std::this_thread::sleep_for(kDeregisteredGrace);
  };
  return server.serve_until_signal(hooks);
}

}  // namespace ecx::serve
