// `ecx bench vllm`: vLLM's own EC connectors (ECExampleConnector, ECCPUConnector,
// ECMooncakeConnector) and ECXConnector side by side inside real `vllm serve` engines, next to
// a single instance, driven by `vllm bench serve` with the same workload, one after another in
// one run (bench/python/bench_vllm.py, run from the project venv). Writes {"results":[{connector,
// ttft_ms, tpot_ms, req_per_s, ec_load_ms_per_item, pd_encoder_iterations, correct, total,
// error, ...}], "workload", "versions"}, a table, and a PNG chart beside the JSON.
#pragma once

#include <CLI/CLI.hpp>

namespace ecx::bench {

void add_vllm_command(CLI::App& bench, int* exit_code);

}  // namespace ecx::bench
