// The p2p connector's consumer (p2p_connector.h): what every way of fetching shares (the
// trust check on params, one connection per producer, lookups that wait for not-ready
// entries, renewals of zero-copy views' pins, pins given back in batches), and the fetch
// mode chosen at start (p2p_fetch.h).
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "connector/connector_driver.h"
#include "ecx/common/mutex.h"

namespace ecx::connector {

class FetchMode;

class P2pConsumer {
 public:
  explicit P2pConsumer(ConnectorCore& core);
  ~P2pConsumer();

  // ConnectorDriver's consumer half (connector_driver.h states each contract).
  bool can_load(const LoadItem& item);
  void fetch(std::vector<FetchSlot*>& slots, Deadline deadline);
  void view(std::vector<FetchSlot*>& slots, Deadline deadline);
  std::vector<Status> renew(std::span<const FetchSlot* const> views, Deadline deadline);
  void release(std::span<const FinishedLoad> loads);
  void add_stats(ConnectorStats& s) const;

  // ---- for the fetch modes ----
  // One control request for the pending items (their indices into the group), letting
  // the producer wait `wait_ms` for not-ready entries; and what an item's answer settles.
  using Exchange =
      std::function<Result<std::string>(const std::vector<size_t>& pending, int64_t wait_ms)>;
  using Settle = std::function<void(size_t index, const ItemReply& reply)>;

  ConnectorCore& core() const { return core_; }
  // Exchanges until every item of `group` is settled: items the producer reports not
  // ready are asked again (each retry waiting there) until `deadline`. A failed exchange
  // fails every pending item, naming `what`.
  void call_until_ready(const std::string& producer, const std::vector<FetchSlot*>& group,
                        Deadline deadline, const char* what, const Exchange& exchange,
                        const Settle& settle);
  // Asks `producer` where `group`'s blocks are, pinning each for us (proved by the params'
  // capability): sets each slot's status and, where found, `where[i]`.
  void lookup(const std::string& producer, std::vector<FetchSlot*>& group,
              std::vector<BlockLocation>& where, Deadline deadline);
  // Where each block of `group` is at `producer`: from its params, or looked up (always,
  // with `force_lookup`; the lookup's pin goes to the slot's producer_pin).
  std::vector<BlockLocation> locate(const std::string& producer, std::vector<FetchSlot*>& group,
                                    bool force_lookup, Deadline deadline);

 private:
  using PinsByProducer = std::map<std::string, std::vector<ReleasedPin>>;

  const ConnectorOptions& options() const { return core_.options(); }
  transfer::Agent* agent() const { return core_.agent(); }
  const std::string& name() const { return core_.name(); }

  Status trust(const LoadItem& item) const;
  Status connect_producer(const EcTransferParams& params, Deadline deadline);
  void per_producer(std::vector<FetchSlot*>& slots, Deadline deadline,
                    const std::function<void(const std::string&, std::vector<FetchSlot*>&)>& fn);
  // One renew CALL to `producer` for the pins of `group`'s views: per view, the
  // producer's answer for its own pin, or the call's failure.
  std::vector<Status> renew_pins(const std::string& producer,
                                 const std::vector<const FetchSlot*>& group, Deadline deadline);
  void collect_pins(const FinishedLoad& load, PinsByProducer& by_producer,
                    std::map<std::string, const EcTransferParams*>& params_of) const;

  ConnectorCore& core_;
  // Chosen at construction by the mode; `views_` only where the mode can view (pull).
  // Dropped with the connector's driver, after its loaders are joined.
  std::unique_ptr<FetchMode> fetches_;
  std::unique_ptr<FetchMode> views_;
  Mutex producers_mu_;
  // engine_id -> agent JSON
  std::map<std::string, std::string> known_producers_ ECX_GUARDED_BY(producers_mu_);
  std::atomic<uint64_t> releases_sent_{0};
  mutable std::atomic<uint64_t> params_rejected_{0};
};

}  // namespace ecx::connector
