// The gateway's JSON as the directory layer reads it: base64 keys and values, int64
// fields that arrive as strings, key-value objects.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "ecx/common/status.h"
#include "ecx/directory/etcd_client.h"

namespace ecx::directory {

std::string base64_encode(std::string_view bytes);
// Strict: the standard alphabet with padding; anything else is InvalidArgument.
Result<std::string> base64_decode(std::string_view text);

// The int64 field `key` of `object` (a string of digits or a number); 0 when absent.
Result<int64_t> read_int64(const nlohmann::json& object, const char* key);

// The string field `key` of `object`; empty when absent or not a string (never throws).
std::string read_string(const nlohmann::json& object, const char* key);

// A gateway key-value object {key, value, mod_revision, lease, ...}; `value` may be
// absent (a delete event carries the key alone).
Result<KeyValue> read_key_value(const nlohmann::json& kv);

}  // namespace ecx::directory
