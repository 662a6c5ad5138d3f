// Splits one load's same-host copies between the caller's thread and helper threads.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include "ecx/common/mutex.h"

namespace ecx::connector {

// A crew of `threads` copiers, the calling thread included: copy() cuts its ranges into
// pieces the crew takes in turn. Helpers start on the first copy that needs them and park
// between copies. One copy at a time uses the helpers; a copy that finds them busy (another
// load's) is done by its caller alone. The helpers run on the cores the calling thread may
// use, except the one it is on: woken onto the caller's own core, a helper would share it
// with the caller while another core idles (which took a 3-item copy from 230 to 430 us).
class CopyCrew {
 public:
  struct Range {
    std::byte* dst;
    const std::byte* src;
    size_t length;
  };

  // Below this many bytes in all, a copy is the caller's alone: a helper's wake-up costs
  // more than it would copy meanwhile.
  static constexpr size_t kSplitMin = 1 << 20;
  // Ranges are cut into pieces of about this size (64-byte multiples), so that helpers
  // that wake late still find work and the crew ends together.
  static constexpr size_t kPieceBytes = 256 << 10;

  // `threads`, at most one per core this process may run on.
  explicit CopyCrew(int threads);
  ~CopyCrew();
  CopyCrew(const CopyCrew&) = delete;
  CopyCrew& operator=(const CopyCrew&) = delete;

  // Copies every range (copy_streaming) and returns once all of it has landed and is
  // visible to this thread. The work is local memory only: it always ends, so it has no
  // deadline.
  void copy(std::span<const Range> ranges) ECX_EXCLUDES(busy_, mu_);

 private:
  struct Batch {
    std::vector<Range> pieces;
    std::atomic<size_t> next{0};
    std::atomic<size_t> finished{0};
  };

  static void run_pieces(Batch& batch);
  // copy() with the helpers, once it holds them.
  void share(std::span<const Range> ranges) ECX_REQUIRES(busy_) ECX_EXCLUDES(mu_);
  void start_helpers() ECX_REQUIRES(mu_);
  // Restricts the helpers to the caller's allowed cores but `cpu` (when it has others).
  void keep_helpers_off(int cpu) ECX_REQUIRES(mu_);
  void helper_loop() ECX_EXCLUDES(mu_);

  const int helpers_wanted_;
  Mutex busy_;  // held by the copy that has the helpers
  Mutex mu_;
  CondVar cv_;
  std::shared_ptr<Batch> current_ ECX_GUARDED_BY(mu_);
  uint64_t generation_ ECX_GUARDED_BY(mu_) = 0;
  bool stop_ ECX_GUARDED_BY(mu_) = false;
  int helpers_off_cpu_ ECX_GUARDED_BY(mu_) = -1;  // the core keep_helpers_off last kept them off
  std::vector<std::thread> helpers_ ECX_GUARDED_BY(mu_);
};

}  // namespace ecx::connector
