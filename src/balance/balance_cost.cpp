#include "balance/balance_cost.hpp"

#include <algorithm>
#include <tuple>

#include "core/workspace_layout.hpp"
#include "poise/errors.hpp"

namespace poise::plan {

SharedPlanRun run_shared_planner(std::span<const int64_t> counts_E, int64_t num_ranks, int64_t rows_per_rank,
                                 int64_t row_limit, int64_t replica_slots, const shared::BalanceCostRates& rates) {
  validate_counts(counts_E, num_ranks, rows_per_rank);
  if (row_limit < rows_per_rank) throw InvalidArgument("row_limit", "must be >= rows_per_rank");
  if (replica_slots < 0) throw InvalidArgument("replica_slots", "must be >= 0");
  const int32_t E = int32_t(counts_E.size()), R = int32_t(num_ranks), L = E / R, B = int32_t(replica_slots);
  std::vector<int32_t> counts(counts_E.begin(), counts_E.end());
  std::vector<int32_t> position(E), sequence(E), start(R * (L + 1)), remaining(R), received(R), replicas(R),
      donors(R), takers(2 * R), sent(R), groups(R);
  std::vector<shared::ReplicaPiece> pieces(std::max(1, R * B));
  // As the device planner kernel: the rows of free entries (kNoExpert) are not balanced.
  const int64_t target = balanced_rows_per_rank(counts_E, num_ranks);
  const shared::BalanceProblem p{counts.data(), R, L, int32_t(target), int32_t(row_limit - rows_per_rank + target), B};
  const shared::BalanceScratch s{position.data(), sequence.data(), start.data(), remaining.data(), received.data(),
                                 replicas.data(), donors.data(), takers.data(), pieces.data()};
  int32_t num_pieces = 0;
  SharedPlanRun out;
  out.exact = shared::plan_balance_serial(p, s, &num_pieces);
  if (rates.link_bytes_per_ns > 0) out.predicted_ns = shared::predicted_ns(p, s, num_pieces, rates, sent.data(), groups.data());
  out.computed_rows.assign(R, 0);
  out.replicas.assign(replicas.begin(), replicas.end());
  out.replicas_sent.assign(R, 0);
  for (int32_t e = 0; e < E; ++e) {
    const int32_t kept = shared::kept_rows(p, s, e);
    if (kept > 0) out.pieces.push_back({e, e / L, e % L, 0, kept});
  }
  for (int32_t i = 0; i < num_pieces; ++i) {
    const shared::ReplicaPiece& q = pieces[i];
    out.pieces.push_back({q.expert, q.rank, q.slot, q.begin, q.end});
    out.moved_rows += q.end - q.begin;
    out.replicas_sent[q.expert / L] += 1;
  }
  for (const ExpertPiece& q : out.pieces) out.computed_rows[q.rank] += q.rows();
  std::sort(out.pieces.begin(), out.pieces.end(), [](const ExpertPiece& a, const ExpertPiece& b) {
    return std::tie(a.expert, a.begin) < std::tie(b.expert, b.begin);
  });
  return out;
}

CostAwareChoice choose_row_limit(std::span<const int64_t> counts_E, int64_t num_ranks, int64_t rows_per_rank,
                                 int64_t replica_slots, int64_t max_row_limit, const shared::BalanceCostRates& rates) {
  if (!(rates.link_bytes_per_ns > 0) || !(rates.expert_ns_per_row > 0) || !(rates.replica_bytes >= 0))
    throw InvalidArgument("rates", "need expert_ns_per_row > 0, link_bytes_per_ns > 0, replica_bytes >= 0");
  CostAwareChoice best;
  for (int32_t i = 0; i < shared::kCostCandidates; ++i) {
    const int64_t limit = shared::candidate_row_limit(int32_t(rows_per_rank), int32_t(max_row_limit), i);
    SharedPlanRun run = run_shared_planner(counts_E, num_ranks, rows_per_rank, limit, replica_slots, rates);
    best.candidate_row_limits.push_back(limit);
    best.candidates_ns.push_back(run.predicted_ns);
    if (i == 0 || run.predicted_ns < best.plan.predicted_ns) {
      best.row_limit = limit;
      best.plan = std::move(run);
    }
  }
  return best;
}

BalancePlan exact_mode_plan(const Config& config, std::span<const int64_t> counts_E, int64_t num_ranks,
                            int64_t rows_per_rank, int64_t replica_slots) {
  if (!config.cost_aware_balance()) return plan_exact_balance(counts_E, num_ranks, rows_per_rank, replica_slots);
  CostAwareChoice choice = choose_row_limit(counts_E, num_ranks, rows_per_rank, replica_slots,
                                            layout::row_limit(config), balance_cost_rates(config));
  return plan_from_pieces(counts_E, num_ranks, rows_per_rank, replica_slots, std::move(choice.plan.pieces));
}

shared::BalanceCostRates balance_cost_rates(const Config& c) {
  if (!c.cost_aware_balance()) throw InvalidArgument("balance_cost_ns_per_row", "the cost-aware plan is not configured");
  const double weights = 3.0 * double(c.intermediate_dim) * double(c.hidden_dim);  // W13 (2 F D) and W2 (F D)
  const double grad_bytes = c.inference ? 0.0 : (c.replica_grad_dtype == DType::bf16 ? 2.0 : 4.0);
  shared::BalanceCostRates rates;
  rates.expert_ns_per_row = float(c.balance_cost_ns_per_row);
  rates.expert_ns_per_group = float(c.balance_cost_ns_per_group);
  rates.link_bytes_per_ns = float(c.balance_link_gb_per_s);  // 1 GB/s = 1 byte/ns
  rates.replica_bytes = float(weights * (2.0 + grad_bytes));
  return rates;
}

}  // namespace poise::plan
