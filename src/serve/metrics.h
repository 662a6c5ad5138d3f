// Prometheus text-format metrics of a service, and the connector's figures rendered
// into them (one function per role: the names are a contract, see docs/SERVING.md).
#pragma once

#include <map>
#include <mutex>
#include <string>

#include "ecx/connector/ec_connector.h"

namespace ecx::serve {

// Counters and gauges with labels. Thread-safe.
class Metrics {
 public:
  void add(const std::string& name, const std::string& labels, double value);
  void set(const std::string& name, const std::string& labels, double value);
  // Counts one observation: <name>_sum and <name>_count.
  void observe(const std::string& name, const std::string& labels, double value);
  // Every series; a name ending in _total, _count or _sum is a counter, others gauges.
  std::string render(const std::string& help_prefix) const;

 private:
  mutable std::mutex mu_;
  std::map<std::string, std::map<std::string, double>> values_;  // guarded by mu_
};

// E: the producer pool as ecx_pool_{capacity_bytes,used_bytes,entries,pins,evictions}.
void set_producer_metrics(const connector::ConnectorStats& stats, Metrics& metrics);
// PD: the consumer cache as ecx_cache_*, failed item loads as ecx_ec_nacks{code}, and
// ecx_ec_params_rejected_total.
void set_consumer_metrics(const connector::ConnectorStats& stats, Metrics& metrics);

}  // namespace ecx::serve
