// NCCL return-code check that turns a failure into poise::DeviceError, with NCCL's own last
// error message when it has one.
#pragma once

#include <nccl.h>

#include <string>

#include "poise/errors.hpp"

namespace poise::comm {

inline void nccl_check(ncclResult_t result, const char* what) {
  if (result != ncclSuccess) {
    const char* last = ncclGetLastError(nullptr);
    throw DeviceError(std::string(what) + ": " + ncclGetErrorString(result) +
                      (last && *last ? std::string(" (") + last + ")" : std::string()));
  }
}

}  // namespace poise::comm
