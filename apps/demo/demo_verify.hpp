// The demo's results against float64: full (a dense computation of every output and weight
// gradient) or sampled (a few tokens' rows), as Setup::check says. Each returns the exit code.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "demo_host.hpp"

namespace poise::demo {

// --check none: says so (exit code 0).
int report_unchecked();

// Row t of rank r of one output, wherever the layer ran.
using RowFn = std::function<std::vector<float>(int64_t rank, int64_t t)>;
struct SampledGot {
  RowFn out, grad_x, grad_scores;
};

// out, grad_x and grad_scores of `tokens` against float64 from the experts' weights.
int check_sampled(const Setup& s, const char* what, const std::vector<ref::SampledToken>& tokens,
                  const ref::ExpertWeightsFn& weights, const SampledGot& got);

// Results held on the host, checked as s.check says.
int check_host_results(const Setup& s, const char* what, const HostResults& got, const HostInputs& h);

}  // namespace poise::demo
