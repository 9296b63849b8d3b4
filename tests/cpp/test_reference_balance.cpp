// Balance modes of the reference engine on adversarial routings: exact balance (replicas, donors
// that overshoot, the slot-limited fallback) gives the results of the unbalanced computation, both
// match float64, and capacity overflow is reported, never dropped.
#include <algorithm>
#include <numeric>
#include <random>

#include "test_reference_support.hpp"

namespace poise::reference::testing {
namespace {

using IdsFor = std::function<std::vector<int32_t>(int64_t rank, int64_t token, std::mt19937_64& rng)>;

// Replaces every token's expert ids (scores, x and weights stay as drawn).
void reroute(std::vector<RankInputs>& inputs, int64_t K, const IdsFor& ids_for) {
  std::mt19937_64 rng(1234);
  for (int64_t r = 0; r < static_cast<int64_t>(inputs.size()); ++r) {
    const int64_t T = static_cast<int64_t>(inputs[r].ids_TK.size()) / K;
    for (int64_t t = 0; t < T; ++t) {
      const std::vector<int32_t> ids = ids_for(r, t, rng);
      std::copy(ids.begin(), ids.end(), inputs[r].ids_TK.begin() + t * K);
    }
  }
}

// K distinct experts drawn uniformly from `allowed`.
std::vector<int32_t> pick(std::vector<int32_t> allowed, int64_t K, std::mt19937_64& rng) {
  std::shuffle(allowed.begin(), allowed.end(), rng);
  allowed.resize(K);
  return allowed;
}

std::vector<int32_t> experts_where(int64_t E, const std::function<bool(int32_t)>& keep) {
  std::vector<int32_t> experts;
  for (int32_t e = 0; e < E; ++e) {
    if (keep(e)) experts.push_back(e);
  }
  return experts;
}

struct Scenario {
  std::string name;
  Config config;
  int64_t ranks;
  std::vector<RankInputs> inputs;
};

// Runs exact and capacity on the same inputs; checks both against float64 and against each other.
struct BothStats {
  RoutingStats exact, capacity;
};

// Returns both runs' routing stats.
BothStats check_exact_equals_capacity(const Scenario& s, Options options = {}) {
  const auto grad_out = random_grad_out(s.config, s.ranks, 5);
  Config exact = s.config, capacity = s.config;
  exact.balance = Balance::exact;
  capacity.balance = Balance::capacity;
  Config exact_fp32 = exact;  // replica weight gradients returned in fp32 (bf16 by default)
  exact_fp32.replica_grad_dtype = DType::fp32;
  const RunResult balanced = run_engine(exact, s.ranks, options, s.inputs, grad_out);
  const RunResult balanced_fp32 = run_engine(exact_fp32, s.ranks, options, s.inputs, grad_out);
  const RunResult unbalanced = run_engine(capacity, s.ranks, options, s.inputs, grad_out);
  const DenseFloat64Result want = dense_float64(s.config, s.ranks, s.inputs, grad_out, options);
  expect_matches_dense(balanced, want, 1e-2, s.name + " exact");
  expect_matches_dense(unbalanced, want, 1e-2, s.name + " capacity");

  // Row results do not depend on which rank computed the row: bitwise equal.
  for (int64_t r = 0; r < s.ranks; ++r) {
    const std::string at = s.name + " rank " + std::to_string(r) + " ";
    expect_bitwise_equal(balanced.out_TD[r], unbalanced.out_TD[r], at + "out_TD");
    expect_bitwise_equal(balanced.grads[r].grad_x_TD, unbalanced.grads[r].grad_x_TD, at + "grad_x_TD");
    expect_bitwise_equal(balanced.grads[r].grad_scores_TK, unbalanced.grads[r].grad_scores_TK, at + "grad_scores_TK");
  }
  // Weight grads: replica partial sums are added at the owner, so with fp32 replica grads only the
  // fp32 order differs; in bf16 (the default) each replica's share is rounded once to bf16 on its
  // way (at most half a bf16 ulp, 2^-9, of that share).
  const auto grad_w13 = [](const RankGradients& g) { return g.grad_w13; };
  const auto grad_w2 = [](const RankGradients& g) { return g.grad_w2; };
  auto as_double = [](const std::vector<std::vector<float>>& v) {
    std::vector<std::vector<double>> d;
    for (const auto& x : v) d.emplace_back(x.begin(), x.end());
    return d;
  };
  expect_matches_dense(balanced_fp32, want, 1e-2, s.name + " exact, fp32 replica grads");
  using GradOf = std::function<std::vector<float>(const RankGradients&)>;
  const GradOf weight_grads[] = {grad_w13, grad_w2};
  for (const GradOf& grad : weight_grads) {
    const auto capacity_grads = as_double(per_rank(unbalanced.grads, grad));
    EXPECT_LT(relative_error(per_rank(balanced_fp32.grads, grad), capacity_grads), 1e-5) << s.name;
    EXPECT_LT(relative_error(per_rank(balanced.grads, grad), capacity_grads), 4e-3) << s.name << " (bf16 replica grads)";
    if (balanced.stats.moved_rows > 0 && s.config.wgrad_dtype == DType::fp32) {
      EXPECT_NE(per_rank(balanced.grads, grad), per_rank(balanced_fp32.grads, grad))
          << s.name << ": replica grads travelled in bf16, so the owners' sums differ from the fp32 ones";
    }
  }

  // Capacity mode computes every expert at home; exact mode computes T*K rows everywhere.
  EXPECT_EQ(unbalanced.stats.computed_rows, unbalanced.stats.owner_rows);
  EXPECT_EQ(unbalanced.stats.moved_rows, 0);
  const int64_t TK = s.config.num_local_input_tokens * s.config.top_k;
  if (balanced.stats.unplaced_surplus_rows == 0) {
    for (int64_t rows : balanced.stats.computed_rows) EXPECT_EQ(rows, TK) << s.name;
  }
  for (int64_t r = 0; r < s.ranks; ++r) {
    EXPECT_LE(balanced.stats.computed_rows[r], balanced.stats.grouped_rows[r]);
    EXPECT_EQ(balanced.stats.grouped_rows[r] % kExpertRowAlignment, 0);
  }
  return {balanced.stats, unbalanced.stats};
}

Scenario make(const std::string& name, int64_t ranks, int64_t local, int64_t K, uint64_t seed = 3) {
  Scenario s{name, small_config(/*T=*/32, /*D=*/128, /*F=*/192, local * ranks, K), ranks, {}};
  s.inputs = random_inputs(s.config, ranks, {.seed = seed, .skew = 1.0, .padding_rows = 2}, {});
  return s;
}

TEST(ReferenceBalance, RandomSkewedRouting) {
  for (int64_t ranks : {2, 4, 8}) {
    Scenario s = make("skew 3, R=" + std::to_string(ranks), ranks, 4, 4);
    s.inputs = random_inputs(s.config, ranks, {.seed = 21, .skew = 3.0, .padding_rows = 2}, {});
    const RoutingStats stats = check_exact_equals_capacity(s).exact;
    EXPECT_GT(stats.owner_peak_over_mean(), 1.5) << s.name;
    EXPECT_DOUBLE_EQ(stats.computed_peak_over_mean(), 1.0) << s.name;
    EXPECT_GT(std::accumulate(stats.replicas.begin(), stats.replicas.end(), int64_t{0}), 0) << s.name;
  }
}

TEST(ReferenceBalance, AllTokensToOneExpert) {
  // K = 1 and every token of every rank picks expert 1: it is split over all ranks.
  for (int64_t ranks : {1, 2, 4, 8}) {
    Scenario s = make("one expert, R=" + std::to_string(ranks), ranks, 2, 1);
    reroute(s.inputs, 1, [](int64_t, int64_t, std::mt19937_64&) { return std::vector<int32_t>{1}; });
    const RoutingStats stats = check_exact_equals_capacity(s).exact;
    EXPECT_EQ(stats.expert_rows[1], 32 * ranks);
    EXPECT_EQ(stats.moved_rows, 32 * (ranks - 1));
    for (int64_t r = 1; r < ranks; ++r) EXPECT_EQ(stats.replicas[r], 1);
  }
}

TEST(ReferenceBalance, AllTokensToOneRank) {
  // Every token picks its 4 experts among rank 1's 4: rank 1 owns 4x the mean.
  for (int64_t ranks : {2, 4, 8}) {
    Scenario s = make("one rank, R=" + std::to_string(ranks), ranks, 4, 4);
    const auto on_rank_1 = experts_where(s.config.num_experts, [](int32_t e) { return e / 4 == 1; });
    reroute(s.inputs, 4, [&](int64_t, int64_t, std::mt19937_64& rng) { return pick(on_rank_1, 4, rng); });
    const BothStats stats = check_exact_equals_capacity(s);
    EXPECT_DOUBLE_EQ(stats.exact.owner_peak_over_mean(), static_cast<double>(ranks));
    // Unbalanced, rank 1 computes all 4 rows of every token, but each token crosses to it once.
    EXPECT_EQ(stats.capacity.computed_rows[1], 4 * 32 * ranks);
    EXPECT_EQ(stats.capacity.received_token_rows[1], 32 * ranks);
  }
}

TEST(ReferenceBalance, ARankWhoseExpertsAreNeverChosen) {
  for (int64_t ranks : {2, 4, 8}) {
    Scenario s = make("idle rank, R=" + std::to_string(ranks), ranks, 4, 4);
    const int64_t idle = ranks - 1;
    const auto elsewhere = experts_where(s.config.num_experts, [&](int32_t e) { return e / 4 != idle; });
    reroute(s.inputs, 4, [&](int64_t, int64_t, std::mt19937_64& rng) { return pick(elsewhere, 4, rng); });
    const RoutingStats stats = check_exact_equals_capacity(s).exact;
    EXPECT_EQ(stats.owner_rows[idle], 0);
    EXPECT_EQ(stats.computed_rows[idle], 32 * 4) << "the idle rank computes replicas";
  }
}

// Token ids whose expert counts are exactly `counts` (each token takes the K experts with the most
// rows still to place).
void route_to_counts(Scenario& s, std::vector<int64_t> counts) {
  const int64_t K = s.config.top_k, E = s.config.num_experts;
  reroute(s.inputs, K, [&](int64_t, int64_t, std::mt19937_64&) {
    std::vector<int32_t> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return counts[a] > counts[b]; });
    order.resize(K);
    for (int32_t e : order) counts[e] -= 1;
    return order;
  });
  for (int64_t c : counts) ASSERT_EQ(c, 0) << "counts not realizable";
}

