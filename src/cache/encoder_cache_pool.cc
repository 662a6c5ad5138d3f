#include "ecx/cache/encoder_cache_pool.h"

#include <condition_variable>
#include <list>
#include <map>
#include <mutex>
#include <set>
#include <span>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cache/arena_allocator.h"
#include "cache/arena_memory.h"
#include "ecx/common/bytes.h"

namespace ecx::cache {
namespace {

// The holder of pins handed out in params (pin_for_peer without a peer). Peers' holders
// are agent identities ("name#session"), which never equal it.
constexpr std::string_view kParamsHolder = "params";

}  // namespace

class EncoderCachePool::Impl {
 public:
  Impl(transfer::Agent* agent, PoolConfig config, std::unique_ptr<ArenaMemory> arena)
      : agent_(agent),
        config_(std::move(config)),
        arena_(std::move(arena)),
        region_(arena_->region()),
        allocator_(region_.length, kBlockAlignment) {
    reaper_ = std::thread([this] { reap_leases(); });
  }

  ~Impl() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    reaper_cv_.notify_all();
    reaper_.join();
  }

  uint32_t region_id() const { return region_.id; }
  const std::string& name() const { return config_.name; }

  Result<Pin> reserve(const MmHash& mm_hash, const TensorMeta& meta, Deadline room_deadline,
                      const std::string* pin_holder) {
    ECX_RETURN_IF_ERROR(meta.validate());
    uint64_t block_length = kBlockHeaderBytes + meta.byte_size();
    std::unique_lock lock(mu_);
    if (block_length > allocator_.capacity()) {
      return Status(StatusCode::kResourceExhausted,
                    "pool " + config_.name + ": an entry of " + format_bytes(block_length) +
                        " is larger than the pool (" + format_bytes(allocator_.capacity()) + ")");
    }
    while (true) {
      if (entries_.count(mm_hash)) {
        return Status(StatusCode::kAlreadyExists,
                      "pool " + config_.name + " already has mm_hash " + mm_hash.str());
      }
      std::optional<uint64_t> offset = allocator_.allocate(block_length);
      while (!offset && evict_one_locked()) offset = allocator_.allocate(block_length);
      if (offset) {
        Entry e;
        e.mm_hash = mm_hash;
        e.meta = meta;
        e.offset = *offset;
        e.block_length = block_length;
        e.generation = next_generation_++;
        auto& stored = entries_.emplace(mm_hash, e).first->second;
        Pin p{ref_of(stored), 0};
        if (pin_holder != nullptr) p.pin_id = add_pin_locked(stored, *pin_holder, config_.lease);
        return p;
      }
      // Everything is pinned or being written: wait for a pin to end, or give up.
      if (cv_.wait_until(lock, room_deadline.time_point()) == std::cv_status::timeout &&
          room_deadline.expired()) {
        return Status(StatusCode::kResourceExhausted,
                      "pool " + config_.name + ": no room for " + format_bytes(block_length) +
                          " (capacity " + format_bytes(allocator_.capacity()) + ", used " +
                          format_bytes(allocator_.used()) + ", largest free " +
                          format_bytes(allocator_.largest_free()) + "; every other entry is " +
                          "pinned or being written)");
      }
    }
  }

  Status commit(const MmHash& mm_hash, uint64_t generation) {
    std::unique_lock lock(mu_);
    ECX_ASSIGN_OR_RETURN(Entry * e, writing_entry(mm_hash, generation));
    ECX_ASSIGN_OR_RETURN(uint64_t sum,
                         arena_->checksum(e->offset + kBlockHeaderBytes, e->meta.byte_size()));
    ECX_RETURN_IF_ERROR(write_header(*e, sum));
    mark_ready_locked(*e);
    lock.unlock();
    cv_.notify_all();
    return Status::Ok();
  }

