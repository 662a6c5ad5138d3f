#include "transfer/transfer_state.h"

#include "ecx/transfer/transfer_handle.h"

namespace ecx::transfer {
namespace {
// After a cancel, parts stop within one socket operation; this bounds that wait.
constexpr int64_t kCancelDrainMs = 10000;
}  // namespace

TransferState::TransferState(std::string description, int parts)
    : description_(std::move(description)), remaining_(parts < 1 ? 1 : parts) {}

void TransferState::part_done(const Status& status) {
  std::function<Status(const Status&)> finalizer;
  Status aggregate;
  {
    MutexLock lock(&mu_);
    if (!status.ok() && status_.ok()) status_ = status;
    if (--remaining_ > 0) return;
    finalizer = std::move(finalizer_);
    aggregate = status_;
  }
  if (cancelled() && aggregate.ok())
    aggregate = Status(StatusCode::kCancelled, description_ + ": cancelled");
  if (finalizer) aggregate = finalizer(aggregate);
  std::vector<std::function<void(const Status&)>> callbacks;
  {
    MutexLock lock(&mu_);
    status_ = aggregate;
    done_ = true;
    callbacks.swap(callbacks_);
  }
  cv_.notify_all();
  for (auto& cb : callbacks) cb(aggregate);
}

void TransferState::record_digest(size_t descriptor, uint64_t value) {
  MutexLock lock(&mu_);
  if (digests_.size() <= descriptor) digests_.resize(descriptor + 1);
  digests_[descriptor] = value;
}

std::optional<uint64_t> TransferState::digest(size_t descriptor) const {
  MutexLock lock(&mu_);
  if (descriptor >= digests_.size()) return std::nullopt;
  return digests_[descriptor];
}

void TransferState::set_finalizer(std::function<Status(const Status&)> finalizer) {
  MutexLock lock(&mu_);
  finalizer_ = std::move(finalizer);
}

void TransferState::set_cancel_hook(std::function<void()> hook) {
  MutexLock lock(&mu_);
  cancel_hook_ = std::move(hook);
}

Status TransferState::wait(Deadline deadline) {
  {
    MutexLock lock(&mu_);
    if (cv_.wait_until(&mu_, deadline.time_point(), [this]() ECX_REQUIRES(mu_) { return done_; }))
      return status_;
  }
  cancel();
  MutexLock lock(&mu_);
  // Parts in progress were interrupted; wait for them so no byte lands after we return.
  bool drained = cv_.wait_for(&mu_, std::chrono::milliseconds(kCancelDrainMs),
                              [this]() ECX_REQUIRES(mu_) { return done_; });
  if (!drained) {
    return Internal(description_ + ": deadline passed and the transfer did not stop after cancel");
  }
  if (status_.code() == StatusCode::kCancelled || status_.ok()) {
    return DeadlineExceeded(description_ + ": deadline passed before completion");
  }
  if (status_.code() == StatusCode::kDeadlineExceeded) return status_;
  return DeadlineExceeded(description_ + ": deadline passed (" + status_.to_string() + ")");
}

bool TransferState::done() const {
  MutexLock lock(&mu_);
  return done_;
}

void TransferState::cancel() {
  if (cancelled_.exchange(true)) return;
  std::function<void()> hook;
  {
    MutexLock lock(&mu_);
    if (done_) return;
    hook = cancel_hook_;
  }
  if (hook) hook();
}

void TransferState::on_complete(std::function<void(const Status&)> callback) {
  Status final_status;
  {
    MutexLock lock(&mu_);
    if (!done_) {
      callbacks_.push_back(std::move(callback));
      return;
    }
    final_status = status_;
  }
  callback(final_status);
}

Status TransferHandle::wait(Deadline deadline) {
  if (!state_) return InvalidArgument("wait on an empty TransferHandle");
  return state_->wait(deadline);
}

bool TransferHandle::done() const { return state_ && state_->done(); }

void TransferHandle::cancel() {
  if (state_) state_->cancel();
}

void TransferHandle::on_complete(std::function<void(const Status&)> callback) {
  if (state_) state_->on_complete(std::move(callback));
}

std::optional<uint64_t> TransferHandle::digest(size_t descriptor) const {
  if (!state_ || !state_->done()) return std::nullopt;
  return state_->digest(descriptor);
}

}  // namespace ecx::transfer
