// Small helpers every GPU test needs: whether an SM90 device is there, and a fresh seed per run
// (tests print it with SCOPED_TRACE so a failure can be replayed).
#pragma once

#include <chrono>
#include <cstdlib>
#include <cstdint>

#include "runtime/device_info.hpp"

namespace poise::testing {

inline bool have_sm90_gpu() { return cuda_device_count() > 0 && is_sm90_device(0); }

// A new seed every run (tests print it in their trace); POISE_TEST_SEED=<n> replays a failure.
inline uint64_t fresh_seed() {
  if (const char* s = std::getenv("POISE_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  return static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
}

}  // namespace poise::testing
