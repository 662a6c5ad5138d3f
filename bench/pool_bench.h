// `ecx bench pool`: contention in an encoder cache pool. Reader threads find, pin and
// release small entries while a writer saves large items (each save checksums its
// payload); the figures are the readers' find and pin latencies. docs/BENCHMARKS.md.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

namespace ecx::bench {

struct PoolBenchOptions {
  int readers = 8;
  double seconds = 3;
  uint64_t item_bytes = 10ull << 20;  // what the writer saves
  int entries = 64;                   // small entries the readers pin
  int reader_pause_us = 50;           // between a reader's operations (a PD does not spin)
  std::string json_path;
};

// Returns the exit code (non-zero when a pool call failed unexpectedly).
int run_pool_bench(const PoolBenchOptions& options);
void add_pool_command(CLI::App& bench, int* exit_code);

}  // namespace ecx::bench
