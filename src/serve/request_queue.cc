#include "serve/request_queue.h"

#include <iterator>

#include <algorithm>
#include <atomic>
#include <memory>

namespace ecx::serve {

RequestQueue::RequestQueue(int workers, size_t max_queued) : max_queued_(max_queued) {
  for (int i = 0; i < std::max(1, workers); ++i) threads_.emplace_back([this] { work(); });
}

RequestQueue::~RequestQueue() { stop(); }

bool RequestQueue::push(std::function<void()> job) {
  {
    std::lock_guard lock(mu_);
    if (stopping_ || jobs_.size() >= max_queued_) return false;
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
  return true;
}

void RequestQueue::stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
}

size_t RequestQueue::waiting() const {
  std::lock_guard lock(mu_);
  return jobs_.size();
}

size_t RequestQueue::running() const {
  std::lock_guard lock(mu_);
  return running_;
}

void RequestQueue::work() {
  std::unique_lock lock(mu_);
  while (true) {
    // No deadline: a worker waits for work for as long as the service runs; stop()
    // wakes it.
    cv_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // stopping, and everything queued has run
    std::function<void()> job = std::move(jobs_.front());
    jobs_.pop_front();
    ++running_;
    auto started = started_.insert(std::chrono::steady_clock::now());
    lock.unlock();
    job();
    job = nullptr;  // what the job captured goes before the next one starts
    lock.lock();
    started_.erase(started);
    --running_;
  }
}

size_t RequestQueue::busy_longer_than(std::chrono::milliseconds after) const {
  std::lock_guard lock(mu_);
  auto since = std::chrono::steady_clock::now() - after;
  return static_cast<size_t>(std::distance(started_.begin(), started_.lower_bound(since)));
}

SlotQueue::SlotQueue(size_t slots, size_t max_queued,
                     std::function<void(std::function<void()>)> post)
    : slots_(std::max<size_t>(1, slots)), max_queued_(max_queued), post_(std::move(post)) {}

bool SlotQueue::push(Job job) {
  {
    std::lock_guard lock(mu_);
    if (running_ >= slots_) {
      if (jobs_.size() >= max_queued_) return false;
      jobs_.push_back(std::move(job));
      return true;
    }
    ++running_;
  }
  job(make_done());
  return true;
}

SlotQueue::Done SlotQueue::make_done() {
  // Called at most once, even when a copy of it is called again.
  auto called = std::make_shared<std::atomic<bool>>(false);
  return [this, called] {
    if (!called->exchange(true)) release();
  };
}

void SlotQueue::release() {
  Job next;
  {
    std::lock_guard lock(mu_);
    if (jobs_.empty()) {
      --running_;
      return;
    }
    next = std::move(jobs_.front());  // the slot passes to it
    jobs_.pop_front();
  }
  post_([this, next = std::move(next)] { next(make_done()); });
}

size_t SlotQueue::waiting() const {
  std::lock_guard lock(mu_);
  return jobs_.size();
}

size_t SlotQueue::running() const {
  std::lock_guard lock(mu_);
  return running_;
}

}  // namespace ecx::serve
