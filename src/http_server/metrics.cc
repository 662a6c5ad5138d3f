#include "http_server/metrics.h"

#include <algorithm>
#include <cassert>
#include <charconv>

#include "http_server/metric_families.h"

namespace ecx::serve {
namespace {

// Prometheus' text format escapes \, " and newlines in label values.
std::string escaped(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\' || c == '"') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

// name="value",... (no braces).
std::string label_text(const Labels& labels) {
  std::string out;
  for (const auto& [name, value] : labels) {
    if (!out.empty()) out += ',';
    out.append(name).append("=\"").append(escaped(value)).append("\"");
  }
  return out;
}

// The shortest text that reads back as `v`.
std::string number(double v) {
  char buf[32];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  return ec == std::errc() ? std::string(buf, end) : std::string("NaN");
}

const char* type_name(MetricType type) {
  switch (type) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
}

// name{labels} value
void sample(std::string& out, std::string_view name, std::string_view suffix,
            const std::string& labels, double value) {
  out.append(name).append(suffix);
  if (!labels.empty()) out.append("{").append(labels).append("}");
  out.append(" ").append(number(value)).append("\n");
}

}  // namespace

Metrics::Series& Metrics::series_locked(const MetricFamily& family, std::string labels) {
  auto [it, added] = families_.try_emplace(family.name, Family{&family, {}});
  Series& s = it->second.series[std::move(labels)];
  if (family.type == MetricType::kHistogram && s.buckets.empty()) {
    s.buckets.assign(family.buckets.size(), 0);
  }
  return s;
}

void Metrics::add(const MetricFamily& family, double value, const Labels& labels) {
  assert(family.type != MetricType::kHistogram);
  std::string key = label_text(labels);
  MutexLock lock(&mu_);
  series_locked(family, std::move(key)).value += value;
}

void Metrics::set(const MetricFamily& family, double value, const Labels& labels) {
  assert(family.type != MetricType::kHistogram);
  std::string key = label_text(labels);
  MutexLock lock(&mu_);
  series_locked(family, std::move(key)).value = value;
}

void Metrics::observe(const MetricFamily& family, double value, const Labels& labels) {
  assert(family.type == MetricType::kHistogram);
  std::string key = label_text(labels);
  MutexLock lock(&mu_);
  Series& s = series_locked(family, std::move(key));
  // Cumulative buckets: the observation counts in every bucket whose bound it is under.
  auto first = std::lower_bound(family.buckets.begin(), family.buckets.end(), value);
  for (auto i = static_cast<size_t>(first - family.buckets.begin()); i < s.buckets.size(); ++i) {
    s.buckets[i]++;
  }
  s.sum += value;
  s.count++;
}

void Metrics::set_histogram(const MetricFamily& family, const transfer::LatencyHistogram& h,
                            const Labels& labels) {
  assert(family.type == MetricType::kHistogram);
  assert(
      std::equal(h.bounds.begin(), h.bounds.end(), family.buckets.begin(), family.buckets.end()));
  std::string key = label_text(labels);
  MutexLock lock(&mu_);
  Series& s = series_locked(family, std::move(key));
  for (size_t i = 0; i < s.buckets.size() && i < h.cumulative.size(); ++i) {
    s.buckets[i] = h.cumulative[i];
  }
  s.sum = h.sum_seconds;
  s.count = h.count;
}

std::string Metrics::render() const {
  MutexLock lock(&mu_);
  std::string out;
  for (const auto& [name, f] : families_) {
    out.append("# HELP ").append(name).append(" ").append(f.family->help).append("\n");
    out.append("# TYPE ").append(name).append(" ").append(type_name(f.family->type)).append("\n");
    for (const auto& [labels, s] : f.series) {
      if (f.family->type != MetricType::kHistogram) {
        sample(out, name, "", labels, s.value);
        continue;
      }
      const std::string sep = labels.empty() ? "" : ",";
      for (size_t i = 0; i < s.buckets.size(); ++i) {
        sample(out, name, "_bucket", labels + sep + "le=\"" + number(f.family->buckets[i]) + "\"",
               static_cast<double>(s.buckets[i]));
      }
      sample(out, name, "_bucket", labels + sep + "le=\"+Inf\"", static_cast<double>(s.count));
      sample(out, name, "_sum", labels, s.sum);
      sample(out, name, "_count", labels, static_cast<double>(s.count));
    }
  }
  return out;
}

namespace {

struct PoolFamilies {
  const MetricFamily& capacity_bytes;
  const MetricFamily& used_bytes;
  const MetricFamily& entries;
  const MetricFamily& pins;
  const MetricFamily& evictions;
};

void set_pool_metrics(const PoolFamilies& f, const cache::PoolStats& pool, Metrics& metrics) {
  metrics.set(f.capacity_bytes, static_cast<double>(pool.capacity_bytes));
  metrics.set(f.used_bytes, static_cast<double>(pool.used_bytes));
  metrics.set(f.entries, static_cast<double>(pool.entries));
  metrics.set(f.pins, static_cast<double>(pool.pins));
  metrics.set(f.evictions, static_cast<double>(pool.evictions));
}

// Connections the agent opened to peers, by the backend chosen.
void set_connect_metrics(const connector::ConnectorStats& stats, Metrics& metrics) {
  for (const auto& [backend, n] : stats.transfer_connects) {
    metrics.set(metric::kTransferConnects, static_cast<double>(n), {{"backend", backend}});
  }
  for (const auto& [op, h] : stats.transfer_seconds) {
    if (h.count != 0) metrics.set_histogram(metric::kTransferSeconds, h, {{"op", op}});
  }
}

}  // namespace

void set_producer_metrics(const connector::ConnectorStats& stats, Metrics& metrics) {
  using namespace metric;
  if (stats.producer_pool) {
    set_pool_metrics({kPoolCapacityBytes, kPoolUsedBytes, kPoolEntries, kPoolPins, kPoolEvictions},
                     *stats.producer_pool, metrics);
  }
  set_connect_metrics(stats, metrics);
}

void set_consumer_metrics(const connector::ConnectorStats& stats, Metrics& metrics) {
  using namespace metric;
  if (stats.consumer_cache) {
    set_pool_metrics(
        {kCacheCapacityBytes, kCacheUsedBytes, kCacheEntries, kCachePins, kCacheEvictions},
        *stats.consumer_cache, metrics);
  }
  set_connect_metrics(stats, metrics);
  for (const auto& [code, n] : stats.nacks) {
    metrics.set(kEcNacks, static_cast<double>(n), {{"code", code}});
  }
  metrics.set(kEcParamsRejected, static_cast<double>(stats.params_rejected));
}

}  // namespace ecx::serve