  Status commit_received(const MmHash& mm_hash, uint64_t generation,
                         const BlockExpectation& expected,
                         std::optional<uint64_t> payload_checksum) {
    std::unique_lock lock(mu_);
    ECX_ASSIGN_OR_RETURN(Entry * e, writing_entry(mm_hash, generation));
    auto host = host_block(*e, /*with_payload=*/!payload_checksum.has_value());
    Status verdict = host.ok()
                         ? verify_block(host->data(), e->block_length, expected, payload_checksum)
                         : host.status();
    BlockHeader h = verdict.ok() ? read_block_header(host->data()) : BlockHeader{};
    if (verdict.ok()) verdict = write_header(*e, h.checksum);
    if (!verdict.ok()) {
      remove_locked(mm_hash);
      lock.unlock();
      cv_.notify_all();
      return verdict;
    }
    mark_ready_locked(*e);
    lock.unlock();
    cv_.notify_all();
    return Status::Ok();
  }

  void abort(const MmHash& mm_hash, uint64_t generation) {
    std::unique_lock lock(mu_);
    auto it = entries_.find(mm_hash);
    if (it == entries_.end() || it->second.ready || it->second.generation != generation) return;
    remove_locked(mm_hash);
    lock.unlock();
    cv_.notify_all();
  }

  Result<BlockRef> find(const MmHash& mm_hash) {
    std::lock_guard lock(mu_);
    auto it = entries_.find(mm_hash);
    if (it == entries_.end()) {
      misses_++;
      return NotFound("mm_hash " + mm_hash.str() + " is not in pool " + config_.name);
    }
    if (!it->second.ready) {
      return Status(StatusCode::kNotReady,
                    "mm_hash " + mm_hash.str() + " is still being written in pool " + config_.name);
    }
    hits_++;
    touch_locked(it->second);
    return ref_of(it->second);
  }

  Result<BlockRef> wait_ready(const MmHash& mm_hash, Deadline deadline) {
    std::unique_lock lock(mu_);
    while (true) {
      auto it = entries_.find(mm_hash);
      if (it == entries_.end()) {
        return NotFound("mm_hash " + mm_hash.str() + " is not in pool " + config_.name);
      }
      if (it->second.ready) {
        touch_locked(it->second);
        return ref_of(it->second);
      }
      if (cv_.wait_until(lock, deadline.time_point()) == std::cv_status::timeout) {
        auto again = entries_.find(mm_hash);
        if (again != entries_.end() && again->second.ready) return ref_of(again->second);
        return Status(StatusCode::kNotReady, "mm_hash " + mm_hash.str() +
                                                 " still being written in pool " + config_.name +
                                                 " at the deadline");
      }
    }
  }

  Result<Pin> pin(const MmHash& mm_hash, const std::string& holder,
                  std::chrono::milliseconds lease) {
    std::unique_lock lock(mu_);
    ECX_ASSIGN_OR_RETURN(Entry * entry, ready_entry_locked(mm_hash));
    Entry& e = *entry;
    touch_locked(e);
    Pin p{ref_of(e), add_pin_locked(e, holder, lease)};
    return p;
  }

  Result<Pin> pin_for_peer(const MmHash& mm_hash, const std::string& peer,
                           std::chrono::milliseconds lease) {
    std::unique_lock lock(mu_);
    ECX_ASSIGN_OR_RETURN(Entry * entry, ready_entry_locked(mm_hash));
    Entry& e = *entry;
    const std::string holder = peer.empty() ? std::string(kParamsHolder) : peer;
    ECX_RETURN_IF_ERROR(check_pin_quota_locked(holder));
    ECX_ASSIGN_OR_RETURN(transfer::Capability cap,
                         agent_->grant(region_.id, e.offset, e.block_length, false, peer));
    touch_locked(e);
    uint64_t id = add_pin_locked(e, holder, lease);
    pins_.at(id).capability = cap;
    pins_by_capability_.emplace(cap, id);
    return Pin{ref_of(e), id, cap};
  }

  Result<Pin> pin_of_capability(const MmHash& mm_hash, const transfer::Capability& capability) {
    std::unique_lock lock(mu_);
    auto by_cap = pins_by_capability_.find(capability);
    Status none = NotFound("mm_hash " + mm_hash.str() + ": no live pin in pool " + config_.name +
                           " with that capability");
    if (capability.empty() || by_cap == pins_by_capability_.end()) return none;
    const PinRecord& record = pins_.at(by_cap->second);
    if (!(record.mm_hash == mm_hash)) return none;
    auto e = entries_.find(mm_hash);
    if (e == entries_.end()) return none;
    return Pin{ref_of(e->second), by_cap->second, capability};
  }

