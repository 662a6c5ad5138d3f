#include "cache/pin_table.h"

namespace ecx::cache {

Status PinTable::check_quota(std::string_view holder) const {
  // Params (E's own, or those one agent asks for with the params op) may number 16 times
  // a peer's quota; each agent's count apart from E's own.
  const bool params = holder == kParamsHolder || holder.starts_with(kParamsOpPrefix);
  size_t quota = max_pins_per_holder_ * (params ? 16 : 1);
  auto held = per_holder_.find(holder);
  if (held == per_holder_.end() || held->second < quota) return Status::Ok();
  const bool bearer = holder.find(':') != std::string_view::npos;  // params-op:, share:
  return Status(StatusCode::kResourceExhausted, "pool " + pool_name_ + ": " +
                                                    (holder == kParamsHolder ? std::string("params")
                                                     : bearer                ? std::string(holder)
                                                              : std::string("this peer")) +
                                                    " already holds " +
                                                    std::to_string(held->second) +
                                                    " pins (the most allowed); release some first");
}

uint64_t PinTable::add(const MmHash& mm_hash, const std::string& holder, Clock::time_point expiry,
                       transfer::Capability capability) {
  uint64_t id = next_id_++;
  if (!capability.empty()) by_capability_.emplace(capability, id);
  per_holder_[holder]++;
  per_entry_[mm_hash]++;
  expiries_.emplace(expiry, id);
  pins_.emplace(id, PinRecord{id, mm_hash, holder, expiry, capability});
  return id;
}

const PinRecord* PinTable::find(uint64_t id) const {
  auto it = pins_.find(id);
  return it == pins_.end() ? nullptr : &it->second;
}

const PinRecord* PinTable::find_by_capability(const transfer::Capability& capability) const {
  if (capability.empty()) return nullptr;
  auto it = by_capability_.find(capability);
  return it == by_capability_.end() ? nullptr : find(it->second);
}

int PinTable::pins_of(const MmHash& mm_hash) const {
  auto it = per_entry_.find(mm_hash);
  return it == per_entry_.end() ? 0 : it->second;
}

std::optional<Clock::time_point> PinTable::next_expiry() const {
  if (expiries_.empty()) return std::nullopt;
  return expiries_.begin()->first;
}

PinRecord PinTable::take(std::map<uint64_t, PinRecord>::iterator it) {
  PinRecord record = std::move(it->second);
  pins_.erase(it);
  expiries_.erase({record.expiry, record.id});
  if (!record.capability.empty()) by_capability_.erase(record.capability);
  auto held = per_holder_.find(record.holder);
  if (held != per_holder_.end() && --held->second == 0) per_holder_.erase(held);
  auto entry = per_entry_.find(record.mm_hash);
  if (entry != per_entry_.end() && --entry->second == 0) per_entry_.erase(entry);
  return record;
}

Status PinTable::renew(uint64_t id, const std::string& holder, Clock::time_point expiry) {
  auto it = pins_.find(id);
  if (it == pins_.end()) {
    return NotFound("pin " + std::to_string(id) + " in pool " + pool_name_ + ": no such pin");
  }
  PinRecord& record = it->second;
  if (record.holder != holder) {
    ECX_RETURN_IF_ERROR(check_quota(holder));
    auto held = per_holder_.find(record.holder);
    if (held != per_holder_.end() && --held->second == 0) per_holder_.erase(held);
    per_holder_[holder]++;
    record.holder = holder;
  }
  if (expiry > record.expiry) {
    expiries_.erase({record.expiry, id});
    record.expiry = expiry;
    expiries_.emplace(expiry, id);
  }
  return Status::Ok();
}

std::optional<PinRecord> PinTable::end(uint64_t id) {
  auto it = pins_.find(id);
  if (it == pins_.end()) return std::nullopt;
  return take(it);
}

std::vector<PinRecord> PinTable::end_holder(std::string_view holder) {
  std::vector<PinRecord> ended;
  if (!per_holder_.contains(holder)) return ended;
  for (auto it = pins_.begin(); it != pins_.end();) {
    auto next = std::next(it);
    if (it->second.holder == holder) ended.push_back(take(it));
    it = next;
  }
  return ended;
}

std::vector<PinRecord> PinTable::end_entry(const MmHash& mm_hash) {
  std::vector<PinRecord> ended;
  if (pins_of(mm_hash) == 0) return ended;
  for (auto it = pins_.begin(); it != pins_.end();) {
    auto next = std::next(it);
    if (it->second.mm_hash == mm_hash) ended.push_back(take(it));
    it = next;
  }
  return ended;
}

std::vector<PinRecord> PinTable::end_expired(Clock::time_point now) {
  std::vector<PinRecord> ended;
  while (!expiries_.empty() && expiries_.begin()->first <= now) {
    ended.push_back(take(pins_.find(expiries_.begin()->second)));
  }
  return ended;
}

}  // namespace ecx::cache
