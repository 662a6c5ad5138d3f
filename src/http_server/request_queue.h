// One FIFO of admitted requests per service: with N requests waiting and a throughput
// of X, each waits about N / X, whichever connection it came on. Past `max_queued`
// waiting requests, push() refuses at once (the server answers 503) and nothing already
// admitted is touched, with one exception that keeps the queue fair between clients
// (source addresses): a client with fewer than its share waiting takes the place of the
// newest request of the client that has the most waiting, when that one has more than
// its share (that request is refused then, as if it had come to a full queue). A busy
// client alone may so fill the whole queue, and still cannot keep others out.
//   RequestQueue  work that blocks (encoding, generating): a fixed pool of worker threads.
//   SlotQueue     work that waits on the network without a thread (the proxy's): at most
//                 `slots` requests run at once, each until it calls its Done.
#pragma once

#include <chrono>
#include <cstddef>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "ecx/common/mutex.h"

namespace ecx::serve {

// One client's request, as a queue holds it: what to run, and what to do instead when
// it is refused after all (its place taken by another client's request).
template <typename Job>
struct QueuedRequest {
  std::string client;
  Job job;
  std::function<void()> refuse;
};

// The waiting requests of a queue and how many each client has (not thread-safe: the
// queue's lock guards it).
template <typename Job>
class FairFifo {
 public:
  // Appends `r`; false when the queue holds `max` and no place can be taken for it.
  // `displaced` gets the request whose place it took (its refuse() is the caller's to
  // run, outside the queue's lock).
  bool admit(QueuedRequest<Job> r, size_t max, size_t share, std::function<void()>* displaced);
  QueuedRequest<Job> pop_front();
  bool empty() const { return items_.empty(); }
  size_t size() const { return items_.size(); }

 private:
  std::deque<QueuedRequest<Job>> items_;
  std::map<std::string, size_t> waiting_;  // by client; absent when none
};

// How many waiting requests are a client's share: a quarter of the queue, at least 16.
size_t queue_share(size_t max_queued);

class RequestQueue {
 public:
  // Starts `workers` threads (at least 1).
  RequestQueue(int workers, size_t max_queued);
  // stop().
  ~RequestQueue();
  RequestQueue(const RequestQueue&) = delete;
  RequestQueue& operator=(const RequestQueue&) = delete;

  // Appends `job` of `client`; false (and `job` dropped) when `max_queued` jobs are
  // already waiting and no place can be taken (see above), or the queue is stopping.
  // `refuse` runs instead of `job` when its place is taken by another client's.
  bool push(const std::string& client, std::function<void()> job, std::function<void()> refuse)
      ECX_EXCLUDES(mu_);
  // Runs every job already queued, then joins the workers. Idempotent.
  void stop() ECX_EXCLUDES(mu_);

  size_t waiting() const ECX_EXCLUDES(mu_);  // queued, not yet started
  size_t running() const ECX_EXCLUDES(mu_);  // on a worker now
  // Workers that have run their current job for longer than `after`.
  size_t busy_longer_than(std::chrono::milliseconds after) const ECX_EXCLUDES(mu_);
  int workers() const { return static_cast<int>(threads_.size()); }
  size_t max_queued() const { return max_queued_; }

 private:
  void work() ECX_EXCLUDES(mu_);

  const size_t max_queued_;
  mutable Mutex mu_;
  CondVar cv_;
  FairFifo<std::function<void()>> jobs_ ECX_GUARDED_BY(mu_);
  size_t running_ ECX_GUARDED_BY(mu_) = 0;
  // When each running job started.
  std::multiset<std::chrono::steady_clock::time_point> started_ ECX_GUARDED_BY(mu_);
  bool stopping_ ECX_GUARDED_BY(mu_) = false;
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

  // Runs `job` of `client` now, in the caller, when a slot is free; else queues it. False
  // (and `job` dropped) when `max_queued` jobs are already waiting and no place can be
  // taken (see above); `refuse` runs instead of `job` when its place is taken.
  bool push(const std::string& client, Job job, std::function<void()> refuse) ECX_EXCLUDES(mu_);

  size_t waiting() const ECX_EXCLUDES(mu_);
  size_t running() const ECX_EXCLUDES(mu_);
  size_t slots() const { return slots_; }
  size_t max_queued() const { return max_queued_; }

 private:
  Done make_done();
  void release() ECX_EXCLUDES(mu_);  // a slot is free: the next waiting job gets it

  const size_t slots_;
  const size_t max_queued_;
  const std::function<void(std::function<void()>)> post_;
  mutable Mutex mu_;
  FairFifo<Job> jobs_ ECX_GUARDED_BY(mu_);
  size_t running_ ECX_GUARDED_BY(mu_) = 0;
};

}  // namespace ecx::serve
