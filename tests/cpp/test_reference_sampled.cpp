// What the demo uses for layers too large for the engine: routing statistics from the ids alone
// (must equal the engine's), routing drawn on its own, and the float64 oracle on sampled tokens
// (must equal dense_float64 on those tokens).
#include <set>
#include <tuple>

#include "test_reference_support.hpp"

namespace poise::reference::testing {
namespace {

std::vector<std::vector<int32_t>> ids_of(const std::vector<RankInputs>& inputs) {
  std::vector<std::vector<int32_t>> ids;
  for (const RankInputs& in : inputs) ids.push_back(in.ids_TK);
  return ids;
}

void expect_same_stats(const RoutingStats& got, const RoutingStats& want) {
  EXPECT_EQ(got.expert_rows, want.expert_rows);
  EXPECT_EQ(got.owner_rows, want.owner_rows);
  EXPECT_EQ(got.computed_rows, want.computed_rows);
  EXPECT_EQ(got.grouped_rows, want.grouped_rows);
  EXPECT_EQ(got.received_token_rows, want.received_token_rows);
  EXPECT_EQ(got.replicas, want.replicas);
  EXPECT_EQ(got.moved_rows, want.moved_rows);
  EXPECT_EQ(got.surplus_rows, want.surplus_rows);
  EXPECT_EQ(got.unplaced_surplus_rows, want.unplaced_surplus_rows);
}

class StatsFromIds : public ::testing::TestWithParam<std::tuple<int, Balance, int64_t>> {};

TEST_P(StatsFromIds, EqualTheEnginesAfterAForward) {
  const auto [ranks, balance, replica_slots] = GetParam();
  const Config config = small_config(/*T=*/40, /*D=*/64, /*F=*/64, /*E=*/4 * ranks, /*K=*/ranks == 1 ? 2 : 3, balance);
  Options options;
  options.replica_slots = replica_slots;
  const auto inputs = random_inputs(config, ranks, {.seed = 3u + ranks, .skew = 2.5, .padding_rows = 2}, options);
  Engine engine(config, ranks, options);
  engine.forward(inputs);
  expect_same_stats(routing_stats(config, ranks, ids_of(inputs), options), engine.routing_stats());
}

INSTANTIATE_TEST_SUITE_P(Sweep, StatsFromIds,
                         ::testing::Values(std::tuple{1, Balance::exact, -1}, std::tuple{2, Balance::exact, -1},
                                           std::tuple{4, Balance::exact, -1}, std::tuple{8, Balance::exact, 1},
                                           std::tuple{4, Balance::capacity, -1}, std::tuple{8, Balance::capacity, -1}));

TEST(StatsFromIds, RejectIdsOutOfRangeOrRepeated) {
  const Config config = small_config(4, 64, 64, 8, 2);
  std::vector<std::vector<int32_t>> ids(2, std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7});
  EXPECT_NO_THROW(routing_stats(config, 2, ids, {}));
  ids[1][3] = 8;
  EXPECT_THROW(routing_stats(config, 2, ids, {}), InvalidArgument);
  ids[1][3] = 2;
  EXPECT_THROW(routing_stats(config, 2, ids, {}), InvalidArgument);
  ids.pop_back();
  EXPECT_THROW(routing_stats(config, 2, ids, {}), InvalidArgument);
}

TEST(RandomRouting, IsValidDeterministicSkewedAndPadded) {
  const Config config = small_config(/*T=*/200, 64, 64, /*E=*/16, /*K=*/4);
  Options options;
  options.scores_dtype = DType::bf16;
  const RandomInputsSpec spec{.seed = 9, .skew = 3.0, .padding_rows = 5};
  const RandomRouting a = random_routing(config, 4, spec, options);
  const RandomRouting b = random_routing(config, 4, spec, options);
  EXPECT_EQ(a.ids_TK, b.ids_TK);
  EXPECT_EQ(a.scores_TK, b.scores_TK);
  EXPECT_NE(a.ids_TK[0], a.ids_TK[1]);  // every rank draws its own
  const RoutingStats stats = routing_stats(config, 4, a.ids_TK, options);  // validates the ids
  EXPECT_GT(stats.owner_peak_over_mean(), 2.0);
  EXPECT_EQ(stats.owner_rows[0], *std::max_element(stats.owner_rows.begin(), stats.owner_rows.end()));
  for (const std::vector<float>& scores : a.scores_TK) {
    for (int64_t t = 0; t < 200; ++t) {
      float sum = 0.0f;
      for (int64_t k = 0; k < 4; ++k) {
        EXPECT_TRUE(is_bf16_value(scores[t * 4 + k]));
        sum += scores[t * 4 + k];
      }
      if (t >= 195) EXPECT_EQ(sum, 0.0f);
      else EXPECT_NEAR(sum, 1.0f, 0.02f);
    }
  }
  EXPECT_THROW(random_routing(config, 4, {.seed = 1, .skew = 0.5}, options), InvalidArgument);
  EXPECT_THROW(random_routing(config, 4, {.seed = 1, .skew = 1.0, .padding_rows = 201}, options), InvalidArgument);
}

// activation, scores dtype, w13 layout
using SampledCase = std::tuple<Activation, DType, W13Layout>;
class SampledVsDense : public ::testing::TestWithParam<SampledCase> {};

TEST_P(SampledVsDense, SampledTokensMatchTheDenseOracle) {
  const auto [activation, scores_dtype, layout] = GetParam();
  const int64_t R = 4, T = 20, D = 128, K = 3;
  Config config = small_config(T, D, /*F=*/64, /*E=*/4 * R, K);
  config.activation = activation;
  config.swiglu_limit = 0.75;  // clamps many elements (used by swiglu_clamped only)
  Options options;
  options.scores_dtype = scores_dtype;
  options.w13_layout = layout;
  const auto inputs = random_inputs(config, R, {.seed = 5, .skew = 2.0, .padding_rows = 2}, options);
  const auto grad_out = random_grad_out(config, R, 6);
  const DenseFloat64Result want = dense_float64(config, R, inputs, grad_out, options);

  // A few tokens of every rank, the last (a padding row) among them.
  const std::vector<std::vector<int64_t>> picks = {{0, 7, T - 1}, {3, 11}, {T - 1}, {1, 2, 3, 4, 5}};
  const std::vector<SampledToken> tokens = sample_tokens(config, R, inputs, grad_out, picks);
  ASSERT_EQ(tokens.size(), 11u);
  std::set<int64_t> fetched;
  const ExpertWeightsFn from_inputs = expert_weights_from(config, R, inputs);
  const SampledFloat64Result got = sampled_float64(
      config, R, tokens,
      [&](int64_t e, std::vector<float>& w13, std::vector<float>& w2) {
        EXPECT_TRUE(fetched.insert(e).second) << "expert " << e << " fetched twice";
        from_inputs(e, w13, w2);
      },
      options, /*threads=*/3);
  std::set<int64_t> visited;
  for (const SampledToken& s : tokens) visited.insert(s.ids_K.begin(), s.ids_K.end());
  EXPECT_EQ(fetched, visited);

  ASSERT_EQ(got.out_D.size(), tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int64_t r = tokens[i].rank, t = tokens[i].token;
    for (int64_t d = 0; d < D; ++d) {
      EXPECT_NEAR(got.out_D[i][d], want.out_TD[r][t * D + d], 1e-12) << "out r" << r << " t" << t;
      EXPECT_NEAR(got.grad_x_D[i][d], want.grad_x_TD[r][t * D + d], 1e-12) << "grad_x r" << r << " t" << t;
    }
    for (int64_t k = 0; k < K; ++k) {
      EXPECT_NEAR(got.grad_scores_K[i][k], want.grad_scores_TK[r][t * K + k], 1e-12) << "grad_scores r" << r;
    }
  }
  // The padding token's out is zero; its grad_scores are not (they are <grad_out, y>).
  for (double v : got.out_D[2]) EXPECT_EQ(v, 0.0);
}

INSTANTIATE_TEST_SUITE_P(Sweep, SampledVsDense,
                         ::testing::Combine(::testing::Values(Activation::swiglu, Activation::swiglu_clamped),
                                            ::testing::Values(DType::fp32, DType::bf16),
                                            ::testing::Values(W13Layout::gate_up_blocked,
                                                              W13Layout::gate_up_interleaved)));

TEST(SampledFloat64, RejectsBadTokensAndWeights) {
  const Config config = small_config(4, 64, 64, 8, 2);
  SampledToken token{0, 0, std::vector<float>(64, 1.0f), {0, 5}, {0.5f, 0.5f}, std::vector<float>(64, 1.0f)};
  const ExpertWeightsFn zeros = [](int64_t, std::vector<float>& w13, std::vector<float>& w2) {
    w13.assign(2 * 64 * 64, 0.0f);
    w2.assign(64 * 64, 0.0f);
  };
  EXPECT_NO_THROW(sampled_float64(config, 2, {token}, zeros, {}));
  EXPECT_THROW(sampled_float64(config, 2, {token}, [](int64_t, auto&, auto&) {}, {}), InvalidArgument);
  token.ids_K = {5, 5};
  EXPECT_THROW(sampled_float64(config, 2, {token}, zeros, {}), InvalidArgument);
  token.ids_K = {0, 8};
  EXPECT_THROW(sampled_float64(config, 2, {token}, zeros, {}), InvalidArgument);
}

}  // namespace
}  // namespace poise::reference::testing
