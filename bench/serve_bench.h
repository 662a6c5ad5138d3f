// `ecx bench serve`: a load generator against an OpenAI-compatible URL, printing the
// same block as `vllm bench serve` plus the EC load time PD reports per request.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

namespace ecx::bench {

struct ServeBenchOptions {
  std::string base_url = "http://127.0.0.1:8000";
  std::string model = "ecx-tiny-vl";
  std::string workload = "seed";  // seed | heavy | shared
  int num_prompts = 100;
  std::string request_rate = "inf";  // requests/s (Poisson arrivals) or inf
  int max_concurrency = 0;           // 0 = unlimited
  int images_per_request = -1;       // -1 = the workload's
  int input_len = 400;               // text bytes per request
  int output_len = 100;
  uint64_t seed = 0;
  std::string json_path;
  bool quiet = false;
};

// Runs the benchmark; returns the exit code (non-zero if any request failed).
int run_serve_bench(const ServeBenchOptions& options);
void add_serve_command(CLI::App& bench, int* exit_code);

}  // namespace ecx::bench