TEST(ReferenceBalance, DonorOvershootsWhenSlotsForceIt) {
  // docs/balance.md's example: ranks 0-2 10% over, rank 3 30% under, E_local = B = 2.
  Scenario s = make("overshoot", 4, 2, 5);
  s.config.num_local_input_tokens = 20;  // T*K = 100 rows per rank
  s.inputs = random_inputs(s.config, 4, {.seed = 8}, {});
  route_to_counts(s, {55, 55, 55, 55, 55, 55, 35, 35});
  const RoutingStats stats = check_exact_equals_capacity(s).exact;
  EXPECT_EQ(stats.surplus_rows, 30);
  EXPECT_EQ(stats.moved_rows, 40);
  EXPECT_EQ(stats.unplaced_surplus_rows, 0);
}

TEST(ReferenceBalance, TooFewReplicaSlotsFallBackAndReport) {
  Scenario s = make("B=1", 2, 4, 4);
  const auto on_rank_0 = experts_where(s.config.num_experts, [](int32_t e) { return e < 4; });
  reroute(s.inputs, 4, [&](int64_t, int64_t, std::mt19937_64& rng) { return pick(on_rank_0, 4, rng); });
  Options options;
  options.replica_slots = 1;
  const RoutingStats stats = check_exact_equals_capacity(s, options).exact;
  EXPECT_GT(stats.unplaced_surplus_rows, 0);
  EXPECT_EQ(stats.replicas[1], 1);
  EXPECT_EQ(stats.computed_rows[0], 32 * 4 + stats.unplaced_surplus_rows);
}

