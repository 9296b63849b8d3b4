// The demo's float64 checks: which tokens the sampled check reads, and how results are reported.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "poise/config.hpp"

namespace poise::demo {

// The sampled check reads tokens until their float64 work reaches this many multiply-adds (about a
// second on 16 host threads), at least 2 and at most 16 per rank.
inline constexpr double kSampledCheckMacs = 1e10;
inline constexpr int64_t kMinSampledTokensPerRank = 2, kMaxSampledTokensPerRank = 16;

// Per rank: its last token (the edge of the last tile, a padding row when there are any), then
// distinct others drawn from the seed.
std::vector<std::vector<int64_t>> pick_sampled_tokens(const Config& config, int64_t ranks, uint64_t seed);

// Each thread of the sampled check holds one expert's weights as floats: as many threads as the
// hardware has, while they hold at most kSampledCheckHostBytes together (at least one).
inline constexpr double kSampledCheckHostBytes = 8.0 * double(1 << 30);
int sampled_check_threads(const Config& config);
double sampled_check_host_bytes(const Config& config);

struct CheckLine {
  std::string name;
  double error = 0.0;  // relative L2 error against float64
};

// One line per output: the error and PASS or FAIL (NaN fails). Returns whether all pass.
bool print_check_lines(const std::vector<CheckLine>& lines, double tolerance);

}  // namespace poise::demo
