// One FIFO of admitted requests per service: with N requests waiting and a throughput
// of X, each waits about N / X, whichever connection it came on. Past `max_queued`
// waiting requests, push() refuses at once (the server answers 503) and nothing already
// admitted is touched.
//   RequestQueue  work that blocks (encoding, generating): a fixed pool of worker threads.
//   SlotQueue     work that waits on the network without a thread (the proxy's): at most
//                 `slots` requests run at once, each until it calls its Done.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <set>
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
  // Workers that have run their current job for longer than `after`.
  size_t busy_longer_than(std::chrono::milliseconds after) const;
  int workers() const { return static_cast<int>(threads_.size()); }
  size_t max_queued() const { return max_queued_; }

 private:
  void work();

  const size_t max_queued_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;  // guarded by mu_
  size_t running_ = 0;                      // guarded by mu_
  // When each running job started; guarded by mu_.
  std::multiset<std::chrono::steady_clock::time_point> started_;
  bool stopping_ = false;             // guarded by mu_
  std::vector<std::thread> threads_;  // set in the constructor, joined by stop()
};

class SlotQueue {
 public:
  using Done = std::function<void()>;     // call once, when the request has been answered
  using Job = std::function<void(Done)>;  // must not block
  // `post` runs a job that waited on an I/O thread (a freed slot is handed on from the
  // thread that frees it, which must not run the next job itself).
  SlotQueue(size_t slots, size_t max_queued, std::function<void(std::function<void()>)> post);
  SlotQueue(const SlotQueue&) = delete;
  SlotQueue& operator=(const SlotQueue&) = delete;

  // Runs `job` now, in the caller, when a slot is free; else queues it. False (and `job`
  // dropped) when `max_queued` jobs are already waiting.
  bool push(Job job);

  size_t waiting() const;
  size_t running() const;
  size_t slots() const { return slots_; }
  size_t max_queued() const { return max_queued_; }

 private:
  Done make_done();
  void release();  // a slot is free: the next waiting job gets it

  const size_t slots_;
  const size_t max_queued_;
  const std::function<void(std::function<void()>)> post_;
  mutable std::mutex mu_;
  std::deque<Job> jobs_;  // guarded by mu_
  size_t running_ = 0;    // guarded by mu_
};

}  // namespace ecx::serve
