// Byte sizes as people write them: "64KiB", "1600KiB", "8MiB", "1.5GiB", "4096".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ecx/common/status.h"

namespace ecx {

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;
constexpr uint64_t kGiB = 1024 * kMiB;

// Parses a size. Suffixes: B, KiB, MiB, GiB, TiB (binary) and KB, MB, GB (decimal),
// case-insensitive; a bare number is bytes. Errors name the text that was rejected.
Result<uint64_t> parse_bytes(std::string_view text);
// Parses a comma-separated list of sizes ("64KiB,1600KiB,8MiB").
Result<std::vector<uint64_t>> parse_byte_list(std::string_view text);
// The shortest exact binary form ("1600KiB", "8MiB", "100B").
std::string format_bytes(uint64_t bytes);

// Lower-case hex of `size` bytes, and back (InvalidArgument on an odd length or a
// character that is not a lower-case hex digit; `what` names the text in the error).
std::string hex_encode(const void* data, size_t size);
Result<std::string> hex_decode(std::string_view hex, std::string_view what);

}  // namespace ecx
