// plan_exact_balance: every rank computes exactly T*K rows, only the surplus of overloaded ranks
// moves, replica slots stay within B, and each expert's pieces tile its rows; on random and extreme
// count vectors. Also the limits argued in docs/balance.md (when B = E_local can fall short).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>

#include "balance/balance_plan.hpp"
#include "poise/errors.hpp"
#include "testing/rejected_name.hpp"

namespace poise::plan {

using poise::testing::rejected_name;
namespace {

int64_t owner_rows_of(const std::vector<int64_t>& counts, int64_t R, int64_t r) {
  const int64_t local = static_cast<int64_t>(counts.size()) / R;
  int64_t rows = 0;
  for (int64_t e = r * local; e < (r + 1) * local; ++e) rows += counts[e];
  return rows;
}

// The fewest experts of rank r whose rows can make up its surplus (largest experts first).
int64_t fewest_surplus_experts(const std::vector<int64_t>& counts, int64_t R, int64_t C, int64_t r) {
  const int64_t local = static_cast<int64_t>(counts.size()) / R;
  int64_t surplus = owner_rows_of(counts, R, r) - C;
  std::vector<int64_t> mine(counts.begin() + r * local, counts.begin() + (r + 1) * local);
  std::sort(mine.rbegin(), mine.rend());
  int64_t experts = 0;
  for (int64_t c : mine) {
    if (surplus <= 0) break;
    surplus -= c;
    ++experts;
  }
  return experts;
}

int64_t total_surplus(const std::vector<int64_t>& counts, int64_t R, int64_t C) {
  int64_t surplus = 0;
  for (int64_t r = 0; r < R; ++r) surplus += std::max<int64_t>(0, owner_rows_of(counts, R, r) - C);
  return surplus;
}

// Every property the plan promises, checked from the counts alone.
void check_plan(const BalancePlan& plan, const std::vector<int64_t>& counts, int64_t R, int64_t C, int64_t B) {
  const int64_t E = static_cast<int64_t>(counts.size()), local = E / R;
  ASSERT_EQ(plan.num_ranks, R);
  ASSERT_EQ(plan.num_local_experts, local);

  std::vector<int64_t> computed(R, 0), own_kept(R, 0), moved_out(R, 0), replicas(R, 0);
  std::set<std::pair<int64_t, int64_t>> expert_on_rank;  // (expert, rank): one piece each
  std::set<std::pair<int64_t, int64_t>> used_slots;      // (rank, slot): one expert each
  for (int64_t e = 0; e < E; ++e) {
    int64_t next = 0;
    const int64_t owner = e / local;
    for (const ExpertPiece& p : plan.pieces_of(e)) {
      // Each expert's pieces are non-empty and tile [0, count) in order.
      ASSERT_EQ(p.expert, e);
      ASSERT_GT(p.rows(), 0) << "empty piece of expert " << e;
      ASSERT_EQ(p.begin, next) << "expert " << e << " pieces leave a gap or overlap";
      next = p.end;
      computed[p.rank] += p.rows();
      ASSERT_TRUE(expert_on_rank.insert({e, p.rank}).second) << "expert " << e << " twice on rank " << p.rank;
      ASSERT_TRUE(used_slots.insert({p.rank, p.slot}).second) << "slot " << p.slot << " of rank " << p.rank << " reused";
      if (p.rank == owner) {
        ASSERT_EQ(p.slot, e % local) << "an owner computes its expert in its own slot";
        ASSERT_EQ(p.begin, 0) << "an owner keeps a prefix of its expert's rows";
        own_kept[owner] += p.rows();
      } else {
        moved_out[owner] += p.rows();
        replicas[p.rank] += 1;
        ASSERT_GE(p.slot, local);
        ASSERT_LT(p.slot, local + B) << "replica slot beyond B";
      }
    }
    ASSERT_EQ(next, counts[e]) << "expert " << e << " rows not covered exactly";
  }
  ASSERT_EQ(plan.computed_rows, computed);
  ASSERT_EQ(plan.replicas, replicas);

  int64_t moved = 0, over_capacity = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t owned = owner_rows_of(counts, R, r);
    ASSERT_EQ(plan.owner_rows[r], owned);
    ASSERT_LE(replicas[r], B);
    moved += moved_out[r];
    over_capacity += std::max<int64_t>(0, computed[r] - C);
    // A rank at or under capacity gives nothing away; a rank that takes replicas is under C with
    // its own rows, either from the start or because it gave beyond its surplus.
    if (owned <= C) ASSERT_EQ(moved_out[r], 0) << "rank " << r << " is not overloaded but gave rows";
    if (replicas[r] > 0) ASSERT_LT(own_kept[r], C) << "rank " << r;
    if (replicas[r] > 0 && moved_out[r] > 0) ASSERT_GT(moved_out[r], owned - C) << "rank " << r;
  }
  ASSERT_EQ(plan.moved_rows, moved);
  ASSERT_EQ(plan.unplaced_surplus_rows, over_capacity);
  const int64_t surplus = total_surplus(counts, R, C);
  if (plan.exact()) {
    for (int64_t r = 0; r < R; ++r) ASSERT_EQ(computed[r], C) << "rank " << r;
    ASSERT_GE(moved, surplus) << "an exact plan moves at least the surplus";
  } else {
    // The fallback moves surplus only and never fills a rank past C.
    for (int64_t r = 0; r < R; ++r) {
      ASSERT_LE(moved_out[r], std::max<int64_t>(0, owner_rows_of(counts, R, r) - C));
      if (owner_rows_of(counts, R, r) <= C) ASSERT_LE(computed[r], C);
    }
    ASSERT_EQ(moved + plan.unplaced_surplus_rows, surplus);
  }
}

// R*C rows spread over E experts by random popularity; heavy-tailed when spread is large.
std::vector<int64_t> random_counts(std::mt19937_64& rng, int64_t E, int64_t total, double spread) {
  std::normal_distribution<double> normal(0.0, spread);
  std::vector<double> weight(E);
  for (double& w : weight) w = std::exp(normal(rng));
  std::discrete_distribution<int64_t> pick(weight.begin(), weight.end());
  std::vector<int64_t> counts(E, 0);
  for (int64_t i = 0; i < total; ++i) counts[pick(rng)] += 1;
  return counts;
}

TEST(BalancePlan, UniformCountsMoveNothing) {
  const std::vector<int64_t> counts(16, 10);  // R = 4, E_local = 4, C = 40
  const BalancePlan plan = plan_exact_balance(counts, 4, 40, 4);
  check_plan(plan, counts, 4, 40, 4);
  EXPECT_TRUE(plan.exact());
  for (int64_t r = 0; r < 4; ++r) EXPECT_EQ(plan.replicas[r], 0);
  EXPECT_EQ(plan.pieces.size(), 16u);
}

TEST(BalancePlan, AllRowsOnOneExpertSpreadOverEveryRank) {
  for (int64_t R : {2, 3, 4, 8}) {
    std::vector<int64_t> counts(R * 2, 0);
    counts[1] = R * 64;  // C = 64; expert 1 lives on rank 0
    const BalancePlan plan = plan_exact_balance(counts, R, 64, 1);
    check_plan(plan, counts, R, 64, 1);
    EXPECT_TRUE(plan.exact());
    EXPECT_EQ(plan.pieces_of(1).size(), static_cast<size_t>(R));
  }
}

TEST(BalancePlan, AllRowsOnOneRankAndAnIdleRank) {
  // Rank 0 owns every row (over 4 experts); with R = 8 each other rank takes one piece or two.
  const int64_t R = 8, local = 4, C = 100;
  std::vector<int64_t> counts(R * local, 0);
  counts[0] = 350;
  counts[1] = 250;
  counts[2] = 150;
  counts[3] = 50;
  const BalancePlan plan = plan_exact_balance(counts, R, C, local);
  check_plan(plan, counts, R, C, local);
  EXPECT_TRUE(plan.exact());
  // Rank 0 keeps its smallest experts whole: 50 of expert 3, then 50 of expert 2.
  EXPECT_EQ(plan.pieces_of(3).size(), 1u);
  EXPECT_EQ(plan.pieces_of(3)[0].rank, 0);
}

TEST(BalancePlan, AlwaysExactWithTrainingSlots) {
  // B = E_local: exact for every count vector, random (light to heavy tails) and extreme.
  std::mt19937_64 rng(7);
  const int64_t ranks[] = {1, 2, 3, 4, 8, 16}, locals[] = {1, 2, 3, 4, 8};
  for (int trial = 0; trial < 1500; ++trial) {
    const int64_t R = ranks[trial % 6], local = locals[(trial / 6) % 5];
    const int64_t C = 1 + static_cast<int64_t>(rng() % 300);
    std::vector<int64_t> counts;
    if (trial % 10 == 9) {  // extreme: everything on a few random experts
      counts.assign(R * local, 0);
      for (int64_t i = 0; i < R * C; ++i) counts[rng() % std::min<int64_t>(3, R * local)] += 1;
      std::shuffle(counts.begin(), counts.end(), rng);
    } else {
      counts = random_counts(rng, R * local, R * C, 0.01 * (trial % 300));
    }
    SCOPED_TRACE("trial " + std::to_string(trial) + " R=" + std::to_string(R) + " E_local=" + std::to_string(local));
    const BalancePlan plan = plan_exact_balance(counts, R, C, local);
    check_plan(plan, counts, R, C, local);
    ASSERT_TRUE(plan.exact());
  }
}

TEST(BalancePlan, OnlySurplusMovesWhenSlotsAllow) {
  // With many experts per rank a taker never runs out of slots: exactly the surplus moves and
  // every owner keeps min(owner rows, C) of its own rows.
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t R = 2 + trial % 7, local = 16, C = 64 + static_cast<int64_t>(rng() % 512);
    const std::vector<int64_t> counts = random_counts(rng, R * local, R * C, 0.005 * (trial % 200));
    const BalancePlan plan = plan_exact_balance(counts, R, C, local);
    SCOPED_TRACE("trial " + std::to_string(trial));
    check_plan(plan, counts, R, C, local);
    ASSERT_TRUE(plan.exact());
    ASSERT_EQ(plan.moved_rows, total_surplus(counts, R, C));
    // The surplus leaves from the largest experts: the owner replicates as few as possible.
    std::set<int64_t> replicated;
    for (const ExpertPiece& p : plan.pieces) {
      if (p.rank != plan.owner_of(p.expert)) replicated.insert(p.expert);
    }
    int64_t fewest = 0;
    for (int64_t r = 0; r < R; ++r) fewest += fewest_surplus_experts(counts, R, C, r);
    ASSERT_EQ(static_cast<int64_t>(replicated.size()), fewest);
  }
}

