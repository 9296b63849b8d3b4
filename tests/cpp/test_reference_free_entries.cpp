// Free entries (ids_TK == kNoExpert, DeepEP's -1) in the reference engine: not routed, adding
// nothing to out_TD whatever their score, zero grad_scores; the rest matches float64, and a free
// entry gives bitwise the same out_TD and grad_x_TD as the same entry routed with score zero.
#include <algorithm>
#include <tuple>

#include "test_reference_support.hpp"

namespace poise::reference::testing {
namespace {

using Case = std::tuple<int, Balance>;  // ranks, balance

class FreeEntries : public ::testing::TestWithParam<Case> {
 protected:
  Config config() const {
    const auto [ranks, balance] = GetParam();
    return small_config(/*T=*/24, /*D=*/192, /*F=*/64, /*E=*/4 * ranks, /*K=*/4, balance);
  }
  // 40% of entries free, their scores kept (nonzero); rank 0's token 5 entirely free.
  std::vector<RankInputs> inputs(const Config& c, int ranks) const {
    auto in = random_inputs(c, ranks, {.seed = 31u + ranks, .skew = 2.0, .free_fraction = 0.4}, {});
    std::fill_n(in[0].ids_TK.begin() + 5 * c.top_k, c.top_k, kNoExpert);
    return in;
  }
};

TEST_P(FreeEntries, AddNothingAndMatchFloat64) {
  const int ranks = std::get<0>(GetParam());
  const Config c = config();
  const auto in = inputs(c, ranks);
  const auto grad_out = random_grad_out(c, ranks, 7);
  const RunResult got = run_engine(c, ranks, {}, in, grad_out);
  expect_matches_dense(got, dense_float64(c, ranks, in, grad_out, {}), 1e-2, "R=" + std::to_string(ranks));

  const int64_t T = c.num_local_input_tokens, D = c.hidden_dim, K = c.top_k;
  int64_t routed = 0, free_with_score = 0;
  for (int r = 0; r < ranks; ++r) {
    for (int64_t i = 0; i < T * K; ++i) {
      if (in[r].ids_TK[i] != kNoExpert) {
        ++routed;
        continue;
      }
      free_with_score += in[r].scores_TK[i] != 0.0f;
      ASSERT_EQ(got.grads[r].grad_scores_TK[i], 0.0f) << "rank " << r << " entry " << i;
    }
  }
  EXPECT_GT(free_with_score, 0) << "no free entry carried a score: the check compares nothing";
  for (int64_t d = 0; d < D; ++d) {  // the all-free token
    ASSERT_EQ(got.out_TD[0][5 * D + d], 0.0f);
    ASSERT_EQ(got.grads[0].grad_x_TD[5 * D + d], 0.0f);
  }
  // Only routed entries become rows; exact balance spreads them evenly.
  int64_t rows = 0, most = 0;
  for (int64_t e : got.stats.expert_rows) rows += e;
  for (int64_t r : got.stats.computed_rows) most = std::max(most, r);
  EXPECT_EQ(rows, routed);
  if (c.balance == Balance::exact) EXPECT_EQ(most, (routed + ranks - 1) / ranks);
}

TEST_P(FreeEntries, EqualARoutedEntryWithScoreZero) {
  const int ranks = std::get<0>(GetParam());
  const Config c = config();
  const auto in = inputs(c, ranks);
  // The same call with every free entry routed to an expert the token does not pick, score 0.
  auto routed = in;
  const int64_t K = c.top_k;
  for (RankInputs& r : routed) {
    for (size_t i = 0; i < r.ids_TK.size(); ++i) {
      if (r.ids_TK[i] != kNoExpert) continue;
      const auto token = r.ids_TK.begin() + (i / K) * K;
      int32_t e = 0;
      while (std::find(token, token + K, e) != token + K) ++e;
      r.ids_TK[i] = e;
      r.scores_TK[i] = 0.0f;
    }
  }
  const auto grad_out = random_grad_out(c, ranks, 8);
  const RunResult free_run = run_engine(c, ranks, {}, in, grad_out);
  const RunResult zero_run = run_engine(c, ranks, {}, routed, grad_out);
  for (int r = 0; r < ranks; ++r) {
    expect_bitwise_equal(free_run.out_TD[r], zero_run.out_TD[r], "out_TD rank " + std::to_string(r));
    expect_bitwise_equal(free_run.grads[r].grad_x_TD, zero_run.grads[r].grad_x_TD, "grad_x_TD rank " + std::to_string(r));
  }
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return "R" + std::to_string(std::get<0>(info.param)) + "_" + to_string(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Sweep, FreeEntries,
                         ::testing::Combine(::testing::Values(1, 2, 4), ::testing::Values(Balance::exact, Balance::capacity)),
                         case_name);

TEST(FreeEntries, EveryEntryFreeGivesZerosAndNoRows) {
  const Config c = small_config(16, 128, 64, 8, 2);
  const auto in = random_inputs(c, 2, {.seed = 3, .free_fraction = 1.0}, {});
  const RunResult got = run_engine(c, 2, {}, in, random_grad_out(c, 2, 4));
  for (int r = 0; r < 2; ++r) {
    for (float v : got.out_TD[r]) ASSERT_EQ(v, 0.0f);
    for (float v : got.grads[r].grad_x_TD) ASSERT_EQ(v, 0.0f);
    for (float v : got.grads[r].grad_w13) ASSERT_EQ(v, 0.0f);
    for (int64_t rows : got.stats.computed_rows) ASSERT_EQ(rows, 0);
  }
}

TEST(FreeEntries, OtherNegativeIdsAreStillRejected) {
  const Config c = small_config(16, 128, 64, 8, 2);
  auto in = random_inputs(c, 1, {.seed = 3}, {});
  in[0].ids_TK[4] = -2;
  try {
    Engine(c, 1, {}).forward(in);
    FAIL() << "ids_TK = -2 was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.name(), "ids_TK");
  }
}

}  // namespace
}  // namespace poise::reference::testing
