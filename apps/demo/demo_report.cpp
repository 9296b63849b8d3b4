#include "demo_report.hpp"

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace poise::demo {
namespace {

std::string list(const std::vector<int64_t>& values) {
  std::string s = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i == 16 && values.size() > 20) {
      s += " ... " + std::to_string(values.size() - 16) + " more";
      break;
    }
    if (i > 0) s += ' ';
    s += std::to_string(values[i]);
  }
  return s + "]";
}

}  // namespace

void print_header(const Setup& s) {
  const Config& c = s.config();
  std::printf("Poise demo: one MoE layer, forward + backward, EP=%lld\n", static_cast<long long>(s.ranks()));
  std::printf("Device: %s\n", s.device_line.c_str());
  std::printf("Layer: activation=%s, scores %s, wgrad %s%s, routing skew %.2f, padding rows %lld, seed %llu\n",
              poise::to_string(c.activation), poise::to_string(s.flags.scores_dtype), poise::to_string(c.wgrad_dtype),
              s.wgrad_note.c_str(), s.flags.skew, static_cast<long long>(s.flags.padding_rows),
              static_cast<unsigned long long>(s.flags.seed));
  if (c.balance == Balance::capacity) {
    std::printf("Balance: capacity, receive capacity factor %.2f%s\n", c.receive_capacity_factor,
                s.capacity_note.c_str());
  }
  std::printf("Check: %s\n", s.check_line.c_str());
  std::printf("Memory: %s\n\n", s.memory_line.c_str());
  std::fputs(s.plan.explain().c_str(), stdout);
  std::printf("\n");
}

void print_balance(const Setup& s) {
  const ref::RoutingStats& st = s.stats;
  const Config& c = s.config();
  std::printf("Routing balance (rows = (token, k) pairs; T*K = %lld per rank):\n",
              static_cast<long long>(c.num_local_input_tokens * c.top_k));
  std::printf("  rows per rank before balancing  %s  peak/mean %.2f\n", list(st.owner_rows).c_str(),
              st.owner_peak_over_mean());
  std::printf("  rows per rank computed          %s  peak/mean %.2f\n", list(st.computed_rows).c_str(),
              st.computed_peak_over_mean());
  std::printf("  grouped rows (padded to %lld)    %s\n", static_cast<long long>(poise::kExpertRowAlignment),
              list(st.grouped_rows).c_str());
  std::printf("  token rows received per rank    %s  (a token crosses to a rank once)\n",
              list(st.received_token_rows).c_str());
  if (c.balance == Balance::exact) {
    std::printf("  replica experts per rank        %s\n", list(st.replicas).c_str());
    std::printf("  rows moved off their owner      %lld (surplus %lld)\n", static_cast<long long>(st.moved_rows),
                static_cast<long long>(st.surplus_rows));
    if (st.unplaced_surplus_rows > 0) {
      std::printf("  NOT EXACT: %lld surplus rows found no replica slot and stay on their owner\n",
                  static_cast<long long>(st.unplaced_surplus_rows));
    }
  }
}

bool capacity_overflows(const Setup& s) {
  const Config& c = s.config();
  if (c.balance != Balance::capacity) return false;
  const auto capacity =
      static_cast<int64_t>(std::floor(c.receive_capacity_factor * double(c.num_local_input_tokens * c.top_k)));
  for (int64_t r = 0; r < s.ranks(); ++r) {
    if (s.stats.computed_rows[r] > capacity) {
      std::printf("\nCapacity: %s\nresult: FAIL (raise --capacity-factor, leave it out to size it from the routing, or "
                  "use --balance exact)\n",
                  ref::CapacityExceeded(r, s.stats.computed_rows[r], capacity).what());
      return true;
    }
  }
  return false;
}

}  // namespace poise::demo
