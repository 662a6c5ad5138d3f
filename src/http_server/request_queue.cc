#include "http_server/request_queue.h"

#include <algorithm>
#include <atomic>
#include <iterator>
#include <memory>

namespace ecx::serve {

namespace {

// The least share of the queue one client may have waiting.
constexpr size_t kMinQueueShare = 16;

}  // namespace

size_t queue_share(size_t max_queued) { return std::max(kMinQueueShare, max_queued / 4); }

template <typename Job>
bool FairFifo<Job>::admit(QueuedRequest<Job> r, size_t max, size_t share,
                          std::function<void()>* displaced) {
  if (items_.size() >= max) {
    // Full: a client under its share takes the place of the newest request of the one
    // with the most waiting, if that one is past its share.
    auto mine = waiting_.find(r.client);
    if (mine != waiting_.end() && mine->second >= share) return false;
    auto most = std::max_element(waiting_.begin(), waiting_.end(),
                                 [](const auto& a, const auto& b) { return a.second < b.second; });
    if (most == waiting_.end() || most->second <= share) return false;
    auto newest = std::find_if(items_.rbegin(), items_.rend(),
                               [&](const auto& q) { return q.client == most->first; });
    *displaced = std::move(newest->refuse);
    items_.erase(std::next(newest).base());
    if (--most->second == 0) waiting_.erase(most);
  }
  waiting_[r.client]++;
  items_.push_back(std::move(r));
  return true;
}

template <typename Job>
QueuedRequest<Job> FairFifo<Job>::pop_front() {
  QueuedRequest<Job> r = std::move(items_.front());
  items_.pop_front();
  auto it = waiting_.find(r.client);
  if (it != waiting_.end() && --it->second == 0) waiting_.erase(it);
  return r;
}

RequestQueue::RequestQueue(int workers, size_t max_queued) : max_queued_(max_queued) {
  for (int i = 0; i < std::max(1, workers); ++i) threads_.emplace_back([this] { work(); });
}

RequestQueue::~RequestQueue() { stop(); }

bool RequestQueue::push(const std::string& client, std::function<void()> job,
                        std::function<void()> refuse) {
  std::function<void()> displaced;
  {
    MutexLock lock(&mu_);
    if (stopping_ || !jobs_.admit({client, std::move(job), std::move(refuse)}, max_queued_,
                                  queue_share(max_queued_), &displaced)) {
      return false;
    }
  }
  cv_.notify_one();
  if (displaced) displaced();
  return true;
}

void RequestQueue::stop() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
}

size_t RequestQueue::waiting() const {
  MutexLock lock(&mu_);
  return jobs_.size();
}

size_t RequestQueue::running() const {
  MutexLock lock(&mu_);
  return running_;
}

void RequestQueue::work() {
  MutexLock lock(&mu_);
  while (true) {
    // No deadline: a worker waits for work for as long as the service runs; stop()
    // wakes it.
    cv_.wait(&mu_, [this]() ECX_REQUIRES(mu_) { return stopping_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // stopping, and everything queued has run
    std::function<void()> job = std::move(jobs_.pop_front().job);
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
  MutexLock lock(&mu_);
  auto since = std::chrono::steady_clock::now() - after;
  return static_cast<size_t>(std::distance(started_.begin(), started_.lower_bound(since)));
}

SlotQueue::SlotQueue(size_t slots, size_t max_queued,
                     std::function<void(std::function<void()>)> post)
    : slots_(std::max<size_t>(1, slots)), max_queued_(max_queued), post_(std::move(post)) {}

bool SlotQueue::push(const std::string& client, Job job, std::function<void()> refuse) {
  std::function<void()> displaced;
  {
    MutexLock lock(&mu_);
    if (running_ >= slots_) {
      if (!jobs_.admit({client, std::move(job), std::move(refuse)}, max_queued_,
                       queue_share(max_queued_), &displaced)) {
        return false;
      }
      job = nullptr;  // queued
    } else {
      ++running_;
    }
  }
  if (displaced) displaced();
  if (job) job(make_done());
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
    MutexLock lock(&mu_);
    if (jobs_.empty()) {
      --running_;
      return;
    }
    next = std::move(jobs_.pop_front().job);  // the slot passes to it
  }
  post_([this, next = std::move(next)] { next(make_done()); });
}

size_t SlotQueue::waiting() const {
  MutexLock lock(&mu_);
  return jobs_.size();
}

size_t SlotQueue::running() const {
  MutexLock lock(&mu_);
  return running_;
}

template class FairFifo<std::function<void()>>;
template class FairFifo<SlotQueue::Job>;

}  // namespace ecx::serve