TEST(BalancePlan, SurplusOnlyIsImpossibleHereSoADonorOvershoots) {
  // Three ranks 10 rows over capacity, one rank 30 under, 2 experts per rank: moving only surplus,
  // the under-loaded rank would host three experts (one per donor) with B = 2 slots. The plan
  // stays exact: rank 3 takes rank 0's surplus (10) and 20 rows from rank 1, which overshoots and
  // takes 10 back from rank 2.
  const std::vector<int64_t> counts = {55, 55, 55, 55, 55, 55, 35, 35};  // R = 4, C = 100
  const BalancePlan plan = plan_exact_balance(counts, 4, 100, 2);
  check_plan(plan, counts, 4, 100, 2);
  EXPECT_TRUE(plan.exact());
  EXPECT_GT(plan.moved_rows, total_surplus(counts, 4, 100));
  EXPECT_EQ(plan.moved_rows, 40);
  EXPECT_EQ(plan.replicas, (std::vector<int64_t>{0, 1, 0, 2}));
  const BalancePlan roomy = plan_exact_balance(counts, 4, 100, 3);  // three slots: surplus only
  check_plan(roomy, counts, 4, 100, 3);
  EXPECT_TRUE(roomy.exact());
  EXPECT_EQ(roomy.moved_rows, 30);
}

