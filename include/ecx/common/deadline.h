// Deadline: every wait in ecx takes one.
#pragma once

#include <chrono>
#include <cstdint>
#include <limits>

namespace ecx {

using Clock = std::chrono::steady_clock;

// Milliseconds from `t` to now.
inline double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

class Deadline {
 public:
  // A deadline `timeout` from now.
  static Deadline after(std::chrono::nanoseconds timeout) {
    return Deadline(Clock::now() + timeout);
  }
  static Deadline after_ms(int64_t ms) { return after(std::chrono::milliseconds(ms)); }
  // A deadline that never expires. Use only where something else bounds the wait.
  static Deadline never() { return Deadline(Clock::time_point::max()); }

  bool expired() const { return Clock::now() >= at_; }
  bool is_never() const { return at_ == Clock::time_point::max(); }
  Clock::time_point time_point() const { return at_; }
  // Time left, never negative.
  std::chrono::nanoseconds remaining() const {
    if (is_never()) return std::chrono::nanoseconds::max();
    auto left = at_ - Clock::now();
    return left.count() > 0 ? std::chrono::duration_cast<std::chrono::nanoseconds>(left)
                            : std::chrono::nanoseconds(0);
  }
  // Milliseconds left for poll(2): -1 for never, rounded up so a wait never ends early.
  int poll_timeout_ms() const {
    if (is_never()) return -1;
    auto ns = remaining().count();
    int64_t ms = (ns + 999'999) / 1'000'000;
    return ms > std::numeric_limits<int>::max() ? std::numeric_limits<int>::max()
                                                : static_cast<int>(ms);
  }
  // The earlier of two deadlines.
  static Deadline earliest(Deadline a, Deadline b) { return a.at_ < b.at_ ? a : b; }

 private:
  explicit Deadline(Clock::time_point at) : at_(at) {}
  Clock::time_point at_;
};

}  // namespace ecx
