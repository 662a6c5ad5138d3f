// The bytes of an encoder cache pool's arena: host memory (an agent arena, which the CPU
// reads and writes in place) or CUDA device memory (PoolConfig::memory = kCuda), where
// every CPU access (block headers, checksums) is a copy through ecx/transfer/cuda_memory.h.
#pragma once

#include <cstdint>
#include <memory>

#include "ecx/cache/encoder_cache_pool.h"
#include "ecx/common/status.h"
#include "ecx/transfer/agent.h"

namespace ecx::cache {

class ArenaMemory {
 public:
  // Allocates `config.capacity_bytes` of `config.memory` and registers it with `agent`
  // (kCuda: device memory registered as MemoryKind::kCuda, which needs the agent's ucx
  // backend with CUDA support; errors say which is missing).
  static Result<std::unique_ptr<ArenaMemory>> create(transfer::Agent* agent,
                                                     const PoolConfig& config);
  // Deregisters the region, then frees device memory.
  ~ArenaMemory();
  ArenaMemory(const ArenaMemory&) = delete;
  ArenaMemory& operator=(const ArenaMemory&) = delete;

  const transfer::LocalRegion& region() const { return region_; }
  transfer::MemoryKind kind() const { return kind_; }

  // Copies between the arena at `offset` and host memory.
  // REQUIRES: [offset, offset + length) inside the arena.
  Status write(uint64_t offset, const void* src, uint64_t length);
  Status read(uint64_t offset, void* dst, uint64_t length) const;
  // xxh3 of arena bytes (device bytes are hashed from a host copy).
  Result<uint64_t> checksum(uint64_t offset, uint64_t length) const;

 private:
  ArenaMemory(transfer::Agent* agent, transfer::MemoryKind kind) : agent_(agent), kind_(kind) {}

  transfer::Agent* const agent_;
  const transfer::MemoryKind kind_;
  transfer::LocalRegion region_;
  void* device_ = nullptr;  // kCuda: the allocation, freed after deregistration
};

}  // namespace ecx::cache
