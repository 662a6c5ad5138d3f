// One FIFO of admitted requests per service, served by a fixed pool of worker threads:
// with N requests waiting and a throughput of X, each waits about N / X, whichever
// connection it came on. Past `max_queued` waiting requests, push() refuses at once
// (the server answers 503) and nothing already admitted is touched.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ecx::serve {

class RequestQueue {
 public:
  // Starts `workers` threads (at least 1).
  RequestQueue(int workers, size_t max_queued);
  // stop().
  ~RequestQueue();
  RequestQueue(const RequestQueue&) = delete;
  RequestQueue& operator=(const RequestQueue&) = delete;

  // Appends `job`; false (and `job` dropped) when `max_queued` jobs are already waiting
  // or the queue is stopping.
  bool push(std::function<void()> job);
  // Runs every job already queued, then joins the workers. Idempotent.
  void stop();

  size_t waiting() const;  // queued, not yet started
  size_t running() const;  // on a worker now
  int workers() const { return static_cast<int>(threads_.size()); }
  size_t max_queued() const { return max_queued_; }

 private:
  void work();

  const size_t max_queued_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;  // guarded by mu_
  size_t running_ = 0;                      // guarded by mu_
  bool stopping_ = false;                   // guarded by mu_
  std::vector<std::thread> threads_;        // set in the constructor, joined by stop()
};

}  // namespace ecx::serve
