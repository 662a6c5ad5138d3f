// The ucx backend's internals (see transfer/ucx_backend.h): the per-agent UCX worker
// with its progress thread, and one batch in flight. The per-peer data path is
// ucx_data_path.h.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "ecx/common/mutex.h"
#include "transfer/data_path.h"
#include "transfer/ucp_library.h"

namespace ecx::transfer {

// A UCX status as a Status with `what` as context; kUnavailable unless the status says
// otherwise (a timeout, a cancel, a bad argument).
Status ucx_status(const UcpApi& api, ucs_status_t status, const std::string& what);

// One batch in flight: completes its TransferState when its last request completes.
class UcxBatch {
 public:
  explicit UcxBatch(std::shared_ptr<TransferState> state) : state_(std::move(state)) {}

  const std::shared_ptr<TransferState>& state() const { return state_; }
  void add_request() { outstanding_.fetch_add(1, std::memory_order_relaxed); }
  // One request (or the submitter, which holds one count) finished with `status`.
  void request_done(const Status& status);
  // Records why the batch fails (the first reason wins) without completing it: its
  // requests still complete (purged) before it does.
  void fail(const Status& status) ECX_EXCLUDES(mu_);
  // Completes the batch now with `reason`, leaving its requests behind. Only for a dead
  // peer on shared memory (error mode none), whose requests UCX cannot purge and whose
  // memory can no longer be copied; called on the progress thread, between progress
  // calls, so no copy is under way.
  void abandon(const Status& reason);
  bool completed() const { return completed_.load(std::memory_order_acquire); }

 private:
  void complete() ECX_EXCLUDES(mu_);

  const std::shared_ptr<TransferState> state_;
  std::atomic<int> outstanding_{1};  // the submitter's count
  std::atomic<bool> completed_{false};
  Mutex mu_;
  Status status_ ECX_GUARDED_BY(mu_);
};

// The ucp context and worker of one agent, and the thread that progresses it. Shared
// by the engine, its data paths and the memory registrations, which may outlive both.
class UcxWorker : public std::enable_shared_from_this<UcxWorker> {
 public:
  static Result<std::shared_ptr<UcxWorker>> create(const UcpApi& api, const UcxConfig& config,
                                                   const std::string& agent);
  ~UcxWorker();

  const UcpApi& api() const { return api_; }
  ucp_context_h context() const { return context_; }
  ucp_worker_h worker() const { return worker_; }
  const std::string& address_hex() const { return address_hex_; }
  bool supports_cuda() const { return supports_cuda_; }
  const std::string& agent() const { return agent_; }

  void start_progress();
  void stop_progress();
  // Wakes the progress thread (after posting requests from another thread).
  void wake() const { api_.worker_signal(worker_); }
  // The progress thread calls `on_expire` once `deadline` passes, unless `owner` is
  // gone by then.
  void watch(Deadline deadline, std::weak_ptr<void> owner, std::function<void()> on_expire)
      ECX_EXCLUDES(watch_mu_);
  // Runs `task` on the progress thread, outside UCX's callbacks. Calls that may purge
  // requests (closing an endpoint) go here: their callbacks then never run on a thread
  // that holds a lock of ours.
  void defer(std::function<void()> task) ECX_EXCLUDES(watch_mu_);
  // Batches in flight. While there are some, the progress thread also wakes on a short
  // timer (a safety net should UCX owe progress without signalling its event fd).
  void batch_started() { batches_.fetch_add(1, std::memory_order_relaxed); }
  void batch_finished() { batches_.fetch_sub(1, std::memory_order_relaxed); }
  // Endpoints being closed; stop_progress waits (bounded) for them.
  void close_started() { closing_.fetch_add(1); }
  void close_finished() { closing_.fetch_sub(1); }
  // Requests posted and not yet completed, by their user data. UCX never completes a
  // request to a dead peer over shared memory (it cannot be purged); when the worker is
  // destroyed, `drop` frees the user data of each one still pending.
  void request_posted(void* op, void (*drop)(void*)) ECX_EXCLUDES(ops_mu_);
  void request_completed(void* op) ECX_EXCLUDES(ops_mu_);

 private:
  UcxWorker(const UcpApi& api, std::string agent) : api_(api), agent_(std::move(agent)) {}
  Status init(const UcxConfig& config);
  void progress_loop();
  // Runs deferred tasks and the callbacks of watches whose deadline passed; returns ms
  // to the next deadline (-1: none).
  int run_due() ECX_EXCLUDES(watch_mu_);

  struct Watch {
    std::weak_ptr<void> owner;
    std::function<void()> on_expire;
  };

  const UcpApi& api_;
  const std::string agent_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
  std::string address_hex_;
  bool supports_cuda_ = false;
  std::atomic<bool> stopping_{false};
  std::thread progress_;
  std::atomic<int> closing_{0};
  std::atomic<int> batches_{0};
  Mutex watch_mu_;
  std::multimap<std::chrono::steady_clock::time_point, Watch> watches_ ECX_GUARDED_BY(watch_mu_);
  std::vector<std::function<void()>> deferred_ ECX_GUARDED_BY(watch_mu_);
  Mutex ops_mu_;
  std::unordered_map<void*, void (*)(void*)> ops_ ECX_GUARDED_BY(ops_mu_);
};

}  // namespace ecx::transfer