  Status release_granted(uint64_t pin_id, const transfer::Capability& capability) {
    std::unique_lock lock(mu_);
    auto it = pins_.find(pin_id);
    if (it == pins_.end() || capability.empty() || !(it->second.capability == capability)) {
      return NotFound("pin " + std::to_string(pin_id) + " in pool " + config_.name +
                      ": no such pin held with that capability");
    }
    end_pin_locked(pin_id);
    lock.unlock();
    cv_.notify_all();
    return Status::Ok();
  }

  Status unpin(uint64_t pin_id) {
    std::unique_lock lock(mu_);
    if (!end_pin_locked(pin_id)) {
      return NotFound("pin " + std::to_string(pin_id) + " in pool " + config_.name +
                      " already ended (released or lease expired)");
    }
    lock.unlock();
    cv_.notify_all();
    return Status::Ok();
  }

  size_t release_holder(const std::string& holder) {
    std::unique_lock lock(mu_);
    std::vector<uint64_t> ids;
    for (const auto& [id, p] : pins_) {
      if (p.holder == holder) ids.push_back(id);
    }
    for (uint64_t id : ids) end_pin_locked(id);
    lock.unlock();
    cv_.notify_all();
    return ids.size();
  }

  Status erase(const MmHash& mm_hash) {
    std::lock_guard lock(mu_);
    auto it = entries_.find(mm_hash);
    if (it == entries_.end())
      return NotFound("mm_hash " + mm_hash.str() + " is not in pool " + config_.name);
    if (it->second.pins > 0) {
      return Status(StatusCode::kFailedPrecondition, "mm_hash " + mm_hash.str() + " is pinned by " +
                                                         std::to_string(it->second.pins) +
                                                         " readers");
    }
    remove_locked(mm_hash);
    return Status::Ok();
  }

  PoolStats stats() const {
    std::lock_guard lock(mu_);
    PoolStats s;
    s.capacity_bytes = allocator_.capacity();
    s.used_bytes = allocator_.used();
    for (const auto& [h, e] : entries_) {
      s.entries++;
      s.payload_bytes += e.meta.byte_size();
      if (!e.ready) s.writing_entries++;
      if (e.pins > 0) s.pinned_entries++;
    }
    s.pins = pins_.size();
    s.evictions = evictions_;
    s.lease_expiries = lease_expiries_;
    s.hits = hits_;
    s.misses = misses_;
    s.bytes_used_per_payload_byte =
        s.payload_bytes ? static_cast<double>(s.used_bytes) / static_cast<double>(s.payload_bytes)
                        : 1.0;
    return s;
  }

  Status wait_unpinned(Deadline deadline) {
    std::unique_lock lock(mu_);
    if (cv_.wait_until(lock, deadline.time_point(), [&] { return pins_.empty(); }))
      return Status::Ok();
    return DeadlineExceeded("pool " + config_.name + ": " + std::to_string(pins_.size()) +
                            " pins still held at the deadline");
  }

  std::chrono::milliseconds default_lease() const { return config_.lease; }

  // Copies host bytes into a reserved block's payload (the caller holds the entry in
  // state writing, so no lock is needed for its bytes).
  Status write_payload(const BlockRef& ref, const void* data, uint64_t length) {
    return arena_->write(ref.offset + kBlockHeaderBytes, data, length);
  }

 private:
  struct Entry {
    MmHash mm_hash;
    TensorMeta meta;
    uint64_t offset = 0;
    uint64_t block_length = 0;
    uint64_t generation = 0;
    bool ready = false;
    int pins = 0;
    std::list<MmHash>::iterator lru;  // valid while ready
  };
  struct PinRecord {
    MmHash mm_hash;
    std::string holder;
    Clock::time_point expiry;
    transfer::Capability capability;  // from pin_for_peer; revoked when the pin ends
  };

  BlockRef ref_of(const Entry& e) const {
    return BlockRef{e.mm_hash,
                    e.meta,
                    region_.id,
                    e.offset,
                    e.block_length,
                    e.generation,
                    region_.data + e.offset};
  }

