// Telling a consumer early (EcConnector::offer): the producer side of an OFFER. vLLM's
// proxy names, in the request it sends E, the PD that will serve it (its scheduler's
// agent address; the example EPD proxy's --ec-consumer-zmq-addrs); E's scheduler sends
// that PD the params it issued for the request's items as soon as it has them, and the
// PD loads them while the request is still on its way to its scheduler (the proxy, PD's
// API server and its input processing), so that it finds them in its cache at first
// sight.
//
// OfferSender: a queue and one thread (started by the first offer). The engine's thread
// only queues (never a connect
// or a send on it); the thread dials each address once (an agent connection, proving the
// deployment secret both ways, as every peer of ours does) and sends the offer as a
// NOTIFY. An address it could not reach is not dialed again for kRetryMs: its offers are
// dropped meanwhile (counted). An offer is a hint: one that is lost costs the PD the early
// start only, since the request carries the same params.
#pragma once

#include <atomic>
#include <deque>
#include <map>
#include <string>
#include <thread>

#include "ecx/common/deadline.h"
#include "ecx/common/mutex.h"
#include "ecx/common/status.h"
#include "ecx/transfer/agent.h"

namespace ecx::connector {

// "host:port" or "tcp://host:port" (an IPv4 address or a name, and a port 1-65535): the
// tcp endpoint of the consumer agent an offer goes to, as "host:port".
Result<std::string> parse_offer_address(const std::string& text);

class OfferSender {
 public:
  // `agent` outlives the sender.
  OfferSender(std::string name, transfer::Agent* agent);
  ~OfferSender();
  OfferSender(const OfferSender&) = delete;
  OfferSender& operator=(const OfferSender&) = delete;

  // Queues `notice` (an OFFER's JSON) for `address` (parse_offer_address's). False when
  // the queue is full or the sender stopped: dropped, counted.
  bool push(std::string address, std::string notice) ECX_EXCLUDES(mu_);
  // Ends the thread; what is still queued is dropped. Idempotent.
  void stop() ECX_EXCLUDES(mu_);

  uint64_t sent() const { return sent_.load(); }
  uint64_t failed() const { return failed_.load(); }  // not delivered: unreachable, full, stopped

  static constexpr size_t kMaxQueued = 1024;
  static constexpr int64_t kConnectMs = 1000;  // a consumer that takes longer is skipped
  static constexpr int64_t kRetryMs = 5000;    // before an unreachable address is dialed again

 private:
  struct Queued {
    std::string address;
    std::string notice;
  };
  void run() ECX_EXCLUDES(mu_);
  Status send(const Queued& offer);

  const std::string name_;
  transfer::Agent* const agent_;
  Mutex mu_;
  CondVar cv_;
  std::deque<Queued> queue_ ECX_GUARDED_BY(mu_);
  bool stopping_ ECX_GUARDED_BY(mu_) = false;
  std::map<std::string, Deadline> unreachable_;  // address -> dialed again after; run()'s
  std::atomic<uint64_t> sent_{0}, failed_{0};
  std::thread thread_;  // started under mu_ by the first push; joined by stop()
};

}  // namespace ecx::connector