TEST(BalancePlan, TooFewSlotsFallBackToTheOwnerAndReportIt) {
  // B = 1 < E_local = 4: rank 1 can host one of rank 0's four experts, 50 rows; 50 stay on rank 0.
  const std::vector<int64_t> counts = {50, 50, 50, 50, 0, 0, 0, 0};  // R = 2, C = 100
  const BalancePlan plan = plan_exact_balance(counts, 2, 100, 1);
  check_plan(plan, counts, 2, 100, 1);
  EXPECT_FALSE(plan.exact());
  EXPECT_EQ(plan.unplaced_surplus_rows, 50);
  EXPECT_EQ(plan.computed_rows, (std::vector<int64_t>{150, 50}));

  const BalancePlan none = plan_exact_balance(counts, 2, 100, 0);  // no replica slots at all
  check_plan(none, counts, 2, 100, 0);
  EXPECT_EQ(none.unplaced_surplus_rows, 100);
  EXPECT_EQ(none.computed_rows, none.owner_rows);

  // Random sweep with B < E_local: whatever happens is reported consistently.
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t R = 2 + trial % 5, local = 4, B = trial % 4, C = 10 + static_cast<int64_t>(rng() % 200);
    const std::vector<int64_t> counts_r = random_counts(rng, R * local, R * C, 0.01 * (trial % 150));
    SCOPED_TRACE("trial " + std::to_string(trial));
    check_plan(plan_exact_balance(counts_r, R, C, B), counts_r, R, C, B);
  }
}

