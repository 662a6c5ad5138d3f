#include "ecx/common/log.h"

namespace ecx {

Status set_log_level(std::string_view level) {
  auto parsed = spdlog::level::from_str(std::string(level));
  if (parsed == spdlog::level::off && level != "off") {
    return InvalidArgument("unknown log level '" + std::string(level) + "'");
  }
  spdlog::set_level(parsed);
  return Status::Ok();
}

}  // namespace ecx
