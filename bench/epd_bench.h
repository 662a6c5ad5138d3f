// `ecx bench epd`: starts a stack (proxy + E + PD; PD alone for `local`) per connector,
// runs the same `bench serve` workload through each, and compares them in one table.
#pragma once

#include <CLI/CLI.hpp>

namespace ecx::bench {

void add_epd_command(CLI::App& bench, int* exit_code);
// `ecx eval`: the same fixed requests through every connector; answers must be
// identical to the local (PD encodes) reference.
void add_eval_command(CLI::App& app, int* exit_code);

}  // namespace ecx::bench
