// ecx-bench: the benchmarks, the correctness run and the test hosts' relay behind
// `ecx bench ...`, `ecx eval` and `ecx relay` (docs/BENCHMARKS.md). `ecx` runs this binary, which
// sits beside it, for every `bench` subcommand but `bench serve` (which `ecx demo` needs),
// for `eval` and for `relay`, with the same command line; so building the services and the
// demo does not compile them.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdlib>
#include <iostream>

#include "bench.h"
#include "ecx/common/log.h"
#include "epd_bench.h"
#include "gpu_bench.h"
#include "load_bench.h"
#include "peers_bench.h"
#include "pool_bench.h"
#include "relay.h"
#include "serve_bench.h"
#include "vllm_bench.h"

int main(int argc, char** argv) {
  CLI::App app{"ecx: encoder-cache transfer for EPD-disaggregated LLM serving (benchmarks)", "ecx"};
  app.require_subcommand(1);
  std::string log_level = "warn";
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error, off")
      ->capture_default_str();
  int exit_code = 0;

  CLI::App* bench = app.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  ecx::bench::add_transfer_commands(*bench, &exit_code);
  ecx::bench::add_gpu_transfer_command(*bench, &exit_code);
  ecx::bench::add_serve_command(*bench, &exit_code);
  ecx::bench::add_load_command(*bench, &exit_code);
  ecx::bench::add_pool_command(*bench, &exit_code);
  ecx::bench::add_epd_command(*bench, &exit_code);
  ecx::bench::add_peers_command(*bench, &exit_code);
  ecx::bench::add_vllm_command(*bench, &exit_code);
  ecx::bench::add_eval_command(app, &exit_code);
  ecx::relay::add_relay_command(app, &exit_code);

  app.parse_complete_callback([&] {
    ecx::Status s = ecx::set_log_level(log_level);
    if (!s.ok()) {
      std::cerr << "ecx: " << s.message() << "\n";
      std::exit(2);
    }
    // ECX_CHECK_ARGS=1: the command line parsed and checked, nothing run (exit 0): what
    // the tests of the docs' commands run (python/tests/test_doc_commands.py).
    if (std::getenv("ECX_CHECK_ARGS") != nullptr) {
      std::cerr << "ECX_CHECK_ARGS: the command line is valid; nothing was run\n";
      throw CLI::Success();
    }
  });
  std::vector<std::string> args(argv, argv + argc);
  std::reverse(args.begin() + 1, args.end());  // CLI11 parses a reversed vector
  args.erase(args.begin());
  try {
    app.parse(std::move(args));
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return exit_code;
}
