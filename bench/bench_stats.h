// Latency samples -> percentiles and throughput.
#pragma once

#include <cstdint>
#include <vector>

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

}  // namespace ecx::bench
