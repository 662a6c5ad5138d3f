// TransferHandle: the completion of one batched READ or WRITE.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>

#include "ecx/common/deadline.h"
#include "ecx/common/status.h"

namespace ecx::transfer {

class TransferState;

class TransferHandle {
 public:
  TransferHandle() = default;
  explicit TransferHandle(std::shared_ptr<TransferState> state) : state_(std::move(state)) {}

  // Blocks until the transfer completes or `deadline` passes. On a passed deadline the
  // transfer is cancelled and kDeadlineExceeded returned; once wait returns, no more
  // bytes land in the local buffers. Woken by a condition variable: no polling.
  Status wait(Deadline deadline);
  // True once the transfer completed (successfully or not).
  bool done() const;
  // Cancels the transfer (kCancelled) unless it already completed.
  void cancel();
  // Runs `callback` once with the final status: at once if already done, else on the
  // thread that completes the transfer. Keep it short; do not wait inside it.
  void on_complete(std::function<void(const Status&)> callback);
  // After a successful wait: descriptor k's checksum64 over the range it asked for
  // (TransferDescriptor::digest_length), where the backend computed it as the bytes
  // landed (tcp); nullopt where it did not (hash the bytes yourself).
  std::optional<uint64_t> digest(size_t descriptor) const;

  bool valid() const { return state_ != nullptr; }

 private:
  std::shared_ptr<TransferState> state_;
};

}  // namespace ecx::transfer
