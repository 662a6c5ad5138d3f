#include "connector/copy_crew.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cstdint>

#include "ecx/common/copy.h"

namespace ecx::connector {
namespace {

constexpr size_t kLine = 64;

// `ranges` cut into pieces of about `piece` bytes; every cut is on a 64-byte boundary of
// the destination, so that streaming stores fill whole lines.
std::vector<CopyCrew::Range> cut(std::span<const CopyCrew::Range> ranges, size_t piece) {
  std::vector<CopyCrew::Range> pieces;
  for (const CopyCrew::Range& r : ranges) {
    size_t done = 0;
    while (done < r.length) {
      size_t n = std::min(piece, r.length - done);
      if (done + n < r.length) {
        const auto end = reinterpret_cast<uintptr_t>(r.dst + done + n);
        n -= end % kLine;
      }
      pieces.push_back({r.dst + done, r.src + done, n});
      done += n;
    }
  }
  return pieces;
}

// The cores this process may run on (its affinity: a container's cpuset, taskset), which
// can be fewer than the machine's.
int usable_cores() {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (::sched_getaffinity(0, sizeof allowed, &allowed) == 0 && CPU_COUNT(&allowed) > 0) {
    return CPU_COUNT(&allowed);
  }
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

}  // namespace

CopyCrew::CopyCrew(int threads)
    : helpers_wanted_(std::max(0, std::min(threads, usable_cores()) - 1)) {}

CopyCrew::~CopyCrew() {
  std::vector<std::thread> helpers;
  {
    MutexLock lock(&mu_);
    stop_ = true;
    helpers.swap(helpers_);
  }
  cv_.notify_all();
  for (auto& t : helpers) t.join();
}

void CopyCrew::run_pieces(Batch& batch) {
  for (size_t i = batch.next.fetch_add(1); i < batch.pieces.size(); i = batch.next.fetch_add(1)) {
    const Range& p = batch.pieces[i];
    copy_streaming(p.dst, p.src, p.length);  // ends with its stores fenced
    if (batch.finished.fetch_add(1, std::memory_order_acq_rel) + 1 == batch.pieces.size()) {
      batch.finished.notify_all();
    }
  }
}

void CopyCrew::start_helpers() {
  for (int i = 0; i < helpers_wanted_; ++i) helpers_.emplace_back([this] { helper_loop(); });
}

void CopyCrew::keep_helpers_off(int cpu) {
  if (cpu < 0 || cpu == helpers_off_cpu_) return;
  helpers_off_cpu_ = cpu;
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (::pthread_getaffinity_np(::pthread_self(), sizeof allowed, &allowed) != 0) return;
  if (!CPU_ISSET(cpu, &allowed) || CPU_COUNT(&allowed) < 2) return;
  CPU_CLR(cpu, &allowed);
  for (auto& helper : helpers_) {
    ::pthread_setaffinity_np(helper.native_handle(), sizeof allowed, &allowed);  // a hint
  }
}

void CopyCrew::helper_loop() {
  uint64_t seen = 0;
  while (true) {
    std::shared_ptr<Batch> batch;
    {
      MutexLock lock(&mu_);
      cv_.wait(&mu_, [&]() ECX_REQUIRES(mu_) { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      batch = current_;
    }
    run_pieces(*batch);  // a batch finished already has no piece left to take
  }
}

void CopyCrew::copy(std::span<const Range> ranges) {
  size_t total = 0;
  for (const Range& r : ranges) total += r.length;
  auto alone = [&] {
    for (const Range& r : ranges) copy_streaming(r.dst, r.src, r.length);
  };
  if (helpers_wanted_ == 0 || total < kSplitMin) return alone();
  if (!busy_.try_lock()) return alone();
  try {
    share(ranges);
  } catch (...) {  // no helper could start, or no memory for the pieces: nothing is shared
    busy_.unlock();
    throw;
  }
  busy_.unlock();
}

void CopyCrew::share(std::span<const Range> ranges) {
  auto batch = std::make_shared<Batch>();
  batch->pieces = cut(ranges, kPieceBytes);
  {
    MutexLock lock(&mu_);
    if (helpers_.empty()) start_helpers();
    current_ = batch;
    ++generation_;
    keep_helpers_off(::sched_getcpu());
  }
  cv_.notify_all();
  run_pieces(*batch);
  // The helpers' last pieces: each is a bounded local copy.
  const size_t n = batch->pieces.size();
  for (size_t done = batch->finished.load(std::memory_order_acquire); done != n;
       done = batch->finished.load(std::memory_order_acquire)) {
    batch->finished.wait(done, std::memory_order_acquire);
  }
}

}  // namespace ecx::connector
