// Backward of one rank, the mirror of forward with the saved layout:
// grad_y and grad_scores at the owner -> grad_y rows to the computing ranks -> expert backward ->
// grad_x rows back and summed over k -> replica weight grads (replica_grad_dtype) reduced to the owner in fp32.
#include <algorithm>

#include "reference/engine_state.hpp"
#include "reference/expert_mlp_fp8.hpp"

namespace poise::reference {

namespace {

float to_dtype(float value, DType dtype) { return dtype == DType::bf16 ? round_to_bf16(value) : value; }

// FP8 GEMMs (docs/fp8.md): grad rows cross unscaled with their scores, as on the GPU; the expert
// applies the score after DGRAD W2 and computes the score's gradient, which returns with grad_x.
bool rows_cross_unscaled(const EngineState& s) { return s.config.gemm_precision == GemmPrecision::fp8_block_scaled; }

// Sends each computing rank the grad_y rows of its entries; returns them placed in grouped order.
// Rows cross unscaled (rows_cross_unscaled): grad_out rows, and each row's score into score_G.
std::vector<float> exchange_grad_y(EngineState& s, int rank, InProcessTransport& transport, const RankInputs& in,
                                   const std::vector<float>& grad_out_TD, RankGradients& grads,
                                   std::vector<float>& score_G) {
  RankState& st = s.ranks[rank];
  const int64_t D = s.D(), K = s.K();
  const bool unscaled = rows_cross_unscaled(s);
  const int64_t width = unscaled ? D + 1 : D;  // + the score
  // grad_y[t,k] = round_bf16(score[t,k] * grad_out[t]); grad_scores[t,k] = dot(grad_out[t], y[t,k]).
  grads.grad_scores_TK.assign(s.T() * K, kPoison);
  for (int64_t entry = 0; entry < s.T() * K; ++entry) {
    if (st.dispatch.dest_rank_TK[entry] < 0) grads.grad_scores_TK[entry] = 0.0f;  // free entry
  }
  std::vector<RowsMessage> to_rank(s.ep_size);
  for (int64_t dst = 0; dst < s.ep_size; ++dst) {
    std::vector<float>& rows = to_rank[dst].rows;
    rows.reserve(st.dispatch.entries_to[dst].size() * width);
    for (int64_t entry : st.dispatch.entries_to[dst]) {
      const float score = in.scores_TK[entry];
      const float* grad_out = grad_out_TD.data() + (entry / K) * D;
      if (unscaled) {
        rows.insert(rows.end(), grad_out, grad_out + D);
        rows.push_back(score);
        continue;
      }
      const float* y = st.y_TKD.data() + entry * D;
      float grad_score = 0.0f;
      for (int64_t d = 0; d < D; ++d) {
        rows.push_back(round_to_bf16(score * grad_out[d]));
        grad_score += grad_out[d] * y[d];
      }
      grads.grad_scores_TK[entry] = to_dtype(grad_score, s.options.scores_dtype);
    }
  }
  std::vector<RowsMessage> from_rank = transport.all_to_all(rank, std::move(to_rank));

  const int64_t G = st.grouped.grouped_rows_per_rank[rank];
  std::vector<float> grad_y_GD(G * D, 0.0f);
  score_G.assign(unscaled ? G : 0, 0.0f);
  for (const ExpertGroup& group : st.grouped.groups_per_rank[rank]) {
    std::fill(grad_y_GD.begin() + group.first_row * D, grad_y_GD.begin() + (group.first_row + group.rows) * D, kPoison);
  }
  for (int64_t src = 0; src < s.ep_size; ++src) {
    const std::vector<int64_t>& rows = st.rows_from[src];
    for (size_t i = 0; i < rows.size(); ++i) {
      std::copy_n(from_rank[src].rows.begin() + i * width, D, grad_y_GD.begin() + rows[i] * D);
      if (unscaled) score_G[rows[i]] = from_rank[src].rows[i * width + D];
    }
  }
  return grad_y_GD;
}

// Returns grad_x rows to their sources, who sum them over k: grad_x[t] = round_bf16(sum_k rows).
// With rows_cross_unscaled, each row's score gradient (grad_score_G) travels with it.
void return_grad_x(EngineState& s, int rank, InProcessTransport& transport, const std::vector<float>& grad_x_GD,
                   const std::vector<float>& grad_score_G, RankGradients& grads) {
  RankState& st = s.ranks[rank];
  const int64_t T = s.T(), D = s.D(), K = s.K();
  const bool unscaled = rows_cross_unscaled(s);
  const int64_t width = unscaled ? D + 1 : D;
  std::vector<RowsMessage> to_rank(s.ep_size);
  for (int64_t src = 0; src < s.ep_size; ++src) {
    std::vector<float>& rows = to_rank[src].rows;
    rows.reserve(st.rows_from[src].size() * width);
    for (int64_t row : st.rows_from[src]) {
      rows.insert(rows.end(), grad_x_GD.begin() + row * D, grad_x_GD.begin() + (row + 1) * D);
      if (unscaled) rows.push_back(grad_score_G[row]);
    }
  }
  std::vector<RowsMessage> from_rank = transport.all_to_all(rank, std::move(to_rank));
  std::vector<float> grad_x_TKD(T * K * D, kPoison);
  for (int64_t dst = 0; dst < s.ep_size; ++dst) {
    const std::vector<int64_t>& entries = st.dispatch.entries_to[dst];
    for (size_t i = 0; i < entries.size(); ++i) {
      std::copy_n(from_rank[dst].rows.begin() + i * width, D, grad_x_TKD.begin() + entries[i] * D);
      if (unscaled) grads.grad_scores_TK[entries[i]] = to_dtype(from_rank[dst].rows[i * width + D], s.options.scores_dtype);
    }
  }
  grads.grad_x_TD.assign(T * D, kPoison);
  std::vector<float> sum(D);
  for (int64_t t = 0; t < T; ++t) {
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      if (st.dispatch.dest_rank_TK[t * K + k] < 0) continue;  // free entry
      const float* rows = grad_x_TKD.data() + (t * K + k) * D;
      for (int64_t d = 0; d < D; ++d) sum[d] += rows[d];
    }
    for (int64_t d = 0; d < D; ++d) grads.grad_x_TD[t * D + d] = round_to_bf16(sum[d]);
  }
}

}  // namespace

