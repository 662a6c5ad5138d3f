#include "serve/upstream.h"

#include <httplib.h>

#include <algorithm>

#include "ecx/common/log.h"

namespace ecx::serve {

std::string Upstream::last_error() const {
  std::lock_guard lock(mu_);
  return last_error_;
}

void Upstream::mark_down(const std::string& error) {
  std::lock_guard lock(mu_);
  if (reachable_.exchange(false, std::memory_order_acq_rel)) {
    spdlog::warn("upstream={} url={} reachable=false error=\"{}\"", role, url, error);
  }
  last_error_ = error;
}

void Upstream::mark_up(const std::string& note) {
  std::lock_guard lock(mu_);
  if (!reachable_.exchange(true, std::memory_order_acq_rel)) {
    spdlog::info("upstream={} url={} reachable=true", role, url);
  }
  last_error_ = note;
}

void probe_upstream(Upstream& upstream, const UpstreamProber::Options& options) {
  httplib::Client cli(upstream.host, upstream.port);
  cli.set_connection_timeout(options.connect_timeout);
  cli.set_read_timeout(options.read_timeout);
  cli.set_write_timeout(options.read_timeout);
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
    : options_(options) {
  std::lock_guard lock(mu_);
  for (auto& u : upstreams) start(std::move(u));
}

UpstreamProber::~UpstreamProber() {
  std::vector<std::unique_ptr<Probe>> all;
  {
    std::lock_guard lock(mu_);
    stop_ = true;
    for (auto& [key, probe] : probes_) all.push_back(std::move(probe));
    for (auto& probe : retired_) all.push_back(std::move(probe));
    probes_.clear();
    retired_.clear();
  }
  cv_.notify_all();
  for (auto& probe : all) probe->thread.join();
}

void UpstreamProber::start(std::shared_ptr<Upstream> upstream) {
  const Upstream* key = upstream.get();
  if (probes_.count(key)) return;  // listed twice: probed once
  auto probe = std::make_unique<Probe>();
  probe->upstream = std::move(upstream);
  Probe* p = probe.get();
  probes_.emplace(key, std::move(probe));
  p->thread = std::thread([this, p] { run(p); });
}

void UpstreamProber::update(const std::vector<std::shared_ptr<Upstream>>& upstreams) {
  std::vector<std::unique_ptr<Probe>> finished;
  {
    std::lock_guard lock(mu_);
    if (stop_) return;
    finished = std::move(retired_);
    retired_.clear();
    std::map<const Upstream*, bool> listed;
    for (const auto& u : upstreams) listed[u.get()] = true;
    for (auto it = probes_.begin(); it != probes_.end();) {
      if (listed.count(it->first)) {
        ++it;
        continue;
      }
      it->second->stop = true;
      retired_.push_back(std::move(it->second));
      it = probes_.erase(it);
    }
    for (const auto& u : upstreams) {
      start(u);
    }
  }
  cv_.notify_all();
  // Told to stop by an earlier update: done, or within one probe of it.
  for (auto& probe : finished) probe->thread.join();
}

size_t UpstreamProber::size() const {
  std::lock_guard lock(mu_);
  return probes_.size();
}

bool UpstreamProber::wait_first_round(Deadline deadline) {
  std::unique_lock lock(mu_);
  return cv_.wait_until(lock, deadline.time_point(), [&] {
    return std::all_of(probes_.begin(), probes_.end(),
                       [](const auto& entry) { return entry.second->probed; });
  });
}

void UpstreamProber::run(Probe* probe) {
  std::unique_lock lock(mu_);
  while (!stop_ && !probe->stop) {
    lock.unlock();
    probe_upstream(*probe->upstream, options_);
    lock.lock();
    if (!probe->probed) {
      probe->probed = true;
      cv_.notify_all();
    }
    cv_.wait_for(lock, options_.interval, [&] { return stop_ || probe->stop; });
  }
}

}  // namespace ecx::serve
