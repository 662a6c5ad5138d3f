// Reading a running service's /metrics from a test: one value, or waiting for one.
#pragma once

#include <string>

#include "ecx/common/deadline.h"

namespace ecx::testing {

// A gauge or counter (no labels) in a /metrics text; -1 when absent.
double metric_in(const std::string& text, const std::string& name);

// A gauge or counter from a service's /metrics (no labels); -1 when absent or unreachable.
double metric(const std::string& url, const std::string& name);

// Asks again every 50 ms until the metric reads `want` or `deadline` passes; `last` (if
// given) gets the last value read. For state a service gives no event for (its pins).
bool metric_reaches(const std::string& url, const std::string& name, double want, Deadline deadline,
                    double* last = nullptr);

}  // namespace ecx::testing
