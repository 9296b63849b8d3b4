#include "balance/balance_plan.hpp"

#include <algorithm>
#include <deque>
#include <numeric>
#include <string>

#include "poise/errors.hpp"

namespace poise::plan {

std::span<const ExpertPiece> BalancePlan::pieces_of(int64_t expert) const {
  const int64_t first = first_piece_of_expert[expert];
  return {pieces.data() + first, static_cast<size_t>(first_piece_of_expert[expert + 1] - first)};
}

void validate_counts(std::span<const int64_t> counts_E, int64_t num_ranks, int64_t rows_per_rank) {
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
  if (total > num_ranks * rows_per_rank) {
    throw InvalidArgument("expert_counts", "must sum to at most num_ranks * rows_per_rank = " +
                                               std::to_string(num_ranks * rows_per_rank) + ", got " +
                                               std::to_string(total));
  }
}

int64_t balanced_rows_per_rank(std::span<const int64_t> counts_E, int64_t num_ranks) {
  const int64_t total = std::accumulate(counts_E.begin(), counts_E.end(), int64_t{0});
  return (total + num_ranks - 1) / num_ranks;
}

namespace {


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

// Sorts the pieces, indexes them by expert and sums what each rank computes and what moved.
void finish_plan(BalancePlan& plan) {
  std::sort(plan.pieces.begin(), plan.pieces.end(), [](const ExpertPiece& a, const ExpertPiece& b) {
    return a.expert != b.expert ? a.expert < b.expert : a.begin < b.begin;
  });
  plan.first_piece_of_expert.assign(plan.num_experts + 1, 0);
  for (const ExpertPiece& piece : plan.pieces) {
    plan.first_piece_of_expert[piece.expert + 1] += 1;
    plan.computed_rows[piece.rank] += piece.rows();
    if (piece.rank != plan.owner_of(piece.expert)) plan.moved_rows += piece.rows();
  }
  std::partial_sum(plan.first_piece_of_expert.begin(), plan.first_piece_of_expert.end(),
                   plan.first_piece_of_expert.begin());
  for (int64_t r = 0; r < plan.num_ranks; ++r) {
    plan.unplaced_surplus_rows += std::max<int64_t>(0, plan.computed_rows[r] - plan.rows_per_rank);
  }
}

// A rank's own rows as one sequence: its non-empty experts smallest first, each expert's rows in
// order. The owner keeps a prefix [0, remaining); donations are cut from the end, so the largest
// experts leave first and a split expert keeps the prefix [0, keep) of its rows.
struct OwnRows {
  std::vector<int64_t> experts;
  std::vector<int64_t> start;  // [experts + 1] first position of each expert, then the total
  int64_t remaining = 0;

  int64_t index_at(int64_t position) const {
    return std::upper_bound(start.begin() + 1, start.end(), position) - (start.begin() + 1);
  }
  // How many experts the last `rows` remaining rows belong to: the replica slots they need.
  int64_t span(int64_t rows) const {
    return rows == 0 ? 0 : index_at(remaining - 1) - index_at(remaining - rows) + 1;
  }
};

class PlanBuilder {
 public:
  PlanBuilder(std::span<const int64_t> counts_E, BalancePlan plan) : plan_(std::move(plan)) {
    const int64_t local = plan_.num_local_experts;
    own_.resize(plan_.num_ranks);
    for (int64_t r = 0; r < plan_.num_ranks; ++r) {
      std::vector<int64_t> order(local);
      std::iota(order.begin(), order.end(), r * local);
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return counts_E[a] < counts_E[b]; });
      OwnRows& own = own_[r];
      own.start.push_back(0);
      for (int64_t e : order) {
        if (counts_E[e] == 0) continue;
        own.experts.push_back(e);
        own.start.push_back(own.start.back() + counts_E[e]);
      }
      own.remaining = own.start.back();
    }
    received_.assign(plan_.num_ranks, 0);
  }

  const OwnRows& own(int64_t rank) const { return own_[rank]; }
  int64_t computed(int64_t rank) const { return own_[rank].remaining + received_[rank]; }
  int64_t free_slots(int64_t rank) const { return plan_.replica_slots - plan_.replicas[rank]; }

  // Moves the last `rows` remaining rows of `donor` to `taker`, one replica slot per expert.
  void donate(int64_t donor, int64_t taker, int64_t rows) {
    OwnRows& own = own_[donor];
    received_[taker] += rows;
    while (rows > 0) {
      const int64_t i = own.index_at(own.remaining - 1);
      const int64_t take = std::min(rows, own.remaining - own.start[i]);
      const int64_t end = own.remaining - own.start[i];
      plan_.pieces.push_back({own.experts[i], taker, plan_.num_local_experts + plan_.replicas[taker], end - take, end});
      plan_.replicas[taker] += 1;
      own.remaining -= take;
      rows -= take;
    }
  }

  // The owners keep what they did not donate, in their own slots.
  BalancePlan finish() && {
    for (int64_t r = 0; r < plan_.num_ranks; ++r) {
      const OwnRows& own = own_[r];
      for (size_t i = 0; i < own.experts.size() && own.start[i] < own.remaining; ++i) {
        const int64_t keep = std::min(own.start[i + 1], own.remaining) - own.start[i];
        plan_.pieces.push_back({own.experts[i], r, own.experts[i] % plan_.num_local_experts, 0, keep});
      }
    }
    finish_plan(plan_);
    return std::move(plan_);
  }

 private:
  BalancePlan plan_;
  std::vector<OwnRows> own_;
  std::vector<int64_t> received_;
};

