// `ecx bench transfer`: the transfer engine against the limits of this machine, and
// the connectors per request (connector_bench.h). Two processes: this one (consumer)
// and a spawned `ecx bench transfer-peer` (producer), optionally in another network
// namespace (--peer-netns).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "connector_bench.h"

namespace ecx::bench {

// Its flags (transfer_commands.cc lists them with their help).
struct TransferBenchOptions {
  std::string backends = "shm,tcp";
  std::string modes = "pull,push,pull-2step";
  std::string sizes = "64KiB,1600KiB,8MiB";
  std::string batches = "1,3,16";
  int iters = 50;
  std::string json_path;
  uint64_t slice_bytes = 4ull << 20;
  int streams = 2;
  ConnectorBenchOptions connectors;
  std::string item_size = "1600KiB";
  // ucx rows: one set per UCX_TLS ("default": UCX's choice), each against ucx_perftest.
  std::vector<std::string> ucx_tls = {"tcp", "posix,cma"};
  std::string ucx_library = "system";
  std::string ucx_error_mode = "auto";
  std::string ucx_perftest = "ucx_perftest";
  // The producer in this network namespace (a test host, docs/HOSTS.md), reached over
  // tcp; the consumer listens on `tcp_host` (default: its address on the route there).
  std::string peer_netns;
  std::string tcp_host;
  bool backends_given = false;  // --backends on the command line (else tcp with a netns)
};

// Runs the whole bench; returns the exit code (2: bad flags, 1: a failure).
int run_transfer_bench(TransferBenchOptions options);

}  // namespace ecx::bench