namespace {

// One expert group's backward: BF16 or FP8 block-scaled GEMMs (docs/fp8.md). x's FP8 rows are
// quantized again from the bf16 rows: row-local, so the same bits as the forward's. FP8: grad_y_GD
// holds the unscaled rows, score_G their scores, and the group's score gradients go to grad_score_G.
void group_backward(const EngineState& s, const RankState& st, const RankInputs& in, const ExpertGroup& group,
                    const std::vector<float>& grad_y_GD, const std::vector<float>& score_G,
                    std::vector<float>& grad_x_GD, std::vector<float>& grad_score_G, float* grad_w13, float* grad_w2,
                    float* grad_b13, float* grad_b2) {
  const int64_t D = s.D(), F = s.F(), first = group.first_row;
  const float* x = st.x_GD.data() + first * D;
  const float* w13 = group_w13(s, st, in, group.slot);
  const float* w2 = group_w2(s, st, in, group.slot);
  if (s.config.gemm_precision == GemmPrecision::fp8_block_scaled) {
    expert_backward_fp8(s.shape, s.act, group.rows, numerics::quantize_row_tiles(x, group.rows, D),
                        st.h13_G2F.data() + first * 2 * F, grad_y_GD.data() + first * D, score_G.data() + first,
                        quantize_expert_weights(s.shape, w13, w2), s.config.fp8_wgrad, grad_x_GD.data() + first * D,
                        grad_score_G.data() + first, grad_w13, grad_w2);
  } else {
    expert_backward(s.shape, s.act, group.rows, x, st.h13_G2F.data() + first * 2 * F, st.a_GF.data() + first * F,
                    grad_y_GD.data() + first * D, w13, w2, grad_x_GD.data() + first * D, grad_w13, grad_w2, grad_b13,
                    grad_b2);
  }
}

}  // namespace

namespace {

// fp32 weight and bias gradient sums of `n` expert slots (own experts, or replica slots).
struct ExpertGrads {
  int64_t block13, block2, bias13, bias2;
  std::vector<float> w13, w2, b13, b2;
  ExpertGrads(int64_t n, int64_t block13, int64_t block2, int64_t bias13, int64_t bias2)
      : block13(block13), block2(block2), bias13(bias13), bias2(bias2), w13(n * block13, 0.0f), w2(n * block2, 0.0f),
        b13(n * bias13, 0.0f), b2(n * bias2, 0.0f) {}
  float* w13_of(int64_t i) { return w13.data() + i * block13; }
  float* w2_of(int64_t i) { return w2.data() + i * block2; }
  float* b13_of(int64_t i) { return bias13 ? b13.data() + i * bias13 : nullptr; }
  float* b2_of(int64_t i) { return bias2 ? b2.data() + i * bias2 : nullptr; }

