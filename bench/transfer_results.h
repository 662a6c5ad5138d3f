// The results of `ecx bench transfer`: one row per case, the baselines measured in the
// same run (memcpy, tcp-socket, ucx_perftest), and how they are printed and written as
// JSON (the schema is in docs/results/HISTORY.md, §1).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace ecx::bench {

struct Row {
  std::string backend, mode;
  uint64_t size = 0;
  int batch = 0, iters = 0;
  double gbps = 0, p50_us = 0, p99_us = 0, control_rtts_per_item = 0;
  uint64_t verified_bytes = 0;          // checked against the source after the last iteration
  std::string ucx_tls, ucx_error_mode;  // ucx rows only
};

struct Baseline {
  std::string name;  // memcpy, tcp-socket or ucx_perftest
  uint64_t size = 0;
  double gbps = 0, p50_us = 0;
  std::string ucx_tls, error_mode, error;  // ucx_perftest only; `error`: it could not run
};

// The table's name for ucx rows over `tls`: ucx-tcp, ucx-shm (shared-memory transports
// only), ucx-default (UCX's choice) or ucx-<transports>.
std::string ucx_label(const std::string& tls);

// The ucx error mode the agents use with `tls` towards a peer on this host, given the
// configured `mode` (auto, peer or none); ucx_perftest must match it (-e for peer).
std::string ucx_resolved_mode(const std::string& mode, const std::string& tls);

// ucx_perftest -t ucp_get with `tls` (and -e when `mode` is peer), one baseline per size;
// a run that fails keeps its place, with `error` set.
std::vector<Baseline> measure_ucx_perftest(const std::string& binary, const std::string& tls,
                                           const std::string& mode,
                                           const std::vector<uint64_t>& sizes, int iters);
// The means of two runs of the same baselines (one alone if the other failed).
std::vector<Baseline> average_baselines(const std::vector<Baseline>& before,
                                        const std::vector<Baseline>& after);

// {"results":[...],"baselines":[...]}.
nlohmann::json results_json(const std::vector<Row>& rows, const std::vector<Baseline>& baselines);
// The table, the baselines, and the ucx rows against ucx_perftest.
void print_results(const std::vector<Row>& rows, const std::vector<Baseline>& baselines);

}  // namespace ecx::bench
