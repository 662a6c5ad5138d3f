#include "serve/upstream.h"

#include <httplib.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "ecx/common/auth.h"
#include "ecx/common/bytes.h"
#include "ecx/common/log.h"
#include "ecx/directory/instance.h"

namespace ecx::serve {

std::string Upstream::last_error() const {
  MutexLock lock(&mu_);
  return last_error_;
}

void Upstream::mark_down(const std::string& error) {
  MutexLock lock(&mu_);
  if (reachable_.exchange(false, std::memory_order_acq_rel)) {
    spdlog::warn("upstream={} url={} reachable=false error=\"{}\"", role, url, error);
  }
  last_error_ = error;
}

void Upstream::mark_up(const std::string& note) {
  MutexLock lock(&mu_);
  if (!reachable_.exchange(true, std::memory_order_acq_rel)) {
    spdlog::info("upstream={} url={} reachable=true", role, url);
  }
  last_error_ = note;
}

namespace {

// Asks an upstream found in etcd to prove it holds the deployment secret: a fresh
// challenge, answered for the id and url it registered. Ok when the proof holds.
Status challenge(Upstream& upstream, httplib::Client& cli, const std::string& secret) {
  std::string bytes = random_bytes(32);
  const std::string nonce = hex_encode(bytes.data(), bytes.size());
  auto res = cli.Get("/v1/ecx/prove?nonce=" + nonce);
  if (!res) return Unavailable("/v1/ecx/prove: " + httplib::to_string(res.error()));
  if (res->status != 200) {
    return PermissionDenied("/v1/ecx/prove answered " + std::to_string(res->status) +
                            " (not an ecx instance of this deployment)");
  }
  auto doc = nlohmann::json::parse(res->body, nullptr, false);
  if (!doc.is_object() || !doc["proof"].is_string()) {
    return PermissionDenied("/v1/ecx/prove: no proof in the answer");
  }
  directory::Instance claimed;
  claimed.id = upstream.instance_id;
  claimed.url = upstream.url;
  auto proof = parse_mac_hex(doc["proof"].get<std::string>());
  auto expected = parse_mac_hex(directory::prove_instance(claimed, nonce, secret));
  if (!proof.ok() || !macs_equal(*proof, *expected)) {
    return PermissionDenied("/v1/ecx/prove: the proof of the deployment secret for " +
                            upstream.instance_id + " does not hold");
  }
  return Status::Ok();
}

}  // namespace

void probe_upstream(Upstream& upstream, const UpstreamProber::Options& options) {
  httplib::Client cli(upstream.host, upstream.port);
  cli.set_connection_timeout(options.connect_timeout);
  cli.set_read_timeout(options.read_timeout);
  cli.set_write_timeout(options.read_timeout);
  if (upstream.must_prove() && !upstream.proven()) {
    Status proven = challenge(upstream, cli, options.secret);
    if (!proven.ok()) {
      if (proven.code() == StatusCode::kPermissionDenied) {
        spdlog::warn("event=member_refused role={} id={} url={} reason=\"{}\"", upstream.role,
                     upstream.instance_id, upstream.url, proven.message());
      }
      upstream.mark_down(proven.message());
      return;
    }
    upstream.mark_proven();
    spdlog::info("event=member_proven role={} id={} url={}", upstream.role, upstream.instance_id,
                 upstream.url);
  }
  auto res = cli.Get("/health");
  if (res) {
    if (res->status == 200) {
      upstream.mark_up();
    } else {
      upstream.mark_down("/health answered " + std::to_string(res->status) + ": " +
                         res->body.substr(0, 200));
    }
    return;
  }
  httplib::Error error = res.error();
  if (error == httplib::Error::Connection || error == httplib::Error::ConnectionTimeout) {
    upstream.mark_down(httplib::to_string(error));
  } else {
    // It accepted the connection: alive, but too busy to answer within read_timeout
    // (its worker threads all serve requests), or it is going down, which the next
    // probe's connect will tell.
    upstream.mark_up("/health: " + httplib::to_string(error) + " after connecting (busy?)");
  }
}

UpstreamProber::UpstreamProber(std::vector<std::shared_ptr<Upstream>> upstreams, Options options)
    : options_(std::move(options)) {
  {
    MutexLock lock(&mu_);
    for (auto& u : upstreams) add_locked(u);
  }
  for (int i = 0; i < std::max(1, options_.threads); ++i) {
    threads_.emplace_back([this] { run(); });
  }
}

UpstreamProber::~UpstreamProber() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void UpstreamProber::add_locked(const std::shared_ptr<Upstream>& upstream) {
  if (probes_.count(upstream.get())) return;  // listed twice: probed once
  auto probe = std::make_shared<Probe>();
  probe->upstream = upstream;
  probe->due = Clock::now();
  probes_.emplace(upstream.get(), std::move(probe));
}

void UpstreamProber::update(const std::vector<std::shared_ptr<Upstream>>& upstreams) {
  {
    MutexLock lock(&mu_);
    if (stop_) return;
    std::map<const Upstream*, bool> listed;
    for (const auto& u : upstreams) listed[u.get()] = true;
    for (auto it = probes_.begin(); it != probes_.end();) {
      it = listed.count(it->first) ? std::next(it) : probes_.erase(it);
    }
    for (const auto& u : upstreams) add_locked(u);
  }
  cv_.notify_all();
}

size_t UpstreamProber::size() const {
  MutexLock lock(&mu_);
  return probes_.size();
}

bool UpstreamProber::wait_first_round(Deadline deadline) {
  MutexLock lock(&mu_);
  return cv_.wait_until(&mu_, deadline.time_point(), [this]() ECX_REQUIRES(mu_) {
    return std::all_of(probes_.begin(), probes_.end(),
                       [](const auto& entry) { return entry.second->probed; });
  });
}

void UpstreamProber::run() {
  MutexLock lock(&mu_);
  while (!stop_) {
    std::shared_ptr<Probe> next;  // the one due first that no thread holds
    for (const auto& [key, probe] : probes_) {
      if (!probe->busy && (!next || probe->due < next->due)) next = probe;
    }
    if (!next) {
      cv_.wait(&mu_);
      continue;
    }
    if (next->due > Clock::now()) {
      cv_.wait_until(&mu_, next->due);
      continue;
    }
    next->busy = true;
    lock.unlock();
    probe_upstream(*next->upstream, options_);
    lock.lock();
    next->busy = false;
    next->probed = true;
    next->due = Clock::now() + options_.interval;
    cv_.notify_all();
  }
}

}  // namespace ecx::serve
