// Test-only fault injection, kept out of the public AgentConfig. Tests and the test
// peer process (`ecx transfer-peer --fault-...`) use it to make an agent misbehave.
#pragma once

#include <cstdint>

#include "ecx/transfer/agent.h"

namespace ecx::transfer {

struct TestFaults {
  // The server stops sending READ data after this many bytes of one reply (and holds
  // the connection open), like a peer that hangs mid-transfer. 0: off.
  uint64_t stall_read_after_bytes = 0;
};

// Sets `agent`'s faults (an agent made by Agent::create); they apply to later requests.
void set_test_faults(Agent& agent, const TestFaults& faults);

}  // namespace ecx::transfer
