// The proxy's view of its upstreams (encoders and PDs): whether each is reachable,
// kept by a background prober so that routing and /health never wait on the network.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ecx/common/deadline.h"

namespace ecx::serve {

// An HTTP service the proxy forwards to, and what the proxy last saw of it.
class Upstream {
 public:
  Upstream(std::string role, std::string url, std::string host, int port,
           std::string source = "static")
      : role(std::move(role)),
        url(std::move(url)),
        host(std::move(host)),
        port(port),
        source(std::move(source)) {}

  const std::string role;  // "encoder" or "pd"
  const std::string url;   // "http://HOST:PORT"
  const std::string host;
  const int port;
  const std::string source;       // how the proxy knows it: "static" (flags) or "etcd"
  std::atomic<int> in_flight{0};  // requests forwarded and not yet answered

  // True when the last probe (or forwarded request) reached it. Never blocks.
  bool reachable() const { return reachable_.load(std::memory_order_acquire); }
  // Why it was last found unreachable (or slow); empty when it answered.
  std::string last_error() const;
  // Down at once: a probe or a forwarded request could not connect.
  void mark_down(const std::string& error);
  // Up: it accepted a connection. `note` says what was odd about it (a slow answer).
  void mark_up(const std::string& note = "");

 private:
  std::atomic<bool> reachable_{false};
  mutable std::mutex mu_;
  std::string last_error_;  // guarded by mu_
};

using UpstreamList = std::vector<std::shared_ptr<Upstream>>;

// Checks `GET /health` of each upstream every `interval` on a thread of its own and
// keeps the upstream's reachable flag:
//   - it cannot connect (refused, connect timeout) or /health answers non-200: down;
//   - it answers 200, or accepts the connection but answers later than
//     `read_timeout` (busy serving requests): up.
// The set probed follows membership (update()). Every probe is bounded by
// connect_timeout + read_timeout; the destructor stops the threads and joins them within
// that bound.
class UpstreamProber {
 public:
  struct Options {
    std::chrono::milliseconds interval{250};
    std::chrono::milliseconds connect_timeout{250};
    std::chrono::milliseconds read_timeout{500};
  };

  UpstreamProber(std::vector<std::shared_ptr<Upstream>> upstreams, Options options);
  ~UpstreamProber();
  UpstreamProber(const UpstreamProber&) = delete;
  UpstreamProber& operator=(const UpstreamProber&) = delete;

  // Waits until every upstream probed now has been probed once, or `deadline`. True if
  // all were.
  bool wait_first_round(Deadline deadline);
  // Probes exactly `upstreams` from now on: one not probed yet at once, on a thread of
  // its own; one no longer listed no more (its thread ends after the probe in progress).
  // Called by one thread at a time.
  void update(const std::vector<std::shared_ptr<Upstream>>& upstreams);
  // How many upstreams are probed now.
  size_t size() const;

 private:
  struct Probe {
    std::shared_ptr<Upstream> upstream;
    bool probed = false;  // probed at least once; guarded by mu_
    bool stop = false;    // guarded by mu_
    std::thread thread;
  };
  void start(std::shared_ptr<Upstream> upstream);  // REQUIRES: mu_ held
  void run(Probe* probe);

  const Options options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;                                         // guarded by mu_
  std::map<const Upstream*, std::unique_ptr<Probe>> probes_;  // guarded by mu_
  // Told to stop, not joined yet (update() joins them, outside mu_); guarded by mu_.
  std::vector<std::unique_ptr<Probe>> retired_;
};

// One probe of `upstream` as described above; updates its flag.
void probe_upstream(Upstream& upstream, const UpstreamProber::Options& options);

}  // namespace ecx::serve
