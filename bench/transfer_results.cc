#include "transfer_results.h"

#include <algorithm>
#include <cstdio>

#include "ecx/common/bytes.h"
#include "transfer/ucx_backend.h"
#include "ucx_perftest.h"

namespace ecx::bench {
namespace {

using nlohmann::json;

// The baseline a row is compared with: memcpy (shm), tcp-socket (tcp) or ucx_perftest
// with the row's transports (ucx); nullptr if there is none.
const Baseline* baseline_for(const Row& r, const std::vector<Baseline>& baselines) {
  std::string name = r.backend == "shm"   ? "memcpy"
                     : r.backend == "ucx" ? "ucx_perftest"
                                          : "tcp-socket";
  for (const auto& b : baselines) {
    if (b.name == name && b.size == r.size && b.ucx_tls == r.ucx_tls && b.error.empty()) {
      return &b;
    }
  }
  return nullptr;
}

double ratio(double a, double b) { return b > 0 ? a / b : 0.0; }

// A ucx row against ucx_perftest with the same transports and size: throughput, and
// (batch 1: one get per iteration, as ucx_perftest does) median latency.
json vs_ucx_perftest(const Row& r, const Baseline& b) {
  json out = {{"gbps_ratio", ratio(r.gbps, b.gbps)}};
  if (r.batch == 1) out["p50_ratio"] = ratio(r.p50_us, b.p50_us);
  return out;
}

std::string label(const Row& r) { return r.backend == "ucx" ? ucx_label(r.ucx_tls) : r.backend; }

}  // namespace

std::string ucx_label(const std::string& tls) {
  if (tls.empty() || tls == "default") return "ucx-default";
  if (transfer::ucx_tls_is_shared_memory(tls)) return "ucx-shm";
  std::string out = "ucx-" + tls;
  std::replace(out.begin(), out.end(), ',', '+');
  return out;
}

std::string ucx_resolved_mode(const std::string& mode, const std::string& tls) {
  if (mode != "auto") return mode;
  return transfer::ucx_auto_mode_is_none(tls == "default" ? "" : tls, /*same_host=*/true) ? "none"
                                                                                          : "peer";
}

std::vector<Baseline> measure_ucx_perftest(const std::string& binary, const std::string& tls,
                                           const std::string& mode,
                                           const std::vector<uint64_t>& sizes, int iters) {
  std::vector<Baseline> out;
  for (uint64_t size : sizes) {
    Baseline b{.name = "ucx_perftest", .size = size, .ucx_tls = tls, .error_mode = mode};
    auto r = run_ucx_perftest({.binary = binary,
                               .tls = tls == "default" ? std::string() : tls,
                               .error_handling = mode == "peer",
                               .size = size,
                               .iters = iters,
                               .warmup = std::max(2, iters / 10)});
    if (r.ok()) {
      b.gbps = r->gbps;
      b.p50_us = r->p50_us;
    } else {
      b.error = r.status().to_string();
      std::fprintf(stderr, "bench transfer: no ucx_perftest baseline: %s\n", b.error.c_str());
    }
    out.push_back(b);
  }
  return out;
}

std::vector<Baseline> average_baselines(const std::vector<Baseline>& before,
                                        const std::vector<Baseline>& after) {
  std::vector<Baseline> out;
  for (size_t i = 0; i < before.size(); ++i) {
    Baseline b = before[i];
    bool second = i < after.size() && after[i].error.empty();
    if (b.error.empty() && second) {
      b.gbps = (b.gbps + after[i].gbps) / 2;
      b.p50_us = (b.p50_us + after[i].p50_us) / 2;
    } else if (second) {
      b = after[i];
    }
    out.push_back(b);
  }
  return out;
}

json results_json(const std::vector<Row>& rows, const std::vector<Baseline>& baselines) {
  json out = {{"results", json::array()}, {"baselines", json::array()}};
  for (const auto& r : rows) {
    json row = {{"backend", r.backend},
                {"mode", r.mode},
                {"size_bytes", r.size},
                {"batch", r.batch},
                {"iters", r.iters},
                {"gbps", r.gbps},
                {"p50_us", r.p50_us},
                {"p99_us", r.p99_us},
                {"control_rtts_per_item", r.control_rtts_per_item},
                {"verified_bytes", r.verified_bytes}};
    if (r.backend == "ucx") {
      row["label"] = label(r);
      row["ucx_tls"] = r.ucx_tls;
      row["ucx_error_mode"] = r.ucx_error_mode;
      if (const Baseline* b = baseline_for(r, baselines)) {
        row["vs_ucx_perftest"] = vs_ucx_perftest(r, *b);
      }
    }
    out["results"].push_back(row);
  }
  for (const auto& b : baselines) {
    json entry = {{"name", b.name}, {"size_bytes", b.size}, {"gbps", b.gbps}, {"p50_us", b.p50_us}};
    if (b.name == "ucx_perftest") {
      entry["ucx_tls"] = b.ucx_tls;
      entry["error_mode"] = b.error_mode;
      if (!b.error.empty()) entry["error"] = b.error;
    }
    out["baselines"].push_back(entry);
  }
  return out;
}

void print_results(const std::vector<Row>& rows, const std::vector<Baseline>& baselines) {
  std::printf("\n%-8s %-11s %9s %5s %9s %10s %10s %6s  %s\n", "backend", "mode", "size", "batch",
              "GB/s", "p50(us)", "p99(us)", "ctrl", "vs baseline");
  for (const auto& r : rows) {
    const Baseline* b = baseline_for(r, baselines);
    std::printf("%-8s %-11s %9s %5d %9.2f %10.1f %10.1f %6.1f  %.2fx %s\n", label(r).c_str(),
                r.mode.c_str(), format_bytes(r.size).c_str(), r.batch, r.gbps, r.p50_us, r.p99_us,
                r.control_rtts_per_item, b ? ratio(r.gbps, b->gbps) : 0.0,
                b ? b->name.c_str() : "(no baseline)");
  }
  std::printf("\nbaselines (same run, same process layout):\n");
  for (const auto& b : baselines) {
    std::printf("  %-12s %9s %9.2f GB/s  p50 %.1f us", b.name.c_str(), format_bytes(b.size).c_str(),
                b.gbps, b.p50_us);
    if (b.name == "ucx_perftest") {
      std::printf("  (UCX_TLS=%s, error mode %s)%s%s", b.ucx_tls.c_str(), b.error_mode.c_str(),
                  b.error.empty() ? "" : " failed: ", b.error.c_str());
    }
    std::printf("\n");
  }
  bool header = false;
  for (const auto& r : rows) {
    const Baseline* b = baseline_for(r, baselines);
    if (r.backend != "ucx" || r.mode != "pull" || r.batch != 1 || b == nullptr) continue;
    if (!header) {
      std::printf("\nucx backend vs ucx_perftest -t ucp_get (pull, batch 1: one get at a time):\n");
      header = true;
    }
    std::printf("  %-8s %9s  GB/s %7.2f vs %7.2f = %.2fx   p50 %9.1f vs %9.1f us = %.2fx\n",
                label(r).c_str(), format_bytes(r.size).c_str(), r.gbps, b->gbps,
                ratio(r.gbps, b->gbps), r.p50_us, b->p50_us, ratio(r.p50_us, b->p50_us));
  }
}

}  // namespace ecx::bench
