#include "serve/metrics.h"

#include <sstream>

namespace ecx::serve {

void Metrics::add(const std::string& name, const std::string& labels, double value) {
  std::lock_guard lock(mu_);
  values_[name][labels] += value;
}

void Metrics::set(const std::string& name, const std::string& labels, double value) {
  std::lock_guard lock(mu_);
  values_[name][labels] = value;
}

void Metrics::observe(const std::string& name, const std::string& labels, double value) {
  std::lock_guard lock(mu_);
  values_[name + "_sum"][labels] += value;
  values_[name + "_count"][labels] += 1;
}

std::string Metrics::render(const std::string& help_prefix) const {
  std::lock_guard lock(mu_);
  std::ostringstream out;
  for (const auto& [name, series] : values_) {
    out << "# HELP " << name << " " << help_prefix << "\n";
    out << "# TYPE " << name
        << (name.ends_with("_total") || name.ends_with("_count") || name.ends_with("_sum")
                ? " counter\n"
                : " gauge\n");
    for (const auto& [labels, v] : series) {
      out << name << (labels.empty() ? "" : "{" + labels + "}") << " " << v << "\n";
    }
  }
  return out.str();
}

namespace {

// <prefix>capacity_bytes, used_bytes, entries, pins, evictions.
void set_pool_metrics(const std::string& prefix, const cache::PoolStats& pool, Metrics& metrics) {
  metrics.set(prefix + "capacity_bytes", "", static_cast<double>(pool.capacity_bytes));
  metrics.set(prefix + "used_bytes", "", static_cast<double>(pool.used_bytes));
  metrics.set(prefix + "entries", "", static_cast<double>(pool.entries));
  metrics.set(prefix + "pins", "", static_cast<double>(pool.pins));
  metrics.set(prefix + "evictions", "", static_cast<double>(pool.evictions));
}

// Connections the agent opened to peers, by the backend chosen.
void set_connect_metrics(const connector::ConnectorStats& stats, Metrics& metrics) {
  for (const auto& [backend, n] : stats.transfer_connects) {
    metrics.set("ecx_transfer_connects_total", "backend=\"" + backend + "\"",
                static_cast<double>(n));
  }
}

}  // namespace

void set_producer_metrics(const connector::ConnectorStats& stats, Metrics& metrics) {
  if (stats.producer_pool) set_pool_metrics("ecx_pool_", *stats.producer_pool, metrics);
  set_connect_metrics(stats, metrics);
}

void set_consumer_metrics(const connector::ConnectorStats& stats, Metrics& metrics) {
  if (stats.consumer_cache) set_pool_metrics("ecx_cache_", *stats.consumer_cache, metrics);
  set_connect_metrics(stats, metrics);
  for (const auto& [code, n] : stats.nacks) {
    metrics.set("ecx_ec_nacks", "code=\"" + code + "\"", static_cast<double>(n));
  }
  // ec_transfer_params refused: unsigned, not signed by this deployment, or not this item's.
  metrics.set("ecx_ec_params_rejected_total", "", static_cast<double>(stats.params_rejected));
}

}  // namespace ecx::serve
