#include "ecx/common/checksum.h"

#include <xxhash.h>

#include <cstring>

namespace ecx {

uint64_t checksum64(const void* data, size_t length) { return XXH3_64bits(data, length); }

void fill_pattern(void* data, size_t length, uint64_t seed) {
  // splitmix64: fast, and every 8-byte word differs, so shifted or stale copies are caught.
  auto* out = static_cast<unsigned char*>(data);
  uint64_t state = seed;
  size_t i = 0;
  for (; i + 8 <= length; i += 8) {
    uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    std::memcpy(out + i, &z, 8);
  }
  for (; i < length; ++i) out[i] = static_cast<unsigned char>(seed + i);
}

}  // namespace ecx
