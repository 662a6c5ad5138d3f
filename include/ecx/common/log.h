// Logging through spdlog. Call set_log_level once at start-up; the default is "info".
#pragma once

#include <spdlog/spdlog.h>

#include <string_view>

#include "ecx/common/status.h"

namespace ecx {

// Levels: trace, debug, info, warn, error, off.
Status set_log_level(std::string_view level);

}  // namespace ecx
