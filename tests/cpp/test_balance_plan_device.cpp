// The __host__ __device__ balance planner (src/balance/balance_plan_device.cuh), run on the host:
//  - with no tolerance it returns exactly plan::plan_exact_balance's pieces (same expert, rank,
//    slot, row range) on random, skewed and extreme count vectors, for B from 0 to E_local;
//  - with a tolerance every rank computes at most C + tolerance rows (B >= E_local), pieces tile
//    every expert, only takers receive, and fewer rows move than with exact balance.
// The GPU planner kernel calls these same functions; tests/gpu/test_ep_balance.cu checks the
// kernel's layout against them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <tuple>
#include <vector>

#include "balance/balance_cost.hpp"
#include "balance/balance_plan.hpp"
#include "balance/balance_plan_device.cuh"

namespace poise::plan {
namespace {

using SharedPlan = SharedPlanRun;

// Runs the shared code as the device does (steps 1-4), with host vectors as its scratch.
SharedPlan run_shared(const std::vector<int64_t>& counts, int R, int C, int tolerance, int B) {
  SharedPlan out = run_shared_planner(counts, R, C, C + tolerance, B);
  for (const ExpertPiece& q : out.pieces) EXPECT_LT(q.begin, q.end) << "an empty piece";
  return out;
}

// Counts summing to R*C: popularity log-normal with spread `s`, optionally one expert taking
// `hot` of all rows.
std::vector<int64_t> random_counts(int R, int L, int C, double s, double hot, std::mt19937_64& rng) {
  const int E = R * L;
  const int64_t total = int64_t(R) * C;
  std::lognormal_distribution<double> pop(0.0, s);
  std::vector<double> w(E);
  for (double& v : w) v = s > 0 ? pop(rng) : 1.0;
  std::vector<int64_t> counts(E, 0);
  int64_t hot_rows = static_cast<int64_t>(hot * total);
  if (hot_rows > 0) counts[std::uniform_int_distribution<int>(0, E - 1)(rng)] += hot_rows;
  std::discrete_distribution<int> pick(w.begin(), w.end());
  for (int64_t i = hot_rows; i < total; ++i) counts[pick(rng)] += 1;
  return counts;
}

void expect_same(const BalancePlan& host, const SharedPlan& shared, const std::string& what) {
  ASSERT_EQ(host.pieces.size(), shared.pieces.size()) << what;
  for (size_t i = 0; i < host.pieces.size(); ++i) {
    const ExpertPiece &a = host.pieces[i], &b = shared.pieces[i];
    ASSERT_EQ(std::tie(a.expert, a.rank, a.slot, a.begin, a.end), std::tie(b.expert, b.rank, b.slot, b.begin, b.end))
        << what << " piece " << i;
  }
  EXPECT_EQ(host.moved_rows, shared.moved_rows) << what;
  for (size_t r = 0; r < host.computed_rows.size(); ++r) {
    EXPECT_EQ(host.computed_rows[r], shared.computed_rows[r]) << what << " rank " << r;
    EXPECT_EQ(host.replicas[r], shared.replicas[r]) << what << " rank " << r;
  }
}

TEST(BalancePlanShared, EqualsHostPlannerOnRandomCounts) {
  std::mt19937_64 rng(0xBA1A);
  int cases = 0, fallbacks = 0;
  for (int R : {1, 2, 3, 4, 8, 16}) {
    for (int L : {1, 2, 3, 4, 8, 32}) {
      for (double s : {0.0, 0.5, 1.0, 2.5}) {
        for (int rep = 0; rep < 4; ++rep) {
          const int C = std::uniform_int_distribution<int>(1, 3000)(rng);
          const auto counts = random_counts(R, L, C, s, 0.0, rng);
          for (int B : {0, 1, L / 2, L}) {
            const BalancePlan host = plan_exact_balance(counts, R, C, B);
            const SharedPlan shared = run_shared(counts, R, C, 0, B);
            expect_same(host, shared, "R" + std::to_string(R) + " L" + std::to_string(L) + " B" + std::to_string(B));
            if (shared.exact) {
              EXPECT_TRUE(host.exact());
            }
            if (B >= L) {
              EXPECT_TRUE(shared.exact);
              for (int r = 0; r < R; ++r) EXPECT_EQ(shared.computed_rows[r], C);
            }
            fallbacks += shared.exact ? 0 : 1;
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_GT(fallbacks, 0) << "the slot-limited fallback was never exercised";
  std::printf("%d count vectors, %d fell back to the slot-limited plan\n", cases, fallbacks);
}

// Free entries: counts summing to less than R*C. The shared planner (as the device kernel runs it)
// balances them to ceil(S/R) exactly as the host planner does, with and without tolerance.
TEST(BalancePlanShared, EqualsHostPlannerWhenEntriesAreFree) {
  std::mt19937_64 rng(0xF3EE);
  for (int R : {1, 2, 3, 4, 8}) {
    for (int L : {1, 3, 8}) {
      for (double s : {0.0, 1.0, 2.5}) {
        const int C = std::uniform_int_distribution<int>(8, 2000)(rng);
        const int real = std::uniform_int_distribution<int>(0, C - 1)(rng);  // rows per rank on average
        const auto counts = random_counts(R, L, real, s, 0.0, rng);
        for (int B : {0, L / 2, L}) {
          const std::string what = "R" + std::to_string(R) + " L" + std::to_string(L) + " B" + std::to_string(B);
          const BalancePlan host = plan_exact_balance(counts, R, C, B);
          const SharedPlan shared = run_shared(counts, R, C, 0, B);
          expect_same(host, shared, what);
          if (B >= L) {
            EXPECT_TRUE(shared.exact) << what;
            for (int r = 0; r < R; ++r) EXPECT_LE(shared.computed_rows[r], real) << what;
          }
          const SharedPlan tolerant = run_shared(counts, R, C, C / 8, B);
          if (B >= L) {
            for (int r = 0; r < R; ++r) EXPECT_LE(tolerant.computed_rows[r], real + C / 8) << what;
          }
        }
      }
    }
  }
}

TEST(BalancePlanShared, EqualsHostPlannerOnExtremeCounts) {
  std::mt19937_64 rng(7);
  for (int R : {2, 4, 8}) {
    for (int L : {1, 2, 8, 32}) {
      const int E = R * L, C = 4096;
      std::vector<std::vector<int64_t>> vectors;
      std::vector<int64_t> one(E, 0);
      one[0] = int64_t(R) * C;  // every row on one expert
      vectors.push_back(one);
      one.assign(E, 0);
      one[E - 1] = int64_t(R) * C;
      vectors.push_back(one);
      std::vector<int64_t> one_rank(E, 0);  // every row on rank 1's experts, evenly
      for (int j = 0; j < L; ++j) one_rank[L + j] = int64_t(R) * C / L + (j < (int64_t(R) * C) % L ? 1 : 0);
      vectors.push_back(one_rank);
      std::vector<int64_t> idle_last = random_counts(R, L, C, 1.0, 0.0, rng);  // rank R-1 gets nothing
      for (int j = 0; j < L; ++j) {
        idle_last[(j % (R - 1)) * L] += idle_last[(R - 1) * L + j];
        idle_last[(R - 1) * L + j] = 0;
      }
      vectors.push_back(idle_last);
      vectors.push_back(random_counts(R, L, C, 0.3, 0.5, rng));  // one expert takes half
      std::vector<int64_t> balanced(E, 0);
      for (int e = 0; e < E; ++e) balanced[e] = C / L + (e % L < C % L ? 1 : 0);
      vectors.push_back(balanced);
      for (const auto& counts : vectors) {
        for (int B : {0, 1, L}) {
          expect_same(plan_exact_balance(counts, R, C, B), run_shared(counts, R, C, 0, B),
                      "extreme R" + std::to_string(R) + " L" + std::to_string(L) + " B" + std::to_string(B));
        }
      }
    }
  }
}

TEST(BalancePlanShared, ToleranceBoundsEveryRankAndMovesLess) {
  std::mt19937_64 rng(11);
  int fewer = 0;
  int64_t moved_exact = 0, moved_loose = 0;
  for (int R : {2, 4, 8}) {
    for (int L : {1, 4, 32}) {
      for (double s : {0.2, 0.6, 1.5}) {
        for (double eps : {0.01, 0.05, 0.25, 1.0}) {
          const int C = 2048;
          const int tolerance = static_cast<int>(std::floor(eps * C));
          const auto counts = random_counts(R, L, C, s, 0.0, rng);
          const SharedPlan exact = run_shared(counts, R, C, 0, L);
          const SharedPlan loose = run_shared(counts, R, C, tolerance, L);
          ASSERT_TRUE(loose.exact);
          std::vector<int64_t> owner_rows(R, 0), covered(counts.size(), 0);
          for (size_t e = 0; e < counts.size(); ++e) owner_rows[e / L] += counts[e];
          int64_t surplus = 0;
          for (int r = 0; r < R; ++r) {
            EXPECT_LE(loose.computed_rows[r], C + tolerance) << "rank " << r;
            EXPECT_LE(loose.replicas[r], L);
            surplus += std::max<int64_t>(0, owner_rows[r] - (C + tolerance));
          }
          std::vector<int64_t> given(R, 0), received(R, 0);
          for (const ExpertPiece& q : loose.pieces) {
            EXPECT_EQ(q.begin, covered[q.expert]) << "pieces tile each expert in order";
            covered[q.expert] = q.end;
            if (q.rank != q.expert / L) {
              given[q.expert / L] += q.rows();
              received[q.rank] += q.rows();
            }
          }
          for (int r = 0; r < R; ++r) {
            // Only ranks under the limit receive, or a donor that first gave more than its surplus
            // (an overshoot, forced by the slot bound) and takes back the difference.
            if (received[r] > 0 && owner_rows[r] >= C + tolerance) {
              EXPECT_GT(given[r], owner_rows[r] - (C + tolerance)) << "rank " << r;
            }
          }
          for (size_t e = 0; e < counts.size(); ++e) EXPECT_EQ(covered[e], counts[e]);
          EXPECT_GE(loose.moved_rows, surplus);
          moved_exact += exact.moved_rows;
          moved_loose += loose.moved_rows;
          fewer += loose.moved_rows < exact.moved_rows ? 1 : 0;
        }
      }
    }
  }
  EXPECT_GT(fewer, 0);
  EXPECT_LT(moved_loose, moved_exact) << "a tolerance should cut traffic";
  std::printf("rows moved: exact %lld, with tolerance %lld\n", (long long)moved_exact, (long long)moved_loose);
}

TEST(BalancePlanShared, ToleranceLeavesMildSkewAlone) {
  // Every rank within 10% of C: with eps = 0.1 nothing moves; with eps = 0 the surplus moves.
  const int R = 4, L = 2, C = 1000;
  const std::vector<int64_t> counts = {550, 500, 450, 500, 480, 500, 520, 500};
  EXPECT_EQ(run_shared(counts, R, C, 100, L).moved_rows, 0);
  EXPECT_EQ(run_shared(counts, R, C, 0, L).moved_rows, 70);
}

}  // namespace
}  // namespace poise::plan
