// A producer agent in a separate process (`ecx bench transfer-peer`), for tests that
// need a real peer: it can be killed, and its memory is not ours.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ecx/common/subprocess.h"
#include "ecx/transfer/agent.h"
#include "support/backend_cases.h"
#include "transfer_peer.h"

namespace ecx::testing {

// The ecx binary that peers run: $ECX_TEST_BINARY when set (test binaries moved to
// another machine, scripts/gpu-check), else the one built beside the tests.
std::string ecx_binary();

// A test's peer: the bench producer, named "peer", with a 64 MiB source region.
bench::TransferPeerOptions peer_options();
// The same, with `backend`'s ucx settings (the peer enables ucx for ucx cases).
bench::TransferPeerOptions peer_options(const BackendCase& backend);

// How a peer misbehaves on purpose: any fault set starts the test binary ecx_fault_peer
// (tests/support/fault_peer_main.cc) in place of `ecx bench transfer-peer`.
struct PeerFaults {
  // Sends this many bytes of a longer READ reply, then hangs. 0: off.
  uint64_t stall_read_after_bytes = 0;
};

class PeerProcess {
 public:
  // Starts the process and waits (with a deadline) for its ready line.
  static Result<PeerProcess> start(const bench::TransferPeerOptions& options = peer_options(),
                                   const PeerFaults& faults = {});

  const transfer::AgentMetadata& metadata() const { return metadata_; }
  uint32_t source_region() const { return source_region_; }
  uint32_t sink_region() const { return sink_region_; }
  Subprocess& process() { return process_; }
  // The bytes of the peer's source region (the same pattern it filled).
  const std::vector<std::byte>& expected() const { return expected_; }

 private:
  PeerProcess(Subprocess p) : process_(std::move(p)) {}
  Subprocess process_;
  transfer::AgentMetadata metadata_;
  uint32_t source_region_ = 0;
  uint32_t sink_region_ = 0;
  std::vector<std::byte> expected_;
};

// An agent config for the test's own side.
transfer::AgentConfig local_config(const std::string& name);

}  // namespace ecx::testing