// Exact whenever replica_slots >= E_local (docs/balance.md proves it); false when it cannot be
// exact within the slots (only possible with fewer). Takers (ranks under C) are filled one at a
// time, each completely, from the donors (ranks over C) in queue order:
//  - if the donors' surpluses, taken in order, complete the taker within its slots, only surplus
//    moves;
//  - otherwise the taker takes surplus from the first j donors and its whole remaining need from
//    donor j (the largest j that fits its slots). Donor j gives beyond its surplus ("overshoots"),
//    drops below C and joins the takers. j = 0 always fits when B >= E_local: a taker starts with
//    B free slots and one donor's rows span at most E_local experts.
bool plan_exact(PlanBuilder& b, int64_t num_ranks, int64_t C) {
  std::deque<int64_t> donors, takers;
  int64_t total_surplus = 0;
  for (int64_t r = 0; r < num_ranks; ++r) {
    if (b.computed(r) > C) donors.push_back(r), total_surplus += b.computed(r) - C;
    if (b.computed(r) < C) takers.push_back(r);
  }
  while (!takers.empty()) {
    const int64_t taker = takers.front();
    takers.pop_front();
    const int64_t slots = b.free_slots(taker);
    // Fewer rows than R * C (free entries): the surplus runs out before the last takers are full.
    int64_t need = std::min(C - b.computed(taker), total_surplus);
    if (need <= 0) continue;
    // Walk the donors: slots used by surplus-only takes so far, and where an overshoot would fit.
    int64_t slots_used = 0, remaining = need;
    int64_t surplus_only_end = -1, overshoot_at = -1;
    for (size_t j = 0; j < donors.size() && slots_used <= slots; ++j) {
      const OwnRows& own = b.own(donors[j]);
      const int64_t surplus = b.computed(donors[j]) - C;
      if (remaining <= surplus) {
        if (slots_used + own.span(remaining) <= slots) surplus_only_end = static_cast<int64_t>(j);
        break;
      }
      if (slots_used + own.span(remaining) <= slots) overshoot_at = static_cast<int64_t>(j);
      slots_used += own.span(surplus);
      remaining -= surplus;
    }
    const int64_t surplus_donors = surplus_only_end >= 0 ? surplus_only_end : overshoot_at;
    if (surplus_donors < 0) return false;
    for (int64_t j = 0; j < surplus_donors; ++j) {  // each gives its whole surplus and is done
      const int64_t donor = donors.front();
      const int64_t surplus = b.computed(donor) - C;
      b.donate(donor, taker, surplus);
      need -= surplus;
      total_surplus -= surplus;
      donors.pop_front();
    }
    const int64_t last = donors.front();
    total_surplus -= std::min(need, b.computed(last) - C);
    b.donate(last, taker, need);
    if (b.computed(last) <= C) donors.pop_front();
    if (b.computed(last) < C) takers.push_back(last);  // it overshot
  }
  return true;
}

// Fewer slots than the exact plan needs: only surplus moves, as far as slots allow; what finds
// no slot stays on its owner (reported as unplaced_surplus_rows).
void plan_within_slots(PlanBuilder& b, int64_t num_ranks, int64_t C) {
  int64_t taker = 0;
  for (int64_t donor = 0; donor < num_ranks; ++donor) {
    while (b.computed(donor) > C) {
      while (taker < num_ranks && (b.computed(taker) >= C || b.free_slots(taker) == 0)) ++taker;
      if (taker == num_ranks) return;
      int64_t rows = std::min(b.computed(donor) - C, C - b.computed(taker));
      const OwnRows& own = b.own(donor);
      if (own.span(rows) > b.free_slots(taker)) {
        // Only the last free_slots experts fit: their remaining rows.
        rows = own.remaining - own.start[own.index_at(own.remaining - 1) - b.free_slots(taker) + 1];
      }
      b.donate(donor, taker, rows);
    }
  }
}

}  // namespace

BalancePlan plan_from_pieces(std::span<const int64_t> counts_E, int64_t num_ranks, int64_t rows_per_rank,
                             int64_t replica_slots, std::vector<ExpertPiece> pieces) {
  validate_counts(counts_E, num_ranks, rows_per_rank);
  BalancePlan plan = start_plan(counts_E, num_ranks, balanced_rows_per_rank(counts_E, num_ranks), replica_slots);
  plan.pieces = std::move(pieces);
  for (const ExpertPiece& piece : plan.pieces) {
    if (piece.rank != plan.owner_of(piece.expert)) plan.replicas[piece.rank] += 1;
  }
  finish_plan(plan);
  return plan;
}

BalancePlan plan_owner_only(std::span<const int64_t> counts_E, int64_t num_ranks, int64_t rows_per_rank) {
  validate_counts(counts_E, num_ranks, rows_per_rank);
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
  validate_counts(counts_E, num_ranks, rows_per_rank);
  if (replica_slots < 0) {
    throw InvalidArgument("replica_slots", "must be >= 0, got " + std::to_string(replica_slots));
  }
  const int64_t target = balanced_rows_per_rank(counts_E, num_ranks);
  const BalancePlan start = start_plan(counts_E, num_ranks, target, replica_slots);
  PlanBuilder exact(counts_E, start);
  if (plan_exact(exact, num_ranks, target)) return std::move(exact).finish();
  PlanBuilder fallback(counts_E, start);
  plan_within_slots(fallback, num_ranks, target);
  return std::move(fallback).finish();
}

}  // namespace poise::plan
