// shm backend: a same-host peer's memfd arenas, mapped into this process on first use
// (the fd arrives once over the unix control socket). READ and WRITE are memcpy.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>

#include "ecx/transfer/agent.h"
#include "transfer/connection.h"
#include "transfer/stats_counters.h"

namespace ecx::transfer {

class ShmPeer {
 public:
  ShmPeer(ControlChannel* control, StatsCounters* stats) : control_(control), stats_(stats) {}

  // Copies every descriptor; validates all of them before the first byte moves.
  Status read(std::span<const TransferDescriptor> descriptors, Deadline deadline);
  Status write(std::span<const TransferDescriptor> descriptors, Deadline deadline);
  Result<RemoteView> view(uint32_t region, uint64_t offset, uint64_t length, Deadline deadline);

 private:
  struct Mapping {
    std::byte* data = nullptr;
    uint64_t length = 0;
    bool writable = false;
    bool readable = false;
    ~Mapping();
  };
  Result<std::shared_ptr<Mapping>> mapping(uint32_t region, Deadline deadline);
  // Resolves and range-checks each descriptor against the peer's mappings.
  Result<std::vector<std::shared_ptr<Mapping>>> resolve(
      std::span<const TransferDescriptor> descriptors, bool write, Deadline deadline);

  ControlChannel* const control_;
  StatsCounters* const stats_;
  std::mutex mu_;
  std::map<uint32_t, std::shared_ptr<Mapping>> mappings_;  // guarded by mu_
};

}  // namespace ecx::transfer
