// TensorMeta: dtype and shape of an encoder output, as it travels in params and headers.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "ecx/common/status.h"

namespace ecx {

enum class DType : uint8_t { kBF16 = 1, kF16 = 2, kF32 = 3, kU8 = 4, kI32 = 5, kI64 = 6 };

// Size of one element in bytes.
size_t dtype_size(DType dtype);
// Safetensors spelling: "BF16", "F16", "F32", "U8", "I32", "I64".
std::string_view dtype_name(DType dtype);
Result<DType> dtype_from_name(std::string_view name);
// Validates a dtype received as a wire byte.
Result<DType> dtype_from_wire(uint8_t value);

constexpr size_t kMaxTensorRank = 8;

struct TensorMeta {
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;

  // Validates rank, non-negative dims and that the byte size fits in 2^48.
  Status validate() const;
  // Number of elements. REQUIRES: validate().ok()
  uint64_t element_count() const;
  // Payload size in bytes. REQUIRES: validate().ok()
  uint64_t byte_size() const { return element_count() * dtype_size(dtype); }
  std::string to_string() const;  // "bf16[400, 2048]"

  nlohmann::json to_json() const;  // {"dtype":"BF16","shape":[400,2048]}
  static Result<TensorMeta> from_json(const nlohmann::json& j);

  friend bool operator==(const TensorMeta&, const TensorMeta&) = default;
};

}  // namespace ecx
