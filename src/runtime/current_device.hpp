// Makes a CUDA device current for a scope (a communicator's device, for its allocations) and
// restores the caller's device after it.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "poise/errors.hpp"

namespace poise::runtime {

class CurrentDevice {
 public:
  // `what` names the caller in the DeviceError thrown when the device cannot be made current.
  CurrentDevice(int device, const char* what) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (cudaSetDevice(device) != cudaSuccess) {
      throw DeviceError(std::string(what) + ": cannot make CUDA device " + std::to_string(device) + " current");
    }
  }
  ~CurrentDevice() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace poise::runtime
