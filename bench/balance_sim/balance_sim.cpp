// Host-side simulator of one MoE layer's forward + backward time at EP 2 / 4 / 8 over NVLink
// (issue 37): the routing's per-expert counts, the plan the shared planner makes under each balance
// mode, and the cost model (src/balance/balance_cost.cuh) with rates fitted to 2 x H200. Runs on a
// CPU in a second. bench/balance_sim/README.md says how the rates were fitted and how close the
// predictions came to the 2-GPU measurements (bench/balance_sim/check.py).
//
//   balance_sim [--out FILE] [--ranks 2,4,8] [--peak-means 1,1.3,1.5,2,3,8]
//               [--ns-per-row 415] [--ns-per-group 45900] [--link-bytes-per-ns 386]
//               [--overhead-ms 1.97] [--token-overhead-ms 3.09]
//               [--replica-grads fp32|bf16] [--hidden-link-fraction 0]
// The last two ask "what if": replica gradients returned in bf16, and a share of the replica traffic
// hidden behind other work (the push prefetched during attention, the gradients during WGRAD).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "balance/balance_cost.hpp"

namespace {

using poise::plan::SharedPlanRun;

// DeepSeek-V3's per-rank shape, as bench/multigpu/multigpu_bench.py runs it.
constexpr int64_t kT = 4096, kK = 8, kD = 7168, kF = 2048, kE = 256, kC = kT * kK;

struct Args {
  std::string out = "bench/results/balance_sim.json";
  std::vector<double> ranks = {2, 4, 8};
  std::vector<double> peak_means = {1, 1.3, 1.5, 2, 3, 8};
  double ns_per_row = 415, ns_per_group = 45900, link_bytes_per_ns = 386;
  double overhead_ms = 1.97, token_overhead_ms = 3.09;  // at EP2; the token part grows with (R-1)/R
  std::string replica_grads = "fp32";
  double hidden_link_fraction = 0;
};

std::vector<double> parse_list(const std::string& text) {
  std::vector<double> values;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) values.push_back(std::stod(item));
  return values;
}

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--out") a.out = value;
    else if (flag == "--ranks") a.ranks = parse_list(value);
    else if (flag == "--peak-means") a.peak_means = parse_list(value);
    else if (flag == "--ns-per-row") a.ns_per_row = std::stod(value);
    else if (flag == "--ns-per-group") a.ns_per_group = std::stod(value);
    else if (flag == "--link-bytes-per-ns") a.link_bytes_per_ns = std::stod(value);
    else if (flag == "--overhead-ms") a.overhead_ms = std::stod(value);
    else if (flag == "--token-overhead-ms") a.token_overhead_ms = std::stod(value);
    else if (flag == "--replica-grads") a.replica_grads = value;
    else if (flag == "--hidden-link-fraction") a.hidden_link_fraction = std::stod(value);
    else {
      std::fprintf(stderr, "balance_sim: unknown flag %s\n", flag.c_str());
      std::exit(2);
    }
  }
  if (argc % 2 == 0) {
    std::fprintf(stderr, "balance_sim: %s needs a value\n", argv[argc - 1]);
    std::exit(2);
  }
  if ((a.replica_grads != "fp32" && a.replica_grads != "bf16") || a.hidden_link_fraction < 0 ||
      a.hidden_link_fraction >= 1) {
    std::fprintf(stderr, "balance_sim: --replica-grads is fp32 or bf16, --hidden-link-fraction in [0, 1)\n");
    std::exit(2);
  }
  return a;
}

// multigpu_bench's routing, in expectation: a share min(1, peak_mean / R) of all picks on rank 0's
// experts, spread evenly; the rest evenly over the other ranks' experts.
std::vector<int64_t> expected_counts(int64_t R, double peak_mean) {
  const int64_t L = kE / R, total = R * kC;
  const int64_t hot = R == 1 ? total : std::min<int64_t>(total, int64_t(double(total) * peak_mean / double(R) + 0.5));
  std::vector<int64_t> counts(kE);
  for (int64_t e = 0; e < kE; ++e) {
    const bool on_rank_0 = e < L;
    const int64_t pool = on_rank_0 ? hot : total - hot, experts = on_rank_0 ? L : kE - L, i = on_rank_0 ? e : e - L;
    counts[e] = pool / experts + (i < pool % experts ? 1 : 0);
  }
  return counts;
}

struct Mode {
  const char* name;
  int64_t row_limit;  // 0: cost-aware choice
};

