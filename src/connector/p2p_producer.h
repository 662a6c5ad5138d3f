// The p2p connector's producer (p2p_connector.h): encoder outputs in a pool registered with
// the agent, and the call service consumers talk to: lookup (where a block is, pinned for
// the caller), load (push: write blocks into the caller's granted windows), params (pins
// by mm_hash, for a proxy) and renew (zero-copy readers keep their pins).
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <string_view>

#include "connector/connector_driver.h"

namespace ecx::connector {

class P2pProducer {
 public:
  explicit P2pProducer(ConnectorCore& core) : core_(core) {}

  // Makes the pool and serves calls for it; a consumer serves lookups and renewals of
  // its own cache's blocks (share_loaded's readers).
  Status start();

  // ConnectorDriver's producer half (connector_driver.h states each contract).
  Result<SaveSlot> begin_save(const MmHash& mm_hash, const TensorMeta& meta);
  Result<EcTransferParams> commit_save(const SaveSlot& slot);
  Result<EcTransferParams> saved_params(const MmHash& mm_hash);
  void abort_save(const SaveSlot& slot);
  Status wait_for_readers(Deadline deadline);
  Status release_params(const EcTransferParams& params);
  bool holds(const MmHash& mm_hash);
  bool release_granted(uint64_t pin, const transfer::Capability& capability);
  void add_stats(ConnectorStats& s) const;

 private:
  const ConnectorOptions& options() const { return core_.options(); }
  transfer::Agent* agent() const { return core_.agent(); }
  const std::string& name() const { return core_.name(); }

  // Pins the item for its params: against the params' quota, or `quota_holder`'s.
  Result<EcTransferParams> params_for(const MmHash& mm_hash, const std::string& quota_holder = "");
  Result<std::string> handle_call(const transfer::Caller& caller, std::string_view body);
  Result<cache::Pin> entry_for(const transfer::Caller& caller, const MmHash& mm_hash,
                               const transfer::Capability& capability, Deadline wait);
  ItemsReply handle_lookup(const transfer::Caller& caller, const LookupRequest& req);
  Result<std::string> handle_load(const transfer::Caller& caller, const LoadBlocksRequest& req);
  ItemsReply handle_params(const transfer::Caller& caller, const ParamsRequest& req);
  ItemsReply handle_renew(const transfer::Caller& caller, const RenewRequest& req);

  ConnectorCore& core_;
  // Made by start (producers only); read-only after it: the pool guards its own state.
  std::unique_ptr<cache::EncoderCachePool> pool_;
  // The pool the call service answers for, set by start: pool_, or a consumer's cache
  // (the blocks its share_loaded handed out); null when there is neither.
  cache::EncoderCachePool* served_ = nullptr;
  std::atomic<uint64_t> releases_received_{0}, renewals_received_{0};
};

}  // namespace ecx::connector
