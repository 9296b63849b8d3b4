// The layer on the host: inputs drawn by reference::random_inputs, and the run of the CPU
// reference engine (R threads as ranks).
#pragma once

#include <vector>

#include "demo_setup.hpp"

namespace poise::demo {

struct HostInputs {
  std::vector<ref::RankInputs> inputs;
  std::vector<std::vector<float>> grad_out;
};

// x and the weights from random_inputs, the routing the statistics were computed from.
HostInputs make_host_inputs(const Setup& s);

// Results per rank as floats, wherever the layer ran.
struct HostResults {
  std::vector<std::vector<float>> out, grad_x, grad_scores, grad_w13, grad_w2;
};

// Forward + backward on the CPU reference engine; prints the time.
HostResults run_engine(const Setup& s, const HostInputs& h);

}  // namespace poise::demo
