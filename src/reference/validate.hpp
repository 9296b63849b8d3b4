// Host checks of the reference engine's arguments: each failure is an InvalidArgument naming the
// argument (and the rank, token or expert at fault), raised before any rank thread starts.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "poise/reference.hpp"

namespace poise::reference {

// config.validate(ep_size) plus the options (replica_slots).
void validate_setup(const Config& config, int64_t ep_size, const Options& options);

// Sizes, bf16 representability, expert id range and distinctness of every rank's inputs.
void validate_inputs(const Config& config, int64_t ep_size, const Options& options,
                     const std::vector<RankInputs>& inputs_per_rank);

// One token's K ids: each kNoExpert or in [0, num_experts), no expert twice. Empty when they are
// fine, else what is wrong ("expert id 300 is out of range ..."), for the caller's InvalidArgument.
std::string token_ids_problem(std::span<const int32_t> ids_K, int64_t num_experts);

// token_ids_problem for every token of every rank: InvalidArgument("ids_TK", "rank r: token t: ...").
void validate_ids(const Config& config, int64_t ep_size, const std::vector<std::span<const int32_t>>& ids_TK_per_rank);

void validate_grad_out(const Config& config, int64_t ep_size,
                       const std::vector<std::vector<float>>& grad_out_TD_per_rank);

// With accumulate_wgrad, the existing grad_w13 / grad_w2 (and, biased, grad_b13 / grad_b2) of every
// rank must have their sizes.
void validate_accumulated_grads(const Config& config, int64_t ep_size,
                                const std::vector<RankGradients>& grads_per_rank, bool biased);

}  // namespace poise::reference
