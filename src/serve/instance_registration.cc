#include "serve/instance_registration.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <thread>

#include "ecx/common/log.h"
#include "ecx/directory/instance.h"
#include "ecx/directory/registration.h"

namespace ecx::serve {

namespace {

// How long a deregistered instance keeps accepting before it drains (SERVING.md).
constexpr std::chrono::milliseconds kDeregisteredGrace{500};

bool wildcard(const std::string& host) {
  return host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]";
}

// The URL an instance listening on host:port is reached at.
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

}  // namespace

Status check_instance_directory(const DirectoryConfig& directory,
                                const CommonServiceConfig& common) {
  if (directory.etcd.empty()) return Status::Ok();
  ECX_RETURN_IF_ERROR(directory::parse_etcd_endpoints(directory.etcd).status());
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
                     const CommonServiceConfig& common, const std::string& role,
                     const std::string& compat_hash) {
  if (directory.etcd.empty()) return server.serve_until_signal();
  std::unique_ptr<directory::Registration> registration;
  ServeHooks hooks;
  hooks.on_listening = [&](int port) {
    // Each call well inside the lease: a keep-alive must land before the TTL runs out.
    auto timeout =
        std::chrono::milliseconds(std::clamp(directory.etcd_ttl_s * 1000 / 3, 100, 1000));
    auto client = directory::EtcdClient::create(directory.etcd, timeout);
    if (!client.ok()) {  // checked at start-up; kept as a message, not a crash
      spdlog::error("event=etcd_config error=\"{}\"", client.status().message());
      return;
    }
    directory::Instance self{make_id(role), advertised_url(directory, common, port), role,
                             common.model, compat_hash};
    std::string key = directory::instance_key(directory.etcd_prefix, self);
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
