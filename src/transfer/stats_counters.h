// Atomic counters behind AgentStats, shared by an agent's server and backends.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>

#include "ecx/transfer/types.h"

namespace ecx::transfer {

// A latency histogram kept with atomics: one count per bucket, so an observation is two
// relaxed increments and an add, taken on the thread that ends a batch.
class LatencyCounters {
 public:
  static constexpr auto kBounds = kLatencyBounds;

  void observe(std::chrono::steady_clock::duration elapsed) {
    const double seconds = std::chrono::duration<double>(elapsed).count();
    size_t i = 0;
    while (i < kBounds.size() && seconds > kBounds[i]) ++i;
    counts_[i].fetch_add(1, std::memory_order_relaxed);  // [kBounds.size()]: over the last
    sum_ns_.fetch_add(static_cast<uint64_t>(
                          std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed).count()),
                      std::memory_order_relaxed);
  }

  LatencyHistogram snapshot() const {
    LatencyHistogram h;
    h.bounds.assign(kBounds.begin(), kBounds.end());
    uint64_t running = 0;
    for (size_t i = 0; i < kBounds.size(); ++i) {
      running += counts_[i].load(std::memory_order_relaxed);
      h.cumulative.push_back(running);
    }
    h.count = running + counts_[kBounds.size()].load(std::memory_order_relaxed);
    h.sum_seconds = static_cast<double>(sum_ns_.load(std::memory_order_relaxed)) * 1e-9;
    return h;
  }

 private:
  std::array<std::atomic<uint64_t>, kBounds.size() + 1> counts_{};
  std::atomic<uint64_t> sum_ns_{0};
};

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
  LatencyCounters read_seconds, write_seconds;

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
    s.read_seconds = read_seconds.snapshot();
    s.write_seconds = write_seconds.snapshot();
    return s;
  }
};

}  // namespace ecx::transfer