  // The i-th slot's grads as they travel: weight grads in `weights` (Config::replica_grad_dtype),
  // biases in fp32.
  void append_to(ExpertBlocksMessage& msg, int64_t i, DType weights) const {
    for (int64_t j = 0; j < block13; ++j) msg.w13.push_back(to_dtype(w13[i * block13 + j], weights));
    for (int64_t j = 0; j < block2; ++j) msg.w2.push_back(to_dtype(w2[i * block2 + j], weights));
    msg.b13.insert(msg.b13.end(), b13.begin() + i * bias13, b13.begin() + (i + 1) * bias13);
    msg.b2.insert(msg.b2.end(), b2.begin() + i * bias2, b2.begin() + (i + 1) * bias2);
  }
  // Adds the message's i-th expert's grads into slot `own_slot`.
  void add_from(const ExpertBlocksMessage& msg, size_t i, int64_t own_slot) {
    for (int64_t j = 0; j < block13; ++j) w13[own_slot * block13 + j] += msg.w13[i * block13 + j];
    for (int64_t j = 0; j < block2; ++j) w2[own_slot * block2 + j] += msg.w2[i * block2 + j];
    for (int64_t j = 0; j < bias13; ++j) b13[own_slot * bias13 + j] += msg.b13[i * bias13 + j];
    for (int64_t j = 0; j < bias2; ++j) b2[own_slot * bias2 + j] += msg.b2[i * bias2 + j];
  }
};

// grads = to_dtype(fp32 sums), or to_dtype(grads + sums) when accumulating.
void store_grads(std::vector<float>& grads, const std::vector<float>& sums, bool accumulate, DType dtype) {
  if (!accumulate) grads.assign(sums.size(), 0.0f);
  for (size_t j = 0; j < sums.size(); ++j) grads[j] = to_dtype(grads[j] + sums[j], dtype);
}

}  // namespace

void backward_rank(EngineState& s, int rank, InProcessTransport& transport, const RankInputs& in,
                   const std::vector<float>& grad_out_TD, RankGradients& grads, bool accumulate_wgrad) {
  RankState& st = s.ranks[rank];
  const int64_t D = s.D(), F = s.F(), local = s.local_experts();
  const int64_t block13 = 2 * F * D, block2 = D * F;
  std::vector<float> score_G;
  std::vector<float> grad_y_GD = exchange_grad_y(s, rank, transport, in, grad_out_TD, grads, score_G);

  // Expert backward over every group. Own experts' weight (and bias) grads go straight into this
  // rank's fp32 sums; replica slots get their own fp32 partial sums, sent to the owner below.
  const int64_t G = st.grouped.grouped_rows_per_rank[rank];
  const int64_t F2 = 2 * F, biased13 = s.biased ? F2 : 0, biased2 = s.biased ? D : 0;
  std::vector<float> grad_x_GD(G * D, 0.0f), grad_score_G(score_G.size(), 0.0f);
  ExpertGrads own(local, block13, block2, biased13, biased2), replicas(s.replica_slots, block13, block2, biased13, biased2);
  for (const ExpertGroup& group : st.grouped.groups_per_rank[rank]) {
    ExpertGrads& sums = group.slot < local ? own : replicas;
    const int64_t i = group.slot < local ? group.slot : group.slot - local;
    group_backward(s, st, in, group, grad_y_GD, score_G, grad_x_GD, grad_score_G, sums.w13_of(i), sums.w2_of(i),
                   sums.b13_of(i), sums.b2_of(i));
  }
  return_grad_x(s, rank, transport, grad_x_GD, grad_score_G, grads);

  // Replica grads travel to the owner (weights in replica_grad_dtype) and are added there in fp32,
  // by source rank.
  std::vector<ExpertBlocksMessage> to_rank(s.ep_size);
  for (const ExpertGroup& group : st.grouped.groups_per_rank[rank]) {
    if (group.slot < local) continue;
    ExpertBlocksMessage& msg = to_rank[st.plan.owner_of(group.expert)];
    msg.experts.push_back(group.expert);
    msg.slots.push_back(group.slot);
    replicas.append_to(msg, group.slot - local, s.config.replica_grad_dtype);
  }
  std::vector<ExpertBlocksMessage> from_rank = transport.all_to_all(rank, std::move(to_rank));
  for (const ExpertBlocksMessage& msg : from_rank) {
    for (size_t i = 0; i < msg.experts.size(); ++i) own.add_from(msg, i, msg.experts[i] % local);
  }

  // Weight (and bias) grads in wgrad_dtype, overwritten or accumulated (the sum in fp32, then rounded).
  const DType wgrad = s.config.wgrad_dtype;
  store_grads(grads.grad_w13, own.w13, accumulate_wgrad, wgrad);
  store_grads(grads.grad_w2, own.w2, accumulate_wgrad, wgrad);
  if (s.biased) {
    store_grads(grads.grad_b13, own.b13, accumulate_wgrad, wgrad);
    store_grads(grads.grad_b2, own.b2, accumulate_wgrad, wgrad);
  } else {
    grads.grad_b13.clear();
    grads.grad_b2.clear();
  }
}

}  // namespace poise::reference