  // Writes the entry's header (through a host copy in a CUDA pool).
  Status write_header(const Entry& e, uint64_t checksum) {
    std::byte header[kBlockHeaderBytes];
    write_block_header(header, e.mm_hash, e.meta, e.generation, checksum);
    return arena_->write(e.offset, header, sizeof(header));
  }

  // The block's bytes where the CPU can read them: in place in a host pool; a host copy
  // of the header (and the payload, when `with_payload`) in a CUDA pool. Either way the
  // buffer spans block_length bytes, so verify_block's bounds hold.
  Result<std::span<const std::byte>> host_block(const Entry& e, bool with_payload) {
    if (arena_->kind() == transfer::MemoryKind::kHost) {
      return std::span<const std::byte>(region_.data + e.offset, e.block_length);
    }
    staging_.assign(e.block_length, std::byte{0});
    ECX_RETURN_IF_ERROR(
        arena_->read(e.offset, staging_.data(), with_payload ? e.block_length : kBlockHeaderBytes));
    return std::span<const std::byte>(staging_);
  }

  // The ready entry for mm_hash: kNotFound or kNotReady otherwise.
  Result<Entry*> ready_entry_locked(const MmHash& mm_hash) {
    auto it = entries_.find(mm_hash);
    if (it == entries_.end()) {
      return NotFound("mm_hash " + mm_hash.str() + " is not in pool " + config_.name);
    }
    if (!it->second.ready) {
      return Status(StatusCode::kNotReady, "mm_hash " + mm_hash.str() + " is still being written");
    }
    return &it->second;
  }

  Result<Entry*> writing_entry(const MmHash& mm_hash, uint64_t generation) {
    auto it = entries_.find(mm_hash);
    if (it == entries_.end() || it->second.generation != generation) {
      return NotFound("no entry being written for mm_hash " + mm_hash.str() + " generation " +
                      std::to_string(generation) + " in pool " + config_.name);
    }
    if (it->second.ready) {
      return Status(StatusCode::kFailedPrecondition,
                    "mm_hash " + mm_hash.str() + " is already committed");
    }
    return &it->second;
  }

  void mark_ready_locked(Entry& e) {
    e.ready = true;
    lru_.push_front(e.mm_hash);
    e.lru = lru_.begin();
  }

  void touch_locked(Entry& e) {
    if (e.ready) lru_.splice(lru_.begin(), lru_, e.lru);
  }

  void remove_locked(const MmHash& mm_hash) {
    auto it = entries_.find(mm_hash);
    Entry& e = it->second;
    // A late reader of this block must not mistake it for the entry: clear the magic.
    // (Should a CUDA copy fail here, the reader still sees the old generation.)
    const uint32_t no_magic = 0;
    arena_->write(e.offset, &no_magic, sizeof(no_magic)).ignore_error();
    if (e.ready) lru_.erase(e.lru);
    if (e.pins > 0) {  // only a writing entry can be removed while pinned (abort)
      for (auto p = pins_.begin(); p != pins_.end();) {
        if (p->second.mm_hash == e.mm_hash) {
          expiries_.erase({p->second.expiry, p->first});
          forget_capability_locked(p->second.capability);
          uncount_holder_locked(p->second.holder);
          p = pins_.erase(p);
        } else {
          ++p;
        }
      }
    }
    allocator_.free(e.offset, e.block_length);
    entries_.erase(it);
  }

  // Evicts the least recently used ready, unpinned entry. False if there is none.
  bool evict_one_locked() {
    for (auto it = lru_.rbegin(); it != lru_.rend(); ++it) {
      auto e = entries_.find(*it);
      if (e->second.pins == 0) {
        remove_locked(MmHash(*it));
        evictions_++;
        return true;
      }
    }
    return false;
  }

  // A peer cannot pile up pins (and the memory their records take) without bound.
  Status check_pin_quota_locked(const std::string& holder) const {
    size_t quota = config_.max_pins_per_holder * (holder == kParamsHolder ? 16 : 1);
    auto held = pins_per_holder_.find(holder);
    if (held == pins_per_holder_.end() || held->second < quota) return Status::Ok();
    return Status(StatusCode::kResourceExhausted,
                  "pool " + config_.name + ": " +
                      (holder == kParamsHolder ? std::string("params") : "this peer") +
                      " already holds " + std::to_string(held->second) +
                      " pins (the most allowed); release some first");
  }

