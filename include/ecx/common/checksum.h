// xxh3 checksums for block payloads and benchmark verification.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace ecx {

// 64-bit XXH3 of `data`.
uint64_t checksum64(const void* data, size_t length);
inline uint64_t checksum64(std::span<const std::byte> data) {
  return checksum64(data.data(), data.size());
}

// Copies `length` bytes and returns checksum64 of them, in one pass: each chunk is
// hashed while it is still in cache. Same value as checksum64(src, length).
uint64_t copy_with_checksum(void* dst, const void* src, size_t length);

// checksum64 of bytes fed in order, a piece at a time: the same value as one call over
// all of them. For hashing bytes as they arrive, while they are still in cache.
class ChecksumStream {
 public:
  ChecksumStream();
  ~ChecksumStream();
  ChecksumStream(const ChecksumStream&) = delete;
  ChecksumStream& operator=(const ChecksumStream&) = delete;
  void update(const void* data, size_t length);
  uint64_t digest() const;

 private:
  void* state_;  // XXH3_state_t (xxhash.h stays out of this header)
};

// Fills `data` with a deterministic pattern derived from `seed` (for tests and benches).
void fill_pattern(void* data, size_t length, uint64_t seed);

}  // namespace ecx
