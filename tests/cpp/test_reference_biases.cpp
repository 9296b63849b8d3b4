// Expert biases (gpt-oss: h13 = x W13^T + b13, y = a W2^T + b2) in the reference engine: against the
// float64 oracle over ranks, balance modes (replicas carry their biases and return their bias
// gradients) and W13 layouts; zero biases change no bit; accumulation; errors name the argument.
#include <tuple>

#include "test_reference_support.hpp"
#include "testing/rejected_name.hpp"

namespace poise::reference::testing {
namespace {

using poise::testing::rejected_name;
using Case = std::tuple<int, Balance, W13Layout>;

Config biased_config(int ranks, Balance balance) {
  Config c = small_config(/*T=*/24, /*D=*/192, /*F=*/64, /*E=*/4 * ranks, /*K=*/4, balance);
  c.activation = Activation::swiglu_clamped;  // gpt-oss: clamped SwiGLU, alpha 1.702, limit 7
  c.swiglu_alpha = 1.702;
  c.swiglu_limit = 7.0;
  return c;
}

class ReferenceBiases : public ::testing::TestWithParam<Case> {};

TEST_P(ReferenceBiases, MatchFloat64WithBiasGradients) {
  const auto [ranks, balance, layout] = GetParam();
  const Config c = biased_config(ranks, balance);
  Options options;
  options.w13_layout = layout;
  const auto inputs = random_inputs(c, ranks, {.seed = 7u + ranks, .skew = 3.0, .biases = true}, options);
  const auto grad_out = random_grad_out(c, ranks, 8);
  const RunResult got = run_engine(c, ranks, options, inputs, grad_out);
  const DenseFloat64Result want = dense_float64(c, ranks, inputs, grad_out, options);
  expect_matches_dense(got, want, 1e-2, "R=" + std::to_string(ranks));
  const auto grad_b13 = per_rank(got.grads, [](const RankGradients& g) { return g.grad_b13; });
  const auto grad_b2 = per_rank(got.grads, [](const RankGradients& g) { return g.grad_b2; });
  EXPECT_LT(relative_error(grad_b13, want.grad_b13), 1e-2);
  EXPECT_LT(relative_error(grad_b2, want.grad_b2), 1e-2);
  if (balance == Balance::exact && ranks > 1) {
    int64_t replicas = 0;
    for (int64_t n : got.stats.replicas) replicas += n;
    EXPECT_GT(replicas, 0) << "no replica: the replicas' biases went untested";
  }
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const auto [ranks, balance, layout] = info.param;
  return "R" + std::to_string(ranks) + "_" + to_string(balance) +
         (layout == W13Layout::gate_up_blocked ? "_blocked" : "_interleaved");
}

INSTANTIATE_TEST_SUITE_P(Sweep, ReferenceBiases,
                         ::testing::Combine(::testing::Values(1, 2, 4), ::testing::Values(Balance::exact, Balance::capacity),
                                            ::testing::Values(W13Layout::gate_up_blocked, W13Layout::gate_up_interleaved)),
                         case_name);

TEST(ReferenceBiasesExtra, ZeroBiasesChangeNoBitAndAccumulationAdds) {
  const Config c = biased_config(2, Balance::exact);
  auto plain = random_inputs(c, 2, {.seed = 3, .skew = 2.0}, {});
  auto zero = plain;
  for (RankInputs& in : zero) {
    in.b13.assign(c.num_local_experts(2) * 2 * c.intermediate_dim, 0.0f);
    in.b2.assign(c.num_local_experts(2) * c.hidden_dim, 0.0f);
  }
  const auto grad_out = random_grad_out(c, 2, 4);
  const RunResult a = run_engine(c, 2, {}, plain, grad_out), b = run_engine(c, 2, {}, zero, grad_out);
  for (int r = 0; r < 2; ++r) {
    expect_bitwise_equal(a.out_TD[r], b.out_TD[r], "out_TD");
    expect_bitwise_equal(a.grads[r].grad_x_TD, b.grads[r].grad_x_TD, "grad_x_TD");
    expect_bitwise_equal(a.grads[r].grad_w13, b.grads[r].grad_w13, "grad_w13");
    EXPECT_TRUE(a.grads[r].grad_b13.empty());
    EXPECT_EQ(b.grads[r].grad_b13.size(), zero[r].b13.size());
  }
  // Accumulating a second backward doubles the bias gradients (fp32 sums of the same values).
  Engine engine(c, 2, {});
  engine.forward(zero);
  std::vector<RankGradients> grads;
  engine.backward(zero, grad_out, grads);
  const std::vector<float> once = grads[0].grad_b2;
  engine.backward(zero, grad_out, grads, /*accumulate_wgrad=*/true);
  for (size_t i = 0; i < once.size(); ++i) ASSERT_EQ(grads[0].grad_b2[i], 2.0f * once[i]) << i;
}

TEST(ReferenceBiasesExtra, ErrorsNameTheArgument) {
  const Config c = biased_config(2, Balance::exact);
  const auto good = random_inputs(c, 2, {.seed = 5, .biases = true}, {});
  auto forward_name = [&](auto edit) {
    auto in = good;
    edit(in);
    return rejected_name([&] { Engine(c, 2, {}).forward(in); });
  };
  EXPECT_EQ(forward_name([](auto& in) { in[0].b13.pop_back(); }), "b13");
  EXPECT_EQ(forward_name([](auto& in) { in[1].b13.clear(), in[1].b2.clear(); }), "b13");  // one rank without
  EXPECT_EQ(forward_name([](auto& in) { in[0].b2.clear(), in[1].b2.clear(); }), "b2");    // b13 without b2
  EXPECT_EQ(forward_name([](auto& in) { in[0].b2[3] = 0.1f; }), "b2");                     // not a bf16 value
  Config fp8 = c;
  fp8.gemm_precision = GemmPrecision::fp8_block_scaled;
  EXPECT_EQ(rejected_name([&] { Engine(fp8, 2, {}).forward(good); }), "b13");
  Engine engine(c, 2, {});
  engine.forward(good);
  auto unbiased = good;
  for (RankInputs& in : unbiased) in.b13.clear(), in.b2.clear();
  std::vector<RankGradients> grads;
  EXPECT_EQ(rejected_name([&] { engine.backward(unbiased, random_grad_out(c, 2, 6), grads); }), "b13");
}

}  // namespace
}  // namespace poise::reference::testing
