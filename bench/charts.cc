#include "charts.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "ecx/common/subprocess.h"

namespace ecx::bench {
namespace {

constexpr const char* kGnuplot = "/usr/bin/gnuplot";

// gnuplot string literal: single quotes, with any quote in the text doubled.
std::string quoted(const std::string& text) {
  std::string out = "'";
  for (char c : text) {
    if (c == '\'')
      out += "''";
    else if (c != '\n')
      out += c;
  }
  return out + "'";
}

}  // namespace

std::string chart_path_for(const std::string& json_path) {
  std::filesystem::path p(json_path);
  if (p.extension() == ".json") return p.replace_extension(".png").string();
  return json_path + ".png";
}

Status write_bar_chart(const BarChart& chart, const std::string& png_path) {
  if (::access(kGnuplot, X_OK) != 0) {
    return Unavailable("no chart: gnuplot is not installed (Debian package gnuplot-nox)");
  }
  if (chart.bars.empty()) return InvalidArgument("no chart: nothing to draw");
  const std::string data = png_path + ".dat";
  const std::string script = png_path + ".gp";
  {
    std::ofstream d(data);
    for (const auto& bar : chart.bars) {
      double high = bar.high > bar.value ? bar.high : bar.value;
      d << "\"" << bar.label << "\" " << bar.value << " " << high << "\n";
    }
    std::ofstream g(script);
    g << "set terminal pngcairo size " << (600 + 40 * chart.bars.size()) << ",640 font ',10'\n"
      << "set output " << quoted(png_path) << "\n"
      << "set title " << quoted(chart.title) << "\n"
      << "set ylabel " << quoted(chart.y_label) << "\n"
      << "set style fill solid 0.55 border -1\nset boxwidth 0.7\nset grid ytics\n"
      << "set xtics rotate by -40 noenhanced\nset key top left\nset yrange [0:*]\n"
      << "set rmargin 14\nset bmargin 12\n"
      << (chart.log_scale ? "set logscale y\nset yrange [*:*]\n" : "") << "plot " << quoted(data)
      << " using 0:2:xtic(1) with boxes title 'p50', '' using "
      << "0:2:2:3 with yerrorbars lc rgb 'black' pt 0 title 'p99'\n";
  }
  auto run = Subprocess::spawn({kGnuplot, script});
  if (!run.ok()) return run.status().with_context("gnuplot");
  while (run->read_line(Deadline::after_ms(30000)).ok()) {
  }
  auto code = run->wait(Deadline::after_ms(30000));
  std::remove(data.c_str());
  std::remove(script.c_str());
  if (!code.ok()) return code.status().with_context("gnuplot");
  if (*code != 0) return Internal("gnuplot exited with " + std::to_string(*code));
  return Status::Ok();
}

}  // namespace ecx::bench
