// The balance planner as __host__ __device__ code: the SAME functions run in the GPU planner
// kernel (src/ep/balance_planner.cu, thread 0 of one block per rank, state in shared
// memory) and on the host (tests/cpp/test_balance_plan_device.cpp proves the result equals
// plan::plan_exact_balance on random and extreme count vectors). docs/balance.md states the
// algorithm, the bound B >= E_local, and the tolerance.
//
// No allocation, no recursion, no library calls: every array lives in caller-provided storage
// (BalanceScratch). int32 rows: the pipeline keeps R*T*K below 2^31.
//
// Tolerance: ranks may compute up to row_limit = C + tolerance rows. Donors are ranks above
// row_limit and give only what exceeds it; takers are ranks below row_limit and take at most up
// to it. row_limit == C is exact balance, and then this is exactly the host planner.
#pragma once

#include <cstdint>

#include "numerics/host_device.hpp"

namespace poise::plan::shared {

// Rows [begin, end) of `expert` (in the expert's global row order: source rank, token, k)
// computed by `rank` in replica slot `slot` (in [E_local, E_local + B)).
struct ReplicaPiece {
  int32_t expert;
  int32_t rank;
  int32_t slot;
  int32_t begin;
  int32_t end;
};

struct BalanceProblem {
  const int32_t* counts_E = nullptr;  // [E] rows of each expert over all ranks (sum <= R*C)
  int32_t num_ranks = 0;              // R
  int32_t num_local_experts = 0;      // E_local = E / R
  int32_t rows_per_rank = 0;          // C = ceil(sum of counts_E / R): T*K unless entries were free
  int32_t row_limit = 0;              // U >= C: the most rows a rank may compute (tolerance)
  int32_t replica_slots = 0;          // B <= E_local
};

// Caller-provided storage. Sizes with E = R * E_local.
struct BalanceScratch {
  int32_t* position_E = nullptr;  // [E] place of expert e in its owner's sequence
  int32_t* sequence_E = nullptr;  // [E] rank r's experts at [r*E_local, (r+1)*E_local), fewest rows first
  int32_t* start_RL = nullptr;    // [R*(E_local+1)] rank r's sequence: first row of each place, then the total
  int32_t* remaining_R = nullptr; // [R] the owner keeps the prefix [0, remaining) of its sequence
  int32_t* received_R = nullptr;  // [R] rows received as replicas
  int32_t* replicas_R = nullptr;  // [R] replica slots used
  int32_t* donors = nullptr;      // [R] queue
  int32_t* takers = nullptr;      // [2R] queue (initial takers, then donors that overshot)
  ReplicaPiece* pieces = nullptr; // [R*B] replica pieces, in the order they were cut
};

// ---- step 1 (parallel over experts): each rank's sequence, stable by rows -------------------

POISE_HD inline int32_t sequence_position(const BalanceProblem& p, int32_t expert) {
  const int32_t first = expert / p.num_local_experts * p.num_local_experts;
  const int32_t rows = p.counts_E[expert];
  int32_t position = 0;
  for (int32_t j = first; j < first + p.num_local_experts; ++j) {
    const int32_t other = p.counts_E[j];
    position += (other < rows || (other == rows && j < expert)) ? 1 : 0;
  }
  return position;
}

POISE_HD inline void place_expert(const BalanceProblem& p, const BalanceScratch& s, int32_t expert) {
  const int32_t position = sequence_position(p, expert);
  s.position_E[expert] = position;
  s.sequence_E[expert / p.num_local_experts * p.num_local_experts + position] = expert;
}

// ---- step 2 (parallel over ranks): sequence starts and the initial state --------------------

POISE_HD inline void start_rank(const BalanceProblem& p, const BalanceScratch& s, int32_t rank) {
  const int32_t L = p.num_local_experts;
  int32_t* start = s.start_RL + rank * (L + 1);
  int32_t total = 0;
  for (int32_t i = 0; i < L; ++i) {
    start[i] = total;
    total += p.counts_E[s.sequence_E[rank * L + i]];
  }
  start[L] = total;
  s.remaining_R[rank] = total;
  s.received_R[rank] = 0;
  s.replicas_R[rank] = 0;
}

// ---- step 3 (one thread): the donor/taker loop ----------------------------------------------

class Planner {
 public:
  POISE_HD Planner(const BalanceProblem& p, const BalanceScratch& s) : p_(p), s_(s) {}

