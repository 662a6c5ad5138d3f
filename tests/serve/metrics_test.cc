#include "http_server/metrics.h"

#include <gtest/gtest.h>

#include "http_server/metric_families.h"

namespace ecx::serve {
namespace {

bool has_line(const std::string& text, const std::string& line) {
  return text.find("\n" + line + "\n") != std::string::npos || text.rfind(line + "\n", 0) == 0;
}

TEST(MetricsTest, AHistogramHasCumulativeBucketsSumAndCount) {
  Metrics m;
  m.observe(metric::kEcLoadSeconds, 0.00390625);
  m.observe(metric::kEcLoadSeconds, 0.00390625);
  m.observe(metric::kEcLoadSeconds, 0.125);
  m.observe(metric::kEcLoadSeconds, 512);  // past the last bucket: +Inf only
  std::string text = m.render();
  EXPECT_TRUE(has_line(text, "# TYPE ecx_ec_load_seconds histogram")) << text;
  EXPECT_TRUE(has_line(text, "ecx_ec_load_seconds_bucket{le=\"0.0025\"} 0")) << text;
  EXPECT_TRUE(has_line(text, "ecx_ec_load_seconds_bucket{le=\"0.005\"} 2")) << text;
  EXPECT_TRUE(has_line(text, "ecx_ec_load_seconds_bucket{le=\"0.1\"} 2")) << text;
  EXPECT_TRUE(has_line(text, "ecx_ec_load_seconds_bucket{le=\"0.25\"} 3")) << text;
  EXPECT_TRUE(has_line(text, "ecx_ec_load_seconds_bucket{le=\"120\"} 3")) << text;
  EXPECT_TRUE(has_line(text, "ecx_ec_load_seconds_bucket{le=\"+Inf\"} 4")) << text;
  EXPECT_TRUE(has_line(text, "ecx_ec_load_seconds_sum 512.1328125")) << text;
  EXPECT_TRUE(has_line(text, "ecx_ec_load_seconds_count 4")) << text;
}

// An agent keeps its transfers' histogram itself; the service renders its counts as they
// are, per op, and renders no op that moved nothing.
TEST(MetricsTest, AnAgentsTransferHistogramIsRenderedAsItKeepsIt) {
  transfer::LatencyHistogram reads;
  reads.bounds.assign(transfer::kLatencyBounds.begin(), transfer::kLatencyBounds.end());
  for (double bound : reads.bounds) reads.cumulative.push_back(bound < 0.001 ? 1 : 2);
  reads.sum_seconds = 0.0025;
  reads.count = 3;  // one past the last bound
  connector::ConnectorStats stats;
  stats.transfer_seconds = {{"read", reads}, {"write", transfer::LatencyHistogram{}}};
  Metrics m;
  set_consumer_metrics(stats, m);
  std::string text = m.render();
  EXPECT_TRUE(has_line(text, "# TYPE ecx_transfer_seconds histogram")) << text;
  EXPECT_TRUE(has_line(text, "ecx_transfer_seconds_bucket{op=\"read\",le=\"5e-05\"} 1")) << text;
  EXPECT_TRUE(has_line(text, "ecx_transfer_seconds_bucket{op=\"read\",le=\"1e-04\"} 1")) << text;
  EXPECT_TRUE(has_line(text, "ecx_transfer_seconds_bucket{op=\"read\",le=\"0.00025\"} 1")) << text;
  EXPECT_TRUE(has_line(text, "ecx_transfer_seconds_bucket{op=\"read\",le=\"0.001\"} 2")) << text;
  EXPECT_TRUE(has_line(text, "ecx_transfer_seconds_bucket{op=\"read\",le=\"+Inf\"} 3")) << text;
  EXPECT_TRUE(has_line(text, "ecx_transfer_seconds_sum{op=\"read\"} 0.0025")) << text;
  EXPECT_TRUE(has_line(text, "ecx_transfer_seconds_count{op=\"read\"} 3")) << text;
  EXPECT_EQ(text.find("op=\"write\""), std::string::npos) << text;
}

TEST(MetricsTest, EachFamilyHasOneHelpAndTypeAndItsSeriesByLabels) {
  Metrics m;
  m.add(metric::kProxyFailures, 1, {{"reason", "no_pd"}});
  m.add(metric::kProxyFailures, 2, {{"reason", "no_pd"}});
  m.add(metric::kProxyFailures, 1, {{"reason", "pd"}});
  m.set(metric::kHttpQueueDepth, 7);
  m.set(metric::kHttpQueueDepth, 5);
  std::string text = m.render();
  EXPECT_TRUE(has_line(text, "# TYPE ecx_proxy_failures_total counter")) << text;
  EXPECT_TRUE(has_line(text, "ecx_proxy_failures_total{reason=\"no_pd\"} 3")) << text;
  EXPECT_TRUE(has_line(text, "ecx_proxy_failures_total{reason=\"pd\"} 1")) << text;
  EXPECT_TRUE(has_line(text, "# TYPE ecx_http_queue_depth gauge")) << text;
  EXPECT_TRUE(has_line(text, "ecx_http_queue_depth 5")) << text;
  size_t helps = 0;
  for (size_t at = 0; (at = text.find("# HELP ecx_proxy_failures_total", at)) != std::string::npos;
       ++at) {
    helps++;
  }
  EXPECT_EQ(helps, 1u);
}

TEST(MetricsTest, LabelValuesAreEscapedSoNoValueCanForgeALine) {
  Metrics m;
  m.set(metric::kProxyUpstreamUp, 1, {{"role", "pd"}, {"url", "http://a\"b\\c\nfake 1"}});
  std::string text = m.render();
  EXPECT_TRUE(
      has_line(text, "ecx_proxy_upstream_up{role=\"pd\",url=\"http://a\\\"b\\\\c\\nfake 1\"} 1"))
      << text;
  EXPECT_FALSE(has_line(text, "fake 1\"} 1")) << text;
}

}  // namespace
}  // namespace ecx::serve
