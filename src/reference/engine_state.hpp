// What the reference engine keeps: per rank, the routing layout and the activations backward
// needs (what a Context keeps in an activation slot); and the messages ranks exchange.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "balance/balance_plan.hpp"
#include "poise/reference.hpp"
#include "reference/expert_mlp.hpp"
#include "reference/routing_layout.hpp"
#include "reference/swiglu.hpp"
#include "reference/transport.hpp"

namespace poise::reference {

inline constexpr float kPoison = std::numeric_limits<float>::quiet_NaN();

// Rows crossing from a source to a destination rank in forward dispatch. A token row travels once;
// each of its entries names the token row and the grouped row the destination puts it in.
struct DispatchMessage {
  std::vector<float> token_rows;               // [tokens, D] bf16
  std::vector<int64_t> token_of_entry;         // [entries] index into token_rows
  std::vector<int64_t> grouped_row_of_entry;   // [entries]
};

// Rows in an order both sides already agree on (the entries of the dispatch message).
struct RowsMessage {
  std::vector<float> rows;  // [entries, D]
};

// Expert weights and biases (owner -> replica rank) or their fp32 grads (replica rank -> owner).
struct ExpertBlocksMessage {
  std::vector<int64_t> experts;  // global ids
  std::vector<int64_t> slots;    // slot on the replica rank
  std::vector<float> w13;        // [n, 2F, D]
  std::vector<float> w2;         // [n, D, F]
  std::vector<float> b13;        // [n, 2F] (layers with biases)
  std::vector<float> b2;         // [n, D]
};

struct RankState {
  // Routing: each rank derives the same plan from the all-gathered counts.
  std::vector<std::vector<int64_t>> counts_RE;
  plan::BalancePlan plan;
  GroupedLayout grouped;
  DispatchLayout dispatch;  // this rank as a source

  // This rank as a destination: its expert-grouped rows.
  std::vector<std::vector<int64_t>> rows_from;  // [R] grouped row of each entry a source sent, in its order
  std::vector<float> x_GD;                      // [G, D] bf16 (padding rows zero)
  std::vector<float> h13_G2F;                   // [G, 2F] bf16 values, as saved for backward
  std::vector<float> a_GF;                      // [G, F] bf16
  std::vector<float> replica_w13, replica_w2;   // [B, 2F, D], [B, D, F] weights of replica slots
  std::vector<float> replica_b13, replica_b2;   // [B, 2F], [B, D] their biases (layers with biases)

  // This rank as an owner of tokens: y of every (t, k), for grad_scores.
  std::vector<float> y_TKD;  // [T*K, D] bf16

  // This rank as an owner of experts: SwiGLU clips over every row of each local expert.
  std::vector<int64_t> clip_counts_E2;  // [E_local][2] gate > limit, |up| > limit (clamped; else 0)
};

struct EngineState {
  Config config;
  int64_t ep_size = 0;
  Options options;
  int64_t replica_slots = 0;  // B
  ExpertShape shape;
  SwigluParams act;

  std::vector<RankState> ranks;
  std::vector<std::vector<int32_t>> forward_ids_TK;  // to check backward differentiates the same call
  bool has_forward = false;
  bool biased = false;  // the latest forward's layer has expert biases (RankInputs::b13 / b2)
  RoutingStats stats;

  int64_t T() const { return config.num_local_input_tokens; }
  int64_t D() const { return config.hidden_dim; }
  int64_t F() const { return config.intermediate_dim; }
  int64_t K() const { return config.top_k; }
  int64_t E() const { return config.num_experts; }
  int64_t local_experts() const { return config.num_local_experts(ep_size); }
};

// Weights of a grouped-buffer slot: the rank's own expert or a replica received in forward.
const float* group_w13(const EngineState& s, const RankState& st, const RankInputs& in, int64_t slot);
const float* group_w2(const EngineState& s, const RankState& st, const RankInputs& in, int64_t slot);
// Its biases (null pointers for a layer without).
ExpertBiases group_biases(const EngineState& s, const RankState& st, const RankInputs& in, int64_t slot);

// One rank's part of a call; run on every rank's thread by Engine::forward / backward.
void forward_rank(EngineState& state, int rank, InProcessTransport& transport, const RankInputs& inputs,
                  std::vector<float>& out_TD);
void backward_rank(EngineState& state, int rank, InProcessTransport& transport, const RankInputs& inputs,
                   const std::vector<float>& grad_out_TD, RankGradients& grads, bool accumulate_wgrad);

}  // namespace poise::reference
