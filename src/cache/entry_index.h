// EntryIndex: an encoder cache pool's entries by mm_hash, where their blocks lie in the
// arena (the allocator), and which ready entry was used least recently (eviction order).
// Pins are not its business: eviction asks a predicate which entries are pinned.
//
// An entry is written by one writer: kWriting from reserve, kCommitting while its writer
// checksums it outside the pool's lock (nobody else may remove it then), kReady after.
// Not thread-safe: the pool's mutex guards it.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <optional>
#include <unordered_map>

#include "cache/arena_allocator.h"
#include "ecx/common/mm_hash.h"
#include "ecx/common/tensor_meta.h"

namespace ecx::cache {

struct Entry {
  enum class State { kWriting, kCommitting, kReady };
  MmHash mm_hash;
  TensorMeta meta;
  uint64_t offset = 0;
  uint64_t block_length = 0;
  uint64_t generation = 0;
  State state = State::kWriting;
  std::list<MmHash>::iterator lru;  // valid while kReady

  bool ready() const { return state == State::kReady; }
};

class EntryIndex {
 public:
  EntryIndex(uint64_t capacity, uint64_t alignment) : allocator_(capacity, alignment) {}

  const ArenaAllocator& allocator() const { return allocator_; }
  size_t size() const { return entries_.size(); }

  Entry* find(const MmHash& mm_hash);
  const Entry* find(const MmHash& mm_hash) const;
  // A new entry (kWriting) in a block of `block_length` bytes, with the next generation;
  // nullptr when no free range is large enough (evict, then try again).
  Entry* add(const MmHash& mm_hash, const TensorMeta& meta, uint64_t block_length);
  // Removes the entry and frees its block; returns what it was.
  Entry remove(const MmHash& mm_hash);
  // Removes the least recently used ready entry for which `pinned` is false.
  std::optional<Entry> evict_lru(const std::function<bool(const MmHash&)>& pinned);

  void mark_ready(Entry& e);
  void touch(Entry& e);  // most recently used

  template <typename F>
  void for_each(F f) const {
    for (const auto& [h, e] : entries_) f(e);
  }

 private:
  ArenaAllocator allocator_;
  std::unordered_map<MmHash, Entry> entries_;
  std::list<MmHash> lru_;  // ready entries; front = most recently used
  uint64_t next_generation_ = 1;
};

}  // namespace ecx::cache
