#include "reference/routing_layout.hpp"

#include <algorithm>
#include <stdexcept>

#include "poise/config.hpp"

namespace poise::reference {

int64_t padded_to_alignment(int64_t rows) {
  return (rows + kExpertRowAlignment - 1) / kExpertRowAlignment * kExpertRowAlignment;
}

GroupedLayout make_grouped_layout(const plan::BalancePlan& plan) {
  const int64_t R = plan.num_ranks;
  const int64_t slots = plan.num_local_experts + plan.replica_slots;
  // rows_of[rank][slot]; a slot may hold several pieces (the owner's kept rows plus unplaced
  // surplus in the fallback), laid out one after the other in begin order.
  std::vector<std::vector<int64_t>> rows_of(R, std::vector<int64_t>(slots, 0));
  std::vector<std::vector<int64_t>> expert_of(R, std::vector<int64_t>(slots, -1));
  GroupedLayout layout;
  layout.piece_first_row.resize(plan.pieces.size());
  std::vector<int64_t> offset_in_slot(plan.pieces.size());
  for (size_t i = 0; i < plan.pieces.size(); ++i) {
    const plan::ExpertPiece& piece = plan.pieces[i];
    offset_in_slot[i] = rows_of[piece.rank][piece.slot];
    rows_of[piece.rank][piece.slot] += piece.rows();
    expert_of[piece.rank][piece.slot] = piece.expert;
  }
  layout.groups_per_rank.resize(R);
  layout.grouped_rows_per_rank.assign(R, 0);
  std::vector<std::vector<int64_t>> first_row_of(R, std::vector<int64_t>(slots, 0));
  for (int64_t r = 0; r < R; ++r) {
    int64_t next_row = 0;
    for (int64_t s = 0; s < slots; ++s) {
      first_row_of[r][s] = next_row;
      if (rows_of[r][s] == 0) continue;
      layout.groups_per_rank[r].push_back({expert_of[r][s], s, next_row, rows_of[r][s]});
      next_row += padded_to_alignment(rows_of[r][s]);
    }
    layout.grouped_rows_per_rank[r] = next_row;
  }
  for (size_t i = 0; i < plan.pieces.size(); ++i) {
    const plan::ExpertPiece& piece = plan.pieces[i];
    layout.piece_first_row[i] = first_row_of[piece.rank][piece.slot] + offset_in_slot[i];
  }
  return layout;
}

GroupedLayout::Destination GroupedLayout::destination(const plan::BalancePlan& plan, int64_t expert,
                                                      int64_t row) const {
  const std::span<const plan::ExpertPiece> pieces = plan.pieces_of(expert);
  // The last piece whose begin <= row (pieces of an expert are sorted by begin and tile its rows).
  auto it = std::upper_bound(pieces.begin(), pieces.end(), row,
                             [](int64_t r, const plan::ExpertPiece& p) { return r < p.begin; });
  if (it == pieces.begin() || row >= (it - 1)->end) {
    throw std::logic_error("routing layout: expert row outside the balance plan");
  }
  --it;
  const size_t index = static_cast<size_t>(plan.first_piece_of_expert[expert] + (it - pieces.begin()));
  return {it->rank, piece_first_row[index] + (row - it->begin)};
}

DispatchLayout make_dispatch_layout(int64_t rank, std::span<const int32_t> ids_TK, int64_t top_k,
                                    const std::vector<std::vector<int64_t>>& counts_RE,
                                    const plan::BalancePlan& plan, const GroupedLayout& grouped) {
  const int64_t R = plan.num_ranks, E = plan.num_experts;
  const auto entries = static_cast<int64_t>(ids_TK.size());
  const int64_t T = entries / top_k;
  // This rank's rows of expert e start after those of lower source ranks.
  std::vector<int64_t> next_row_of_expert(E, 0);
  for (int64_t src = 0; src < rank; ++src) {
    for (int64_t e = 0; e < E; ++e) next_row_of_expert[e] += counts_RE[src][e];
  }
  DispatchLayout layout;
  layout.dest_rank_TK.resize(entries);
  layout.dest_row_TK.resize(entries);
  layout.entries_to.resize(R);
  layout.tokens_to.resize(R);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < top_k; ++k) {
      const int64_t entry = t * top_k + k;
      const int64_t e = ids_TK[entry];
      if (e == kNoExpert) {  // free: no rank computes it
        layout.dest_rank_TK[entry] = -1;
        layout.dest_row_TK[entry] = -1;
        continue;
      }
      const GroupedLayout::Destination dest = grouped.destination(plan, e, next_row_of_expert[e]++);
      layout.dest_rank_TK[entry] = dest.rank;
      layout.dest_row_TK[entry] = dest.grouped_row;
      layout.entries_to[dest.rank].push_back(entry);
      // A token crosses to a rank once, however many of its k rows that rank computes.
      std::vector<int64_t>& tokens = layout.tokens_to[dest.rank];
      if (tokens.empty() || tokens.back() != t) tokens.push_back(t);
    }
  }
  return layout;
}

}  // namespace poise::reference
