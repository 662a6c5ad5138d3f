// The proxy's view of its upstreams (encoders and PDs): whether each is reachable,
// kept by a background prober so that routing and /health never wait on the network.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ecx/common/deadline.h"
#include "ecx/common/mutex.h"
#include "http/http_client.h"

namespace ecx::serve {

// An HTTP service the proxy forwards to, and what the proxy last saw of it.
class Upstream {
 public:
  Upstream(std::string role, std::string url, std::string host, int port,
           std::string source = "static", std::string instance_id = "")
      : role(std::move(role)),
        url(std::move(url)),
        host(std::move(host)),
        port(port),
        source(std::move(source)),
        instance_id(std::move(instance_id)) {}

  const std::string role;  // "encoder" or "pd"
  const std::string url;   // "http://HOST:PORT"
  const std::string host;
  const int port;
  const std::string source;       // how the proxy knows it: "static" (flags) or "etcd"
  const std::string instance_id;  // the id it registered under (etcd members)
  // Where it answers the proxy's challenge (etcd members): its sidecar's host and port
  // when a sidecar registered it (directory::Instance::prove_url), else its own. Set
  // before the upstream is shared, never after.
  std::string prove_host = host;
  int prove_port = port;
  std::atomic<int> in_flight{0};  // requests forwarded and not yet answered

  // Static upstreams are trusted by configuration; one found in etcd gets traffic only
  // once it has proven the deployment secret (GET /v1/ecx/prove, in the prober).
  bool must_prove() const { return source == "etcd"; }
  bool proven() const { return proven_.load(std::memory_order_acquire); }
  void mark_proven() { proven_.store(true, std::memory_order_release); }

  // True when the last probe (or forwarded request) reached it. Never blocks.
  bool reachable() const { return reachable_.load(std::memory_order_acquire); }
  // Why it was last found unreachable (or slow); empty when it answered.
  std::string last_error() const ECX_EXCLUDES(mu_);
  // Down at once: a probe or a forwarded request could not connect.
  void mark_down(const std::string& error) ECX_EXCLUDES(mu_);
  // Up: it accepted a connection. `note` says what was odd about it (a slow answer).
  void mark_up(const std::string& note = "") ECX_EXCLUDES(mu_);
  // The models it serves (its GET /v1/models), once the prober asked: PDs, for a proxy
  // that learns its model (ProxyServiceConfig::learn_model). Empty until then.
  std::vector<std::string> models() const ECX_EXCLUDES(mu_);
  void set_models(std::vector<std::string> models) ECX_EXCLUDES(mu_);

 private:
  std::atomic<bool> reachable_{false};
  std::atomic<bool> proven_{false};
  mutable Mutex mu_;
  std::string last_error_ ECX_GUARDED_BY(mu_);
  std::vector<std::string> models_ ECX_GUARDED_BY(mu_);
};

using UpstreamList = std::vector<std::shared_ptr<Upstream>>;

// Checks `GET /health` of each upstream every `interval` and keeps the upstream's
// reachable flag:
//   - it cannot connect (refused, connect timeout) or /health answers non-200: down;
//   - it answers 200, or accepts the connection but answers later than
//     `read_timeout` (busy serving requests): up.
// An upstream found in etcd is first challenged (must_prove()): it stays down until it
// answers GET /v1/ecx/prove?nonce=N with the proof of the deployment secret for its
// registered id and url (directory::prove_instance).
// The set probed follows membership (update()). A fixed pool of `threads` does every
// probe, whatever the number of upstreams. Every probe is bounded by connect_timeout +
// read_timeout; the destructor stops the threads and joins them within that bound.
class UpstreamProber {
 public:
  struct Options {
    std::chrono::milliseconds interval{250};
    std::chrono::milliseconds connect_timeout{250};
    std::chrono::milliseconds read_timeout{500};
    int threads = 4;
    std::string secret;  // the deployment secret, to check members' proofs
    // Ask each PD that answers /health for its models (GET /v1/models) until it tells them.
    bool learn_models = false;
  };

  UpstreamProber(std::vector<std::shared_ptr<Upstream>> upstreams, Options options);
  ~UpstreamProber();
  UpstreamProber(const UpstreamProber&) = delete;
  UpstreamProber& operator=(const UpstreamProber&) = delete;

  // Waits until every upstream probed now has been probed once, or `deadline`. True if
  // all were.
  bool wait_first_round(Deadline deadline) ECX_EXCLUDES(mu_);
  // Probes exactly `upstreams` from now on: one not probed yet at once; one no longer
  // listed no more (after the probe in progress, if any).
  void update(const std::vector<std::shared_ptr<Upstream>>& upstreams) ECX_EXCLUDES(mu_);
  // How many upstreams are probed now.
  size_t size() const ECX_EXCLUDES(mu_);

 private:
  // Its fields are read and written with the prober's mu_ held; they carry no
  // ECX_GUARDED_BY, as the analysis cannot name the enclosing prober's mutex from here.
  struct Probe {
    std::shared_ptr<Upstream> upstream;
    Clock::time_point due;
    bool probed = false;  // probed at least once
    bool busy = false;    // a thread probes it now
  };
  void add_locked(const std::shared_ptr<Upstream>& upstream) ECX_REQUIRES(mu_);
  // A pool thread: probes whatever is due first, until stop.
  void run() ECX_EXCLUDES(mu_);

  const Options options_;
  mutable Mutex mu_;
  CondVar cv_;
  bool stop_ ECX_GUARDED_BY(mu_) = false;
  std::map<const Upstream*, std::shared_ptr<Probe>> probes_ ECX_GUARDED_BY(mu_);
  http::HttpClient client_;  // the probes' (keep-alive) connections; stopped after threads_
  std::vector<std::thread> threads_;  // started last
};

// One probe of `upstream` as described above; updates its flags.
void probe_upstream(http::HttpClient& client, Upstream& upstream,
                    const UpstreamProber::Options& options);

}  // namespace ecx::serve
