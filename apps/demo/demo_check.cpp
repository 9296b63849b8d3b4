#include "demo_check.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <thread>

namespace poise::demo {

std::vector<std::vector<int64_t>> pick_sampled_tokens(const Config& c, int64_t ranks, uint64_t seed) {
  const int64_t T = c.num_local_input_tokens, K = c.top_k;
  // Per (token, k) pair: h13 (2FD), y (FD), grad_a (FD), grad_x (2FD).
  const double pair_macs = 6.0 * double(c.intermediate_dim) * double(c.hidden_dim);
  const double affordable = kSampledCheckMacs / (pair_macs * double(K) * double(ranks));
  const int64_t per_rank = std::clamp<int64_t>(static_cast<int64_t>(std::min(affordable, 1e6)),
                                               std::min(T, kMinSampledTokensPerRank),
                                               std::min(T, kMaxSampledTokensPerRank));
  std::vector<std::vector<int64_t>> picks(ranks);
  for (int64_t r = 0; r < ranks; ++r) {
    std::mt19937_64 rng(seed * 0xA24BAED4963EE407ull + static_cast<uint64_t>(r));
    std::uniform_int_distribution<int64_t> token(0, T - 1);
    picks[r].push_back(T - 1);
    while (static_cast<int64_t>(picks[r].size()) < per_rank) {
      const int64_t t = token(rng);
      if (std::find(picks[r].begin(), picks[r].end(), t) == picks[r].end()) picks[r].push_back(t);
    }
  }
  return picks;
}

namespace {

double expert_float_bytes(const Config& c) {
  return 3.0 * double(c.intermediate_dim) * double(c.hidden_dim) * 4.0;
}

}  // namespace

int sampled_check_threads(const Config& config) {
  const double fit = std::floor(kSampledCheckHostBytes / expert_float_bytes(config));
  return static_cast<int>(std::clamp(fit, 1.0, double(std::max(1u, std::thread::hardware_concurrency()))));
}

double sampled_check_host_bytes(const Config& config) {
  return double(sampled_check_threads(config)) * expert_float_bytes(config) * 1.5;  // + the bf16 read
}

bool print_check_lines(const std::vector<CheckLine>& lines, double tolerance) {
  bool pass = true;
  for (const CheckLine& line : lines) {
    const bool ok = line.error < tolerance;  // false for NaN
    pass = pass && ok;
    std::printf("  %-12s %.3e  %s\n", line.name.c_str(), line.error, ok ? "PASS" : "FAIL");
  }
  return pass;
}

}  // namespace poise::demo