TEST(ReferenceBalance, CapacityOverflowIsReportedNotDropped) {
  Scenario s = make("overflow", 4, 2, 2);
  const auto on_rank_2 = experts_where(s.config.num_experts, [](int32_t e) { return e / 2 == 2; });
  // Rank 2's experts take 3 of every 4 tokens' first pick: rank 2 owns more than T*K rows.
  reroute(s.inputs, 2, [&](int64_t, int64_t t, std::mt19937_64& rng) {
    if (t % 4 == 3) return pick(experts_where(8, [](int32_t e) { return e / 2 != 2; }), 2, rng);
    return pick(on_rank_2, 2, rng);
  });
  Config config = s.config;
  config.balance = Balance::capacity;
  config.receive_capacity_factor = 1.5;
  Engine engine(config, 4, {});
  try {
    engine.forward(s.inputs);
    FAIL() << "no CapacityExceeded";
  } catch (const CapacityExceeded& e) {
    EXPECT_EQ(e.rank(), 2);
    EXPECT_EQ(e.capacity_rows(), 96);  // 1.5 * 32 * 2
    EXPECT_GT(e.rows(), 96);
    EXPECT_NE(std::string(e.what()).find("rank 2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(std::to_string(e.rows())), std::string::npos) << e.what();
  }
  std::vector<RankGradients> grads;
  EXPECT_THROW(engine.backward(s.inputs, random_grad_out(config, 4, 1), grads), std::logic_error);

  // With room for every row the same call runs.
  config.receive_capacity_factor = 4.0;
  Engine roomy(config, 4, {});
  EXPECT_NO_THROW(roomy.forward(s.inputs));
  EXPECT_GT(roomy.routing_stats().computed_rows[2], 96);
}

}  // namespace
}  // namespace poise::reference::testing
