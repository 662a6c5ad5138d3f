#include "ecx/common/copy.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ecx {
namespace {

#if defined(__x86_64__)
constexpr size_t kLine = 64;

// dst 64-byte aligned, length a multiple of 128.
__attribute__((target("avx2"))) void stream_lines(std::byte* dst, const std::byte* src,
                                                  size_t length) {
  for (size_t i = 0; i < length; i += 2 * kLine) {
    const auto* s = reinterpret_cast<const __m256i*>(src + i);
    auto* d = reinterpret_cast<__m256i*>(dst + i);
    __m256i a = _mm256_loadu_si256(s), b = _mm256_loadu_si256(s + 1);
    __m256i c = _mm256_loadu_si256(s + 2), e = _mm256_loadu_si256(s + 3);
    _mm256_stream_si256(d, a);
    _mm256_stream_si256(d + 1, b);
    _mm256_stream_si256(d + 2, c);
    _mm256_stream_si256(d + 3, e);
  }
  _mm_sfence();
}

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}
#endif

}  // namespace

void copy_streaming(void* dst, const void* src, size_t length) {
  if (length == 0) return;  // nothing to copy: the pointers may be null
#if defined(__x86_64__)
  if (length >= kStreamingCopyMin && has_avx2()) {
    auto* d = static_cast<std::byte*>(dst);
    const auto* s = static_cast<const std::byte*>(src);
    // memcpy up to the first line boundary of the destination, stream whole pairs of
    // lines, memcpy the rest.
    size_t head = (kLine - reinterpret_cast<uintptr_t>(d) % kLine) % kLine;
    std::memcpy(d, s, head);
    size_t body = (length - head) / (2 * kLine) * (2 * kLine);
    stream_lines(d + head, s + head, body);
    std::memcpy(d + head + body, s + head + body, length - head - body);
    return;
  }
#endif
  std::memcpy(dst, src, length);
}

}  // namespace ecx
