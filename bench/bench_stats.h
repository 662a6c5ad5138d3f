// Latency samples -> percentiles and throughput.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "ecx/common/deadline.h"
#include "ecx/common/status.h"

namespace ecx::bench {

struct LatencySummary {
  double p50_us = 0;
  double p99_us = 0;
  double mean_us = 0;
  double total_seconds = 0;
};

// Summarises per-iteration latencies given in nanoseconds.
LatencySummary summarize(std::vector<int64_t> samples_ns);
// Decimal gigabytes per second for `bytes` moved in `seconds`.
double gbps(uint64_t bytes, double seconds);

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

// Runs `body` max(3, iters / 10) times to warm up (connections, page faults, a GPU's lazy
// set-up), then `iters` timed times; the per-iteration latencies in nanoseconds. Every
// benchmark that times iterations uses this one, so their figures compare.
template <typename Body>
Result<std::vector<int64_t>> time_iterations(int iters, Body body) {
  for (int i = 0; i < std::max(3, iters / 10); ++i) ECX_RETURN_IF_ERROR(body());
  std::vector<int64_t> samples;
  samples.reserve(iters);
  for (int i = 0; i < iters; ++i) {
    int64_t t0 = now_ns();
    ECX_RETURN_IF_ERROR(body());
    samples.push_back(now_ns() - t0);
  }
  return samples;
}

}  // namespace ecx::bench
