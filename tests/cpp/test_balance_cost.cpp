// The cost-aware balance plan (src/balance/balance_cost.*): a plan's predicted time, and the row
// limit choice among exact balance, tolerances and capacity mode, at DeepSeek-V3's per-rank shape
// with rates of the order measured on 2 H200 (bench/results/multigpu_h200.json):
//  - balanced routing moves nothing; one hot expert pays for its replicas; skew spread thinly over
//    many experts does not (each replica carries 264 MB for ~1000 rows);
//  - on random routings the choice is never predicted slower than exact balance or capacity mode.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "balance/balance_cost.hpp"
#include "core/workspace_layout.hpp"
#include "poise/errors.hpp"
#include "testing/rejected_name.hpp"

namespace poise::plan {

using poise::testing::rejected_name;
namespace {

constexpr int64_t kC = 4096 * 8;  // T*K rows per rank
constexpr double kD = 7168, kF = 2048;

// Fitted to 2 x H200 at 3b703cf (bench/balance_sim): forward + backward GEMMs 414 ns per row plus
// 46.6 us per expert group; 385 bytes/ns per link direction; bf16 weights out, fp32 gradients back.
shared::BalanceCostRates deepseek_rates() {
  shared::BalanceCostRates r;
  r.expert_ns_per_row = 414.0f;
  r.expert_ns_per_group = 46600.0f;
  r.link_bytes_per_ns = 385.0f;
  r.replica_bytes = float(6 * kF * kD + 12 * kF * kD);
  return r;
}

std::vector<int64_t> uniform_counts(int64_t R, int64_t E) {
  std::vector<int64_t> counts(E, R * kC / E);
  for (int64_t i = 0; i < R * kC % E; ++i) counts[i] += 1;
  return counts;
}

int64_t total_replicas(const SharedPlanRun& run) {
  return std::accumulate(run.replicas.begin(), run.replicas.end(), int64_t{0});
}

TEST(BalanceCost, BalancedRoutingMovesNothing) {
  const auto counts = uniform_counts(8, 256);
  const CostAwareChoice choice = choose_row_limit(counts, 8, kC, 32, 2 * kC, deepseek_rates());
  EXPECT_EQ(choice.row_limit, kC);
  EXPECT_EQ(total_replicas(choice.plan), 0);
  EXPECT_FLOAT_EQ(choice.plan.predicted_ns, float(kC) * 414.0f + 32 * 46600.0f);
}

TEST(BalanceCost, OneHotExpertPaysForItsReplicas) {
  auto counts = uniform_counts(8, 256);
  const int64_t hot = 8 * kC / 4;  // a quarter of all rows to expert 3 (rank 0), the rest spread
  for (int64_t e = 0; e < 256; ++e) counts[e] = (8 * kC - hot) / 256;
  counts[3] += hot;
  counts[0] += 8 * kC - std::accumulate(counts.begin(), counts.end(), int64_t{0});
  const int64_t owner_load = std::accumulate(counts.begin(), counts.begin() + 32, int64_t{0});
  const CostAwareChoice choice = choose_row_limit(counts, 8, kC, 32, owner_load, deepseek_rates());
  EXPECT_GT(total_replicas(choice.plan), 0);
  EXPECT_LT(choice.plan.predicted_ns, 0.6 * choice.candidates_ns.back()) << "capacity mode: rank 0 holds 2.75 C rows";
  EXPECT_LT(choice.row_limit, owner_load);
}

TEST(BalanceCost, SkewSpreadOverManyExpertsStaysHome) {
  // EP2 (128 experts per rank, 256 rows each): rank 0's experts each hold 20% more rows, rank 1's
  // 20% fewer. A replica carries at most ~310 rows of work (0.18 ms) for 264 MB of link traffic
  // (0.69 ms): exact balance replicates ~21 experts and loses; the choice keeps the rows home.
  auto counts = uniform_counts(2, 256);
  for (int64_t e = 0; e < 128; ++e) {
    const int64_t shift = counts[e] / 5;
    counts[e] += shift;
    counts[128 + e] -= shift;
  }
  const shared::BalanceCostRates rates = deepseek_rates();
  const CostAwareChoice choice = choose_row_limit(counts, 2, kC, 128, 2 * kC, rates);
  const SharedPlanRun exact = run_shared_planner(counts, 2, kC, kC, 128, rates);
  EXPECT_GT(total_replicas(exact), 16) << "exact balance replicates many experts here";
  EXPECT_EQ(total_replicas(choice.plan), 0);
  EXPECT_LT(choice.plan.predicted_ns, 0.8 * exact.predicted_ns);
}

TEST(BalanceCost, NeverPredictedSlowerThanExactOrCapacity) {
  std::mt19937_64 rng(11);
  for (int64_t R : {2, 4, 8}) {
    for (double spread : {0.0, 0.5, 1.0, 2.0}) {
      for (int trial = 0; trial < 20; ++trial) {
        const int64_t E = R * 32, total = R * kC / 8;  // C/8 rows per rank keeps the test quick
        std::lognormal_distribution<double> popularity(0.0, spread);
        std::vector<double> weight(E);
        for (double& w : weight) w = popularity(rng);
        std::discrete_distribution<int64_t> pick(weight.begin(), weight.end());
        std::vector<int64_t> counts(E, 0);
        for (int64_t i = 0; i < total; ++i) counts[pick(rng)] += 1;
        int64_t max_load = 0;
        for (int64_t r = 0; r < R; ++r)
          max_load = std::max(max_load, std::accumulate(counts.begin() + r * 32, counts.begin() + (r + 1) * 32, int64_t{0}));
        const CostAwareChoice c = choose_row_limit(counts, R, kC / 8, 32, std::max(max_load, kC / 8), deepseek_rates());
        EXPECT_LE(c.plan.predicted_ns, c.candidates_ns.front()) << "exact balance";
        EXPECT_LE(c.plan.predicted_ns, c.candidates_ns.back()) << "capacity mode";
        EXPECT_EQ(total_replicas(run_shared_planner(counts, R, kC / 8, c.candidate_row_limits.back(), 32)), 0)
            << "the last candidate holds every owner's load: nothing moves";
        EXPECT_TRUE(c.plan.exact);
        for (int64_t rows : c.plan.computed_rows) EXPECT_LE(rows, c.row_limit);
      }
    }
  }
}

TEST(BalanceCost, AFreeLinkMeansExactBalance) {
  auto counts = uniform_counts(4, 64);  // 2048 rows per expert
  counts[0] += 1500;
  counts[63] -= 1500;
  shared::BalanceCostRates free_link = deepseek_rates();
  free_link.replica_bytes = 0.0f;
  const CostAwareChoice choice = choose_row_limit(counts, 4, kC, 16, 2 * kC, free_link);
  EXPECT_EQ(choice.row_limit, kC);
  for (int64_t rows : choice.plan.computed_rows) EXPECT_EQ(rows, kC);
}

// A Config with the cost-aware rates: its plan is the cost-aware choice among row limits up to the
// receive buffers' (layout::row_limit), the plan the planner kernel makes (tests/gpu/test_ep_balance).
Config deepseek_rank_config(double link_gb_per_s) {
  Config c;
  c.num_local_input_tokens = 4096;
  c.hidden_dim = int64_t(kD);
  c.intermediate_dim = int64_t(kF);
  c.top_k = 8;
  c.num_experts = 256;
  c.balance_cost_ns_per_row = 414;
  c.balance_cost_ns_per_group = 46600;
  c.balance_link_gb_per_s = link_gb_per_s;
  return c;
}

TEST(BalanceCost, ConfigRatesCountAReplicasBytesBothWays) {
  Config c = deepseek_rank_config(385);
  c.replica_grad_dtype = DType::fp32;
  const shared::BalanceCostRates rates = balance_cost_rates(c);
  EXPECT_FLOAT_EQ(rates.replica_bytes, deepseek_rates().replica_bytes);  // bf16 weights out, fp32 grads back
  EXPECT_FLOAT_EQ(rates.link_bytes_per_ns, 385.0f);
  EXPECT_FLOAT_EQ(rates.expert_ns_per_group, 46600.0f);
  c.replica_grad_dtype = DType::bf16;  // the default
  EXPECT_FLOAT_EQ(balance_cost_rates(c).replica_bytes, float(3 * kF * kD * 4));
  c.inference = true;
  EXPECT_FLOAT_EQ(balance_cost_rates(c).replica_bytes, float(3 * kF * kD * 2));  // weights only
  c.balance_link_gb_per_s = 0;
  EXPECT_EQ(rejected_name([&] { balance_cost_rates(c); }), "balance_cost_ns_per_row");
}

TEST(BalanceCost, ExactModePlanFollowsTheConfig) {
  auto counts = uniform_counts(8, 256);  // 1024 rows per expert
  counts[0] += 6000;  // one hot expert: its owner holds kC + 6000 rows
  for (int64_t e = 1; e <= 6; ++e) counts[e * 32 + 5] -= 1000;
  Config plain = deepseek_rank_config(385);
  plain.balance_cost_ns_per_row = plain.balance_link_gb_per_s = 0;
  const BalancePlan exact = plan_exact_balance(counts, 8, kC, 32);
  const BalancePlan got_plain = exact_mode_plan(plain, counts, 8, kC, 32);
  EXPECT_EQ(got_plain.computed_rows, exact.computed_rows);
  EXPECT_EQ(got_plain.pieces.size(), exact.pieces.size());

  // The cost-aware choice, as a BalancePlan: the same pieces as the shared planner's run.
  const Config cost = deepseek_rank_config(385);
  EXPECT_EQ(layout::row_limit(cost), 2 * kC);  // receive_capacity_factor 2: capacity mode's rows
  const CostAwareChoice choice = choose_row_limit(counts, 8, kC, 32, 2 * kC, balance_cost_rates(cost));
  const BalancePlan got = exact_mode_plan(cost, counts, 8, kC, 32);
  EXPECT_EQ(got.computed_rows, choice.plan.computed_rows);
  EXPECT_EQ(got.replicas, choice.plan.replicas);
  EXPECT_EQ(got.moved_rows, choice.plan.moved_rows);
  ASSERT_EQ(got.pieces.size(), choice.plan.pieces.size());
  for (size_t i = 0; i < got.pieces.size(); ++i) {
    EXPECT_EQ(got.pieces[i].expert, choice.plan.pieces[i].expert);
    EXPECT_EQ(got.pieces[i].rank, choice.plan.pieces[i].rank);
    EXPECT_EQ(got.pieces[i].begin, choice.plan.pieces[i].begin);
  }
  // A dear link keeps every row home (the owner's 1.18 C rows fit the limit); a free one balances exactly.
  const BalancePlan dear = exact_mode_plan(deepseek_rank_config(0.001), counts, 8, kC, 32);
  EXPECT_EQ(dear.moved_rows, 0);
  const BalancePlan free_link = exact_mode_plan(deepseek_rank_config(1e9), counts, 8, kC, 32);
  for (int64_t rows : free_link.computed_rows) EXPECT_EQ(rows, kC);
}

TEST(BalanceCost, BadArgumentsAreNamed) {
  auto counts = uniform_counts(2, 8);
  EXPECT_EQ(rejected_name([&] { choose_row_limit(counts, 2, kC, 4, 2 * kC, {}); }), "rates");
  EXPECT_EQ(rejected_name([&] { run_shared_planner(counts, 2, kC, kC - 1, 4); }), "row_limit");
  EXPECT_EQ(rejected_name([&] { run_shared_planner(counts, 2, kC, kC, -1); }), "replica_slots");
  counts[7] -= 5 * kC;  // negative
  counts[0] += 5 * kC;
  EXPECT_EQ(rejected_name([&] { run_shared_planner(counts, 2, kC, kC, 4); }), "expert_counts");
}

}  // namespace
}  // namespace poise::plan
