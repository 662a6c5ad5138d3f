#include "cache/arena_allocator.h"

namespace ecx::cache {

ArenaAllocator::ArenaAllocator(uint64_t capacity, uint64_t alignment)
    : capacity_(capacity / alignment * alignment), alignment_(alignment) {
  if (capacity_ > 0) insert_free(0, capacity_);
}

void ArenaAllocator::insert_free(uint64_t offset, uint64_t size) {
  by_offset_.emplace(offset, size);
  by_size_.emplace(size, offset);
}

void ArenaAllocator::erase_free(std::map<uint64_t, uint64_t>::iterator it) {
  by_size_.erase({it->second, it->first});
  by_offset_.erase(it);
}

std::optional<uint64_t> ArenaAllocator::allocate(uint64_t size) {
  if (size == 0) return std::nullopt;
  size = round_up(size);
  auto fit = by_size_.lower_bound({size, 0});
  if (fit == by_size_.end()) return std::nullopt;
  auto [free_size, offset] = *fit;
  erase_free(by_offset_.find(offset));
  if (free_size > size) insert_free(offset + size, free_size - size);
  used_ += size;
  return offset;
}

void ArenaAllocator::free(uint64_t offset, uint64_t size) {
  size = round_up(size);
  used_ -= size;
  // Coalesce with the free range after, then the one before.
  auto next = by_offset_.lower_bound(offset);
  if (next != by_offset_.end() && next->first == offset + size) {
    size += next->second;
    erase_free(next);
  }
  auto after = by_offset_.lower_bound(offset);
  if (after != by_offset_.begin()) {
    auto prev = std::prev(after);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      size += prev->second;
      erase_free(prev);
    }
  }
  insert_free(offset, size);
}

uint64_t ArenaAllocator::largest_free() const {
  return by_size_.empty() ? 0 : by_size_.rbegin()->first;
}

}  // namespace ecx::cache
