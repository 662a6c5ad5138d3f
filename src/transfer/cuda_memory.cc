#include "ecx/transfer/cuda_memory.h"

#ifdef ECX_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace ecx::transfer::cuda {

#ifdef ECX_HAVE_CUDA

namespace {
Status cuda_error(cudaError_t error, const std::string& what) {
  return Status(StatusCode::kUnavailable,
                what + ": " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) + ")");
}
}  // namespace

bool built_with_cuda() { return true; }

Status available() {
  int devices = 0;
  cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess) return cuda_error(e, "no usable GPU");
  if (devices == 0) return Unavailable("no usable GPU: the CUDA driver reports 0 devices");
  return Status::Ok();
}

bool is_device_pointer(const void* data) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, data) != cudaSuccess) {
    cudaGetLastError();  // clears the sticky-free error state of this thread
    return false;
  }
  return attributes.type == cudaMemoryTypeDevice;
}

Status check_device_range(const void* data, uint64_t length) {
  ECX_RETURN_IF_ERROR(available());
  if (!is_device_pointer(data)) {
    return InvalidArgument(
        "register_memory: MemoryKind::kCuda, but the buffer is not CUDA "
        "device memory");
  }
  const auto* last = static_cast<const char*>(data) + (length - 1);
  if (!is_device_pointer(last)) {
    return OutOfRange("register_memory: the last of " + std::to_string(length) +
                      " bytes is not device memory");
  }
  return Status::Ok();
}

Result<void*> device_alloc(uint64_t length) {
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, length);
  if (e != cudaSuccess) return cuda_error(e, "cudaMalloc of " + std::to_string(length) + " bytes");
  return p;
}

void device_free(void* data) {
  if (data != nullptr) cudaFree(data);
}

Result<std::string> describe_device() {
  ECX_RETURN_IF_ERROR(available());
  int device = 0;
  cudaDeviceProp prop{};
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) return cuda_error(e, "cudaGetDeviceProperties");
  return std::string(prop.name) + ", compute capability " + std::to_string(prop.major) + "." +
         std::to_string(prop.minor) + ", " + std::to_string(prop.totalGlobalMem >> 30) + " GiB";
}

Status copy(void* dst, const void* src, uint64_t length) {
  cudaError_t e = cudaMemcpy(dst, src, length, cudaMemcpyDefault);
  // A device-to-device cudaMemcpy may return before the copy ends.
  if (e == cudaSuccess) e = cudaStreamSynchronize(nullptr);
  if (e != cudaSuccess) return cuda_error(e, "cudaMemcpy of " + std::to_string(length) + " bytes");
  return Status::Ok();
}

Status fill(void* data, int value, uint64_t length) {
  cudaError_t e = cudaMemset(data, value, length);
  if (e != cudaSuccess) return cuda_error(e, "cudaMemset of " + std::to_string(length) + " bytes");
  return cudaDeviceSynchronize() == cudaSuccess ? Status::Ok()
                                                : Internal("cudaDeviceSynchronize failed");
}

#else  // no CUDA in this build

namespace {
Status no_cuda() {
  return Status(StatusCode::kFailedPrecondition,
                "this build has no CUDA (configure with the CUDA toolkit installed, ECX_CUDA=auto "
                "or on)");
}
}  // namespace

bool built_with_cuda() { return false; }
Status available() { return no_cuda(); }
bool is_device_pointer(const void*) { return false; }
Status check_device_range(const void*, uint64_t) { return no_cuda(); }
Result<std::string> describe_device() { return no_cuda(); }
Result<void*> device_alloc(uint64_t) { return no_cuda(); }
void device_free(void*) {}
Status copy(void*, const void*, uint64_t) { return no_cuda(); }
Status fill(void*, int, uint64_t) { return no_cuda(); }

#endif

}  // namespace ecx::transfer::cuda
