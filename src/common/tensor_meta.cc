#include "ecx/common/tensor_meta.h"

#include "ecx/common/json_reader.h"

#include <array>
#include <nlohmann/json.hpp>

namespace ecx {
namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  size_t size;
};

constexpr std::array<DTypeInfo, 6> kDTypes = {{{DType::kBF16, "BF16", 2},
                                               {DType::kF16, "F16", 2},
                                               {DType::kF32, "F32", 4},
                                               {DType::kU8, "U8", 1},
                                               {DType::kI32, "I32", 4},
                                               {DType::kI64, "I64", 8}}};

constexpr uint64_t kMaxTensorBytes = uint64_t{1} << 48;

}  // namespace

size_t dtype_size(DType dtype) {
  for (const auto& d : kDTypes) {
    if (d.dtype == dtype) return d.size;
  }
  return 0;
}

std::string_view dtype_name(DType dtype) {
  for (const auto& d : kDTypes) {
    if (d.dtype == dtype) return d.name;
  }
  return "?";
}

Result<DType> dtype_from_name(std::string_view name) {
  for (const auto& d : kDTypes) {
    if (d.name == name) return d.dtype;
  }
  return InvalidArgument("unknown dtype '" + std::string(name.substr(0, 32)) + "'");
}

Result<DType> dtype_from_wire(uint8_t value) {
  for (const auto& d : kDTypes) {
    if (static_cast<uint8_t>(d.dtype) == value) return d.dtype;
  }
  return InvalidArgument("unknown dtype code " + std::to_string(value));
}

Status TensorMeta::validate() const {
  if (dtype_size(dtype) == 0) return InvalidArgument("tensor has an unknown dtype");
  if (shape.size() > kMaxTensorRank) {
    return InvalidArgument("tensor rank " + std::to_string(shape.size()) + " exceeds " +
                           std::to_string(kMaxTensorRank));
  }
  uint64_t bytes = dtype_size(dtype);
  for (int64_t d : shape) {
    if (d < 0) return InvalidArgument("tensor dimension " + std::to_string(d) + " is negative");
    if (d != 0 && bytes > kMaxTensorBytes / static_cast<uint64_t>(d)) {
      return OutOfRange("tensor " + to_string() + " is larger than 2^48 bytes");
    }
    bytes *= static_cast<uint64_t>(d);
  }
  return Status::Ok();
}

uint64_t TensorMeta::element_count() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

std::string TensorMeta::to_string() const {
  std::string out(dtype_name(dtype));
  for (auto& c : out) c = static_cast<char>(std::tolower(c));
  out += "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(shape[i]);
  }
  out += "]";
  return out;
}

nlohmann::json TensorMeta::to_json() const {
  return {{"dtype", std::string(dtype_name(dtype))}, {"shape", shape}};
}

Result<TensorMeta> TensorMeta::from_json(const nlohmann::json& j) {
  JsonReader r(j, "tensor meta");
  ECX_RETURN_IF_ERROR(r.object());
  ECX_ASSIGN_OR_RETURN(std::string dtype, r.string("dtype", Presence::kRequired, 32));
  ECX_ASSIGN_OR_RETURN(const nlohmann::json* shape,
                       r.array("shape", Presence::kRequired, kMaxTensorRank));
  TensorMeta meta;
  ECX_ASSIGN_OR_RETURN(meta.dtype, dtype_from_name(dtype));
  for (const auto& d : *shape) {
    if (!d.is_number_integer()) return InvalidArgument("tensor shape entries must be integers");
    meta.shape.push_back(d.get<int64_t>());
  }
  ECX_RETURN_IF_ERROR(meta.validate());
  return meta;
}

}  // namespace ecx
