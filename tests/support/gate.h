// A flag a test thread waits on (with a deadline) and another opens: a handler held
// until the test lets it answer.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

namespace ecx::testing {

class Gate {
 public:
  void open() {
    std::lock_guard lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  // True once open; false when `timeout` passed first.
  bool wait(std::chrono::seconds timeout = std::chrono::seconds(60)) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return open_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;  // guarded by mu_
};

}  // namespace ecx::testing
