// EncoderCachePool: encoder outputs keyed by mm_hash, in one arena registered with the
// transfer agent, so peers can READ (or WRITE) blocks one-sidedly.
//
// Entry states: writing -> ready -> (pinned by N readers) -> evictable (ready, no pins).
// Only ready, unpinned entries are evicted, least recently used first. A pin ends by
// unpin() (the reader's RELEASE), by release_holder() (the reader went away) or when its
// lease expires. Thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "ecx/cache/block_header.h"
#include "ecx/common/deadline.h"
#include "ecx/common/mm_hash.h"
#include "ecx/common/status.h"
#include "ecx/common/tensor_meta.h"
#include "ecx/transfer/agent.h"

namespace ecx::cache {

struct PoolConfig {
  std::string name = "pool";
  uint64_t capacity_bytes = 1ull << 30;
  std::chrono::milliseconds lease{30000};  // default pin lease
  bool remote_write = false;               // peers may WRITE into the arena (push receivers)
  // Peers reach blocks only through grants (pin_for_peer; RegionAccess::require_grant):
  // a peer cannot read, or map, what it was not handed.
  bool require_grant = false;
  // Most live pins one peer (pin_for_peer's holder) may hold; more are refused with
  // kResourceExhausted. Pins handed out in params (no holder) may number 16 times this.
  size_t max_pins_per_holder = 4096;
  // Where the arena lives. kCuda: CUDA device memory of this process's current device,
  // registered as MemoryKind::kCuda, so peers reach it over ucx only (the agent needs
  // ucx.enable with a UCX that has CUDA support, e.g. library "wheel"). The pool writes
  // block headers and computes payload checksums through host copies (docs/GPU.md).
  transfer::MemoryKind memory = transfer::MemoryKind::kHost;
};

// Where an entry's block lives. `block` points into this process's arena: in a pool in
// CUDA memory (PoolConfig::memory) it is a device address, for CUDA copies and kernels,
// never for the CPU.
struct BlockRef {
  MmHash mm_hash;
  TensorMeta meta;
  uint32_t region = 0;
  uint64_t offset = 0;        // of the block (header first) in the region
  uint64_t block_length = 0;  // header + payload (not rounded)
  uint64_t generation = 0;
  std::byte* block = nullptr;

  std::byte* payload() const { return block + kBlockHeaderBytes; }
  uint64_t payload_length() const { return block_length - kBlockHeaderBytes; }
};

struct Pin {
  BlockRef ref;
  uint64_t pin_id = 0;
  // Set by pin_for_peer: lets its holder READ the block, find it by key and release the
  // pin. Revoked when the pin ends.
  transfer::Capability capability;
};

struct PoolStats {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;     // bytes of allocated blocks
  uint64_t payload_bytes = 0;  // payload bytes they hold
  uint64_t entries = 0;
  uint64_t writing_entries = 0;
  uint64_t pinned_entries = 0;
  uint64_t pins = 0;
  uint64_t evictions = 0;
  uint64_t lease_expiries = 0;
  uint64_t hits = 0;
  uint64_t misses = 0;
  // used_bytes / payload_bytes (1.0 when empty): the cost of headers and alignment.
  double bytes_used_per_payload_byte = 1.0;
};

class EncoderCachePool {
 public:
  // Allocates the arena from `agent` (which must outlive the pool).
  static Result<std::unique_ptr<EncoderCachePool>> create(transfer::Agent* agent,
                                                          PoolConfig config);
  ~EncoderCachePool();

  uint32_t region_id() const;
  const std::string& name() const;