  uint64_t add_pin_locked(Entry& e, const std::string& holder, std::chrono::milliseconds lease) {
    e.pins++;
    pins_per_holder_[holder]++;
    uint64_t id = next_pin_++;
    auto expiry = Clock::now() + lease;
    pins_.emplace(id, PinRecord{e.mm_hash, holder, expiry});
    bool earliest = expiries_.empty() || expiry < expiries_.begin()->first;
    expiries_.emplace(expiry, id);
    if (earliest) reaper_cv_.notify_all();
    return id;
  }

  bool end_pin_locked(uint64_t pin_id) {
    auto it = pins_.find(pin_id);
    if (it == pins_.end()) return false;
    expiries_.erase({it->second.expiry, pin_id});
    auto e = entries_.find(it->second.mm_hash);
    if (e != entries_.end() && e->second.pins > 0) e->second.pins--;
    uncount_holder_locked(it->second.holder);
    forget_capability_locked(it->second.capability);
    pins_.erase(it);
    return true;
  }

  void uncount_holder_locked(const std::string& holder) {
    auto held = pins_per_holder_.find(holder);
    if (held != pins_per_holder_.end() && --held->second == 0) pins_per_holder_.erase(held);
  }

  void forget_capability_locked(const transfer::Capability& capability) {
    if (capability.empty()) return;
    agent_->revoke(capability);  // the agent's grant table has its own lock; never calls back
    pins_by_capability_.erase(capability);
  }

  void reap_leases() {
    std::unique_lock lock(mu_);
    while (!stopping_) {
      if (expiries_.empty()) {
        reaper_cv_.wait(lock);
        continue;
      }
      auto next = expiries_.begin()->first;
      if (Clock::now() < next) {
        reaper_cv_.wait_until(lock, next);
        continue;
      }
      bool freed = false;
      while (!expiries_.empty() && expiries_.begin()->first <= Clock::now()) {
        end_pin_locked(expiries_.begin()->second);
        lease_expiries_++;
        freed = true;
      }
      if (freed) cv_.notify_all();
    }
  }

  transfer::Agent* const agent_;
  const PoolConfig config_;
  const std::unique_ptr<ArenaMemory> arena_;  // deregistered after the reaper stops
  const transfer::LocalRegion region_;
  std::vector<std::byte> staging_;  // guarded by mu_; host copies of CUDA blocks

  mutable std::mutex mu_;
  std::condition_variable cv_;                 // entry became ready, or a pin ended
  std::condition_variable reaper_cv_;          // a sooner lease, or stop
  ArenaAllocator allocator_;                   // guarded by mu_
  std::unordered_map<MmHash, Entry> entries_;  // guarded by mu_
  std::list<MmHash> lru_;                      // guarded by mu_; front = most recent
  std::map<uint64_t, PinRecord> pins_;         // guarded by mu_
  std::map<transfer::Capability, uint64_t> pins_by_capability_;          // guarded by mu_
  std::map<std::string, size_t, std::less<>> pins_per_holder_;           // guarded by mu_
  std::set<std::pair<Clock::time_point, uint64_t>> expiries_;            // guarded by mu_
  uint64_t next_generation_ = 1;                                         // guarded by mu_
  uint64_t next_pin_ = 1;                                                // guarded by mu_
  uint64_t evictions_ = 0, lease_expiries_ = 0, hits_ = 0, misses_ = 0;  // guarded by mu_
  bool stopping_ = false;                                                // guarded by mu_
  std::thread reaper_;
};

