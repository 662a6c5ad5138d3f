// Progress of a benchmark a person waits for: a bar redrawn in place on a terminal,
// plain lines (every 10 %, and at the end) when the output is a file or a pipe.
//
//   Progress p("p2p", 50);
//   for (...) { ...; p.advance(); }
//   p.finish();
//
// Plain lines read "progress: p2p 20/50", which `ecx bench epd` parses from the
// `bench serve` runs it starts (parse_progress_line).
#pragma once

#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>

namespace ecx::bench {

class Progress {
 public:
  // `out`: where to draw (stdout by default); a bar only if it is a terminal.
  Progress(std::string label, int total, std::FILE* out = stdout);
  ~Progress() { finish(); }

  void advance(int n = 1) { set(done_ + n); }
  void set(int done);
  // Draws the final state (and ends the bar's line). Idempotent.
  void finish();

 private:
  void draw();

  const std::string label_;
  const int total_;
  std::FILE* const out_;
  const bool terminal_;
  const std::chrono::steady_clock::time_point start_;
  int done_ = 0;
  int last_line_decile_ = -1;
  bool finished_ = false;
};

// "progress: LABEL DONE/TOTAL" -> (done, total); nullopt for any other line.
std::optional<std::pair<int, int>> parse_progress_line(const std::string& line);

}  // namespace ecx::bench
