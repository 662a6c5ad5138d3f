// Waiting on a condition another process (or a thread the test cannot join) makes true:
// it is asked again every `interval` until it holds or the deadline passes. The one place
// tests sleep; a test never sleeps to show that something did not happen.
#pragma once

#include <chrono>
#include <functional>
#include <thread>

#include "ecx/common/deadline.h"

namespace ecx::testing {

// True once `done` held; false when `deadline` passed first.
inline bool poll_until(Deadline deadline, const std::function<bool()>& done,
                       std::chrono::milliseconds interval = std::chrono::milliseconds(20)) {
  while (true) {
    if (done()) return true;
    if (deadline.expired()) return false;
    std::this_thread::sleep_for(interval);
  }
}

}  // namespace ecx::testing
