// Balance plan: which rank computes which rows of each expert (a pure host function; the GPU
// routing kernel mirrors it). docs/balance.md states the algorithm and what it guarantees.
//
// Rows of expert e are numbered 0..count[e)-1 in a global order every rank can compute from the
// all-gathered counts: by source rank, then token, then k. A piece is a contiguous range of them.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace poise::plan {

struct ExpertPiece {
  int64_t expert = 0;
  int64_t rank = 0;   // the rank that computes these rows
  int64_t slot = 0;   // its expert slot there: [0, E_local) own experts by local index, then replicas
  int64_t begin = 0;  // first row (in the expert's global row order)
  int64_t end = 0;    // one past the last row
  int64_t rows() const { return end - begin; }
};

struct BalancePlan {
  int64_t num_ranks = 0;
  int64_t num_experts = 0;
  int64_t num_local_experts = 0;  // E / R
  // The rows every rank computes when the plan is exact: ceil(total / R), which is C = T*K unless
  // free entries (kNoExpert) left fewer rows than R * C (then some ranks compute one row less).
  int64_t rows_per_rank = 0;
  int64_t replica_slots = 0;      // B: replica slots each rank may fill

  // Non-empty pieces sorted by expert, then begin; each expert's pieces tile [0, count[e]).
  std::vector<ExpertPiece> pieces;
  std::vector<int64_t> owner_rows;     // [R] rows of each rank's own experts (before balancing)
  std::vector<int64_t> computed_rows;  // [R] rows each rank computes under this plan
  std::vector<int64_t> replicas;       // [R] replica slots used on each rank
  // Rows computed away from their owner. The least possible is the total surplus
  // (sum over ranks of max(0, owner_rows - C)); more moves only when slots force it.
  int64_t moved_rows = 0;
  // Rows computed beyond C (sum over ranks): surplus that found no replica slot and stays on its
  // owner. 0 when the plan is exact, which it always is with replica_slots >= E_local.
  int64_t unplaced_surplus_rows = 0;

  bool exact() const { return unplaced_surplus_rows == 0; }
  int64_t owner_of(int64_t expert) const { return expert / num_local_experts; }
  // The pieces of one expert (a view into `pieces`).
  std::span<const ExpertPiece> pieces_of(int64_t expert) const;

  std::vector<int64_t> first_piece_of_expert;  // [E + 1] offsets into `pieces`
};

// Throws InvalidArgument("expert_counts" / "num_ranks" / "rows_per_rank") unless counts_E has a
// multiple of num_ranks entries, none negative, summing to at most num_ranks * rows_per_rank (less
// when free entries name no expert).
void validate_counts(std::span<const int64_t> counts_E, int64_t num_ranks, int64_t rows_per_rank);

// ceil(sum of counts_E / num_ranks): the rows each rank computes under an exact plan.
int64_t balanced_rows_per_rank(std::span<const int64_t> counts_E, int64_t num_ranks);

// Exact balance. counts_E: rows per expert over all ranks; their sum S is at most R * rows_per_rank.
// With replica_slots >= E_local every rank computes ceil(S / R) rows (rows_per_rank when S = R * C;
// when S is not a multiple of R, some ranks compute one row less). Rows move as
// replicas (one slot per (expert, rank), at most replica_slots per rank); an owner keeps its
// experts' rows up to its capacity and only the surplus moves, unless the slot bound forces a
// donor to give more (then moved_rows exceeds the surplus). With fewer slots than that needs, only
// surplus moves, as far as slots allow, and the rest stays on its owner (unplaced_surplus_rows).
// Throws InvalidArgument("expert_counts" / "num_ranks" / "replica_slots") on bad input.
BalancePlan plan_exact_balance(std::span<const int64_t> counts_E, int64_t num_ranks,
                               int64_t rows_per_rank, int64_t replica_slots);

// A plan from its pieces (owners' kept prefixes and replica pieces, in any order), such as the
// shared planner's (balance_cost.hpp): sorted, indexed and summed as the planners' own plans.
BalancePlan plan_from_pieces(std::span<const int64_t> counts_E, int64_t num_ranks, int64_t rows_per_rank,
                             int64_t replica_slots, std::vector<ExpertPiece> pieces);

// No balancing (capacity mode): every expert's rows on its owner, in its own slot.
BalancePlan plan_owner_only(std::span<const int64_t> counts_E, int64_t num_ranks, int64_t rows_per_rank);

}  // namespace poise::plan