void write_case(FILE* out, bool first, int64_t R, double peak_mean, const char* mode, int64_t row_limit,
                const SharedPlanRun& run, double overhead_ms) {
  const int64_t replicas = std::accumulate(run.replicas.begin(), run.replicas.end(), int64_t{0});
  const int64_t busiest = *std::max_element(run.computed_rows.begin(), run.computed_rows.end());
  const double layer_ms = run.predicted_ns / 1e6 + overhead_ms;
  std::fprintf(out, "%s\n  {\"ranks\": %lld, \"peak_mean\": %g, \"mode\": \"%s\", \"row_limit\": %lld, "
               "\"busiest_rank_rows\": %lld, \"replicas\": %lld, \"moved_rows\": %lld, \"experts_and_link_ms\": %.3f, "
               "\"predicted_fwdbwd_ms\": %.3f}",
               first ? "" : ",", (long long)R, peak_mean, mode, (long long)row_limit, (long long)busiest,
               (long long)replicas, (long long)run.moved_rows, run.predicted_ns / 1e6, layer_ms);
  std::printf("EP%-2lld peak/mean %-4g %-13s U=%-6lld busiest %-6lld replicas %-4lld -> %7.2f ms\n", (long long)R,
              peak_mean, mode, (long long)row_limit, (long long)busiest, (long long)replicas, layer_ms);
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse_args(argc, argv);
  poise::plan::shared::BalanceCostRates rates;
  rates.expert_ns_per_row = float(a.ns_per_row);
  rates.expert_ns_per_group = float(a.ns_per_group);
  // Link time that overlaps other work costs nothing: the same as a faster link.
  rates.link_bytes_per_ns = float(a.link_bytes_per_ns / (1.0 - a.hidden_link_fraction));
  // bf16 weights out (3FD x 2 bytes), gradients back in fp32 (x 4) or bf16 (x 2).
  rates.replica_bytes = float(3 * kF * kD * (2 + (a.replica_grads == "fp32" ? 4 : 2)));
  FILE* out = std::fopen(a.out.c_str(), "w");
  if (!out) {
    std::fprintf(stderr, "balance_sim: cannot write %s\n", a.out.c_str());
    return 1;
  }
  std::fprintf(out, "{\"benchmark\": \"balance_sim\", \"shape\": {\"T\": %lld, \"K\": %lld, \"D\": %lld, \"F\": %lld, "
               "\"E\": %lld}, \"rates\": {\"ns_per_row\": %g, \"ns_per_group\": %g, \"link_bytes_per_ns\": %g, "
               "\"replica_bytes\": %g, \"overhead_ms\": %g, \"token_overhead_ms_at_ep2\": %g, \"replica_grads\": \"%s\", "
               "\"hidden_link_fraction\": %g},\n \"cases\": [",
               (long long)kT, (long long)kK, (long long)kD, (long long)kF, (long long)kE, a.ns_per_row, a.ns_per_group,
               a.link_bytes_per_ns, double(rates.replica_bytes), a.overhead_ms, a.token_overhead_ms,
               a.replica_grads.c_str(), a.hidden_link_fraction);
  bool first = true;
  for (double ranks : a.ranks) {
    const int64_t R = int64_t(ranks), L = kE / R;
    const double overhead_ms = a.overhead_ms + a.token_overhead_ms * (double(R - 1) / double(R)) / 0.5;
    for (double peak_mean : a.peak_means) {
      if (peak_mean > double(R)) continue;  // rank 0 cannot hold more than every row
      const std::vector<int64_t> counts = expected_counts(R, peak_mean);
      const int64_t owner_max = std::max(kC, std::accumulate(counts.begin(), counts.begin() + L, int64_t{0}));
      for (const Mode& m : {Mode{"capacity", owner_max}, Mode{"exact", kC}, Mode{"tolerance_0.5", kC + kC / 2},
                            Mode{"cost_aware", 0}}) {
        if (m.row_limit == 0) {
          const auto choice = poise::plan::choose_row_limit(counts, R, kC, L, owner_max, rates);
          write_case(out, first, R, peak_mean, m.name, choice.row_limit, choice.plan, overhead_ms);
        } else {
          const int64_t limit = std::min(m.row_limit, owner_max);  // a limit above every load moves nothing
          write_case(out, first, R, peak_mean, m.name, limit,
                     poise::plan::run_shared_planner(counts, R, kC, limit, L, rates), overhead_ms);
        }
        first = false;
      }
    }
  }
  std::fprintf(out, "\n]}\n");
  std::fclose(out);
  std::printf("wrote %s\n", a.out.c_str());
  return 0;
}
