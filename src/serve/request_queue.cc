#include "serve/request_queue.h"

#include <algorithm>

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
    lock.unlock();
    job();
    job = nullptr;  // what the job captured goes before the next one starts
    lock.lock();
    --running_;
  }
}

}  // namespace ecx::serve
