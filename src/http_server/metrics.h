// Prometheus metrics of a service. Each family is declared once (metric_families.h: its
// name, type, help and, for a histogram, its buckets); a service adds to it, sets it or
// observes into it with label values, and one renderer writes the text format. The names
// are a contract (docs/SERVING.md).
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ecx/common/mutex.h"
#include "ecx/connector/ec_connector.h"

namespace ecx::serve {

enum class MetricType { kCounter, kGauge, kHistogram };

struct MetricFamily {
  std::string_view name;
  MetricType type;
  std::string_view help;
  std::span<const double> buckets = {};  // histograms: upper bounds, ascending (+Inf implied)
};

// A series' label names and values; values are escaped when rendered.
using Labels = std::vector<std::pair<std::string_view, std::string>>;

// Series of declared families. Thread-safe.
class Metrics {
 public:
  // Counters (and gauges): adds `value`.
  void add(const MetricFamily& family, double value, const Labels& labels = {}) ECX_EXCLUDES(mu_);
  // Gauges, and counters kept elsewhere (a connector's totals): the value now.
  void set(const MetricFamily& family, double value, const Labels& labels = {}) ECX_EXCLUDES(mu_);
  // Histograms: one observation, counted in its bucket, _sum and _count.
  void observe(const MetricFamily& family, double value, const Labels& labels = {})
      ECX_EXCLUDES(mu_);
  // Histograms kept elsewhere (an agent's transfers): the counts now. `h`'s bounds must
  // be the family's.
  void set_histogram(const MetricFamily& family, const transfer::LatencyHistogram& h,
                     const Labels& labels = {}) ECX_EXCLUDES(mu_);
  // Every family with a series: HELP and TYPE once, then its series.
  std::string render() const ECX_EXCLUDES(mu_);

 private:
  struct Series {
    double value = 0;               // counter, gauge
    std::vector<uint64_t> buckets;  // histogram: observations <= each bound
    double sum = 0;
    uint64_t count = 0;
  };
  struct Family {
    const MetricFamily* family;
    std::map<std::string, Series> series;  // by rendered labels
  };
  // `labels`: as label_text rendered them, outside the lock.
  Series& series_locked(const MetricFamily& family, std::string labels) ECX_REQUIRES(mu_);

  mutable Mutex mu_;
  std::map<std::string_view, Family> families_ ECX_GUARDED_BY(mu_);
};

// E and PD: the agent's connections (ecx_transfer_connects_total{backend}) and batches
// (ecx_transfer_seconds{op}) come with the figures below.
// E: the producer pool as ecx_pool_{capacity_bytes,used_bytes,entries,pins,evictions}.
void set_producer_metrics(const connector::ConnectorStats& stats, Metrics& metrics);
// PD: the consumer cache as ecx_cache_*, failed item loads as ecx_ec_nacks{code}, and
// ecx_ec_params_rejected_total.
void set_consumer_metrics(const connector::ConnectorStats& stats, Metrics& metrics);

}  // namespace ecx::serve
