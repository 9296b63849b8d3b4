// Routing layout: where every (token, k) row goes. Each rank derives it, without talking to
// anyone else, from the all-gathered per-rank expert counts and the balance plan (the same on
// every rank), exactly as the GPU routing kernel will.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "balance/balance_plan.hpp"

namespace poise::reference {

// One expert group of a rank's expert-grouped buffer: the rows one slot computes, padded to
// kExpertRowAlignment so a GEMM tile never straddles two experts.
struct ExpertGroup {
  int64_t expert = 0;
  int64_t slot = 0;       // [0, E_local) own experts by local index, then replicas
  int64_t first_row = 0;  // in the grouped buffer
  int64_t rows = 0;       // computed rows (padding excluded)
};

// The grouped buffers of all ranks under one plan.
struct GroupedLayout {
  std::vector<std::vector<ExpertGroup>> groups_per_rank;  // [R], by slot; groups with 0 rows omitted
  std::vector<int64_t> grouped_rows_per_rank;             // [R] rows including padding
  std::vector<int64_t> piece_first_row;                   // [pieces] grouped row of the piece's begin

  // The grouped row, on plan.pieces[i].rank, of row `row` of `expert`.
  struct Destination {
    int64_t rank, grouped_row;
  };
  Destination destination(const plan::BalancePlan& plan, int64_t expert, int64_t row) const;
};

GroupedLayout make_grouped_layout(const plan::BalancePlan& plan);

// What one source rank sends where.
struct DispatchLayout {
  std::vector<int64_t> dest_rank_TK;  // [T*K] rank computing entry (t, k)
  std::vector<int64_t> dest_row_TK;   // [T*K] its row in that rank's grouped buffer
  std::vector<std::vector<int64_t>> entries_to;  // [R] entries t*K+k sent to each rank, in (t, k) order
  std::vector<std::vector<int64_t>> tokens_to;   // [R] tokens sent to each rank, once each, in t order
};

// counts_RE: [R][E] rows each rank routes to each expert (all-gathered).
DispatchLayout make_dispatch_layout(int64_t rank, std::span<const int32_t> ids_TK, int64_t top_k,
                                    const std::vector<std::vector<int64_t>>& counts_RE,
                                    const plan::BalancePlan& plan, const GroupedLayout& grouped);

int64_t padded_to_alignment(int64_t rows);

}  // namespace poise::reference
