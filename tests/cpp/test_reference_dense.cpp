// The reference engine against the dense float64 formulation, over ranks, activations, score
// dtypes, W13 layouts, balance modes and dims that are multiples of 64 but not of 128.
#include <tuple>

#include "test_reference_support.hpp"

namespace poise::reference::testing {
namespace {

// ranks, activation, scores dtype, balance, w13 layout
using Case = std::tuple<int, Activation, DType, Balance, W13Layout>;

class ReferenceVsDense : public ::testing::TestWithParam<Case> {};

TEST_P(ReferenceVsDense, ForwardAndBackwardMatchFloat64) {
  const auto [ranks, activation, scores_dtype, balance, layout] = GetParam();
  // D = 192 = 64*3; F alternates 64 and 192; 4 experts per rank; 3 padding rows.
  Config config = small_config(/*T=*/24, /*D=*/192, /*F=*/ranks % 2 == 0 ? 64 : 192, /*E=*/4 * ranks,
                               /*K=*/ranks == 1 ? 2 : 4, balance);
  config.activation = activation;
  if (activation == Activation::swiglu_clamped) {
    config.swiglu_limit = 0.75;  // small enough that many gate and up values are clamped
    config.swiglu_alpha = 1.702;
  }
  Options options;
  options.scores_dtype = scores_dtype;
  options.w13_layout = layout;
  const auto inputs = random_inputs(config, ranks, {.seed = 11u + ranks, .skew = 2.0, .padding_rows = 3}, options);
  const auto grad_out = random_grad_out(config, ranks, 99);

  const RunResult got = run_engine(config, ranks, options, inputs, grad_out);
  const DenseFloat64Result want = dense_float64(config, ranks, inputs, grad_out, options);
  expect_matches_dense(got, want, 1e-2, "R=" + std::to_string(ranks));

  // Padding rows (all-zero scores) contribute nothing.
  const int64_t T = config.num_local_input_tokens, D = config.hidden_dim;
  for (int r = 0; r < ranks; ++r) {
    for (int64_t i = (T - 3) * D; i < T * D; ++i) ASSERT_EQ(got.out_TD[r][i], 0.0f);
  }
  // bf16 outputs hold bf16 values; bf16 scores get bf16 grads.
  for (int r = 0; r < ranks; ++r) {
    for (float v : got.out_TD[r]) ASSERT_TRUE(is_bf16_value(v));
    for (float v : got.grads[r].grad_x_TD) ASSERT_TRUE(is_bf16_value(v));
    if (scores_dtype == DType::bf16) {
      for (float v : got.grads[r].grad_scores_TK) ASSERT_TRUE(is_bf16_value(v));
    }
  }
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const auto [ranks, activation, scores_dtype, balance, layout] = info.param;
  return "R" + std::to_string(ranks) + "_" + to_string(activation) + "_scores_" + to_string(scores_dtype) + "_" +
         to_string(balance) + (layout == W13Layout::gate_up_blocked ? "_blocked" : "_interleaved");
}

INSTANTIATE_TEST_SUITE_P(
    Sweep, ReferenceVsDense,
    ::testing::Combine(::testing::Values(1, 2, 4, 8),
                       ::testing::Values(Activation::swiglu, Activation::swiglu_clamped),
                       ::testing::Values(DType::fp32, DType::bf16),
                       ::testing::Values(Balance::exact, Balance::capacity),
                       ::testing::Values(W13Layout::gate_up_blocked, W13Layout::gate_up_interleaved)),
    case_name);

}  // namespace
}  // namespace poise::reference::testing
