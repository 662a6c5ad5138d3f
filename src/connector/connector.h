// Connector: the one EcConnector class. It owns the agent and the consumer-side cache,
// runs the scheduler side (which items to load) and the loader threads, applies the
// failure policy, keeps the counters, and shuts down in one order: loaders, view
// renewals, releases, agent serving threads, driver, cache, agent. What varies per
// connector kind is its driver (connector_driver.h). connector.cc: lifecycle, producer
// and scheduler side, stats; connector_load.cc: the loaders and one request's load;
// producer_holdings.cc: what finished loads hold at producers (releases, held views).
#pragma once

#include <deque>
#include <map>
#include <thread>

#include "connector/connector_driver.h"
#include "connector/control_messages.h"
#include "connector/offers.h"
#include "connector/producer_holdings.h"
#include "ecx/common/mutex.h"

namespace ecx::connector {

class Connector final : public EcConnector {
 public:
  Connector(std::string name, ConnectorConfig config, ConnectorOptions options,
            ConnectorContext context)
      : core_(std::move(name), std::move(config), std::move(options), std::move(context)) {}
  ~Connector() override;

  Status init(const ConnectorKind& kind);

  const std::string& name() const override { return core_.name(); }
  Role role() const override { return core_.config().role; }
  const std::string& compat_hash() const override { return core_.options().compat_hash; }
  FailurePolicy failure_policy() const override { return core_.options().failure_policy; }

  Result<SaveSlot> begin_save(const MmHash& mm_hash, const TensorMeta& meta) override;
  Result<EcTransferParams> commit_save(const SaveSlot& slot) override;
  Result<EcTransferParams> saved_params(const MmHash& mm_hash) override;
  void abort_save(const SaveSlot& slot) override;
  bool holds(const MmHash& mm_hash) override;
  Result<std::vector<Result<EcTransferParams>>> remote_saved_params(
      const std::string& producer, const std::vector<MmHash>& hashes, Deadline deadline) override;
  Status wait_for_readers(Deadline deadline) override;
  Status release_params(const EcTransferParams& params) override;
  Status offer(const std::string& address, const std::vector<EcTransferParams>& params) override;

  std::vector<bool> has_caches(const LoadRequest& request) override;
  Status update_state_after_alloc(const LoadRequest& request, size_t index) override;
  ConnectorMetadata build_connector_meta() override;
  Status start_load_caches(const ConnectorMetadata& metadata) override;
  LoadOutcome wait_for_load(const std::string& request_id, Deadline deadline) override;
  // The caller's thread runs the load: no hand-off to a loader and back.
  LoadOutcome load(const LoadRequest& request, Deadline deadline) override;
  std::vector<std::string> get_finished() override;
  Result<cache::BlockRef> loaded(const std::string& request_id, const MmHash& mm_hash) override;
  Status view_intact(const std::string& request_id, const MmHash& mm_hash) override;
  Result<std::vector<EcTransferParams>> share_loaded(const std::string& request_id,
                                                     const MmHash& mm_hash,
                                                     size_t readers) override;
  Status item_finished(const std::string& request_id, const MmHash& mm_hash) override;
  void request_finished(const std::string& request_id) override;
  void discard(const LoadRequest& request) override;
  ConnectorStats stats() const override;
  std::string agent_metadata() const override { return core_.agent_metadata_json(); }

 private:
  // A consumer cache pin a request holds, and the item it holds.
  struct ItemPin {
    MmHash mm_hash;
    uint64_t pin_id = 0;
  };
  // Its outcome, done and abandoned are guarded by the connector's mu_.
  struct RequestState {
    LoadRequest request;
    std::vector<size_t> items;
    std::vector<ItemPin> pins;  // consumer cache pins held for the request
    LoadOutcome outcome;
    bool done = false;
    bool abandoned = false;  // request_finished came before the load ended
    // An offer's load (accept_offer): copied into the cache for the request to come,
    // which gives the producers' pins back; nobody waits for it or finishes it.
    bool offered = false;
  };
  // The request a release or a held view keeps alive (its items are pointed into).
  static std::shared_ptr<const LoadRequest> request_of(const std::shared_ptr<RequestState>& s) {
    return {s, &s->request};
  }
  // One load's working state, from planning to the outcome.
  struct LoadJob {
    std::shared_ptr<RequestState> state;
    Deadline deadline;
    std::string holder;  // of the consumer cache pins
    std::vector<FetchSlot> slots;
    std::vector<FetchSlot*> to_view, to_fetch, to_encode;
    std::vector<ItemPin> pins;
    LoadOutcome outcome;
  };

