// UCX's own benchmark, `ucx_perftest -t ucp_get`, as the baseline of the ucx backend's
// rows in `ecx bench transfer`: the same transports (UCX_TLS), error mode, item size and
// iterations, in two processes on loopback (a server and a client, both children of the
// bench, each with a bounded lifetime).
//
// What it measures: one ucp_get of `size` bytes at a time, the client polling its
// worker (no wakeup), the server's memory allocated by UCX and never written. UCX 1.13
// does not touch that memory, so over shared memory (cma) the client reads the kernel's
// zero page: faster than reading real data would be (docs/BENCHMARKS.md).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "ecx/common/status.h"

namespace ecx::bench {

struct UcxPerftestOptions {
  std::string binary = "ucx_perftest";  // a path, or a name found on PATH
  std::string tls;                      // UCX_TLS of both processes ("" = UCX's choice)
  bool error_handling = false;          // -e: endpoints with peer error handling
  uint64_t size = 0;                    // bytes per get (-s)
  int iters = 0;                        // timed gets (-n)
  int warmup = 0;                       // untimed gets before them (-w)
  int timeout_s = 120;                  // each process is killed after this long
};

struct UcxPerftestResult {
  double p50_us = 0;  // median latency of one get
  double gbps = 0;    // decimal GB/s over the whole run (ucx_perftest prints MiB/s)
};

// Runs the server and the client and returns the client's final figures. Errors say
// which process failed and why (not installed, a bad UCX_TLS, a timeout).
Result<UcxPerftestResult> run_ucx_perftest(const UcxPerftestOptions& options);

// Parses the line `ucx_perftest -f` prints: iterations, latency p50 / average / overall
// (us), bandwidth average / overall (MiB/s), message rate average / overall.
Result<UcxPerftestResult> parse_ucx_perftest_line(std::string_view line);

// The binary's path: `binary` if it names a path, else the first match on PATH.
Result<std::string> find_ucx_perftest(const std::string& binary);

}  // namespace ecx::bench
