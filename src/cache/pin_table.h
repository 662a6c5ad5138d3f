// PinTable: the pins of an encoder cache pool, kept apart from its entries. One record
// per pin (entry, holder, lease expiry, the capability it was granted with), indexed by
// id, by capability, by holder (quotas) and by expiry (the lease reaper), and a count of
// pins per entry (eviction asks it). Every index changes in one method, so they cannot
// drift apart.
//
// Not thread-safe: the pool's mutex guards it. Revoking an ended pin's capability is the
// caller's (the records it gets back carry it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ecx/common/deadline.h"
#include "ecx/common/mm_hash.h"
#include "ecx/common/status.h"
#include "ecx/transfer/types.h"

namespace ecx::cache {

struct PinRecord {
  uint64_t id = 0;
  MmHash mm_hash;
  std::string holder;
  Clock::time_point expiry;
  transfer::Capability capability;  // empty unless granted (pin_for_peer)
};

class PinTable {
 public:
  // The holder of pins handed out in params (pin_for_peer without a peer). Peers' holders
  // are agent identities ("name#session"), which never equal it. It may hold 16 times the
  // quota of one peer.
  static constexpr std::string_view kParamsHolder = "params";
  // The holders of params an agent asked for with the params op ("params-op:<holder>"):
  // each has the params' quota, counted apart.
  static constexpr std::string_view kParamsOpPrefix = "params-op:";

  PinTable(std::string pool_name, size_t max_pins_per_holder)
      : pool_name_(std::move(pool_name)), max_pins_per_holder_(max_pins_per_holder) {}

  // kResourceExhausted if `holder` already holds its quota of pins.
  Status check_quota(std::string_view holder) const;
  // Records a pin of `mm_hash` for `holder` until `expiry`; returns its id.
  uint64_t add(const MmHash& mm_hash, const std::string& holder, Clock::time_point expiry,
               transfer::Capability capability = {});

  const PinRecord* find(uint64_t id) const;
  const PinRecord* find_by_capability(const transfer::Capability& capability) const;
  int pins_of(const MmHash& mm_hash) const;
  size_t size() const { return pins_.size(); }
  bool empty() const { return pins_.empty(); }
  size_t pinned_entries() const { return per_entry_.size(); }
  // When the soonest lease ends (nullopt: no pins).
  std::optional<Clock::time_point> next_expiry() const;

  // Moves pin `id`'s lease end to `expiry`, and makes `holder` its holder: a pin handed
  // out in params and kept longer by the peer that reads it counts toward that peer's
  // quota (kResourceExhausted if the peer already holds its quota). kNotFound: no such pin.
  Status renew(uint64_t id, const std::string& holder, Clock::time_point expiry);

  // Each returns the pins it ended (their capabilities are still to be revoked).
  std::optional<PinRecord> end(uint64_t id);
  std::vector<PinRecord> end_holder(std::string_view holder);
  std::vector<PinRecord> end_entry(const MmHash& mm_hash);
  std::vector<PinRecord> end_expired(Clock::time_point now);

 private:
  PinRecord take(std::map<uint64_t, PinRecord>::iterator it);

  const std::string pool_name_;
  const size_t max_pins_per_holder_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, PinRecord> pins_;
  std::map<transfer::Capability, uint64_t> by_capability_;
  std::map<std::string, size_t, std::less<>> per_holder_;
  std::unordered_map<MmHash, int> per_entry_;
  std::set<std::pair<Clock::time_point, uint64_t>> expiries_;
};

}  // namespace ecx::cache
