// ConnectorBase: what every connector shares. It owns the agent and the consumer-side
// cache, runs the scheduler side (which items to load) and the loader threads, applies
// the failure policy, and keeps the counters. A connector adds how bytes get from the
// producer into a reserved consumer block (fetch) and how the producer stores them.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "connector/options.h"
#include "ecx/cache/encoder_cache_pool.h"
#include "ecx/connector/ec_connector.h"
#include "ecx/transfer/agent.h"

namespace ecx::connector {

// One item a loader must bring into the consumer cache.
struct FetchSlot {
  const LoadItem* item = nullptr;
  cache::BlockRef block;  // reserved (writing) in the consumer cache, pinned for the request
  uint64_t pin_id = 0;
  Status status;      // set by fetch: ok once committed
  bool done = false;  // fetch committed or failed this slot
};

class ConnectorBase : public EcConnector {
 public:
  ~ConnectorBase() override;

  const std::string& name() const override { return name_; }
  Role role() const override { return config_.role; }
  const std::string& compat_hash() const override { return options_.compat_hash; }
  FailurePolicy failure_policy() const override { return options_.failure_policy; }

  std::vector<bool> has_caches(const LoadRequest& request) override;
  Status update_state_after_alloc(const LoadRequest& request, size_t index) override;
  ConnectorMetadata build_connector_meta() override;
  Status start_load_caches(const ConnectorMetadata& metadata) override;
  LoadOutcome wait_for_load(const std::string& request_id, Deadline deadline) override;
  std::vector<std::string> get_finished() override;
  Result<cache::BlockRef> loaded(const std::string& request_id, const MmHash& mm_hash) override;
  void request_finished(const std::string& request_id) override;
  nlohmann::json stats() const override;
  Status wait_for_readers(Deadline) override { return Status::Ok(); }

 protected:
  ConnectorBase(std::string name, ConnectorConfig config, ConnectorOptions options,
                ConnectorContext context);
  // Creates the agent and the consumer cache, starts the loaders; call from the
  // subclass's init.
  Status init_base(bool consumer_cache_remote_write);
  // Stops the loaders and the agent's serving threads, so no virtual method runs any
  // more. Every subclass destructor calls it first. Idempotent.
  void shutdown_base();

  bool is_producer() const { return config_.role != Role::kConsumer; }
  bool is_consumer() const { return config_.role != Role::kProducer; }

  // Whether this connector can load `item` at all (has_caches).
  virtual bool can_load(const LoadItem& item) = 0;
  // Fills and commits every slot (consumer_cache()->commit / commit_received), or sets
  // its status. Must return by `deadline`.
  virtual void fetch(const LoadRequest& request, std::vector<FetchSlot*>& slots,
                     Deadline deadline) = 0;
  // After the request's outcome is known (off the critical path): releases, etc.
  virtual void after_load(const LoadRequest&, const std::vector<FetchSlot*>&) {}
  // An item was served without using its params (already cached here): the connector
  // gives back what the params held at the producer (its pin), so it does not wait for
  // the lease. Runs on the loader; must not block.
  virtual void on_unused_params(const LoadItem&) {}
  // request_finished hook (e.g. delete files).
  virtual void on_request_finished(const LoadRequest&) {}
  // Connector-specific stats.
  virtual void add_stats(nlohmann::json&) const {}

  // Params for an item this producer stored, for connectors that keep no location
  // (disk, store): the consumer finds the item by mm_hash.
  EcTransferParams keyed_params(const MmHash& mm_hash, const TensorMeta& meta) const;
  // Checks a producer's compatibility hash against ours, naming both.
  Status check_compat(const std::string& producer, const std::string& their_hash) const;
  void note_not_ready(const MmHash& mm_hash);
  void count_nack(const Status& status);

  transfer::Agent* agent() const { return agent_.get(); }
  cache::EncoderCachePool* consumer_cache() const { return consumer_cache_.get(); }
  const ConnectorOptions& options() const { return options_; }
  const ConnectorContext& context() const { return context_; }

  std::atomic<uint64_t> saves_{0};
  std::atomic<uint64_t> not_ready_retries_{0};

 private:
  struct RequestState {
    LoadRequest request;
    std::vector<size_t> items;
    std::vector<uint64_t> pins;  // consumer cache pins held for the request
    LoadOutcome outcome;
    bool done = false;
    bool abandoned = false;  // request_finished came before the load ended
  };

  void run_load(const std::shared_ptr<RequestState>& state);
  // fetch(), with anything it throws turned into failed slots, and every slot that
  // claims success checked to be committed.
  void fetch_guarded(const LoadRequest& request, std::vector<FetchSlot*>& slots, Deadline deadline);
  // A pinned block to write (second = false), or the entry another loader wrote
  // (second = true), for `item` in the consumer cache.
  Result<std::pair<cache::Pin, bool>> reserve_or_join(const LoadItem& item,
                                                      const std::string& holder, Deadline deadline);
  void loader_loop();

  const std::string name_;
  const ConnectorConfig config_;
  const ConnectorOptions options_;
  const ConnectorContext context_;
  std::unique_ptr<transfer::Agent> agent_;
  std::unique_ptr<cache::EncoderCachePool> consumer_cache_;

  mutable std::mutex mu_;
  std::condition_variable done_cv_;
  std::condition_variable work_cv_;
  std::map<std::string, ConnectorMetadata::Entry> scheduled_;      // guarded by mu_
  std::map<std::string, std::shared_ptr<RequestState>> requests_;  // guarded by mu_
  std::deque<std::shared_ptr<RequestState>> queue_;                // guarded by mu_
  std::deque<std::function<void()>> background_;  // after-load work (releases); guarded by mu_
  std::vector<std::string> finished_;             // guarded by mu_
  std::map<std::string, uint64_t> nacks_;         // guarded by mu_
  bool stopping_ = false;                         // guarded by mu_
  std::vector<std::thread> loaders_;

  std::atomic<uint64_t> loads_ok_{0}, loads_failed_{0}, items_loaded_{0}, items_recomputed_{0},
      local_hits_{0}, bytes_loaded_{0};
  std::atomic<uint64_t> load_us_total_{0};
};

// Constructs a connector of type T and runs its init(): the one way connectors are made.
template <typename T>
Result<std::unique_ptr<EcConnector>> make_connector(ConnectorConfig config,
                                                    ConnectorOptions options,
                                                    ConnectorContext context) {
  auto c = std::make_unique<T>(std::move(config), std::move(options), std::move(context));
  ECX_RETURN_IF_ERROR(c->init());
  return std::unique_ptr<EcConnector>(std::move(c));
}

}  // namespace ecx::connector
