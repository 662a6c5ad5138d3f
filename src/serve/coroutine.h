// The proxy's request coroutines (C++20), with no executor of their own: Detached, a
// coroutine that starts at once and frees itself when it ends, and Await<T>, which
// suspends it until a callback-style operation (the HTTP client's calls) calls back, on
// whichever thread, and resumes it there, as the callbacks themselves ran before.
#pragma once

#include <atomic>
#include <coroutine>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <utility>

#include "ecx/common/log.h"

namespace ecx::serve {

struct Detached {
  struct promise_type {
    Detached get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    // Logs it; the frame ends, and with it what it held (an unanswered reply answers 500).
    void unhandled_exception() noexcept {
      try {
        throw;
      } catch (const std::exception& e) {
        spdlog::error("event=coroutine_failed error=\"{}\"", e.what());
      } catch (...) {
        spdlog::error("event=coroutine_failed error=\"unknown\"");
      }
    }
  };
};

// co_await Await<T>(start): calls start(done); done(T) must be called at most once, on
// any thread, and the coroutine resumes there with T. When the operation ends without
// calling done (its owner stopped), the coroutine's frame is destroyed instead, which
// runs the destructors of its locals.
template <typename T>
class Await {
 public:
  using Done = std::function<void(T)>;
  explicit Await(std::function<void(Done)> start) : start_(std::move(start)) {}

  bool await_ready() const noexcept { return false; }
  bool await_suspend(std::coroutine_handle<> handle) {
    auto resumer = std::make_shared<Resumer>(handle, &value_);
    start_([resumer](T value) { resumer->complete(std::move(value)); });
    // From here on `this` (in the frame) may be gone: done may have resumed it already.
    return resumer->suspend();
  }
  T await_resume() { return std::move(*value_); }

 private:
  // Who resumes the coroutine: done if it comes after the suspension, else await_suspend
  // (returning false) when done came first, synchronously or from another thread.
  class Resumer {
   public:
    Resumer(std::coroutine_handle<> handle, std::optional<T>* value)
        : handle_(handle), value_(value) {}
    // Suspended and never called back: the operation dropped done.
    ~Resumer() {
      if (state_.load(std::memory_order_acquire) == kSuspended) handle_.destroy();
    }
    void complete(T value) {
      value_->emplace(std::move(value));
      if (state_.exchange(kDone, std::memory_order_acq_rel) == kSuspended) handle_.resume();
    }
    // True: stay suspended (done resumes it); false: done came first, go on.
    bool suspend() {
      State expected = kStarting;
      return state_.compare_exchange_strong(expected, kSuspended, std::memory_order_acq_rel);
    }

   private:
    enum State { kStarting, kSuspended, kDone };
    const std::coroutine_handle<> handle_;
    std::optional<T>* const value_;
    std::atomic<State> state_{kStarting};
  };

  std::function<void(Done)> start_;
  std::optional<T> value_;
};

}  // namespace ecx::serve
