#include "cache/entry_index.h"

namespace ecx::cache {

Entry* EntryIndex::find(const MmHash& mm_hash) {
  auto it = entries_.find(mm_hash);
  return it == entries_.end() ? nullptr : &it->second;
}

const Entry* EntryIndex::find(const MmHash& mm_hash) const {
  auto it = entries_.find(mm_hash);
  return it == entries_.end() ? nullptr : &it->second;
}

Entry* EntryIndex::add(const MmHash& mm_hash, const TensorMeta& meta, uint64_t block_length) {
  std::optional<uint64_t> offset = allocator_.allocate(block_length);
  if (!offset) return nullptr;
  Entry e;
  e.mm_hash = mm_hash;
  e.meta = meta;
  e.offset = *offset;
  e.block_length = block_length;
  e.generation = next_generation_++;
  return &entries_.emplace(mm_hash, std::move(e)).first->second;
}

Entry EntryIndex::remove(const MmHash& mm_hash) {
  auto it = entries_.find(mm_hash);
  Entry e = std::move(it->second);
  entries_.erase(it);
  if (e.ready()) lru_.erase(e.lru);
  allocator_.free(e.offset, e.block_length);
  return e;
}

std::optional<Entry> EntryIndex::evict_lru(const std::function<bool(const MmHash&)>& pinned) {
  for (auto it = lru_.rbegin(); it != lru_.rend(); ++it) {
    if (!pinned(*it)) return remove(MmHash(*it));
  }
  return std::nullopt;
}

void EntryIndex::mark_ready(Entry& e) {
  e.state = Entry::State::kReady;
  lru_.push_front(e.mm_hash);
  e.lru = lru_.begin();
}

void EntryIndex::touch(Entry& e) {
  if (e.ready()) lru_.splice(lru_.begin(), lru_, e.lru);
}

}  // namespace ecx::cache
