// Value types of the transfer layer: memory kinds, backends, descriptors, stats.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "ecx/common/status.h"

namespace ecx::transfer {

enum class MemoryKind : uint8_t { kHost = 0, kCuda = 1 };
std::string_view memory_kind_name(MemoryKind kind);

// How bytes move to a peer. kAuto picks shm on the same host, then ucx (when the agent
// enables it), then tcp.
enum class Backend : uint8_t { kAuto = 0, kShm = 1, kTcp = 2, kUcx = 3 };
std::string_view backend_name(Backend backend);
Result<Backend> parse_backend(std::string_view name);  // "auto", "shm", "tcp", "ucx"

// What a remote agent may do with a region.
struct RegionAccess {
  bool remote_read = true;
  bool remote_write = false;
  // Peers reach the region only through grants (Agent::grant): every READ or WRITE must
  // carry a capability that covers its bytes, and a same-host peer gets the region's
  // memfd only for a capability in it. Encoder cache pools set this.
  bool require_grant = false;
};

// An unguessable token (128 random bits) that lets a peer READ or WRITE one range of a
// region (Agent::grant). All zero = none.
struct Capability {
  std::array<uint8_t, 16> bytes{};

  bool empty() const;
  std::string hex() const;  // 32 lower-case hex digits
  static Result<Capability> parse_hex(std::string_view hex);
  static Capability random();
  friend bool operator==(const Capability&, const Capability&) = default;
  friend auto operator<=>(const Capability&, const Capability&) = default;
};

// A region of this process registered with the agent. Plain value: the memory stays
// valid until Agent::deregister or the agent is destroyed.
struct LocalRegion {
  uint32_t id = 0;
  std::byte* data = nullptr;
  uint64_t length = 0;
};

// One element of a batched READ or WRITE: `length` bytes between `local` (this
// process) and (`remote_region`, `remote_offset`) on the peer.
struct TransferDescriptor {
  void* local = nullptr;
  uint32_t remote_region = 0;
  uint64_t remote_offset = 0;
  uint64_t length = 0;
  Capability capability;  // needed for regions with RegionAccess::require_grant
  // READ only: the checksum64 (xxh3) of the landed bytes [digest_from, digest_from +
  // digest_length), asked of the backend, which computes it as they arrive (while they
  // are still in cache) where it can: TransferHandle::digest. 0: none asked.
  uint64_t digest_from = 0;
  uint64_t digest_length = 0;
};

// A message delivered to this agent, after any data its sender wrote before it.
struct Notification {
  std::string from;  // sender agent name
  std::string message;
};

// The bounds of an agent's latency buckets, seconds: 50 us (a same-host copy of a small
// item) to 10 s (a stalled peer's deadline).
inline constexpr std::array<double, 17> kLatencyBounds = {
    50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3,
    50e-3, 100e-3, 250e-3, 500e-3, 1,    2.5,    5,    10};

// Latencies in fixed buckets (kLatencyBounds), as Prometheus counts them: observations at or under
// each bound (cumulative; +Inf is `count`), their sum and their count.
struct LatencyHistogram {
  std::vector<double> bounds;        // seconds, ascending
  std::vector<uint64_t> cumulative;  // one per bound
  double sum_seconds = 0;
  uint64_t count = 0;
};

struct AgentStats {
  uint64_t bytes_read = 0;     // by this agent, from peers
  uint64_t bytes_written = 0;  // by this agent, to peers
  uint64_t transfers_completed = 0;
  uint64_t transfers_failed = 0;
  uint64_t rejected_requests = 0;     // served requests refused (bad region/offset/length)
  uint64_t rejected_descriptors = 0;  // local descriptors refused before sending
  uint64_t handshakes_rejected = 0;   // incompatible / bad HELLO / failed authentication
  uint64_t connections_refused = 0;   // over max_connections, or another uid on unix
  uint64_t peers_connected = 0;
  uint64_t peer_failures = 0;  // peers that died while connected
  uint64_t notifications_received = 0;
  // Connections this agent opened to peers, by the backend chosen ("shm", "tcp", "ucx").
  std::map<std::string, uint64_t> connects_by_backend;
  // Seconds from a batch's submission to its end (moved, or failed), by direction.
  LatencyHistogram read_seconds;
  LatencyHistogram write_seconds;
};

}  // namespace ecx::transfer
