// TransferState: shared completion of one batched transfer, split into parts that
// backend workers complete independently.
#pragma once

#include <atomic>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ecx/common/deadline.h"
#include "ecx/common/mutex.h"
#include "ecx/common/status.h"

namespace ecx::transfer {

class TransferState {
 public:
  // `parts`: how many part_done calls complete the transfer (at least 1).
  TransferState(std::string description, int parts);

  // Records one finished part. The first error wins. The last part runs the finalizer
  // (if any), then wakes waiters and runs callbacks.
  void part_done(const Status& status) ECX_EXCLUDES(mu_);
  // Runs on the completing thread with the aggregate status; may replace it
  // (e.g. to send the notification that follows a WRITE).
  void set_finalizer(std::function<Status(const Status&)> finalizer) ECX_EXCLUDES(mu_);
  // Called once by cancel() to interrupt parts in progress (e.g. shut sockets down).
  void set_cancel_hook(std::function<void()> hook) ECX_EXCLUDES(mu_);

  Status wait(Deadline deadline) ECX_EXCLUDES(mu_);
  bool done() const ECX_EXCLUDES(mu_);
  void cancel() ECX_EXCLUDES(mu_);
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }
  void on_complete(std::function<void(const Status&)> callback) ECX_EXCLUDES(mu_);
  const std::string& description() const { return description_; }
  // A backend records descriptor k's digest (TransferDescriptor::digest_length) before
  // the part that completed it is done; read once the transfer completed.
  void record_digest(size_t descriptor, uint64_t value) ECX_EXCLUDES(mu_);
  std::optional<uint64_t> digest(size_t descriptor) const ECX_EXCLUDES(mu_);

 private:
  const std::string description_;
  std::atomic<bool> cancelled_{false};
  mutable Mutex mu_;
  CondVar cv_;
  int remaining_ ECX_GUARDED_BY(mu_);
  bool done_ ECX_GUARDED_BY(mu_) = false;
  Status status_ ECX_GUARDED_BY(mu_);
  std::function<Status(const Status&)> finalizer_ ECX_GUARDED_BY(mu_);
  std::function<void()> cancel_hook_ ECX_GUARDED_BY(mu_);
  std::vector<std::function<void(const Status&)>> callbacks_ ECX_GUARDED_BY(mu_);
  std::vector<std::optional<uint64_t>> digests_ ECX_GUARDED_BY(mu_);
};

}  // namespace ecx::transfer
