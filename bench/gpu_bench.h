// `ecx bench gpu-transfer`: VRAM -> VRAM READ through the ucx backend between two
// processes on one GPU host, against cudaMemcpy device-to-device in the same run.
#pragma once

#include <CLI/CLI.hpp>

namespace ecx::bench {

// Exit code of `bench gpu-transfer` when this machine has no usable GPU (or the build no
// CUDA): nothing was measured, and the JSON says why.
constexpr int kNoGpuExitCode = 77;

void add_gpu_transfer_command(CLI::App& bench, int* exit_code);

}  // namespace ecx::bench
