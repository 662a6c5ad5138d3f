// What a consumer holds at producers once a load is over, each job on a thread and a lock
// of its own, apart from the loaders (connector_load.cc):
//   ReleaseBatcher gives back what finished loads hold there, coalesced: one driver call
//                  for every release queued within kBatchMs of the batch's first;
//   HeldViews      keeps finished requests' zero-copy views and renews the pins that hold
//                  them at their producers (every renew_period_ms) until each ends.
// Lock order: Connector::mu_, then HeldViews', then ReleaseBatcher's. Neither class calls
// back into the connector; each calls its driver with no lock held.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "connector/connector_driver.h"
#include "ecx/common/mutex.h"

namespace ecx::connector {

// A finished (or discarded) load's holdings at producers. `request` keeps alive the request
// its slots' items point into.
struct PendingRelease {
  std::shared_ptr<const LoadRequest> request;
  std::vector<FetchSlot> slots;
  bool views = false;  // the request's views, at its end (FinishedLoad::views)
};

class ReleaseBatcher {
 public:
  // `driver` outlives the batcher.
  ReleaseBatcher(std::string name, ConnectorDriver* driver);
  ~ReleaseBatcher();
  ReleaseBatcher(const ReleaseBatcher&) = delete;
  ReleaseBatcher& operator=(const ReleaseBatcher&) = delete;

  // Queues a release. Once stopped, it is dropped (false): its pins end by lease.
  bool push(PendingRelease release) ECX_EXCLUDES(mu_);
  // Sends what is queued, batching no more, until `drain_until`; drops what is left then
  // (its pins end by lease), and ends the thread. Idempotent.
  void stop(Deadline drain_until) ECX_EXCLUDES(mu_);

 private:
  void run() ECX_EXCLUDES(mu_);
  void send(std::vector<PendingRelease> batch);

  // How long a batch waits for more releases before it goes out.
  static constexpr int64_t kBatchMs = 2;

  const std::string name_;
  ConnectorDriver* const driver_;
  Mutex mu_;
  CondVar cv_;
  std::vector<PendingRelease> queued_ ECX_GUARDED_BY(mu_);
  Deadline due_ ECX_GUARDED_BY(mu_) = Deadline::never();  // of the batch in queued_
  bool stopping_ ECX_GUARDED_BY(mu_) = false;
  Deadline drain_until_ ECX_GUARDED_BY(mu_) = Deadline::never();
  std::thread thread_;
};

class HeldViews {
 public:
  // `driver` outlives the holder.
  HeldViews(std::string name, ConnectorDriver* driver, int64_t renew_period_ms);
  ~HeldViews();
  HeldViews(const HeldViews&) = delete;
  HeldViews& operator=(const HeldViews&) = delete;

  // Holds a finished request's views (moved out of `views`), renewed from now until taken.
  // False, leaving `views` to the caller to release, when stopped or when the request id
  // holds views already.
  bool hold(std::shared_ptr<const LoadRequest> request, std::vector<FetchSlot>& views)
      ECX_EXCLUDES(mu_);
  // A copy of the view of `mm_hash` that `request_id` holds (its status: a renewal the
  // producer refused), or nullopt if it holds none. Its item points into the request,
  // which the caller keeps.
  std::optional<FetchSlot> find(const std::string& request_id, const MmHash& mm_hash) const
      ECX_EXCLUDES(mu_);
  // Takes out a request's views (all of them, or the one of `mm_hash`): no longer renewed,
  // theirs to release. The request comes with them.
  PendingRelease take(const std::string& request_id) ECX_EXCLUDES(mu_);
  PendingRelease take(const std::string& request_id, const MmHash& mm_hash) ECX_EXCLUDES(mu_);
  // Ends the renewals; every view still held is returned, one release per request.
  std::vector<PendingRelease> stop() ECX_EXCLUDES(mu_);

  size_t size() const ECX_EXCLUDES(mu_);
  uint64_t renewals_failed() const { return renewals_failed_.load(); }

 private:
  struct Held {
    std::shared_ptr<const LoadRequest> request;
    std::vector<FetchSlot> views;
  };
  void run() ECX_EXCLUDES(mu_);
  // One renew call per producer for every view held; a view whose pin its producer
  // refused to renew is marked, so that it is no longer handed out.
  void renew() ECX_EXCLUDES(mu_);

  const std::string name_;
  ConnectorDriver* const driver_;
  const int64_t renew_period_ms_;
  mutable Mutex mu_;
  CondVar cv_;
  std::map<std::string, Held> held_ ECX_GUARDED_BY(mu_);  // by request id
  size_t views_ ECX_GUARDED_BY(mu_) = 0;
  Deadline renew_due_ ECX_GUARDED_BY(mu_) = Deadline::never();
  bool stopping_ ECX_GUARDED_BY(mu_) = false;
  std::atomic<uint64_t> renewals_failed_{0};
  std::thread thread_;
};

}  // namespace ecx::connector
