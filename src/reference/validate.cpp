#include "reference/validate.hpp"

#include <algorithm>
#include <cmath>
#include <string>

namespace poise::reference {

namespace {

std::string at_rank(int64_t rank) { return "rank " + std::to_string(rank) + ": "; }

void require_size(size_t got, int64_t want, const char* name, int64_t rank, const std::string& shape) {
  if (static_cast<int64_t>(got) != want) {
    throw InvalidArgument(name, at_rank(rank) + "expected " + std::to_string(want) + " values (" + shape +
                                    "), got " + std::to_string(got));
  }
}

void require_bf16(const std::vector<float>& values, const char* name, int64_t rank) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (!is_bf16_value(values[i])) {
      throw InvalidArgument(name, at_rank(rank) + "value " + std::to_string(values[i]) + " at index " +
                                      std::to_string(i) + " is not a bf16 value (use round_to_bf16)");
    }
  }
}

// Biases: b13 and b2 together, on every rank or on none, of their sizes, bf16 values; not (yet)
// with FP8 GEMMs.
void validate_biases(const Config& config, const RankInputs& in, bool none, int64_t local, int64_t rank) {
  if (in.b13.empty() != none || in.b2.empty() != none) {
    throw InvalidArgument(in.b13.empty() != none ? "b13" : "b2",
                          at_rank(rank) + "biases go with every rank or none, b13 and b2 together");
  }
  if (none) return;
  if (config.gemm_precision != GemmPrecision::bf16) {
    throw InvalidArgument("b13", "expert biases with gemm_precision " + std::string(to_string(config.gemm_precision)) +
                                     ": not built (bf16 only)");
  }
  require_size(in.b13.size(), local * 2 * config.intermediate_dim, "b13", rank, "E_local*2F");
  require_size(in.b2.size(), local * config.hidden_dim, "b2", rank, "E_local*D");
  require_bf16(in.b13, "b13", rank);
  require_bf16(in.b2, "b2", rank);
}

}  // namespace

void validate_setup(const Config& config, int64_t ep_size, const Options& options) {
  config.validate(ep_size);
  if (options.replica_slots < -1) {
    throw InvalidArgument("replica_slots", "must be >= 0 (or -1 for E_local), got " +
                                               std::to_string(options.replica_slots));
  }
}

void validate_inputs(const Config& config, int64_t ep_size, const Options& options,
                     const std::vector<RankInputs>& inputs_per_rank) {
  if (static_cast<int64_t>(inputs_per_rank.size()) != ep_size) {
    throw InvalidArgument("inputs_per_rank", "expected one RankInputs per rank (" + std::to_string(ep_size) +
                                                 "), got " + std::to_string(inputs_per_rank.size()));
  }
  const int64_t T = config.num_local_input_tokens, D = config.hidden_dim, F = config.intermediate_dim;
  const int64_t K = config.top_k, local = config.num_local_experts(ep_size);
  for (int64_t r = 0; r < ep_size; ++r) {
    const RankInputs& in = inputs_per_rank[r];
    require_size(in.x_TD.size(), T * D, "x_TD", r, "T*D");
    require_size(in.ids_TK.size(), T * K, "ids_TK", r, "T*K");
    require_size(in.scores_TK.size(), T * K, "scores_TK", r, "T*K");
    require_size(in.w13.size(), local * 2 * F * D, "w13", r, "E_local*2F*D");
    require_size(in.w2.size(), local * D * F, "w2", r, "E_local*D*F");
    require_bf16(in.x_TD, "x_TD", r);
    require_bf16(in.w13, "w13", r);
    require_bf16(in.w2, "w2", r);
    if (options.scores_dtype == DType::bf16) require_bf16(in.scores_TK, "scores_TK", r);
    validate_biases(config, in, inputs_per_rank[0].b13.empty(), local, r);
  }
  std::vector<std::span<const int32_t>> ids;
  for (const RankInputs& in : inputs_per_rank) ids.emplace_back(in.ids_TK);
  validate_ids(config, ep_size, ids);
}

std::string token_ids_problem(std::span<const int32_t> ids_K, int64_t num_experts) {
  for (size_t k = 0; k < ids_K.size(); ++k) {
    const int32_t e = ids_K[k];
    if (e == kNoExpert) continue;
    if (e < 0 || e >= num_experts) {
      return "expert id " + std::to_string(e) + " is out of range [0, " + std::to_string(num_experts) +
             ") (or " + std::to_string(kNoExpert) + ": no expert)";
    }
    if (std::find(ids_K.begin(), ids_K.begin() + k, e) != ids_K.begin() + k) {
      return "picks expert " + std::to_string(e) + " twice (top-k ids must be distinct)";
    }
  }
  return {};
}

void validate_ids(const Config& config, int64_t ep_size, const std::vector<std::span<const int32_t>>& ids_TK_per_rank) {
  if (static_cast<int64_t>(ids_TK_per_rank.size()) != ep_size) {
    throw InvalidArgument("ids_TK", "expected one tensor per rank (" + std::to_string(ep_size) + "), got " +
                                        std::to_string(ids_TK_per_rank.size()));
  }
  const int64_t T = config.num_local_input_tokens, K = config.top_k;
  for (int64_t r = 0; r < ep_size; ++r) {
    const std::span<const int32_t> ids = ids_TK_per_rank[r];
    require_size(ids.size(), T * K, "ids_TK", r, "T*K");
    for (int64_t t = 0; t < T; ++t) {
      const std::string problem = token_ids_problem(ids.subspan(t * K, K), config.num_experts);
      if (!problem.empty()) throw InvalidArgument("ids_TK", at_rank(r) + "token " + std::to_string(t) + ": " + problem);
    }
  }
}

void validate_grad_out(const Config& config, int64_t ep_size,
                       const std::vector<std::vector<float>>& grad_out_TD_per_rank) {
  if (static_cast<int64_t>(grad_out_TD_per_rank.size()) != ep_size) {
    throw InvalidArgument("grad_out_TD", "expected one tensor per rank (" + std::to_string(ep_size) + "), got " +
                                             std::to_string(grad_out_TD_per_rank.size()));
  }
  for (int64_t r = 0; r < ep_size; ++r) {
    require_size(grad_out_TD_per_rank[r].size(), config.num_local_input_tokens * config.hidden_dim,
                 "grad_out_TD", r, "T*D");
    require_bf16(grad_out_TD_per_rank[r], "grad_out_TD", r);
  }
}

void validate_accumulated_grads(const Config& config, int64_t ep_size,
                                const std::vector<RankGradients>& grads_per_rank, bool biased) {
  if (static_cast<int64_t>(grads_per_rank.size()) != ep_size) {
    throw InvalidArgument("grads_per_rank", "accumulate_wgrad needs the existing gradients of every rank (" +
                                                std::to_string(ep_size) + "), got " +
                                                std::to_string(grads_per_rank.size()));
  }
  const int64_t D = config.hidden_dim, F = config.intermediate_dim, local = config.num_local_experts(ep_size);
  for (int64_t r = 0; r < ep_size; ++r) {
    require_size(grads_per_rank[r].grad_w13.size(), local * 2 * F * D, "grad_w13", r, "E_local*2F*D");
    require_size(grads_per_rank[r].grad_w2.size(), local * D * F, "grad_w2", r, "E_local*D*F");
    if (!biased) continue;
    require_size(grads_per_rank[r].grad_b13.size(), local * 2 * F, "grad_b13", r, "E_local*2F");
    require_size(grads_per_rank[r].grad_b2.size(), local * D, "grad_b2", r, "E_local*D");
  }
}

}  // namespace poise::reference