  Status producer_only(const char* what) const;
  void on_notification(const transfer::Notification& n);
  // Loads an offer's items into the consumer cache (keep_loaded), leaving the params'
  // pins at their producers to the requests that will use them.
  void accept_offer(const std::string& from, OfferNotice notice);
  void finish_offered(LoadJob& job);
  void run_load(const std::shared_ptr<RequestState>& state);
  // When a load of `state`, started now, gives up.
  Deadline load_deadline(const RequestState& state) const;
  void plan(LoadJob& job);
  bool take_local_hit(LoadJob& job, FetchSlot& slot);
  void hold_local_hit(LoadJob& job, FetchSlot& slot, const cache::Pin& pin);
  bool load_if_all_here(const std::shared_ptr<RequestState>& state);
  // A block of the consumer cache for `slot` to be fetched into (or another load's entry).
  void reserve_for_fetch(LoadJob& job, FetchSlot& slot);
  // zero_copy: the driver views what it can; the rest is reserved and fetched.
  void view_or_reserve(LoadJob& job);
  // fetch(), with anything it throws turned into failed slots, and every slot that
  // claims success checked to be committed.
  void fetch_guarded(std::vector<FetchSlot*>& slots, Deadline deadline);
  void settle_fetched(LoadJob& job);
  void count_nack(const Status& failure) ECX_EXCLUDES(nacks_mu_);
  void count_loaded(LoadJob& job, const LoadItem& item);
  Status recompute(LoadJob& job, const LoadItem& item, double* recompute_ms);
  void recompute_or_fail(LoadJob& job);
  void report_settled_failures(LoadJob& job);
  void finish(LoadJob& job);
  // A pinned block to write (second = false), or the entry another loader wrote
  // (second = true), for `item` in the consumer cache.
  Result<std::pair<cache::Pin, bool>> reserve_or_join(const LoadItem& item,
                                                      const std::string& holder, Deadline deadline);
  // A copy of each view in the consumer cache (keep_loaded), before its pins go.
  void keep_views(const std::vector<FetchSlot>& views);
  // Gives back a request's consumer cache pins (and, unless keep_loaded, their entries).
  void unpin_all(const std::vector<ItemPin>& pins);
  Result<std::vector<EcTransferParams>> share_view(const std::string& request_id,
                                                   const FetchSlot& view, size_t readers) const;
  int64_t renew_period_ms() const { return std::max<int64_t>(1, core_.options().lease_ms / 3); }
  // Queues a release; once the releases stopped, logs that its pins are left to lease.
  void give_back(PendingRelease release);
  void loader_loop();
  std::deque<std::shared_ptr<RequestState>>::iterator next_load_locked() ECX_REQUIRES(mu_);
  void stop();

  ConnectorCore core_;
  std::unique_ptr<ConnectorDriver> driver_;

  mutable Mutex mu_;
  CondVar done_cv_;
  CondVar work_cv_;
  std::map<std::string, ConnectorMetadata::Entry> scheduled_ ECX_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<RequestState>> requests_ ECX_GUARDED_BY(mu_);
  std::deque<std::shared_ptr<RequestState>> queue_ ECX_GUARDED_BY(mu_);
  std::vector<std::string> finished_ ECX_GUARDED_BY(mu_);
  bool stopping_ ECX_GUARDED_BY(mu_) = false;
  std::vector<std::thread> loaders_;  // run the queued loads, and nothing else
  std::atomic<uint64_t> items_viewed_{0};

  // Consumers: what finished loads hold at producers, each with its own thread and lock
  // (producer_holdings.h). A request's views are held from the moment its load is done
  // (set under mu_) until request_finished takes them.
  std::unique_ptr<HeldViews> views_;
  std::unique_ptr<ReleaseBatcher> releases_;

  // Offers: what this side sends (its thread starts with the first), and the offered
  // loads queued or running here now.
  std::unique_ptr<OfferSender> offers_;
  int offered_loads_ ECX_GUARDED_BY(mu_) = 0;    // queued or running
  int offered_running_ ECX_GUARDED_BY(mu_) = 0;  // on a loader now
  uint64_t next_offer_ ECX_GUARDED_BY(mu_) = 0;
  static constexpr int kMaxOfferedLoads = 64;

  // Failed item loads by code: a figure, counted apart from the loaders' work.
  mutable Mutex nacks_mu_;
  std::map<std::string, uint64_t> nacks_ ECX_GUARDED_BY(nacks_mu_);

  std::atomic<uint64_t> saves_{0}, loads_ok_{0}, loads_failed_{0}, items_loaded_{0},
      items_recomputed_{0}, local_hits_{0}, bytes_loaded_{0}, load_us_total_{0}, items_offered_{0},
      offered_refused_{0};
};

}  // namespace ecx::connector
