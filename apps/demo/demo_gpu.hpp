// The layer on the GPU, through the public entry points (Context + routed_experts) with R virtual
// ranks: timed, then checked against float64. Each returns the exit code.
#pragma once

#include "demo_setup.hpp"

namespace poise::demo {

// Full check: the host's inputs uploaded; when the GPU path lacks a feature, the CPU engine's results.
int run_gpu_full(const Setup& s);
// Sampled or no check: x, the weights and grad_out generated on the GPU, nothing large on the host.
int run_gpu_generated(const Setup& s);

}  // namespace poise::demo
