// What varies per connector kind (p2p, disk, store, local): how a producer stores an
// item, and how a consumer brings it into a block reserved in its cache. Everything
// else (the agent, the consumer cache, the loader threads, the failure policy, the
// counters and the shutdown order) belongs to the one Connector class (connector.h),
// which owns its driver: a driver cannot forget a shutdown step.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "connector/control_messages.h"
#include "connector/options.h"
#include "ecx/cache/encoder_cache_pool.h"
#include "ecx/connector/ec_connector.h"
#include "ecx/transfer/agent.h"

namespace ecx::connector {

// One item a consumer's fetch must bring into the consumer cache.
struct FetchSlot {
  const LoadItem* item = nullptr;
  cache::BlockRef block;  // reserved (writing) in the consumer cache, pinned for the request
  uint64_t pin_id = 0;
  Status status;      // set by fetch: ok once committed
  bool done = false;  // settled before any fetch (validation, local hit, reserve failure)
  // Set by fetch: a pin it took at the producer besides the params' own (a lookup's),
  // which the driver's release gives back.
  ReleasedPin producer_pin;
  // Set by fetch: the producer already ended the params' pin itself (push).
  bool params_pin_released = false;
  // An offer's load: the params' pin is the request's to give back, not this load's.
  bool params_pin_left = false;
  // Set by view (zero_copy): `block` is a read-only view of the producer's block, not a
  // block of ours. The params' pin holds it there (renewed) until the request finishes;
  // `keepalive` keeps the mapping.
  bool viewed = false;
  std::shared_ptr<const void> keepalive;
};

// A load whose holdings at producers are to be given back (ConnectorDriver::release).
struct FinishedLoad {
  const LoadRequest* request = nullptr;
  const std::vector<FetchSlot>* slots = nullptr;  // empty for a discarded request
  // The slots are zero-copy views the request held to its end: exactly their pins go.
  // Otherwise the request's items' pins go, except those of views (kept until then).
  bool views = false;
};

// What a Connector shares with its driver. Lives as long as the connector.
class ConnectorCore {
 public:
  ConnectorCore(std::string name, ConnectorConfig config, ConnectorOptions options,
                ConnectorContext context)
      : name_(std::move(name)),
        config_(std::move(config)),
        options_(std::move(options)),
        context_(std::move(context)) {}

  const std::string& name() const { return name_; }
  const ConnectorConfig& config() const { return config_; }
  const ConnectorOptions& options() const { return options_; }
  const ConnectorContext& context() const { return context_; }
  bool is_producer() const { return config_.role != Role::kConsumer; }
  bool is_consumer() const { return config_.role != Role::kProducer; }

  transfer::Agent* agent() const { return agent_.get(); }
  cache::EncoderCachePool* consumer_cache() const { return consumer_cache_.get(); }

  // Params for an item this producer stored, for connectors that keep no location
  // (disk, store): the consumer finds the item by mm_hash.
  EcTransferParams keyed_params(const MmHash& mm_hash, const TensorMeta& meta) const;
  // Signed p2p params for a block this agent pinned for a peer (`pin` from pin_for_peer,
  // in the producer pool or the consumer cache): its location, pin and capability.
  // `mode`: the p2p mode they name (default: this connector's).
  EcTransferParams located_params(const cache::Pin& pin,
                                  std::optional<P2pMode> mode = std::nullopt) const;
  // This agent's metadata (JSON), as params carry it: taken once its pools exist.
  const std::string& agent_metadata_json() const;
  // Checks a producer's compatibility hash against ours, naming both.
  Status check_compat(const std::string& producer, const std::string& their_hash) const;
  // An item was not ready at the producer; the fetch retries it.
  void note_not_ready(const MmHash& mm_hash);
  uint64_t not_ready_retries() const { return not_ready_retries_.load(); }

 private:
  friend class Connector;

