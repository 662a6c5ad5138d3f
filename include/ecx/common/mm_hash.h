// MmHash: the key of one multimodal item (an image), shared by E and PD.
#pragma once

#include <functional>
#include <string>
#include <string_view>

#include "ecx/common/status.h"

namespace ecx {

class MmHash {
 public:
  MmHash() = default;
  // Validates an identifier received from outside: 1..128 characters of [A-Za-z0-9_.:-],
  // not starting with '.', so it is safe as a file name and a Redis key.
  static Result<MmHash> parse(std::string_view text);
  // SHA-256 (hex) over the given byte strings, each length-prefixed.
  static MmHash sha256_of(std::initializer_list<std::string_view> parts);

  const std::string& str() const { return value_; }
  bool empty() const { return value_.empty(); }
  friend bool operator==(const MmHash&, const MmHash&) = default;
  friend auto operator<=>(const MmHash&, const MmHash&) = default;

 private:
  explicit MmHash(std::string value) : value_(std::move(value)) {}
  std::string value_;
};

}  // namespace ecx

template <>
struct std::hash<ecx::MmHash> {
  size_t operator()(const ecx::MmHash& h) const { return std::hash<std::string>()(h.str()); }
};
