// Connector-level part of `ecx bench transfer --connectors ...`: per-request load
// latency for a request of N items (default 3 x 1600 KiB, the seed's request), through
// each connector, producer in its own process.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace ecx::bench {

struct ConnectorBenchOptions {
  std::string connectors;  // "p2p:pull,p2p:pull-2step,p2p:push,disk,store"
  int items = 3;
  uint64_t item_bytes = 1600 * 1024;
  int requests = 50;
  std::string redis = "127.0.0.1:6379";
  std::string backend = "auto";
  // "on": a deployment secret (authenticated agents, signed params) and grant checks;
  // "off": neither. "on,off" measures both, alternated, `rounds` times in one run.
  std::string security = "on";
  int rounds = 1;
  // Before each timed load the consumer writes a scratch buffer of 8x this machine's
  // last-level cache, so every load starts with the same cold caches whatever the item
  // size (without it, a small item's load finds the connector's code and data still
  // cached, a large one's after the bench's own byte check evicted them).
  bool cold_cache = false;
  // The producer in this network namespace (ip netns exec), its agent on `peer_host`,
  // the consumer's on `consumer_host` (transfer_bench.cc resolves both). Needs security
  // on: an agent without a secret listens on loopback only.
  std::string peer_netns;
  std::string peer_host;
  std::string consumer_host;
};

struct ConnectorRow {
  std::string connector;
  std::string security = "on";
  bool cold_cache = false;
  int round = 0;
  int items = 0;
  uint64_t item_bytes = 0;
  int requests = 0;
  double p50_us = 0, p99_us = 0, mean_us = 0, gbps = 0;
  double control_rtts_per_item = 0;
  double bytes_used_per_payload_byte = 0;  // producer pool (p2p), 0 where there is none
  std::vector<double> samples_us;          // each timed load, in order (JSON only)
  std::string error;                       // set when the row could not be measured
};

// Runs every connector; rows with `error` set were skipped (e.g. Redis unreachable).
std::vector<ConnectorRow> run_connector_bench(const ConnectorBenchOptions& options,
                                              const std::string& self_exe);
void print_connector_rows(const std::vector<ConnectorRow>& rows);
nlohmann::json connector_rows_json(const std::vector<ConnectorRow>& rows);

}  // namespace ecx::bench
