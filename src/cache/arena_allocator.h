// ArenaAllocator: exact-fit, aligned allocation of byte ranges inside one arena, with
// coalescing of neighbouring free ranges. Best fit by size. Not thread-safe: the pool
// guards it.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>

namespace ecx::cache {

class ArenaAllocator {
 public:
  ArenaAllocator(uint64_t capacity, uint64_t alignment);

  // An offset for `size` bytes (rounded up to the alignment), or nullopt if no free
  // range is large enough.
  std::optional<uint64_t> allocate(uint64_t size);
  // Returns a range from allocate(). REQUIRES: offset/size as allocated.
  void free(uint64_t offset, uint64_t size);

  uint64_t capacity() const { return capacity_; }
  uint64_t used() const { return used_; }
  uint64_t largest_free() const;
  size_t free_ranges() const { return by_offset_.size(); }
  uint64_t round_up(uint64_t size) const {
    return (size + alignment_ - 1) / alignment_ * alignment_;
  }

 private:
  void insert_free(uint64_t offset, uint64_t size);
  void erase_free(std::map<uint64_t, uint64_t>::iterator it);

  const uint64_t capacity_;
  const uint64_t alignment_;
  uint64_t used_ = 0;
  std::map<uint64_t, uint64_t> by_offset_;           // free ranges: offset -> size
  std::set<std::pair<uint64_t, uint64_t>> by_size_;  // (size, offset), for best fit
};

}  // namespace ecx::cache
