// Host buffers for copies that outlive their source (a PD worker's copy of a loaded item
// into vLLM's encoder cache), kept warm between uses.
//
// A fresh allocation of a few MiB comes from the kernel as untouched pages: the copy into
// it faults on every 4 KiB page (a 1600 KiB item, 400 faults: 1.6 ms on this machine's VM,
// against 0.06 ms into memory already touched). A buffer given back here is kept for the
// next copy of its size class instead, up to `idle_cap` bytes held idle: past that, the
// buffers idle longest go back to the allocator (sizes no longer asked for do not hold
// the cap).
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>

#include "ecx/common/mutex.h"

namespace ecx {

class RecycledBuffers : public std::enable_shared_from_this<RecycledBuffers> {
 public:
  struct Stats {
    uint64_t reused = 0;      // takes served by a buffer given back earlier
    uint64_t allocated = 0;   // takes that allocated (none idle of the size)
    uint64_t released = 0;    // buffers given back to the allocator (idle_cap)
    uint64_t idle_bytes = 0;  // held now for the next takes
  };

  // Shared: each buffer taken holds the pool only weakly (a buffer that outlives it is freed).
  static std::shared_ptr<RecycledBuffers> create(uint64_t idle_cap);
  ~RecycledBuffers();  // frees what is idle
  RecycledBuffers(const RecycledBuffers&) = delete;
  RecycledBuffers& operator=(const RecycledBuffers&) = delete;

  // A buffer of at least `length` bytes (64-byte aligned, its contents whatever its last
  // user left); it comes back here when the last copy of the pointer is gone, from any
  // thread. `length` 0 gives a null pointer; over 2^62 bytes throws std::bad_alloc.
  std::shared_ptr<std::byte> take(uint64_t length);

  Stats stats() const;
  uint64_t idle_cap() const { return idle_cap_; }

  // The size a take of `length` bytes allocates: `length` rounded up to an eighth of its
  // power of two, or to 4 KiB if that is more, so items of nearby sizes share buffers.
  static uint64_t size_class(uint64_t length);

 private:
  explicit RecycledBuffers(uint64_t idle_cap) : idle_cap_(idle_cap) {}
  void give_back(std::byte* data, uint64_t size);

  struct Idle {
    uint64_t size;
    std::byte* data;
  };
  using IdleList = std::list<Idle>;

  const uint64_t idle_cap_;
  mutable Mutex mu_;
  IdleList idle_ ECX_GUARDED_BY(mu_);  // the longest idle first
  std::multimap<uint64_t, IdleList::iterator> by_size_ ECX_GUARDED_BY(mu_);
  Stats stats_ ECX_GUARDED_BY(mu_);
};

}  // namespace ecx