// Free entries (kNoExpert) leave fewer rows than R*C: the plan balances what there is, ceil(S/R)
// rows per rank at most, every expert's rows tiled, no rank over it with training slots.
TEST(BalancePlan, FewerRowsThanCapacityAreBalancedToTheirMean) {
  std::mt19937_64 rng(17);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t R = 1 + trial % 8, local = 1 + trial % 5, C = 20 + static_cast<int64_t>(rng() % 300);
    const int64_t S = trial % 10 == 0 ? 0 : static_cast<int64_t>(rng() % (R * C));  // S < R*C
    const std::vector<int64_t> counts = random_counts(rng, R * local, S, 0.02 * (trial % 100));
    SCOPED_TRACE("trial " + std::to_string(trial) + " R=" + std::to_string(R) + " S=" + std::to_string(S));
    const BalancePlan plan = plan_exact_balance(counts, R, C, local);
    const int64_t target = (S + R - 1) / R;
    EXPECT_EQ(plan.rows_per_rank, target);
    EXPECT_TRUE(plan.exact());
    int64_t sum = 0;
    for (int64_t r = 0; r < R; ++r) {
      EXPECT_LE(plan.computed_rows[r], target) << "rank " << r;
      sum += plan.computed_rows[r];
    }
    EXPECT_EQ(sum, S);
    for (int64_t e = 0; e < R * local; ++e) {
      int64_t next = 0;
      for (const ExpertPiece& q : plan.pieces_of(e)) {
        ASSERT_EQ(q.begin, next) << "expert " << e;
        next = q.end;
      }
      ASSERT_EQ(next, counts[e]) << "expert " << e;
    }
  }
  // Divisible: every rank computes exactly S/R.
  const std::vector<int64_t> counts = {60, 0, 0, 0, 20, 0, 0, 0};  // R = 4, E_local = 2, C = 100, S = 80
  const BalancePlan plan = plan_exact_balance(counts, 4, 100, 2);
  EXPECT_EQ(plan.computed_rows, (std::vector<int64_t>{20, 20, 20, 20}));
}

TEST(BalancePlan, OwnerOnlyKeepsEveryExpertHome) {
  const std::vector<int64_t> counts = {0, 90, 30, 40, 20, 20};  // R = 2, E_local = 3, C = 100
  const BalancePlan plan = plan_owner_only(counts, 2, 100);
  EXPECT_EQ(plan.computed_rows, plan.owner_rows);
  EXPECT_EQ(plan.computed_rows, (std::vector<int64_t>{120, 80}));
  EXPECT_EQ(plan.pieces.size(), 5u);  // expert 0 has no rows, no piece
  EXPECT_TRUE(plan.pieces_of(0).empty());
}

TEST(BalancePlan, RejectsBadCounts) {
  EXPECT_EQ(rejected_name([] { plan_exact_balance(std::vector<int64_t>{1, 2, 3}, 2, 3, 1); }), "expert_counts");
  EXPECT_EQ(rejected_name([] { plan_exact_balance(std::vector<int64_t>{1, 2, 3, 4}, 2, 4, 1); }), "expert_counts");
  EXPECT_EQ(rejected_name([] { plan_exact_balance(std::vector<int64_t>{-1, 3, 2, 2}, 2, 3, 1); }), "expert_counts");
  EXPECT_EQ(rejected_name([] { plan_exact_balance(std::vector<int64_t>{1, 1}, 0, 1, 1); }), "num_ranks");
  EXPECT_EQ(rejected_name([] { plan_exact_balance(std::vector<int64_t>{1, 1}, 2, 1, -1); }), "replica_slots");
}

}  // namespace
}  // namespace poise::plan
