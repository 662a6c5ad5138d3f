#include "ecx/common/json_reader.h"

namespace ecx {

using nlohmann::json;

bool json_too_deep(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return true;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return false;
}

Result<json> parse_json(std::string_view text, std::string_view what, JsonLimits limits) {
  if (text.size() > limits.max_bytes) {
    return InvalidArgument(std::string(what) + " is larger than " +
                           std::to_string(limits.max_bytes) + " bytes");
  }
  if (json_too_deep(text, limits.max_depth)) {
    return InvalidArgument(std::string(what) + " nests deeper than " +
                           std::to_string(limits.max_depth) + " levels");
  }
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgument(std::string(what) + " is not valid JSON");
  return j;
}

Result<json> parse_json_object(std::string_view text, std::string_view what, JsonLimits limits) {
  ECX_ASSIGN_OR_RETURN(json j, parse_json(text, what, limits));
  if (!j.is_object()) return InvalidArgument(std::string(what) + " must be a JSON object");
  return j;
}

std::string safe_dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string safe_dump(const json& j, size_t expected_bytes) {
  std::string out;
  out.reserve(expected_bytes);
  // What json::dump does, into our string (nlohmann exposes no public way to give it one).
  nlohmann::detail::serializer<json> writer(
      nlohmann::detail::output_adapter<char, std::string>(out), ' ',
      json::error_handler_t::replace);
  writer.dump(j, /*pretty_print=*/false, /*ensure_ascii=*/false, /*indent_step=*/0);
  return out;
}

JsonReader::JsonReader(const json& object, std::string where)
    : j_(&object), where_(std::move(where)) {}

Status JsonReader::object() const {
  return j_->is_object() ? Status::Ok() : InvalidArgument(where_ + " must be a JSON object");
}

const json* JsonReader::find(std::string_view key) const {
  if (!j_->is_object()) return nullptr;
  auto it = j_->find(key);
  return it == j_->end() ? nullptr : &*it;
}

bool JsonReader::has(std::string_view key) const { return find(key) != nullptr; }

Status JsonReader::missing(std::string_view key) const {
  return InvalidArgument(where_ + " lacks '" + std::string(key) + "'");
}

Status JsonReader::wrong(std::string_view key, std::string_view what) const {
  return InvalidArgument(where_ + " '" + std::string(key) + "' must be " + std::string(what));
}

Result<std::string> JsonReader::string(std::string_view key, Presence presence, size_t max_length,
                                       std::string fallback) const {
  return field<std::string>(
      key, presence, std::move(fallback), [&](const json& v) -> Result<std::string> {
        if (!v.is_string()) return wrong(key, "a string");
        const auto& s = v.get_ref<const std::string&>();
        if (s.size() > max_length) {
          return wrong(key, "at most " + std::to_string(max_length) + " characters");
        }
        return s;
      });
}

Result<uint64_t> JsonReader::u64(std::string_view key, Presence presence, uint64_t max,
                                 uint64_t fallback) const {
  return field<uint64_t>(key, presence, fallback, [&](const json& v) -> Result<uint64_t> {
    if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0)) {
      return wrong(key, "a non-negative integer");
    }
    uint64_t n = v.get<uint64_t>();
    if (n > max)
      return OutOfRange(where_ + " '" + std::string(key) + "' must be at most " +
                        std::to_string(max));
    return n;
  });
}

Result<int64_t> JsonReader::i64(std::string_view key, int64_t min, int64_t max, Presence presence,
                                int64_t fallback) const {
  return field<int64_t>(key, presence, fallback, [&](const json& v) -> Result<int64_t> {
    if (!v.is_number_integer()) return wrong(key, "an integer");
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      return wrong(key, "at most " + std::to_string(max));
    }
    int64_t n = v.get<int64_t>();
    if (n < min || n > max) {
      return OutOfRange(where_ + " '" + std::string(key) + "' = " + std::to_string(n) +
                        " is outside [" + std::to_string(min) + ", " + std::to_string(max) + "]");
    }
    return n;
  });
}

Result<double> JsonReader::number(std::string_view key, Presence presence, double fallback) const {
  return field<double>(key, presence, fallback, [&](const json& v) -> Result<double> {
    if (!v.is_number()) return wrong(key, "a number");
    return v.get<double>();
  });
}

Result<bool> JsonReader::boolean(std::string_view key, Presence presence, bool fallback) const {
  return field<bool>(key, presence, fallback, [&](const json& v) -> Result<bool> {
    if (!v.is_boolean()) return wrong(key, "a boolean");
    return v.get<bool>();
  });
}

Result<const json*> JsonReader::array(std::string_view key, Presence presence,
                                      size_t max_items) const {
  return field<const json*>(key, presence, nullptr, [&](const json& v) -> Result<const json*> {
    if (!v.is_array()) return wrong(key, "an array");
    if (v.size() > max_items) return wrong(key, "at most " + std::to_string(max_items) + " items");
    return &v;
  });
}

Result<const json*> JsonReader::object(std::string_view key, Presence presence) const {
  return field<const json*>(key, presence, nullptr, [&](const json& v) -> Result<const json*> {
    if (!v.is_object()) return wrong(key, "an object");
    return &v;
  });
}

Result<JsonReader> JsonReader::child(std::string_view key, Presence presence) const {
  static const json kEmpty = json::object();
  ECX_ASSIGN_OR_RETURN(const json* v, object(key, presence));
  return JsonReader(v ? *v : kEmpty, where_ + "." + std::string(key));
}

}  // namespace ecx
