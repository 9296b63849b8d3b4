#include <cuda_runtime.h>

#include "runtime/device_info.hpp"

namespace poise {

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver / no device: not an error for the caller
    return 0;
  }
  return count;
}

bool is_sm90_device(int index) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, index) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return prop.major == 9 && prop.minor == 0;
}

}  // namespace poise
