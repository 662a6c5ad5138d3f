#include "ecx/cache/encoder_cache_pool.h"

#include <span>
#include <thread>
#include <vector>

#include "cache/arena_memory.h"
#include "cache/entry_index.h"
#include "cache/pin_table.h"
#include "ecx/common/bytes.h"
#include "ecx/common/mutex.h"

namespace ecx::cache {

// The pool's state is two tables under one mutex: the entry index (entries, their blocks,
// LRU) and the pin table (pins, grants, quotas, leases). Byte work (checksums, headers,
// device copies) runs outside the mutex on an entry its writer owns; the mutex only
// flips the entry's state.
class EncoderCachePool::Impl {
 public:
  Impl(transfer::Agent* agent, PoolConfig config, std::unique_ptr<ArenaMemory> arena)
      : agent_(agent),
        config_(std::move(config)),
        arena_(std::move(arena)),
        region_(arena_->region()),
        index_(region_.length, kBlockAlignment),
        pins_(config_.name, config_.max_pins_per_holder) {
    reaper_ = std::thread([this] { reap_leases(); });
  }

  ~Impl() {
    {
      MutexLock lock(&mu_);
      stopping_ = true;
    }
    reaper_cv_.notify_all();
    reaper_.join();
  }

  uint32_t region_id() const { return region_.id; }
  const std::string& name() const { return config_.name; }
  std::chrono::milliseconds default_lease() const { return config_.lease; }

  Result<Pin> reserve(const MmHash& mm_hash, const TensorMeta& meta, Deadline room_deadline,
                      const std::string* pin_holder) ECX_EXCLUDES(mu_) {
    ECX_RETURN_IF_ERROR(meta.validate());
    const uint64_t block_length = kBlockHeaderBytes + meta.byte_size();
    MutexLock lock(&mu_);
    if (block_length > index_.allocator().capacity()) {
      return Status(StatusCode::kResourceExhausted,
                    "pool " + config_.name + ": an entry of " + format_bytes(block_length) +
                        " is larger than the pool (" + format_bytes(index_.allocator().capacity()) +
                        ")");
    }
    while (true) {
      if (index_.find(mm_hash) != nullptr) {
        return Status(StatusCode::kAlreadyExists,
                      "pool " + config_.name + " already has mm_hash " + mm_hash.str());
      }
      if (Entry* e = allocate_locked(mm_hash, meta, block_length)) {
        Pin p{ref_of(*e), 0};
        if (pin_holder != nullptr) p.pin_id = add_pin_locked(*e, *pin_holder, config_.lease);
        return p;
      }
      // Everything is pinned or being written: wait for a pin to end, or give up.
      if (!cv_.wait_until(&mu_, room_deadline.time_point()) && room_deadline.expired()) {
        return no_room_locked(block_length);
      }
    }
  }

  // Checksums the payload and writes the header outside the lock, then marks it ready.
  Status commit(const MmHash& mm_hash, uint64_t generation) ECX_EXCLUDES(mu_) {
    ECX_ASSIGN_OR_RETURN(Entry e, begin_commit(mm_hash, generation));
    Result<uint64_t> sum = arena_->checksum(e.offset + kBlockHeaderBytes, e.meta.byte_size());
    Status verdict = sum.ok() ? write_header(e, *sum) : sum.status();
    return finish_commit(e, std::move(verdict), /*drop_on_failure=*/false);
  }

  Status commit_received(const MmHash& mm_hash, uint64_t generation,
                         const BlockExpectation& expected, std::optional<uint64_t> payload_checksum)
      ECX_EXCLUDES(mu_) {
    ECX_ASSIGN_OR_RETURN(Entry e, begin_commit(mm_hash, generation));
    Status verdict = verify_and_stamp(e, expected, payload_checksum);
    return finish_commit(e, std::move(verdict), /*drop_on_failure=*/true);
  }

