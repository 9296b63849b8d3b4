// A CUDA driver function fetched through the runtime, so that nothing links libcuda directly.
#pragma once

#include <cuda_runtime_api.h>

namespace poise::runtime {

// The driver's `name` at the CUDA 12.0 ABI, or nullptr where the driver lacks it.
inline void* driver_entry_point(const char* name) {
  void* ptr = nullptr;
  cudaDriverEntryPointQueryResult status{};
  if (cudaGetDriverEntryPointByVersion(name, &ptr, 12000, cudaEnableDefault, &status) != cudaSuccess ||
      status != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return ptr;
}

}  // namespace poise::runtime
