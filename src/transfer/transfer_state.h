// TransferState: shared completion of one batched transfer, split into parts that
// backend workers complete independently.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "ecx/common/deadline.h"
#include "ecx/common/status.h"

namespace ecx::transfer {

class TransferState {
 public:
  // `parts`: how many part_done calls complete the transfer (at least 1).
  TransferState(std::string description, int parts);

  // Records one finished part. The first error wins. The last part runs the finalizer
  // (if any), then wakes waiters and runs callbacks.
  void part_done(const Status& status);
  // Runs on the completing thread with the aggregate status; may replace it
  // (e.g. to send the notification that follows a WRITE).
  void set_finalizer(std::function<Status(const Status&)> finalizer);
  // Called once by cancel() to interrupt parts in progress (e.g. shut sockets down).
  void set_cancel_hook(std::function<void()> hook);

  Status wait(Deadline deadline);
  bool done() const;
  void cancel();
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }
  void on_complete(std::function<void(const Status&)> callback);
  const std::string& description() const { return description_; }

 private:
  const std::string description_;
  std::atomic<bool> cancelled_{false};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int remaining_;                                              // guarded by mu_
  bool done_ = false;                                          // guarded by mu_
  Status status_;                                              // guarded by mu_
  std::function<Status(const Status&)> finalizer_;             // guarded by mu_
  std::function<void()> cancel_hook_;                          // guarded by mu_
  std::vector<std::function<void(const Status&)>> callbacks_;  // guarded by mu_
};

}  // namespace ecx::transfer
