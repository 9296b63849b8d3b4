// Routing statistics from the ids alone: the counts, balance plan and layouts a forward derives,
// without the experts (mirrors route() in forward.cpp), assembled as Engine::forward assembles its.
#include "reference/routing_stats.hpp"

#include <algorithm>
#include <string>
#include <utility>

#include "balance/balance_cost.hpp"
#include "reference/validate.hpp"

namespace poise::reference {

RoutingStats plan_stats(const plan::BalancePlan& plan, const GroupedLayout& grouped, std::vector<int64_t> expert_rows,
                        int64_t rows_per_rank, int64_t ep_size) {
  RoutingStats stats;
  stats.expert_rows = std::move(expert_rows);
  stats.owner_rows = plan.owner_rows;
  stats.computed_rows = plan.computed_rows;
  stats.grouped_rows = grouped.grouped_rows_per_rank;
  stats.replicas = plan.replicas;
  stats.moved_rows = plan.moved_rows;
  stats.unplaced_surplus_rows = plan.unplaced_surplus_rows;
  for (int64_t rows : stats.owner_rows) stats.surplus_rows += std::max<int64_t>(0, rows - rows_per_rank);
  stats.received_token_rows.assign(ep_size, 0);
  return stats;
}

void count_received(RoutingStats& stats, const DispatchLayout& dispatch) {
  for (size_t dst = 0; dst < stats.received_token_rows.size(); ++dst) {
    stats.received_token_rows[dst] += static_cast<int64_t>(dispatch.tokens_to[dst].size());
  }
}

RoutingStats routing_stats(const Config& config, int64_t ep_size,
                           const std::vector<std::vector<int32_t>>& ids_TK_per_rank, const Options& options) {
  validate_setup(config, ep_size, options);
  validate_ids(config, ep_size, std::vector<std::span<const int32_t>>(ids_TK_per_rank.begin(), ids_TK_per_rank.end()));
  const int64_t E = config.num_experts, K = config.top_k, rows_per_rank = config.num_local_input_tokens * K;
  std::vector<std::vector<int64_t>> counts_RE(ep_size, std::vector<int64_t>(E, 0));
  std::vector<int64_t> expert_rows(E, 0);
  for (int64_t r = 0; r < ep_size; ++r) {
    for (int32_t e : ids_TK_per_rank[r]) {
      if (e == kNoExpert) continue;
      counts_RE[r][e] += 1;
      expert_rows[e] += 1;
    }
  }
  const int64_t replica_slots = options.replica_slots < 0 ? config.num_local_experts(ep_size) : options.replica_slots;
  const plan::BalancePlan plan = config.balance == Balance::exact
                                     ? plan::exact_mode_plan(config, expert_rows, ep_size, rows_per_rank, replica_slots)
                                     : plan::plan_owner_only(expert_rows, ep_size, rows_per_rank);
  const GroupedLayout grouped = make_grouped_layout(plan);
  RoutingStats stats = plan_stats(plan, grouped, expert_rows, rows_per_rank, ep_size);
  for (int64_t r = 0; r < ep_size; ++r) {
    count_received(stats, make_dispatch_layout(r, ids_TK_per_rank[r], K, counts_RE, plan, grouped));
  }
  return stats;
}

}  // namespace poise::reference
