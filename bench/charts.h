// PNG charts of benchmark results, drawn by gnuplot (Debian gnuplot-nox, installed by
// scripts/deps). A bench writes its chart next to its JSON: results.json -> results.png.
#pragma once

#include <string>
#include <vector>

#include "ecx/common/status.h"

namespace ecx::bench {

// One bar: `value` (e.g. p50) with a whisker up to `high` (e.g. p99; <= value: none).
struct ChartBar {
  std::string label;
  double value = 0;
  double high = 0;
};

struct BarChart {
  std::string title;
  std::string y_label;
  bool log_scale = false;
  std::vector<ChartBar> bars;
};

// Writes `chart` to `png_path`. kUnavailable (naming the package) without gnuplot; the
// bench then says so and carries on.
Status write_bar_chart(const BarChart& chart, const std::string& png_path);

// "results.json" -> "results.png" (any other name: + ".png").
std::string chart_path_for(const std::string& json_path);

}  // namespace ecx::bench
