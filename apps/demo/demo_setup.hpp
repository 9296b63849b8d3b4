// The demo's setup: everything decided and checked before the first line is printed (the device,
// the check, whether the layer fits, the routing and its balance).
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "demo_flags.hpp"
#include "poise/memory_plan.hpp"
#include "poise/reference.hpp"

namespace poise::demo {

namespace ref = poise::reference;

// A CUDA failure as poise::DeviceError (exit code 1).
void cuda_ok(cudaError_t status);

inline double milliseconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

struct Setup {
  Flags flags;  // receive_capacity_factor and wgrad_dtype as chosen
  poise::MemoryPlan plan;
  bool gpu = false;
  std::string device_line, check_line, capacity_note, wgrad_note, memory_line;
  Check check = Check::full;
  ref::RandomRouting routing;
  ref::RoutingStats stats;
  std::vector<std::vector<int64_t>> sampled_tokens;  // per rank, for --check sampled

  const Config& config() const { return flags.config; }
  int64_t ranks() const { return flags.ranks; }
  ref::Options options() const {
    ref::Options o;
    o.scores_dtype = flags.scores_dtype;
    o.replica_slots = plan.num_replica_slots;
    return o;
  }
};

ref::RandomInputsSpec inputs_spec(const Flags& f);

// Throws FlagError when an argument is bad or the layer does not fit in memory.
Setup prepare(const Flags& flags);

}  // namespace poise::demo
