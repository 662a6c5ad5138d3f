// Entry points of `ecx bench ...` subcommands.
#pragma once

#include <CLI/CLI.hpp>

namespace ecx::bench {

// Adds `bench transfer` and the hidden `bench transfer-peer` to `bench`.
void add_transfer_commands(CLI::App& bench, int* exit_code);

}  // namespace ecx::bench
