// The RoutingStats of one call from what its forward derived: shared by routing_stats() (from the
// ids alone) and Engine::forward (from what its ranks derived).
#pragma once

#include <cstdint>
#include <vector>

#include "poise/reference.hpp"
#include "reference/routing_layout.hpp"

namespace poise::reference {

// Every field but the received token rows, which start at zero: count_received adds each rank's.
RoutingStats plan_stats(const plan::BalancePlan& plan, const GroupedLayout& grouped, std::vector<int64_t> expert_rows,
                        int64_t rows_per_rank, int64_t ep_size);
// The token rows one source rank's dispatch sends to each rank.
void count_received(RoutingStats& stats, const DispatchLayout& dispatch);

}  // namespace poise::reference
