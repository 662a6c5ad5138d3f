// Atomic counters behind AgentStats, shared by an agent's server and backends.
#pragma once

#include <atomic>
#include <cstdint>

#include "ecx/transfer/types.h"

namespace ecx::transfer {

struct StatsCounters {
  std::atomic<uint64_t> bytes_read{0};
  std::atomic<uint64_t> bytes_written{0};
  std::atomic<uint64_t> transfers_completed{0};
  std::atomic<uint64_t> transfers_failed{0};
  std::atomic<uint64_t> rejected_requests{0};
  std::atomic<uint64_t> rejected_descriptors{0};
  std::atomic<uint64_t> handshakes_rejected{0};
  std::atomic<uint64_t> connections_refused{0};
  std::atomic<uint64_t> peers_connected{0};
  std::atomic<uint64_t> peer_failures{0};
  std::atomic<uint64_t> notifications_received{0};

  AgentStats snapshot() const {
    AgentStats s;
    s.bytes_read = bytes_read.load();
    s.bytes_written = bytes_written.load();
    s.transfers_completed = transfers_completed.load();
    s.transfers_failed = transfers_failed.load();
    s.rejected_requests = rejected_requests.load();
    s.rejected_descriptors = rejected_descriptors.load();
    s.handshakes_rejected = handshakes_rejected.load();
    s.connections_refused = connections_refused.load();
    s.peers_connected = peers_connected.load();
    s.peer_failures = peer_failures.load();
    s.notifications_received = notifications_received.load();
    return s;
  }
};

}  // namespace ecx::transfer