  const std::string name_;
  const ConnectorConfig config_;
  const ConnectorOptions options_;
  const ConnectorContext context_;
  // Stopped by Connector::stop in a stated order (driver, cache, agent), not by their
  // declaration order.
  std::unique_ptr<transfer::Agent> agent_;
  std::unique_ptr<cache::EncoderCachePool> consumer_cache_;  // consumers only
  std::atomic<uint64_t> not_ready_retries_{0};
  mutable std::once_flag metadata_once_;
  mutable std::string metadata_json_;  // written once, under metadata_once_
};

class ConnectorDriver {
 public:
  virtual ~ConnectorDriver() = default;

  // ---- producer ----
  virtual Result<SaveSlot> begin_save(const MmHash& mm_hash, const TensorMeta& meta) = 0;
  virtual Result<EcTransferParams> commit_save(const SaveSlot& slot) = 0;
  virtual Result<EcTransferParams> saved_params(const MmHash& mm_hash) = 0;
  virtual void abort_save(const SaveSlot& slot) = 0;
  virtual Status wait_for_readers(Deadline) { return Status::Ok(); }
  virtual Status release_params(const EcTransferParams&) { return Status::Ok(); }
  // Whether the producer holds a ready entry for mm_hash (no pin taken).
  virtual bool holds(const MmHash&) { return false; }
  // A peer's RELEASE of one pin the driver handed out: true if it was one of its pins and
  // `capability` is the one granted with it.
  virtual bool release_granted(uint64_t /*pin*/, const transfer::Capability&) { return false; }

  // ---- consumer ----
  // Whether this driver can load `item` at all (has_caches).
  virtual bool can_load(const LoadItem& item) = 0;
  // Fills and commits every slot (consumer_cache()->commit / commit_received), or sets
  // its status. Must return by `deadline`.
  virtual void fetch(std::vector<FetchSlot*>& slots, Deadline deadline) = 0;
  // zero_copy: views each slot's block where it lies, with no copy (slot.viewed, its
  // block, status ok), once its producer has confirmed the pin that holds it there and
  // taken it as ours; or fails the slot. A slot the driver cannot view (the block is not
  // on this host, or the mode copies) is left ok and not viewed: fetch copies it.
  virtual void view(std::vector<FetchSlot*>& /*slots*/, Deadline) {}
  // Another lease for the pins that hold these views at their producers: per view, ok,
  // or the producer's refusal (the pin ended, or the reader's pin quota is full). A
  // producer that cannot be reached leaves its views ok: their pins still run their lease.
  virtual std::vector<Status> renew(std::span<const FetchSlot* const> views, Deadline) {
    return std::vector<Status>(views.size());
  }
  // These requests' loads are over, whichever way: loaded, already cached, recomputed,
  // failed, or discarded before they started (then `slots` is empty). Gives back exactly
  // what they hold at producers, coalesced: all the loads that finished since the last
  // call come together. Runs on a loader thread, off the critical path.
  virtual void release(std::span<const FinishedLoad> /*loads*/) {}
  // request_finished: the consumer is done with the loaded bytes (e.g. delete files).
  virtual void on_request_finished(const LoadRequest&) {}

  virtual void add_stats(ConnectorStats&) const {}
};

// How a connector kind is made: its name, whether producers write into the consumer's
// cache (push), and its driver, created once the core's agent and cache exist.
struct ConnectorKind {
  std::string name;
  bool consumer_cache_remote_write = false;
  std::function<Result<std::unique_ptr<ConnectorDriver>>(ConnectorCore&)> make_driver;
};

// The kind whose driver is a T constructed from the core, then started (T::start()).
template <typename T>
ConnectorKind driver_kind(std::string name, bool consumer_cache_remote_write = false) {
  return {.name = std::move(name),
          .consumer_cache_remote_write = consumer_cache_remote_write,
          .make_driver = [](ConnectorCore& core) -> Result<std::unique_ptr<ConnectorDriver>> {
            auto driver = std::make_unique<T>(core);
            ECX_RETURN_IF_ERROR(driver->start());
            return std::unique_ptr<ConnectorDriver>(std::move(driver));
          }};
}

// The one way connectors are made.
Result<std::unique_ptr<EcConnector>> make_connector(ConnectorKind kind, ConnectorConfig config,
                                                    ConnectorOptions options,
                                                    ConnectorContext context);

}  // namespace ecx::connector
