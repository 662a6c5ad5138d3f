// shm backend: a same-host peer's memfd arenas, mapped read-only into this process on
// first use (the fd arrives once over the unix control socket, and is mapped only if it
// is sealed against shrinking and writing). READ is a memcpy; WRITEs to a same-host peer
// go over a unix data stream (the agent's), so no peer ever maps another's memory
// writable.
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
  Result<RemoteView> view(uint32_t region, uint64_t offset, uint64_t length,
                          const Capability& capability, Deadline deadline);

 private:
  struct Mapping {
    std::byte* data = nullptr;
    uint64_t length = 0;
    bool readable = false;
    ~Mapping();
  };
  Result<std::shared_ptr<Mapping>> mapping(uint32_t region, const Capability& capability,
                                           Deadline deadline);
  // Resolves and range-checks each descriptor against the peer's mappings.
  Result<std::vector<std::shared_ptr<Mapping>>> resolve(
      std::span<const TransferDescriptor> descriptors, Deadline deadline);

  ControlChannel* const control_;
  StatsCounters* const stats_;
  std::mutex mu_;
  std::map<uint32_t, std::shared_ptr<Mapping>> mappings_;  // guarded by mu_
};

}  // namespace ecx::transfer
