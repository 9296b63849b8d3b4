#include "reference/validate.hpp"

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
  const int64_t K = config.top_k, E = config.num_experts, local = config.num_local_experts(ep_size);
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
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = in.ids_TK[t * K + k];
        if (e < 0 || e >= E) {
          throw InvalidArgument("ids_TK", at_rank(r) + "expert id " + std::to_string(e) + " of token " +
                                              std::to_string(t) + " is out of range [0, " + std::to_string(E) + ")");
        }
        for (int64_t j = 0; j < k; ++j) {
          if (in.ids_TK[t * K + j] == e) {
            throw InvalidArgument("ids_TK", at_rank(r) + "token " + std::to_string(t) + " picks expert " +
                                                std::to_string(e) + " twice (top-k ids must be distinct)");
          }
        }
      }
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
                                const std::vector<RankGradients>& grads_per_rank) {
  if (static_cast<int64_t>(grads_per_rank.size()) != ep_size) {
    throw InvalidArgument("grads_per_rank", "accumulate_wgrad needs the existing gradients of every rank (" +
                                                std::to_string(ep_size) + "), got " +
                                                std::to_string(grads_per_rank.size()));
  }
  const int64_t D = config.hidden_dim, F = config.intermediate_dim, local = config.num_local_experts(ep_size);
  for (int64_t r = 0; r < ep_size; ++r) {
    require_size(grads_per_rank[r].grad_w13.size(), local * 2 * F * D, "grad_w13", r, "E_local*2F*D");
    require_size(grads_per_rank[r].grad_w2.size(), local * D * F, "grad_w2", r, "E_local*D*F");
  }
}

}  // namespace poise::reference
