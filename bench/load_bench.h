// `ecx bench load`: many concurrent connections against the proxy (closed loop), at
// several connection counts, with /health sampled during the load and a streaming run
// that checks every stream ends with [DONE]. docs/BENCHMARKS.md has the figures.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace ecx::bench {

struct LoadBenchOptions {
  std::string base_url;  // empty: start proxy + E + PD (p2p) on loopback
  std::vector<int> connections = {16, 256, 1000};
  double seconds = 12;            // per level
  int stream_connections = 1000;  // 0 = no streaming run
  int image_size = 112;
  int distinct_images = 256;
  int max_tokens = 4;
  std::string json_path;
};

// Returns the exit code: non-zero when a request failed (connection error, a 4xx/5xx
// other than 503, a stream without [DONE]).
int run_load_bench(const LoadBenchOptions& options);
void add_load_command(CLI::App& bench, int* exit_code);

}  // namespace ecx::bench
