// CUDA return-code checks that turn failures into poise::DeviceError.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "poise/errors.hpp"

namespace poise::runtime {

inline void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw DeviceError(std::string(what) + ": " + cudaGetErrorName(status) + " (" + cudaGetErrorString(status) +
                      ")");
  }
}

// After a launch: configuration errors show up here, not in the launch statement.
inline void cuda_check_launch(const char* kernel) { cuda_check(cudaGetLastError(), kernel); }

}  // namespace poise::runtime
