// The end of the wish for an answer: set once, when a request's client has gone. Work
// checks it at its steps (cancelled()); asynchronous calls made for the request ask to
// be told (on_cancel), so that they end too and their upstreams see their client go.
#pragma once

#include <atomic>
#include <functional>
#include <utility>
#include <vector>

#include "ecx/common/mutex.h"

namespace ecx::http {

class Cancellation {
 public:
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }

  // Sets it and runs each callback once, on this thread (so they must not block).
  void cancel() ECX_EXCLUDES(mu_) {
    std::vector<std::function<void()>> callbacks;
    {
      MutexLock lock(&mu_);
      if (cancelled_.exchange(true, std::memory_order_acq_rel)) return;
      callbacks.swap(callbacks_);
    }
    for (auto& f : callbacks) f();
  }

  // Runs `f` once when it is set: at once, here, when it already is.
  void on_cancel(std::function<void()> f) ECX_EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      if (!cancelled_.load(std::memory_order_acquire)) {
        callbacks_.push_back(std::move(f));
        return;
      }
    }
    f();
  }

 private:
  std::atomic<bool> cancelled_{false};
  Mutex mu_;
  std::vector<std::function<void()>> callbacks_ ECX_GUARDED_BY(mu_);  // run by cancel()
};

}  // namespace ecx::http
