#include "plan/balance_plan.hpp"

#include <algorithm>
#include <numeric>
#include <string>

#include "poise/errors.hpp"

namespace poise::plan {

std::span<const ExpertPiece> BalancePlan::pieces_of(int64_t expert) const {
  const int64_t first = first_piece_of_expert[expert];
  return {pieces.data() + first, static_cast<size_t>(first_piece_of_expert[expert + 1] - first)};
}

namespace {

void validate(std::span<const int64_t> counts_E, int64_t num_ranks, int64_t rows_per_rank) {
  if (num_ranks <= 0) throw InvalidArgument("num_ranks", "must be > 0, got " + std::to_string(num_ranks));
  const auto num_experts = static_cast<int64_t>(counts_E.size());
  if (num_experts == 0 || num_experts % num_ranks != 0) {
    throw InvalidArgument("expert_counts", "needs a positive multiple of num_ranks (" +
                                               std::to_string(num_ranks) + ") entries, got " +
                                               std::to_string(num_experts));
  }
  if (rows_per_rank < 0) {
    throw InvalidArgument("rows_per_rank", "must be >= 0, got " + std::to_string(rows_per_rank));
  }
  int64_t total = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    if (counts_E[e] < 0) {
      throw InvalidArgument("expert_counts", "expert " + std::to_string(e) + " has a negative count " +
                                                 std::to_string(counts_E[e]));
    }
    total += counts_E[e];
  }
  if (total != num_ranks * rows_per_rank) {
    throw InvalidArgument("expert_counts", "must sum to num_ranks * rows_per_rank = " +
                                               std::to_string(num_ranks * rows_per_rank) + ", got " +
                                               std::to_string(total));
  }
}

BalancePlan start_plan(std::span<const int64_t> counts_E, int64_t num_ranks, int64_t rows_per_rank,
                       int64_t replica_slots) {
  BalancePlan plan;
  plan.num_ranks = num_ranks;
  plan.num_experts = static_cast<int64_t>(counts_E.size());
  plan.num_local_experts = plan.num_experts / num_ranks;
  plan.rows_per_rank = rows_per_rank;
  plan.replica_slots = replica_slots;
  plan.owner_rows.assign(num_ranks, 0);
  plan.computed_rows.assign(num_ranks, 0);
  plan.replicas.assign(num_ranks, 0);
  for (int64_t e = 0; e < plan.num_experts; ++e) plan.owner_rows[plan.owner_of(e)] += counts_E[e];
  return plan;
}

// Sorts the pieces, indexes them by expert and sums the rows each rank computes.
void finish_plan(BalancePlan& plan) {
  std::sort(plan.pieces.begin(), plan.pieces.end(), [](const ExpertPiece& a, const ExpertPiece& b) {
    return a.expert != b.expert ? a.expert < b.expert : a.begin < b.begin;
  });
  plan.first_piece_of_expert.assign(plan.num_experts + 1, 0);
  for (const ExpertPiece& piece : plan.pieces) {
    plan.first_piece_of_expert[piece.expert + 1] += 1;
    plan.computed_rows[piece.rank] += piece.rows();
  }
  std::partial_sum(plan.first_piece_of_expert.begin(), plan.first_piece_of_expert.end(),
                   plan.first_piece_of_expert.begin());
}

struct SurplusRange {
  int64_t expert, begin, end;
};

}  // namespace

BalancePlan plan_owner_only(std::span<const int64_t> counts_E, int64_t num_ranks, int64_t rows_per_rank) {
  validate(counts_E, num_ranks, rows_per_rank);
  BalancePlan plan = start_plan(counts_E, num_ranks, rows_per_rank, 0);
  for (int64_t e = 0; e < plan.num_experts; ++e) {
    if (counts_E[e] > 0) {
      plan.pieces.push_back({e, plan.owner_of(e), e % plan.num_local_experts, 0, counts_E[e]});
    }
  }
  finish_plan(plan);
  return plan;
}

BalancePlan plan_exact_balance(std::span<const int64_t> counts_E, int64_t num_ranks,
                               int64_t rows_per_rank, int64_t replica_slots) {
  validate(counts_E, num_ranks, rows_per_rank);
  if (replica_slots < 0) {
    throw InvalidArgument("replica_slots", "must be >= 0, got " + std::to_string(replica_slots));
  }
  BalancePlan plan = start_plan(counts_E, num_ranks, rows_per_rank, replica_slots);
  const int64_t local = plan.num_local_experts;

  // 1. Every owner keeps its experts' rows up to its capacity C. It keeps its smallest experts
  //    whole first, so the surplus comes from as few (the largest) experts as possible; a split
  //    expert keeps the prefix [0, keep) of its rows.
  std::vector<SurplusRange> surplus;
  std::vector<int64_t> order(local);
  for (int64_t r = 0; r < num_ranks; ++r) {
    const int64_t first = r * local;
    std::iota(order.begin(), order.end(), int64_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return counts_E[first + a] < counts_E[first + b]; });
    int64_t capacity_left = rows_per_rank;
    for (int64_t slot : order) {
      const int64_t e = first + slot;
      const int64_t keep = std::min(counts_E[e], capacity_left);
      capacity_left -= keep;
      if (keep > 0) plan.pieces.push_back({e, r, slot, 0, keep});
      if (keep < counts_E[e]) surplus.push_back({e, keep, counts_E[e]});
    }
  }
  std::sort(surplus.begin(), surplus.end(),
            [](const SurplusRange& a, const SurplusRange& b) { return a.expert < b.expert; });

  // 2. Fill the underloaded ranks' deficits, in rank order, with the surplus ranges in expert
  //    order (two pointers). Each (expert, rank) pair gets one contiguous piece and one slot.
  std::vector<int64_t> deficit(num_ranks);
  for (int64_t r = 0; r < num_ranks; ++r) deficit[r] = std::max<int64_t>(0, rows_per_rank - plan.owner_rows[r]);
  int64_t taker = 0;
  for (const SurplusRange& range : surplus) {
    int64_t row = range.begin;
    while (row < range.end) {
      while (taker < num_ranks && (deficit[taker] == 0 || plan.replicas[taker] == replica_slots)) ++taker;
      if (taker == num_ranks) {
        // 3. No rank can take more: the rest stays on the owner, in its own slot (fallback).
        plan.pieces.push_back({range.expert, plan.owner_of(range.expert), range.expert % local, row, range.end});
        plan.unplaced_surplus_rows += range.end - row;
        break;
      }
      const int64_t take = std::min(range.end - row, deficit[taker]);
      plan.pieces.push_back({range.expert, taker, local + plan.replicas[taker], row, row + take});
      plan.replicas[taker] += 1;
      deficit[taker] -= take;
      row += take;
    }
  }
  finish_plan(plan);
  return plan;
}

}  // namespace poise::plan
