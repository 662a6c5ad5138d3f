// Names of an enum's values, from one table: the name of a value, and the value of a
// name with an error that lists every accepted name. One table per enum, so a name is
// spelled in one place.
#pragma once

#include <span>
#include <string>
#include <string_view>

#include "ecx/common/status.h"

namespace ecx {

template <typename E>
struct EnumName {
  E value;
  std::string_view name;
};

template <typename E>
std::string_view name_of(std::span<const EnumName<E>> table, E value) {
  for (const auto& e : table) {
    if (e.value == value) return e.name;
  }
  return "?";
}

// "a, b or c"
template <typename E>
std::string names_of(std::span<const EnumName<E>> table) {
  std::string out;
  for (size_t i = 0; i < table.size(); ++i) {
    if (i > 0) out += i + 1 == table.size() ? " or " : ", ";
    out += table[i].name;
  }
  return out;
}

// The value named `name`, or "unknown <what> '<name>' (expected a, b or c)".
template <typename E>
Result<E> parse_name(std::span<const EnumName<E>> table, std::string_view name,
                     std::string_view what) {
  for (const auto& e : table) {
    if (e.name == name) return e.value;
  }
  return InvalidArgument("unknown " + std::string(what) + " '" + std::string(name.substr(0, 64)) +
                         "' (expected " + names_of(table) + ")");
}

}  // namespace ecx
