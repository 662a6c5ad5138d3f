#include "serve/upstream.h"

#include <httplib.h>

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
    : options_(options), total_(upstreams.size()) {
  threads_.reserve(upstreams.size());
  for (auto& u : upstreams) threads_.emplace_back([this, u] { run(u); });
}

UpstreamProber::~UpstreamProber() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

bool UpstreamProber::wait_first_round(Deadline deadline) {
  std::unique_lock lock(mu_);
  return cv_.wait_until(lock, deadline.time_point(), [&] { return probed_ == total_; });
}

void UpstreamProber::run(const std::shared_ptr<Upstream>& upstream) {
  bool first = true;
  std::unique_lock lock(mu_);
  while (!stop_) {
    lock.unlock();
    probe_upstream(*upstream, options_);
    lock.lock();
    if (first) {
      first = false;
      ++probed_;
      cv_.notify_all();
    }
    cv_.wait_for(lock, options_.interval, [&] { return stop_; });
  }
}

}  // namespace ecx::serve
