// The one way ecx reads JSON: parse_json turns text into a document without exceptions,
// bounded in size and nesting (a recursive parser would overflow the stack on a deep
// enough document), and JsonReader reads one object's fields, each checked for presence,
// type and range, every error naming the document and the field. Every JSON that comes
// from outside (a peer, a client, a file, the command line) goes through these two.
#pragma once

#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "ecx/common/status.h"

namespace ecx {

struct JsonLimits {
  size_t max_bytes = size_t{64} << 20;
  int max_depth = 64;
};

// True when `text` nests arrays/objects deeper than `max_depth` (counted without parsing,
// strings skipped).
bool json_too_deep(std::string_view text, int max_depth = 64);

// Parses `text`; errors name `what` ("agent metadata", "request body", ...).
Result<nlohmann::json> parse_json(std::string_view text, std::string_view what,
                                  JsonLimits limits = {});
// parse_json, and the document must be an object.
Result<nlohmann::json> parse_json_object(std::string_view text, std::string_view what,
                                         JsonLimits limits = {});

// dump() that never throws on invalid UTF-8 (replaces it).
std::string safe_dump(const nlohmann::json& j);
// safe_dump into a string that starts with `expected_bytes` of room: a large document
// (a request holding images) is written once, not grown by doubling through copies.
std::string safe_dump(const nlohmann::json& j, size_t expected_bytes);

enum class Presence { kOptional, kRequired };

// Reads the fields of one JSON object. An absent optional field reads as the fallback
// given (or empty/zero); a present field of the wrong type or range is an error. The
// reader refers to the document: it must outlive the reader.
class JsonReader {
 public:
  // `where` names the object in errors: "agent metadata", "lookup item 3", ...
  JsonReader(const nlohmann::json& object, std::string where);

  const std::string& where() const { return where_; }
  const nlohmann::json& document() const { return *j_; }
  // Ok when the value is an object (check before reading fields of untrusted input).
  Status object() const;
  bool has(std::string_view key) const;

  Result<std::string> string(std::string_view key, Presence presence = Presence::kOptional,
                             size_t max_length = 4096, std::string fallback = {}) const;
  // A non-negative integer up to `max`.
  Result<uint64_t> u64(std::string_view key, Presence presence = Presence::kOptional,
                       uint64_t max = std::numeric_limits<uint64_t>::max(),
                       uint64_t fallback = 0) const;
  // An integer in [min, max].
  Result<int64_t> i64(std::string_view key, int64_t min, int64_t max,
                      Presence presence = Presence::kOptional, int64_t fallback = 0) const;
  Result<double> number(std::string_view key, Presence presence = Presence::kOptional,
                        double fallback = 0) const;
  Result<bool> boolean(std::string_view key, Presence presence = Presence::kOptional,
                       bool fallback = false) const;
  // The array or object at `key` (nullptr when optional and absent).
  Result<const nlohmann::json*> array(std::string_view key, Presence presence = Presence::kRequired,
                                      size_t max_items = std::numeric_limits<size_t>::max()) const;
  Result<const nlohmann::json*> object(std::string_view key,
                                       Presence presence = Presence::kOptional) const;
  // A reader for the object at `key`, named "<where>.<key>" (an empty object when absent).
  Result<JsonReader> child(std::string_view key, Presence presence = Presence::kOptional) const;

  Status missing(std::string_view key) const;
  Status wrong(std::string_view key, std::string_view what) const;

 private:
  const nlohmann::json* find(std::string_view key) const;
  // The field at `key` through `convert`; when absent, `fallback` (an error if required).
  template <typename T, typename Convert>
  Result<T> field(std::string_view key, Presence presence, T fallback, Convert convert) const {
    const nlohmann::json* v = find(key);
    if (v != nullptr) return convert(*v);
    if (presence == Presence::kRequired) return missing(key);
    return fallback;
  }

  const nlohmann::json* j_;
  std::string where_;
};

}  // namespace ecx
