// CUDA device memory, where the build has the CUDA toolkit (ECX_CUDA, CMake) and the
// machine a GPU. Every function answers without a GPU: `available()` says why not.
#pragma once

#include <cstdint>
#include <string>

#include "ecx/common/status.h"

namespace ecx::transfer::cuda {

// Whether this build links CUDA (ECX_CUDA=on or auto with the toolkit found).
bool built_with_cuda();
// Ok when this process can use a GPU; otherwise why not (no CUDA in the build, no
// driver, no device), in words a skipped test can print.
Status available();

// Whether `data` is device memory of this process (false without CUDA).
bool is_device_pointer(const void* data);
// Ok when [data, data + length) lies inside one device allocation.
Status check_device_range(const void* data, uint64_t length);

// The current device, in words ("NVIDIA H200, compute capability 9.0, 139 GiB"), or why
// there is none.
Result<std::string> describe_device();

// Device memory for tests, benchmarks and pools: allocate, free, and copy (any
// direction; both pointers may be host or device). `copy` and `fill` return once the
// bytes are in place (device-to-device copies are waited for too).
Result<void*> device_alloc(uint64_t length);
void device_free(void* data);
Status copy(void* dst, const void* src, uint64_t length);
Status fill(void* data, int value, uint64_t length);

}  // namespace ecx::transfer::cuda
