#include "support/peer_process.h"

#include "ecx/common/checksum.h"

namespace ecx::testing {

Result<PeerProcess> PeerProcess::start(const PeerOptions& o) {
  ECX_ASSIGN_OR_RETURN(
      Subprocess child,
      Subprocess::spawn({ECX_BINARY, "bench", "transfer-peer", "--name", o.name, "--compat-hash",
                         o.compat_hash, "--region-bytes", std::to_string(o.region_bytes), "--seed",
                         std::to_string(o.seed), "--fault-stall-read-after-bytes",
                         std::to_string(o.stall_read_after_bytes)}));
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