  POISE_HD int32_t computed(int32_t rank) const { return s_.remaining_R[rank] + s_.received_R[rank]; }
  POISE_HD int32_t free_slots(int32_t rank) const { return p_.replica_slots - s_.replicas_R[rank]; }

  // Place (in rank's sequence) of the expert holding row `position`: the last place whose start
  // is <= position (empty experts come first in the sequence and are skipped).
  POISE_HD int32_t index_at(int32_t rank, int32_t position) const {
    const int32_t* start = s_.start_RL + rank * (p_.num_local_experts + 1);
    int32_t lo = 0, hi = p_.num_local_experts;  // number of start[1..L] entries <= position
    while (lo < hi) {
      const int32_t mid = (lo + hi) / 2;
      if (start[mid + 1] <= position) lo = mid + 1; else hi = mid;
    }
    return lo;
  }
  // Same, given a place `from` at or above the answer: steps down, one load per expert passed
  // (the planner cuts rows from the end of a sequence, so the answer is a few places below).
  POISE_HD int32_t index_at_or_below(int32_t rank, int32_t position, int32_t from) const {
    const int32_t* start = s_.start_RL + rank * (p_.num_local_experts + 1);
    while (start[from] > position) --from;  // start[0] == 0 <= position ends it
    return from;
  }
  // Experts (= replica slots) the last `rows` kept rows of `rank` belong to.
  POISE_HD int32_t span(int32_t rank, int32_t rows) const {
    if (rows == 0) return 0;
    const int32_t remaining = s_.remaining_R[rank];
    const int32_t last = index_at(rank, remaining - 1);
    return last - index_at_or_below(rank, remaining - rows, last) + 1;
  }

  // Moves the last `rows` kept rows of `donor` to `taker`, one replica slot per expert.
  POISE_HD void donate(int32_t donor, int32_t taker, int32_t rows) {
    const int32_t L = p_.num_local_experts;
    const int32_t* start = s_.start_RL + donor * (L + 1);
    s_.received_R[taker] += rows;
    int32_t i = rows > 0 ? index_at(donor, s_.remaining_R[donor] - 1) : 0;
    while (rows > 0) {
      int32_t& remaining = s_.remaining_R[donor];
      i = index_at_or_below(donor, remaining - 1, i);
      const int32_t end = remaining - start[i];
      const int32_t take = rows < end ? rows : end;
      s_.pieces[num_pieces_++] = {s_.sequence_E[donor * L + i], taker, L + s_.replicas_R[taker], end - take, end};
      s_.replicas_R[taker] += 1;
      remaining -= take;
      rows -= take;
    }
  }

  // Fills takers (ranks under U) one at a time from the donors (ranks over U) in queue order:
  // only surplus when that fits the taker's slots, else the surplus of the first j donors and the
  // rest from donor j (the largest j that fits), which overshoots and becomes a taker. False when
  // no j fits (only possible with B < E_local).
  POISE_HD bool plan_exact() {
    const int32_t R = p_.num_ranks, U = p_.row_limit;
    int32_t donor_head = 0, donor_tail = 0, taker_head = 0, taker_tail = 0;
    int32_t total_surplus = 0;
    for (int32_t r = 0; r < R; ++r) {
      if (computed(r) > U) {
        s_.donors[donor_tail++] = r;
        total_surplus += computed(r) - U;
      }
      if (computed(r) < U) s_.takers[taker_tail++] = r;
    }
    while (taker_head < taker_tail) {
      const int32_t taker = s_.takers[taker_head++];
      const int32_t slots = free_slots(taker);
      int32_t need = U - computed(taker);
      if (need > total_surplus) need = total_surplus;  // only with a tolerance: surplus runs out first
      if (need <= 0) continue;
      int32_t slots_used = 0, still = need, surplus_only_end = -1, overshoot_at = -1;
      for (int32_t j = 0; donor_head + j < donor_tail && slots_used <= slots; ++j) {
        const int32_t donor = s_.donors[donor_head + j];
        const int32_t surplus = computed(donor) - U;
        if (still <= surplus) {
          if (slots_used + span(donor, still) <= slots) surplus_only_end = j;
          break;
        }
        if (slots_used + span(donor, still) <= slots) overshoot_at = j;
        slots_used += span(donor, surplus);
        still -= surplus;
      }
      const int32_t surplus_donors = surplus_only_end >= 0 ? surplus_only_end : overshoot_at;
      if (surplus_donors < 0) return false;
      for (int32_t j = 0; j < surplus_donors; ++j) {  // each gives its whole surplus and is done
        const int32_t donor = s_.donors[donor_head++];
        const int32_t surplus = computed(donor) - U;
        donate(donor, taker, surplus);
        need -= surplus;
        total_surplus -= surplus;
      }
      const int32_t last = s_.donors[donor_head];
      const int32_t last_surplus = computed(last) - U;
      donate(last, taker, need);
      total_surplus -= need < last_surplus ? need : last_surplus;
      if (computed(last) <= U) donor_head += 1;
      if (computed(last) < U) s_.takers[taker_tail++] = last;  // it overshot: now it needs rows
    }
    return true;
  }

