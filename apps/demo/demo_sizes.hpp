// What a demo run costs, estimated before anything is allocated: host and device bytes, the work
// that picks the default check. Doubles, so an absurd --tokens cannot overflow the estimate.
#pragma once

#include <cstdint>
#include <string>

#include "demo_flags.hpp"
#include "poise/memory_plan.hpp"

namespace poise::demo {

// The default check is full up to this many expert multiply-adds (dense float64 on one host core
// then takes about a second), sampled above.
inline constexpr double kFullCheckMacs = 1e9;

// Device bytes the demo leaves free for what the plan does not count (CUDA context, kernel modules).
inline constexpr double kDeviceReserveBytes = double(1 << 30);

// Expert multiply-adds of one forward over all ranks: R*T*K rows x (W13 2F*D + W2 D*F).
double expert_macs(const Config& config, int64_t ranks);

Check default_check(const Config& config, int64_t ranks);

// Host bytes of the CPU work: the routing (always), the inputs as floats (random_inputs, grad_out),
// the CPU reference engine's state and results, the GPU results read back for a full check, the
// dense float64 check, the sampled check's expert weights.
struct HostWork {
  bool inputs = false, engine = false, gpu_results = false, dense = false, sampled = false;
};
double host_bytes(const Flags& flags, const MemoryPlan& plan, const HostWork& work);
double physical_memory_bytes();

// Device bytes of one rank's layer tensors, as LayerTensors::add_rank allocates them.
double layer_tensor_bytes(const Flags& flags, const MemoryPlan& plan);
// Device bytes of the GPU path: every virtual rank's plan and layer tensors, plus the reserve.
double device_bytes(const Flags& flags, const MemoryPlan& plan);

std::string gib(double bytes);

}  // namespace poise::demo
