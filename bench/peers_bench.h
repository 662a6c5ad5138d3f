// `ecx bench peers`: ecx next to memcpy, a tcp socket, and the real NIXL and Mooncake
// engines (through bench/python/peers.py in the project venv), in one run on one machine.
// Writes {"results":[{system, transport, variant, items, item_bytes, p50_us, p99_us, gbps,
// control_rtts_per_item, verified_bytes, error}]} and a PNG chart beside it.
#pragma once

#include <CLI/CLI.hpp>

namespace ecx::bench {

void add_peers_command(CLI::App& bench, int* exit_code);

}  // namespace ecx::bench
