#include "progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>

namespace ecx::bench {

Progress::Progress(std::string label, int total, std::FILE* out)
    : label_(std::move(label)),
      total_(std::max(total, 1)),
      out_(out),
      terminal_(::isatty(::fileno(out)) != 0),
      start_(std::chrono::steady_clock::now()) {
  draw();
}

void Progress::set(int done) {
  done_ = std::clamp(done, 0, total_);
  draw();
}

void Progress::finish() {
  if (finished_) return;
  done_ = std::max(done_, 0);
  draw();
  if (terminal_) std::fputc('\n', out_);
  std::fflush(out_);
  finished_ = true;
}

void Progress::draw() {
  if (finished_) return;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  if (terminal_) {
    constexpr int kWidth = 30;
    const int filled = done_ * kWidth / total_;
    std::fprintf(out_, "\r%-16s [%s%s] %d/%d  %.0fs", label_.c_str(),
                 std::string(static_cast<size_t>(filled), '#').c_str(),
                 std::string(static_cast<size_t>(kWidth - filled), '.').c_str(), done_, total_,
                 seconds);
    std::fflush(out_);
    return;
  }
  // Not a terminal: a line at every tenth, so logs stay short.
  const int decile = done_ * 10 / total_;
  if (decile == last_line_decile_) return;
  last_line_decile_ = decile;
  std::fprintf(out_, "progress: %s %d/%d (%.0fs)\n", label_.c_str(), done_, total_, seconds);
  std::fflush(out_);
}

std::optional<std::pair<int, int>> parse_progress_line(const std::string& line) {
  constexpr const char* kPrefix = "progress: ";
  if (line.rfind(kPrefix, 0) != 0) return std::nullopt;
  int done = 0, total = 0;
  // "progress: LABEL DONE/TOTAL (Ns)": the counts are the last field before the time.
  std::string rest = line.substr(std::strlen(kPrefix));
  size_t paren = rest.rfind(" (");
  if (paren != std::string::npos) rest = rest.substr(0, paren);
  size_t space = rest.rfind(' ');
  if (space == std::string::npos) return std::nullopt;
  if (std::sscanf(rest.c_str() + space + 1, "%d/%d", &done, &total) != 2) return std::nullopt;
  return std::make_pair(done, total);
}

}  // namespace ecx::bench