  void abort(const MmHash& mm_hash, uint64_t generation) ECX_EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      const Entry* e = index_.find(mm_hash);
      if (e == nullptr || e->state != Entry::State::kWriting || e->generation != generation) {
        return;
      }
      remove_locked(mm_hash);
    }
    cv_.notify_all();
  }

  Result<BlockRef> find(const MmHash& mm_hash) ECX_EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    Result<Entry*> e = ready_entry_locked(mm_hash);
    if (!e.ok()) {
      if (e.status().code() == StatusCode::kNotFound) misses_++;
      return e.status();
    }
    hits_++;
    index_.touch(**e);
    return ref_of(**e);
  }

  Result<BlockRef> wait_ready(const MmHash& mm_hash, Deadline deadline) ECX_EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    while (true) {
      Entry* e = index_.find(mm_hash);
      if (e == nullptr) {
        return NotFound("mm_hash " + mm_hash.str() + " is not in pool " + config_.name);
      }
      if (e->ready()) {
        index_.touch(*e);
        return ref_of(*e);
      }
      if (!cv_.wait_until(&mu_, deadline.time_point()) && deadline.expired()) {
        const Entry* again = index_.find(mm_hash);
        if (again != nullptr && again->ready()) return ref_of(*again);
        return Status(StatusCode::kNotReady, "mm_hash " + mm_hash.str() +
                                                 " still being written in pool " + config_.name +
                                                 " at the deadline");
      }
    }
  }

  Result<Pin> pin(const MmHash& mm_hash, const std::string& holder, std::chrono::milliseconds lease)
      ECX_EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    ECX_ASSIGN_OR_RETURN(Entry * e, ready_entry_locked(mm_hash));
    index_.touch(*e);
    return Pin{ref_of(*e), add_pin_locked(*e, holder, lease)};
  }

  // `quota_holder`: whose quota the pin counts against, when not the peer's (or, for a
  // bearer pin, the params').
  Result<Pin> pin_for_peer(const MmHash& mm_hash, const std::string& peer,
                           std::chrono::milliseconds lease, const std::string& quota_holder = "")
      ECX_EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    ECX_ASSIGN_OR_RETURN(Entry * e, ready_entry_locked(mm_hash));
    const std::string holder = !quota_holder.empty() ? quota_holder
                               : peer.empty()        ? std::string(PinTable::kParamsHolder)
                                                     : peer;
    ECX_RETURN_IF_ERROR(pins_.check_quota(holder));
    ECX_ASSIGN_OR_RETURN(transfer::Capability cap,
                         agent_->grant(region_.id, e->offset, e->block_length, false, peer));
    index_.touch(*e);
    uint64_t id = add_pin_locked(*e, holder, lease, cap);
    return Pin{ref_of(*e), id, cap};
  }

  Result<Pin> pin_of_capability(const MmHash& mm_hash, const transfer::Capability& capability)
      ECX_EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    const PinRecord* record = pins_.find_by_capability(capability);
    const Entry* e =
        record != nullptr && record->mm_hash == mm_hash ? index_.find(mm_hash) : nullptr;
    if (e == nullptr) {
      return NotFound("mm_hash " + mm_hash.str() + ": no live pin in pool " + config_.name +
                      " with that capability");
    }
    return Pin{ref_of(*e), record->id, capability};
  }

  Status release_granted(uint64_t pin_id, const transfer::Capability& capability)
      ECX_EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      const PinRecord* record = pins_.find(pin_id);
      if (record == nullptr || capability.empty() || !(record->capability == capability)) {
        return NotFound("pin " + std::to_string(pin_id) + " in pool " + config_.name +
                        ": no such pin held with that capability");
      }
      revoke_locked(pins_.end(pin_id));
    }
    cv_.notify_all();
    return Status::Ok();
  }

  Status renew_granted(uint64_t pin_id, const transfer::Capability& capability,
                       const std::string& peer) ECX_EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    const PinRecord* record = pins_.find(pin_id);
    if (record == nullptr || capability.empty() || !(record->capability == capability)) {
      return NotFound("pin " + std::to_string(pin_id) + " in pool " + config_.name +
                      ": no such pin held with that capability (released, or its lease ended)");
    }
    // A later lease end never wakes the reaper: it wakes at the old one and looks again.
    return pins_.renew(pin_id, peer, Clock::now() + config_.lease);
  }

  Status unpin(uint64_t pin_id) ECX_EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      std::optional<PinRecord> ended = pins_.end(pin_id);
      if (!ended) {
        return NotFound("pin " + std::to_string(pin_id) + " in pool " + config_.name +
                        " already ended (released or lease expired)");
      }
      revoke_locked(std::move(ended));
    }
    cv_.notify_all();
    return Status::Ok();
  }

  size_t release_holder(const std::string& holder) ECX_EXCLUDES(mu_) {
    size_t ended = 0;
    {
      MutexLock lock(&mu_);
      std::vector<PinRecord> records = pins_.end_holder(holder);
      ended = records.size();
      revoke_locked(std::move(records));
    }
    cv_.notify_all();
    return ended;
  }

  Status erase(const MmHash& mm_hash) ECX_EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    const Entry* e = index_.find(mm_hash);
    if (e == nullptr)
      return NotFound("mm_hash " + mm_hash.str() + " is not in pool " + config_.name);
    if (int pins = pins_.pins_of(mm_hash); pins > 0) {
      return Status(StatusCode::kFailedPrecondition, "mm_hash " + mm_hash.str() + " is pinned by " +
                                                         std::to_string(pins) + " readers");
    }
    if (!e->ready()) {  // its writer owns it: only abort() removes it
      return Status(StatusCode::kFailedPrecondition,
                    "mm_hash " + mm_hash.str() + " is still being written");
    }
    remove_locked(mm_hash);
    return Status::Ok();
  }

  PoolStats stats() const ECX_EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    PoolStats s;
    s.capacity_bytes = index_.allocator().capacity();
    s.used_bytes = index_.allocator().used();
    index_.for_each([&s](const Entry& e) {
      s.entries++;
      s.payload_bytes += e.meta.byte_size();
      if (!e.ready()) s.writing_entries++;
    });
    s.pinned_entries = pins_.pinned_entries();
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

  Status wait_unpinned(Deadline deadline) ECX_EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    if (cv_.wait_until(&mu_, deadline.time_point(),
                       [this]() ECX_REQUIRES(mu_) { return pins_.empty(); })) {
      return Status::Ok();
    }
    return DeadlineExceeded("pool " + config_.name + ": " + std::to_string(pins_.size()) +
                            " pins still held at the deadline");
  }

  // Copies host bytes into a reserved block's payload (its writer owns the entry while it
  // is being written, so no lock is needed for its bytes).
  Status write_payload(const BlockRef& ref, const void* data, uint64_t length) {
    return arena_->write(ref.offset + kBlockHeaderBytes, data, length);
  }

 private:
  BlockRef ref_of(const Entry& e) const {
    return BlockRef{e.mm_hash,
                    e.meta,
                    region_.id,
                    e.offset,
                    e.block_length,
                    e.generation,
                    region_.data + e.offset};
  }

  // A block for a new entry, evicting least recently used unpinned ready entries until
  // one fits; nullptr if none does.
  Entry* allocate_locked(const MmHash& mm_hash, const TensorMeta& meta, uint64_t block_length)
      ECX_REQUIRES(mu_) {
    Entry* e = index_.add(mm_hash, meta, block_length);
    while (e == nullptr) {
      std::optional<Entry> victim = index_.evict_lru([this](const MmHash& h) {
        mu_.assert_held();
        return pins_.pins_of(h) > 0;
      });
      if (!victim) return nullptr;
      evictions_++;
      clear_magic(*victim);
      e = index_.add(mm_hash, meta, block_length);
    }
    return e;
  }

  Status no_room_locked(uint64_t block_length) const ECX_REQUIRES(mu_) {
    const ArenaAllocator& a = index_.allocator();
    return Status(StatusCode::kResourceExhausted,
                  "pool " + config_.name + ": no room for " + format_bytes(block_length) +
                      " (capacity " + format_bytes(a.capacity()) + ", used " +
                      format_bytes(a.used()) + ", largest free " + format_bytes(a.largest_free()) +
                      "; every other entry is pinned or being written)");
  }

  // kWriting -> kCommitting: from here until finish_commit the entry is its writer's
  // alone (nothing else removes or evicts it), so its bytes are worked on unlocked.
  Result<Entry> begin_commit(const MmHash& mm_hash, uint64_t generation) ECX_EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    Entry* e = index_.find(mm_hash);
    if (e == nullptr || e->generation != generation) {
      return NotFound("no entry being written for mm_hash " + mm_hash.str() + " generation " +
                      std::to_string(generation) + " in pool " + config_.name);
    }
    if (e->state != Entry::State::kWriting) {
      return Status(StatusCode::kFailedPrecondition,
                    "mm_hash " + mm_hash.str() + " is already committed");
    }
    e->state = Entry::State::kCommitting;
    return *e;
  }

  // kCommitting -> kReady, or on failure back to kWriting (the writer may abort) or, with
  // `drop_on_failure`, removed.
  Status finish_commit(const Entry& committed, Status verdict, bool drop_on_failure)
      ECX_EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      Entry* e = index_.find(committed.mm_hash);
      if (e == nullptr) return Internal("pool " + config_.name + ": a committing entry vanished");
      if (verdict.ok()) {
        index_.mark_ready(*e);
      } else if (drop_on_failure) {
        remove_locked(committed.mm_hash);
      } else {
        e->state = Entry::State::kWriting;
      }
    }
    cv_.notify_all();
    return verdict;
  }

  // Verifies a block a peer wrote against what its producer said, then stamps it with
  // this pool's generation.
  Status verify_and_stamp(const Entry& e, const BlockExpectation& expected,
                          std::optional<uint64_t> payload_checksum) {
    std::vector<std::byte> staging;
    ECX_ASSIGN_OR_RETURN(
        std::span<const std::byte> host,
        host_block(e, /*with_payload=*/expected.verify_payload && !payload_checksum.has_value(),
                   staging));
    ECX_RETURN_IF_ERROR(verify_block(host.data(), e.block_length, expected, payload_checksum));
    return write_header(e, read_block_header(host.data()).checksum);
  }

  // Writes the entry's header (through a host copy in a CUDA pool).
  Status write_header(const Entry& e, uint64_t checksum) {
    std::byte header[kBlockHeaderBytes];
    write_block_header(header, e.mm_hash, e.meta, e.generation, checksum);
    return arena_->write(e.offset, header, sizeof(header));
  }

  // A late reader of a removed block must not mistake it for the entry: clear the magic.
  // (Should a CUDA copy fail here, the reader still sees the old generation.)
  void clear_magic(const Entry& e) {
    const uint32_t no_magic = 0;
    arena_->write(e.offset, &no_magic, sizeof(no_magic)).ignore_error();
  }

  // The block's bytes where the CPU can read them: in place in a host pool; a host copy
  // (into `staging`) of the header, and the payload when `with_payload`, in a CUDA pool.
  // Either way the span is block_length bytes long, so verify_block's bounds hold.
  Result<std::span<const std::byte>> host_block(const Entry& e, bool with_payload,
                                                std::vector<std::byte>& staging) {
    if (arena_->kind() == transfer::MemoryKind::kHost) {
      return std::span<const std::byte>(region_.data + e.offset, e.block_length);
    }
    staging.assign(e.block_length, std::byte{0});
    ECX_RETURN_IF_ERROR(
        arena_->read(e.offset, staging.data(), with_payload ? e.block_length : kBlockHeaderBytes));
    return std::span<const std::byte>(staging);
  }

  // The ready entry for mm_hash: kNotFound or kNotReady otherwise.
  Result<Entry*> ready_entry_locked(const MmHash& mm_hash) ECX_REQUIRES(mu_) {
    Entry* e = index_.find(mm_hash);
    if (e == nullptr) {
      return NotFound("mm_hash " + mm_hash.str() + " is not in pool " + config_.name);
    }
    if (!e->ready()) {
      return Status(StatusCode::kNotReady,
                    "mm_hash " + mm_hash.str() + " is still being written in pool " + config_.name);
    }
    return e;
  }

  void remove_locked(const MmHash& mm_hash) ECX_REQUIRES(mu_) {
    clear_magic(index_.remove(mm_hash));
    revoke_locked(pins_.end_entry(mm_hash));  // only a writing entry can go while pinned
  }

  uint64_t add_pin_locked(const Entry& e, const std::string& holder,
                          std::chrono::milliseconds lease, transfer::Capability cap = {})
      ECX_REQUIRES(mu_) {
    auto expiry = Clock::now() + lease;
    uint64_t id = pins_.add(e.mm_hash, holder, expiry, std::move(cap));
    // The reaper wakes by itself before this lease ends, as a rule: waking it costs the
    // pinning thread a system call and, on a busy host, its core for a while (8 us of a
    // load's reserve, measured).
    if (expiry < reaper_wakes_at_) reaper_cv_.notify_all();
    return id;
  }

  // Revokes the grants of ended pins (the agent's grant table has its own lock and never
  // calls back).
  void revoke_locked(std::optional<PinRecord> ended) ECX_REQUIRES(mu_) {
    if (ended && !ended->capability.empty()) agent_->revoke(ended->capability);
  }
  void revoke_locked(std::vector<PinRecord> ended) ECX_REQUIRES(mu_) {
    for (PinRecord& r : ended) revoke_locked(std::move(r));
  }

  void reap_leases() ECX_EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    while (!stopping_) {
      std::optional<Clock::time_point> next = pins_.next_expiry();
      const Clock::time_point now = Clock::now();
      if (!next || now < *next) {
        // With no pin, it wakes one default lease from now: a pin taken meanwhile with
        // that lease (nearly all are) ends after it, and needs no wake-up.
        reaper_wakes_at_ = next ? *next : now + config_.lease;
        reaper_cv_.wait_until(&mu_, reaper_wakes_at_);
        reaper_wakes_at_ = Clock::time_point::min();  // awake: it looks at every pin
      } else {
        std::vector<PinRecord> expired = pins_.end_expired(Clock::now());
        lease_expiries_ += expired.size();
        revoke_locked(std::move(expired));
        cv_.notify_all();
      }
    }
  }

  transfer::Agent* const agent_;
  const PoolConfig config_;
  const std::unique_ptr<ArenaMemory> arena_;  // deregistered after the reaper stops
  const transfer::LocalRegion region_;

  mutable Mutex mu_;
  CondVar cv_;         // an entry became ready or went, or a pin ended
  CondVar reaper_cv_;  // a sooner lease, or stop
  // When the reaper wakes by itself; min() while it is awake (it looks at every pin).
  Clock::time_point reaper_wakes_at_ ECX_GUARDED_BY(mu_) = Clock::time_point::min();
  EntryIndex index_ ECX_GUARDED_BY(mu_);
  PinTable pins_ ECX_GUARDED_BY(mu_);
  uint64_t evictions_ ECX_GUARDED_BY(mu_) = 0;
  uint64_t lease_expiries_ ECX_GUARDED_BY(mu_) = 0;
  uint64_t hits_ ECX_GUARDED_BY(mu_) = 0;
  uint64_t misses_ ECX_GUARDED_BY(mu_) = 0;
  bool stopping_ ECX_GUARDED_BY(mu_) = false;
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
std::string EncoderCachePool::params_quota_holder(const std::string& agent) {
  return std::string(PinTable::kParamsOpPrefix) + agent;
}

Result<Pin> EncoderCachePool::pin_for_bearer(const MmHash& h, const std::string& quota_holder,
                                             std::optional<std::chrono::milliseconds> lease) {
  if (quota_holder.empty()) return InvalidArgument("pin_for_bearer: no quota holder");
  return impl_->pin_for_peer(h, "", lease.value_or(impl_->default_lease()), quota_holder);
}
Result<Pin> EncoderCachePool::pin_of_capability(const MmHash& h, const transfer::Capability& c) {
  return impl_->pin_of_capability(h, c);
}
Status EncoderCachePool::release_granted(uint64_t id, const transfer::Capability& c) {
  return impl_->release_granted(id, c);
}
Status EncoderCachePool::renew_granted(uint64_t id, const transfer::Capability& c,
                                       const std::string& peer) {
  return impl_->renew_granted(id, c, peer);
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
