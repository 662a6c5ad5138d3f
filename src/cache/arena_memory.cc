#include "cache/arena_memory.h"

#include <cstring>
#include <vector>

#include "ecx/common/checksum.h"
#include "ecx/transfer/cuda_memory.h"

namespace ecx::cache {

namespace cuda = transfer::cuda;

Result<std::unique_ptr<ArenaMemory>> ArenaMemory::create(transfer::Agent* agent,
                                                         const PoolConfig& config) {
  transfer::RegionAccess access{.remote_read = true,
                                .remote_write = config.remote_write,
                                .require_grant = config.require_grant};
  std::unique_ptr<ArenaMemory> arena(new ArenaMemory(agent, config.memory));
  if (config.memory == transfer::MemoryKind::kHost) {
    ECX_ASSIGN_OR_RETURN(arena->region_, agent->allocate(config.capacity_bytes, access));
    return arena;
  }
  auto what = [&] { return "pool " + config.name + " in CUDA memory"; };
  // The agent's refusal (no ucx, a UCX without CUDA) comes before any device memory.
  if (!agent->config().ucx.enable) {
    return Status(StatusCode::kFailedPrecondition,
                  what() + ": CUDA memory is reached only through the ucx backend, which agent " +
                      agent->name() + " does not enable (AgentConfig::ucx.enable)");
  }
  if (Status gpu = cuda::available(); !gpu.ok()) return gpu.with_context(what());
  auto device = cuda::device_alloc(config.capacity_bytes);
  if (!device.ok()) return device.status().with_context(what());
  arena->device_ = *device;
  // Zeroed like a host arena: no stale bytes look like a block header.
  ECX_RETURN_IF_ERROR(cuda::fill(arena->device_, 0, config.capacity_bytes));
  auto region = agent->register_memory(arena->device_, config.capacity_bytes,
                                       transfer::MemoryKind::kCuda, access);
  if (!region.ok()) return region.status().with_context(what());
  arena->region_ = *region;
  return arena;
}

ArenaMemory::~ArenaMemory() {
  if (region_.id != 0) agent_->deregister(region_.id).ignore_error();
  cuda::device_free(device_);
}

Status ArenaMemory::write(uint64_t offset, const void* src, uint64_t length) {
  if (kind_ == transfer::MemoryKind::kHost) {
    std::memcpy(region_.data + offset, src, length);
    return Status::Ok();
  }
  return cuda::copy(region_.data + offset, src, length);
}

Status ArenaMemory::read(uint64_t offset, void* dst, uint64_t length) const {
  if (kind_ == transfer::MemoryKind::kHost) {
    std::memcpy(dst, region_.data + offset, length);
    return Status::Ok();
  }
  return cuda::copy(dst, region_.data + offset, length);
}

Result<uint64_t> ArenaMemory::checksum(uint64_t offset, uint64_t length) const {
  if (kind_ == transfer::MemoryKind::kHost) return checksum64(region_.data + offset, length);
  std::vector<std::byte> host(length);
  ECX_RETURN_IF_ERROR(cuda::copy(host.data(), region_.data + offset, length));
  return checksum64(host.data(), length);
}

}  // namespace ecx::cache
