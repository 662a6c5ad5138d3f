// ecx: one binary, one subcommand per job (DESIGN.md §7).
#include <CLI/CLI.hpp>
#include <iostream>

#include "bench.h"
#include "ecx/common/log.h"

int main(int argc, char** argv) {
  CLI::App app{"ecx: encoder-cache transfer for EPD-disaggregated LLM serving"};
  app.require_subcommand(1);
  std::string log_level = "warn";
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error, off")
      ->capture_default_str();
  int exit_code = 0;

  CLI::App* bench = app.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  ecx::bench::add_transfer_commands(*bench, &exit_code);

  app.parse_complete_callback([&] {
    ecx::Status s = ecx::set_log_level(log_level);
    if (!s.ok()) {
      std::cerr << "ecx: " << s.message() << "\n";
      std::exit(2);
    }
  });
  CLI11_PARSE(app, argc, argv);
  return exit_code;
}
