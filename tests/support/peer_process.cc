#include "support/peer_process.h"

#include <cstdlib>

#include "ecx/common/checksum.h"

namespace ecx::testing {

std::string ecx_binary() {
  const char* moved = std::getenv("ECX_TEST_BINARY");
  return moved != nullptr && *moved != '\0' ? moved : ECX_BINARY;
}

bench::TransferPeerOptions peer_options() {
  return {.name = "peer", .region_bytes = 64ull << 20, .seed = 99};
}

bench::TransferPeerOptions peer_options(const BackendCase& backend) {
  auto options = peer_options();
  if (backend.ucx()) options.ucx = backend.ucx_tls.empty() ? "default" : backend.ucx_tls;
  return options;
}

Result<PeerProcess> PeerProcess::start(const bench::TransferPeerOptions& o,
                                       const PeerFaults& faults) {
  std::vector<std::string> argv = bench::transfer_peer_command(ecx_binary(), o);
  if (faults.stall_read_after_bytes > 0) {
    // The same producer flags, without `ecx bench transfer-peer`.
    argv.erase(argv.begin(), argv.begin() + 3);
    argv.insert(argv.begin(), {ECX_FAULT_PEER, "--stall-read-after-bytes",
                               std::to_string(faults.stall_read_after_bytes)});
  }
  ECX_ASSIGN_OR_RETURN(Subprocess child, Subprocess::spawn(argv));
  PeerProcess peer(std::move(child));
  ECX_ASSIGN_OR_RETURN(std::string line, peer.process_.read_line(Deadline::after_ms(30000)));
  auto ready = nlohmann::json::parse(line, nullptr, false);
  if (ready.is_discarded()) return Internal("peer printed no JSON: " + line);
  ECX_ASSIGN_OR_RETURN(peer.metadata_,
                       transfer::AgentMetadata::parse(ready["metadata"].get<std::string>()));
  peer.source_region_ = ready["source_region"];
  peer.sink_region_ = ready["sink_region"];
  peer.expected_.resize(o.region_bytes);
  fill_pattern(peer.expected_.data(), peer.expected_.size(), o.seed);
  return peer;
}

transfer::AgentConfig local_config(const std::string& name) {
  transfer::AgentConfig c;
  c.name = name;
  c.tcp_slice_bytes = 1 << 20;  // small slices: many slices and streams even in tests
  c.tcp_streams = 3;
  return c;
}

}  // namespace ecx::testing
