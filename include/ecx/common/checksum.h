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

// Fills `data` with a deterministic pattern derived from `seed` (for tests and benches).
void fill_pattern(void* data, size_t length, uint64_t seed);

}  // namespace ecx