Result<std::unique_ptr<EncoderCachePool>> EncoderCachePool::create(transfer::Agent* agent,
                                                                   PoolConfig config) {
  if (agent == nullptr) return InvalidArgument("pool needs an agent");
  if (config.capacity_bytes < kBlockHeaderBytes + kBlockAlignment) {
    return InvalidArgument("pool " + config.name + ": capacity " +
                           std::to_string(config.capacity_bytes) + " bytes is too small");
  }
  if (config.lease.count() <= 0)
    return InvalidArgument("pool " + config.name + ": lease must be positive");
  ECX_ASSIGN_OR_RETURN(std::unique_ptr<ArenaMemory> arena, ArenaMemory::create(agent, config));
  return std::unique_ptr<EncoderCachePool>(
      new EncoderCachePool(std::make_unique<Impl>(agent, std::move(config), std::move(arena))));
}

EncoderCachePool::EncoderCachePool(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EncoderCachePool::~EncoderCachePool() = default;
uint32_t EncoderCachePool::region_id() const { return impl_->region_id(); }
const std::string& EncoderCachePool::name() const { return impl_->name(); }
Result<BlockRef> EncoderCachePool::reserve(const MmHash& h, const TensorMeta& m, Deadline room) {
  ECX_ASSIGN_OR_RETURN(Pin p, impl_->reserve(h, m, room, nullptr));
  return p.ref;
}
Result<Pin> EncoderCachePool::reserve_pinned(const MmHash& h, const TensorMeta& m,
                                             const std::string& holder, Deadline room) {
  return impl_->reserve(h, m, room, &holder);
}
Status EncoderCachePool::commit(const MmHash& h, uint64_t g) { return impl_->commit(h, g); }
Status EncoderCachePool::commit_received(const MmHash& h, uint64_t g, const BlockExpectation& e,
                                         std::optional<uint64_t> payload_checksum) {
  return impl_->commit_received(h, g, e, payload_checksum);
}
void EncoderCachePool::abort(const MmHash& h, uint64_t g) { impl_->abort(h, g); }
Result<BlockRef> EncoderCachePool::find(const MmHash& h) { return impl_->find(h); }
Result<BlockRef> EncoderCachePool::wait_ready(const MmHash& h, Deadline d) {
  return impl_->wait_ready(h, d);
}
Result<Pin> EncoderCachePool::pin(const MmHash& h, const std::string& holder,
                                  std::optional<std::chrono::milliseconds> lease) {
  return impl_->pin(h, holder, lease.value_or(impl_->default_lease()));
}
Status EncoderCachePool::unpin(uint64_t id) { return impl_->unpin(id); }
Result<Pin> EncoderCachePool::pin_for_peer(const MmHash& h, const std::string& peer,
                                           std::optional<std::chrono::milliseconds> lease) {
  return impl_->pin_for_peer(h, peer, lease.value_or(impl_->default_lease()));
}
Result<Pin> EncoderCachePool::pin_of_capability(const MmHash& h, const transfer::Capability& c) {
  return impl_->pin_of_capability(h, c);
}
Status EncoderCachePool::release_granted(uint64_t id, const transfer::Capability& c) {
  return impl_->release_granted(id, c);
}
size_t EncoderCachePool::release_holder(const std::string& holder) {
  return impl_->release_holder(holder);
}
Status EncoderCachePool::erase(const MmHash& h) { return impl_->erase(h); }
PoolStats EncoderCachePool::stats() const { return impl_->stats(); }
Status EncoderCachePool::wait_unpinned(Deadline d) { return impl_->wait_unpinned(d); }

Result<BlockRef> EncoderCachePool::put(const MmHash& mm_hash, const TensorMeta& meta,
                                       std::span<const std::byte> payload) {
  ECX_RETURN_IF_ERROR(meta.validate());
  if (payload.size() != meta.byte_size()) {
    return InvalidArgument("payload of " + std::to_string(payload.size()) +
                           " bytes does not match " + meta.to_string() + " (" +
                           std::to_string(meta.byte_size()) + " bytes)");
  }
  ECX_ASSIGN_OR_RETURN(BlockRef ref, reserve(mm_hash, meta));
  Status s =
      payload.empty() ? Status::Ok() : impl_->write_payload(ref, payload.data(), payload.size());
  if (!s.ok()) {
    abort(mm_hash, ref.generation);
    return s;
  }
  s = commit(mm_hash, ref.generation);
  if (!s.ok()) return s;
  return ref;
}

}  // namespace ecx::cache
