#include "ecx/common/bytes.h"

#include <array>
#include <cctype>
#include <cmath>
#include <cstdlib>

namespace ecx {
namespace {

struct Unit {
  std::string_view suffix;
  uint64_t factor;
};

constexpr std::array<Unit, 11> kUnits = {{{"tib", kGiB * 1024},
                                          {"gib", kGiB},
                                          {"mib", kMiB},
                                          {"kib", kKiB},
                                          {"tb", 1'000'000'000'000},
                                          {"gb", 1'000'000'000},
                                          {"mb", 1'000'000},
                                          {"kb", 1'000},
                                          {"k", kKiB},
                                          {"m", kMiB},
                                          {"b", 1}}};

std::string lower(std::string_view s) {
  std::string out(s);
  for (auto& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

}  // namespace

Result<uint64_t> parse_bytes(std::string_view text) {
  std::string_view t = trim(text);
  std::string low = lower(t);
  uint64_t factor = 1;
  std::string number = low;
  for (const auto& unit : kUnits) {
    if (low.size() > unit.suffix.size() && low.ends_with(unit.suffix)) {
      factor = unit.factor;
      number = low.substr(0, low.size() - unit.suffix.size());
      break;
    }
  }
  number = std::string(trim(number));
  if (number.empty() || !(std::isdigit(static_cast<unsigned char>(number[0])))) {
    return InvalidArgument("not a byte size: '" + std::string(text) + "'");
  }
  char* end = nullptr;
  double value = std::strtod(number.c_str(), &end);
  if (end != number.c_str() + number.size() || !std::isfinite(value) || value < 0) {
    return InvalidArgument("not a byte size: '" + std::string(text) + "'");
  }
  double bytes = value * static_cast<double>(factor);
  if (bytes > 9.0e18) return OutOfRange("byte size too large: '" + std::string(text) + "'");
  if (bytes != std::floor(bytes)) {
    return InvalidArgument("byte size is not a whole number of bytes: '" + std::string(text) + "'");
  }
  return static_cast<uint64_t>(bytes);
}

Result<std::vector<uint64_t>> parse_byte_list(std::string_view text) {
  std::vector<uint64_t> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string_view::npos) comma = text.size();
    ECX_ASSIGN_OR_RETURN(uint64_t v, parse_bytes(text.substr(start, comma - start)));
    out.push_back(v);
    start = comma + 1;
  }
  return out;
}

std::string format_bytes(uint64_t bytes) {
  struct Named {
    uint64_t factor;
    const char* suffix;
  };
  constexpr Named kNamed[] = {{kGiB, "GiB"}, {kMiB, "MiB"}, {kKiB, "KiB"}};
  for (const auto& n : kNamed) {
    if (bytes >= n.factor && bytes % n.factor == 0) {
      return std::to_string(bytes / n.factor) + n.suffix;
    }
  }
  return std::to_string(bytes) + "B";
}

std::string hex_encode(const void* data, size_t size) {
  static constexpr char kDigits[] = "0123456789abcdef";
  const auto* bytes = static_cast<const uint8_t*>(data);
  std::string s;
  s.reserve(size * 2);
  for (size_t i = 0; i < size; ++i) {
    s.push_back(kDigits[bytes[i] >> 4]);
    s.push_back(kDigits[bytes[i] & 15]);
  }
  return s;
}

Result<std::string> hex_decode(std::string_view hex, std::string_view what) {
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  if (hex.size() % 2 != 0) {
    return InvalidArgument(std::string(what) + ": odd number of hex digits");
  }
  std::string out(hex.size() / 2, '\0');
  for (size_t i = 0; i < out.size(); ++i) {
    int hi = digit(hex[2 * i]), lo = digit(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return InvalidArgument(std::string(what) + ": not lower-case hex");
    out[i] = static_cast<char>(hi << 4 | lo);
  }
  return out;
}

}  // namespace ecx
