// Small helpers every GPU test needs: whether an SM90 device is there, and a fresh seed per run
// (tests print it with SCOPED_TRACE so a failure can be replayed).
#pragma once

#include <chrono>
#include <cstdint>

#include "kernels/device_info.hpp"

namespace poise::testing {

inline bool have_sm90_gpu() { return cuda_device_count() > 0 && is_sm90_device(0); }

inline uint64_t fresh_seed() {
  return static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
}

}  // namespace poise::testing
