// Shared by the reference engine tests: small configs, one forward+backward run, the float64 check.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "poise/reference.hpp"
#include "testing/layer_config.hpp"

namespace poise::reference::testing {

inline Config small_config(int64_t T, int64_t D, int64_t F, int64_t E, int64_t K,
                           Balance balance = Balance::exact) {
  return poise::testing::layer_config(T, D, F, E, K, balance, 1e6);  // capacity tests lower the factor on purpose
}

struct RunResult {
  std::vector<std::vector<float>> out_TD;
  std::vector<RankGradients> grads;
  RoutingStats stats;
};

// Forward + backward; gradient buffers poisoned with NaN first so an unwritten value shows.
inline RunResult run_engine(const Config& config, int64_t ep_size, const Options& options,
                            const std::vector<RankInputs>& inputs,
                            const std::vector<std::vector<float>>& grad_out) {
  Engine engine(config, ep_size, options);
  RunResult result;
  result.out_TD = engine.forward(inputs);
  result.stats = engine.routing_stats();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  result.grads.assign(ep_size, RankGradients{std::vector<float>(7, nan), std::vector<float>(3, nan),
                                             std::vector<float>(5, nan), std::vector<float>(2, nan)});
  engine.backward(inputs, grad_out, result.grads);
  return result;
}

template <class Get>
std::vector<std::vector<float>> per_rank(const std::vector<RankGradients>& grads, Get get) {
  std::vector<std::vector<float>> out;
  for (const RankGradients& g : grads) out.push_back(get(g));
  return out;
}

// Relative L2 errors against float64, each below tolerance (a NaN fails).
inline void expect_matches_dense(const RunResult& got, const DenseFloat64Result& want, double tolerance,
                                 const std::string& what) {
  const double errors[5] = {
      relative_error(got.out_TD, want.out_TD),
      relative_error(per_rank(got.grads, [](const RankGradients& g) { return g.grad_x_TD; }), want.grad_x_TD),
      relative_error(per_rank(got.grads, [](const RankGradients& g) { return g.grad_scores_TK; }),
                     want.grad_scores_TK),
      relative_error(per_rank(got.grads, [](const RankGradients& g) { return g.grad_w13; }), want.grad_w13),
      relative_error(per_rank(got.grads, [](const RankGradients& g) { return g.grad_w2; }), want.grad_w2)};
  const char* names[5] = {"out_TD", "grad_x_TD", "grad_scores_TK", "grad_w13", "grad_w2"};
  for (int i = 0; i < 5; ++i) {
    EXPECT_TRUE(errors[i] < tolerance) << what << ": " << names[i] << " relative error " << errors[i];
    EXPECT_TRUE(errors[i] > 0.0) << what << ": " << names[i]
                                 << " matches float64 exactly, so the check compares nothing";
  }
}

inline void expect_bitwise_equal(const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i])))) {
      ADD_FAILURE() << what << " differs at " << i << ": " << a[i] << " vs " << b[i];
      return;
    }
  }
}

}  // namespace poise::reference::testing
