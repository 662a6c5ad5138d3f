// Host buffers for copies that outlive their source (a PD worker's copy of a loaded item
// into vLLM's encoder cache), kept warm between uses.
//
// A fresh allocation of a few MiB comes from the kernel as untouched pages: the copy into
// it faults on every 4 KiB page (a 1600 KiB item, 400 faults: about 1 ms on this machine's
// VM, against 0.1 ms into memory already touched). A buffer given back here is kept for the
// next copy of a similar size instead, up to `idle_cap` bytes held idle; past that it goes
// back to the allocator.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "ecx/common/mutex.h"

namespace ecx {

class RecycledBuffers : public std::enable_shared_from_this<RecycledBuffers> {
 public:
  struct Stats {
    uint64_t reused = 0;      // takes served by a buffer given back earlier
    uint64_t allocated = 0;   // takes that allocated (none idle of the size)
    uint64_t released = 0;    // buffers given back to the allocator (past idle_cap)
    uint64_t idle_bytes = 0;  // held now for the next takes
  };

  // Shared: each buffer taken holds the pool only weakly (a buffer that outlives it is freed).
  static std::shared_ptr<RecycledBuffers> create(uint64_t idle_cap);
  ~RecycledBuffers();  // frees what is idle
  RecycledBuffers(const RecycledBuffers&) = delete;
  RecycledBuffers& operator=(const RecycledBuffers&) = delete;

  // A buffer of at least `length` bytes (64-byte aligned, its contents whatever its last
  // user left); it comes back here when the last copy of the pointer is gone, from any
  // thread. `length` 0 gives a null pointer.
  std::shared_ptr<std::byte> take(uint64_t length);

  Stats stats() const;
  uint64_t idle_cap() const { return idle_cap_; }

  // The size a take of `length` bytes allocates: `length` rounded up to an eighth of its
  // power of two, or to 4 KiB if that is more, so items of nearby sizes share buffers.
  static uint64_t size_class(uint64_t length);

 private:
  explicit RecycledBuffers(uint64_t idle_cap) : idle_cap_(idle_cap) {}
  void give_back(std::byte* data, uint64_t size);

  const uint64_t idle_cap_;
  mutable Mutex mu_;
  std::map<uint64_t, std::vector<std::byte*>> idle_ ECX_GUARDED_BY(mu_);  // by size class
  Stats stats_ ECX_GUARDED_BY(mu_);
};

}  // namespace ecx