  // Fewer slots than the exact plan needs: only surplus moves, as far as slots allow; what finds
  // no slot stays on its owner.
  POISE_HD void plan_within_slots() {
    const int32_t R = p_.num_ranks, U = p_.row_limit, L = p_.num_local_experts;
    int32_t taker = 0;
    for (int32_t donor = 0; donor < R; ++donor) {
      while (computed(donor) > U) {
        while (taker < R && (computed(taker) >= U || free_slots(taker) == 0)) ++taker;
        if (taker == R) return;
        int32_t rows = computed(donor) - U;
        if (U - computed(taker) < rows) rows = U - computed(taker);
        if (span(donor, rows) > free_slots(taker)) {  // only the last free_slots experts fit
          const int32_t remaining = s_.remaining_R[donor];
          const int32_t place = index_at(donor, remaining - 1) - free_slots(taker) + 1;
          rows = remaining - s_.start_RL[donor * (L + 1) + place];
        }
        donate(donor, taker, rows);
      }
    }
  }

  // The exact plan, or the slot-limited fallback from a fresh start. True when exact (every rank
  // at most U rows).
  POISE_HD bool run() {
    if (plan_exact()) return true;
    for (int32_t r = 0; r < p_.num_ranks; ++r) {
      s_.remaining_R[r] = s_.start_RL[r * (p_.num_local_experts + 1) + p_.num_local_experts];
      s_.received_R[r] = 0;
      s_.replicas_R[r] = 0;
    }
    num_pieces_ = 0;
    plan_within_slots();
    return false;
  }

  POISE_HD int32_t num_pieces() const { return num_pieces_; }

 private:
  BalanceProblem p_;
  BalanceScratch s_;
  int32_t num_pieces_ = 0;
};

// ---- step 4 (parallel over experts): what the owner keeps ----------------------------------

// Rows [0, kept) of `expert` stay on its owner, in slot expert % E_local.
POISE_HD inline int32_t kept_rows(const BalanceProblem& p, const BalanceScratch& s, int32_t expert) {
  const int32_t L = p.num_local_experts, rank = expert / L;
  const int32_t first = s.start_RL[rank * (L + 1) + s.position_E[expert]];
  const int32_t kept = s.remaining_R[rank] - first;
  const int32_t rows = p.counts_E[expert];
  return kept < 0 ? 0 : (kept > rows ? rows : kept);
}

// Host-side helpers: the one-thread version of steps 1-2 and 3 (the device spreads 1-2 over threads).
POISE_HD inline bool plan_balance_serial(const BalanceProblem& p, const BalanceScratch& s, int32_t* num_pieces) {
  const int32_t E = p.num_ranks * p.num_local_experts;
  for (int32_t e = 0; e < E; ++e) place_expert(p, s, e);
  for (int32_t r = 0; r < p.num_ranks; ++r) start_rank(p, s, r);
  Planner planner(p, s);
  const bool exact = planner.run();
  *num_pieces = planner.num_pieces();
  return exact;
}

}  // namespace poise::plan::shared
