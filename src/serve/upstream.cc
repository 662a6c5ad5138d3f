#include "serve/upstream.h"

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
  models_.clear();  // asked again once it is back: it may come back serving another
}

void Upstream::mark_up(const std::string& note) {
  MutexLock lock(&mu_);
  if (!reachable_.exchange(true, std::memory_order_acq_rel)) {
    spdlog::info("upstream={} url={} reachable=true", role, url);
  }
  last_error_ = note;
}

std::vector<std::string> Upstream::models() const {
  MutexLock lock(&mu_);
  return models_;
}

void Upstream::set_models(std::vector<std::string> models) {
  MutexLock lock(&mu_);
  models_ = std::move(models);
}

namespace {

// GET `target` at host:port, bounded by the probe's timeouts.
http::ClientResult probe_get(http::HttpClient& client, const std::string& host, int port,
                             const std::string& target, const UpstreamProber::Options& options) {
  http::ClientRequest request;
  request.method = "GET";
  request.target = target;
  request.connect_timeout = options.connect_timeout;
  request.timeout = options.connect_timeout + options.read_timeout;
  return client.call(host, port, std::move(request));
}

// Asks an upstream found in etcd to prove it holds the deployment secret: a fresh
// challenge, answered for the id and url it registered. Ok when the proof holds.
Status challenge(http::HttpClient& client, Upstream& upstream,
                 const UpstreamProber::Options& options) {
  std::string bytes = random_bytes(32);
  const std::string nonce = hex_encode(bytes.data(), bytes.size());
  auto res = probe_get(client, upstream.prove_host, upstream.prove_port,
                       "/v1/ecx/prove?nonce=" + nonce, options);
  if (!res.ok()) return Unavailable("/v1/ecx/prove: " + res.message);
  if (res.status != 200) {
    return PermissionDenied("/v1/ecx/prove answered " + std::to_string(res.status) +
                            " (not an ecx instance of this deployment)");
  }
  auto doc = nlohmann::json::parse(res.body, nullptr, false);
  if (!doc.is_object() || !doc["proof"].is_string()) {
    return PermissionDenied("/v1/ecx/prove: no proof in the answer");
  }
  directory::Instance claimed;
  claimed.id = upstream.instance_id;
  claimed.url = upstream.url;
  auto proof = parse_mac_hex(doc["proof"].get<std::string>());
  auto expected = parse_mac_hex(directory::prove_instance(claimed, nonce, options.secret));
  if (!proof.ok() || !macs_equal(*proof, *expected)) {
    return PermissionDenied("/v1/ecx/prove: the proof of the deployment secret for " +
                            upstream.instance_id + " does not hold");
  }
  return Status::Ok();
}

// The ids an OpenAI server lists at GET /v1/models ({"data": [{"id": ...}, ...]}), at most
// 64 of at most 256 bytes each; none when it answers otherwise.
std::vector<std::string> ask_models(http::HttpClient& client, const Upstream& upstream,
                                    const UpstreamProber::Options& options) {
  std::vector<std::string> out;
  auto res = probe_get(client, upstream.host, upstream.port, "/v1/models", options);
  if (!res.ok() || res.status != 200) return out;
  auto doc = nlohmann::json::parse(res.body, nullptr, false);
  if (!doc.is_object() || !doc["data"].is_array()) return out;
  for (const auto& entry : doc["data"]) {
    if (out.size() == 64) break;
    if (!entry.is_object() || !entry.contains("id") || !entry["id"].is_string()) continue;
    const auto& id = entry["id"].get_ref<const std::string&>();
    if (!id.empty() && id.size() <= 256) out.push_back(id);
  }
  return out;
}

}  // namespace

void probe_upstream(http::HttpClient& client, Upstream& upstream,
                    const UpstreamProber::Options& options) {
  if (upstream.must_prove() && !upstream.proven()) {
    Status proven = challenge(client, upstream, options);
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
  auto res = probe_get(client, upstream.host, upstream.port, "/health", options);
  if (res.ok()) {
    if (res.status == 200) {
      upstream.mark_up();
      if (options.learn_models && upstream.role == "pd" && upstream.models().empty()) {
        auto models = ask_models(client, upstream, options);
        if (!models.empty()) {
          spdlog::info("event=models_learnt url={} models={}", upstream.url,
                       nlohmann::json(models).dump());
          upstream.set_models(std::move(models));
        }
      }
    } else {
      upstream.mark_down("/health answered " + std::to_string(res.status) + ": " +
                         res.body.substr(0, 200));
    }
  } else if (res.error == http::ClientError::kConnect) {
    upstream.mark_down(res.message);
  } else {
    // It accepted the connection: alive, but too busy to answer within read_timeout
    // (its worker threads all serve requests), or it is going down, which the next
    // probe's connect will tell.
    upstream.mark_up("/health: " + res.message + " after connecting (busy?)");
  }
}

UpstreamProber::UpstreamProber(std::vector<std::shared_ptr<Upstream>> upstreams, Options options)
    : options_(std::move(options)),
      // Probe answers are small: /health, a proof, a list of models.
      client_(http::HttpClient::Options{
          .threads = 1, .keep_idle = std::chrono::seconds(5), .max_body_bytes = 1 << 20}) {
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
  for (auto& t : threads_) t.join();  // each within its probe's bound
  client_.stop();
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
    probe_upstream(client_, *next->upstream, options_);
    lock.lock();
    next->busy = false;
    next->probed = true;
    next->due = Clock::now() + options_.interval;
    cv_.notify_all();
  }
}

}  // namespace ecx::serve
