// The cost-aware balance plan on the host (issue 37; docs/balance.md, "Cost-aware plan"): the shared
// planner (balance_plan_device.cuh) run on host vectors, and the row limit whose plan has the least
// predicted time (balance_cost.cuh). The same numbers the device will compute, for the simulator
// and the tests.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "balance/balance_cost.cuh"
#include "balance/balance_plan.hpp"
#include "poise/config.hpp"

namespace poise::plan {

// One run of the shared planner with row limit U, as the planner kernel runs it.
struct SharedPlanRun {
  bool exact = false;                   // every rank at most U rows
  std::vector<ExpertPiece> pieces;      // kept prefixes and replica pieces, sorted by expert then begin
  std::vector<int64_t> computed_rows;   // [R]
  std::vector<int64_t> replicas;        // [R] replica slots filled on each rank (weights received)
  std::vector<int64_t> replicas_sent;   // [R] replicas of each rank's experts placed elsewhere
  int64_t moved_rows = 0;
  double predicted_ns = 0;              // under the rates given (0 without rates)
};

SharedPlanRun run_shared_planner(std::span<const int64_t> counts_E, int64_t num_ranks, int64_t rows_per_rank,
                                 int64_t row_limit, int64_t replica_slots,
                                 const shared::BalanceCostRates& rates = {});

// Tries every shared::candidate_row_limit (exact balance first, capacity mode last) and returns
// the run with the least predicted time (the first such in candidate order), with every
// candidate's predicted time in `candidates_ns`.
struct CostAwareChoice {
  int64_t row_limit = 0;
  SharedPlanRun plan;
  std::vector<int64_t> candidate_row_limits;
  std::vector<double> candidates_ns;
};

CostAwareChoice choose_row_limit(std::span<const int64_t> counts_E, int64_t num_ranks, int64_t rows_per_rank,
                                 int64_t replica_slots, int64_t max_row_limit, const shared::BalanceCostRates& rates);

// The plan a Config's exact balance makes on the GPU for these counts (the reference engine's):
// exact balance, or with Config::cost_aware_balance the cost-aware choice among row limits up to
// layout::row_limit, as a BalancePlan.
BalancePlan exact_mode_plan(const Config& config, std::span<const int64_t> counts_E, int64_t num_ranks,
                            int64_t rows_per_rank, int64_t replica_slots);

// The cost-aware plan's rates of a Config (Config::cost_aware_balance): its per-row and per-group
// expert costs and link rate, and the bytes one replica moves over a call: its bf16 weights out and,
// in training, its gradients (Config::replica_grad_dtype) back.
shared::BalanceCostRates balance_cost_rates(const Config& config);

}  // namespace poise::plan
