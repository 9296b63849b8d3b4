// Routing statistics from the ids alone: the counts, balance plan and layouts a forward derives,
// without the experts (mirrors route() in forward.cpp), assembled as Engine::forward assembles its.
#include "reference/routing_stats.hpp"

#include <algorithm>
#include <string>
#include <utility>

#include "reference/validate.hpp"

namespace poise::reference {

namespace {

void validate_ids(const Config& config, int64_t ep_size, const std::vector<std::vector<int32_t>>& ids_TK_per_rank) {
  if (static_cast<int64_t>(ids_TK_per_rank.size()) != ep_size) {
    throw InvalidArgument("ids_TK", "expected one tensor per rank (" + std::to_string(ep_size) + "), got " +
                                        std::to_string(ids_TK_per_rank.size()));
  }
  const int64_t T = config.num_local_input_tokens, K = config.top_k, E = config.num_experts;
  for (int64_t r = 0; r < ep_size; ++r) {
    const std::vector<int32_t>& ids = ids_TK_per_rank[r];
    const std::string at = "rank " + std::to_string(r) + ": ";
    if (static_cast<int64_t>(ids.size()) != T * K) {
      throw InvalidArgument("ids_TK", at + "expected T*K = " + std::to_string(T * K) + " ids, got " +
                                          std::to_string(ids.size()));
    }
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = ids[t * K + k];
        if (e < 0 || e >= E) {
          throw InvalidArgument("ids_TK", at + "expert id " + std::to_string(e) + " of token " + std::to_string(t) +
                                              " is out of range [0, " + std::to_string(E) + ")");
        }
        if (std::find(ids.begin() + t * K, ids.begin() + t * K + k, e) != ids.begin() + t * K + k) {
          throw InvalidArgument("ids_TK", at + "token " + std::to_string(t) + " picks expert " + std::to_string(e) +
                                              " twice (top-k ids must be distinct)");
        }
      }
    }
  }
}

}  // namespace

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
  validate_ids(config, ep_size, ids_TK_per_rank);
  const int64_t E = config.num_experts, K = config.top_k, rows_per_rank = config.num_local_input_tokens * K;
  std::vector<std::vector<int64_t>> counts_RE(ep_size, std::vector<int64_t>(E, 0));
  std::vector<int64_t> expert_rows(E, 0);
  for (int64_t r = 0; r < ep_size; ++r) {
    for (int32_t e : ids_TK_per_rank[r]) {
      counts_RE[r][e] += 1;
      expert_rows[e] += 1;
    }
  }
  const int64_t replica_slots = options.replica_slots < 0 ? config.num_local_experts(ep_size) : options.replica_slots;
  const plan::BalancePlan plan = config.balance == Balance::exact
                                     ? plan::plan_exact_balance(expert_rows, ep_size, rows_per_rank, replica_slots)
                                     : plan::plan_owner_only(expert_rows, ep_size, rows_per_rank);
  const GroupedLayout grouped = make_grouped_layout(plan);
  RoutingStats stats = plan_stats(plan, grouped, expert_rows, rows_per_rank, ep_size);
  for (int64_t r = 0; r < ep_size; ++r) {
    count_received(stats, make_dispatch_layout(r, ids_TK_per_rank[r], K, counts_RE, plan, grouped));
  }
  return stats;
}

}  // namespace poise::reference
