// Large copies into memory that is not in cache.
#pragma once

#include <cstddef>

namespace ecx {

// Copies `length` bytes with non-temporal (streaming) stores where the CPU has them
// (x86-64 with AVX2), else with memcpy. A streaming store does not read the destination's
// cache lines first, so a copy into cold memory (a block of a large cache, about to be
// read by someone else) moves a third fewer bytes; the copy ends with its stores fenced.
// Below kStreamingCopyMin bytes it is memcpy; 0 bytes touch nothing (null pointers too).
void copy_streaming(void* dst, const void* src, size_t length);
inline constexpr size_t kStreamingCopyMin = 256 * 1024;

}  // namespace ecx