  // Reserves a block for a new entry (state writing), evicting LRU unpinned ready entries
  // if the arena is full. kAlreadyExists if the mm_hash has an entry; kResourceExhausted
  // if pinned and writing entries leave no room.
  //
  // With `room_deadline`, waits (until then) for pins to end when everything else is
  // pinned, instead of failing at once: backpressure for producers.
  // With `pin_holder`, the entry is pinned for that holder from the start (Pin::pin_id).
  Result<BlockRef> reserve(const MmHash& mm_hash, const TensorMeta& meta,
                           Deadline room_deadline = Deadline::after_ms(0));
  Result<Pin> reserve_pinned(const MmHash& mm_hash, const TensorMeta& meta,
                             const std::string& pin_holder,
                             Deadline room_deadline = Deadline::after_ms(0));
  // Computes the payload checksum, writes the header, marks the entry ready.
  Status commit(const MmHash& mm_hash, uint64_t generation);
  // For blocks filled by a peer (header + payload): verifies them against `expected`
  // (mm_hash, meta, the producer's generation, checksum), then re-stamps the header with
  // this pool's generation and marks the entry ready. On failure the entry is dropped.
  // `payload_checksum`: see verify_block.
  Status commit_received(const MmHash& mm_hash, uint64_t generation,
                         const BlockExpectation& expected,
                         std::optional<uint64_t> payload_checksum = std::nullopt);
  // Drops an entry that is still being written (a failed load).
  void abort(const MmHash& mm_hash, uint64_t generation);
  // reserve + copy + commit (`payload` is host memory, in either kind of pool).
  Result<BlockRef> put(const MmHash& mm_hash, const TensorMeta& meta,
                       std::span<const std::byte> payload);

  // The ready entry for mm_hash: kNotFound ("missing") or kNotReady. Marks it recently used.
  Result<BlockRef> find(const MmHash& mm_hash);
  // Waits until the entry is ready. kNotFound at once if there is none; kNotReady at the
  // deadline if it is still being written.
  Result<BlockRef> wait_ready(const MmHash& mm_hash, Deadline deadline);

  // Pins a ready entry for `holder` for `lease` (default: the pool's).
  Result<Pin> pin(const MmHash& mm_hash, const std::string& holder,
                  std::optional<std::chrono::milliseconds> lease = std::nullopt);
  // Pins a ready entry for a peer and grants that peer READ of its block: the pin's
  // capability. `peer` empty: whoever presents the capability (params handed out through
  // the proxy); else only the agent of that name.
  Result<Pin> pin_for_peer(const MmHash& mm_hash, const std::string& peer,
                           std::optional<std::chrono::milliseconds> lease = std::nullopt);
  // As pin_for_peer with `peer` empty (a bearer capability: params), but counted against
  // `quota_holder`'s quota of max_pins_per_holder, not against the params' own: params
  // one agent asks this pool's owner for cannot use up the quota of those it issues
  // itself, nor another agent's.
  Result<Pin> pin_for_bearer(const MmHash& mm_hash, const std::string& quota_holder,
                             std::optional<std::chrono::milliseconds> lease = std::nullopt);
  // The quota holder for params `agent` asks this pool's owner for (pin_for_bearer): each
  // such agent has the params' quota, counted apart from the others'.
  static std::string params_quota_holder(const std::string& agent);
  // The pin whose capability is `capability`, if it is a live pin of `mm_hash`: how a
  // peer proves it was handed an entry before it may look it up by key.
  Result<Pin> pin_of_capability(const MmHash& mm_hash, const transfer::Capability& capability);
  // Ends one pin. kNotFound if it already ended (released, expired).
  Status unpin(uint64_t pin_id);
  // A peer's RELEASE: ends the pin only if `capability` is the one it was granted with.
  // kNotFound otherwise (an unknown pin and a wrong capability look the same).
  Status release_granted(uint64_t pin_id, const transfer::Capability& capability);
  // A peer's RENEW: the pin's lease starts again (the pool's lease), only if `capability`
  // is the one it was granted with; the pin is `peer`'s from then on, within its quota
  // (kResourceExhausted beyond it; the pin then keeps its old lease end).
  Status renew_granted(uint64_t pin_id, const transfer::Capability& capability,
                       const std::string& peer);
  // Ends every pin of `holder`; returns how many.
  size_t release_holder(const std::string& holder);
  // Removes an unpinned entry. kFailedPrecondition if pinned.
  Status erase(const MmHash& mm_hash);

  PoolStats stats() const;
  // Waits until no entry is pinned (leases expire meanwhile). For drains and tests.
  Status wait_unpinned(Deadline deadline);

 private:
  class Impl;
  explicit EncoderCachePool(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ecx::cache
