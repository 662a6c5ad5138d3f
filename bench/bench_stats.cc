#include "bench_stats.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace ecx::bench {

LatencySummary summarize(std::vector<int64_t> samples_ns) {
  LatencySummary s;
  if (samples_ns.empty()) return s;
  std::sort(samples_ns.begin(), samples_ns.end());
  auto pct = [&](double p) {
    size_t idx = static_cast<size_t>(std::ceil(p * static_cast<double>(samples_ns.size()))) - 1;
    idx = std::min(idx, samples_ns.size() - 1);
    return static_cast<double>(samples_ns[idx]) / 1000.0;
  };
  s.p50_us = pct(0.50);
  s.p99_us = pct(0.99);
  double total =
      static_cast<double>(std::accumulate(samples_ns.begin(), samples_ns.end(), int64_t{0}));
  s.mean_us = total / 1000.0 / static_cast<double>(samples_ns.size());
  s.total_seconds = total / 1e9;
  return s;
}

double gbps(uint64_t bytes, double seconds) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0;
}

}  // namespace ecx::bench
