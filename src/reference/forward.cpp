// Forward of one rank: route -> dispatch -> replica weights -> experts -> return -> combine.
#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "balance/balance_cost.hpp"
#include "reference/engine_state.hpp"
#include "reference/expert_mlp_fp8.hpp"

namespace poise::reference {

namespace {

// Counts, all-gathered counts, the balance plan (the same on every rank) and this rank's layout.
void route(EngineState& s, int rank, InProcessTransport& transport, const RankInputs& in) {
  RankState& st = s.ranks[rank];
  std::vector<int64_t> counts_E(s.E(), 0);
  for (int32_t e : in.ids_TK) {
    if (e != kNoExpert) counts_E[e] += 1;
  }
  st.counts_RE = transport.all_gather(rank, counts_E);

  std::vector<int64_t> expert_rows(s.E(), 0);
  for (const std::vector<int64_t>& counts : st.counts_RE) {
    for (int64_t e = 0; e < s.E(); ++e) expert_rows[e] += counts[e];
  }
  const int64_t rows_per_rank = s.T() * s.K();
  if (s.config.balance == Balance::exact) {
    st.plan = plan::exact_mode_plan(s.config, expert_rows, s.ep_size, rows_per_rank, s.replica_slots);
  } else {
    st.plan = plan::plan_owner_only(expert_rows, s.ep_size, rows_per_rank);
    // Rows beyond the receive capacity are reported, never dropped. Each rank checks its own.
    const auto capacity = static_cast<int64_t>(std::floor(s.config.receive_capacity_factor * rows_per_rank));
    if (st.plan.computed_rows[rank] > capacity) {
      throw CapacityExceeded(rank, st.plan.computed_rows[rank], capacity);
    }
  }
  st.grouped = make_grouped_layout(st.plan);
  st.dispatch = make_dispatch_layout(rank, in.ids_TK, s.K(), st.counts_RE, st.plan, st.grouped);
}

// Sends token rows (once per destination rank) and fills this rank's grouped x_GD.
void dispatch(EngineState& s, int rank, InProcessTransport& transport, const RankInputs& in) {
  RankState& st = s.ranks[rank];
  const int64_t D = s.D();
  std::vector<DispatchMessage> to_rank(s.ep_size);
  std::vector<int64_t> token_index(s.T(), -1);
  for (int64_t dst = 0; dst < s.ep_size; ++dst) {
    DispatchMessage& msg = to_rank[dst];
    const std::vector<int64_t>& tokens = st.dispatch.tokens_to[dst];
    msg.token_rows.reserve(tokens.size() * D);
    for (size_t i = 0; i < tokens.size(); ++i) {
      token_index[tokens[i]] = static_cast<int64_t>(i);
      msg.token_rows.insert(msg.token_rows.end(), in.x_TD.begin() + tokens[i] * D,
                            in.x_TD.begin() + (tokens[i] + 1) * D);
    }
    for (int64_t entry : st.dispatch.entries_to[dst]) {
      msg.token_of_entry.push_back(token_index[entry / s.K()]);
      msg.grouped_row_of_entry.push_back(st.dispatch.dest_row_TK[entry]);
    }
  }
  std::vector<DispatchMessage> from_rank = transport.all_to_all(rank, std::move(to_rank));

  // Padding rows are zero; computed rows start poisoned so a row nobody sent shows up as NaN.
  const int64_t G = st.grouped.grouped_rows_per_rank[rank];
  st.x_GD.assign(G * D, 0.0f);
  std::vector<char> filled(G, 1);
  for (const ExpertGroup& group : st.grouped.groups_per_rank[rank]) {
    std::fill(st.x_GD.begin() + group.first_row * D, st.x_GD.begin() + (group.first_row + group.rows) * D, kPoison);
    std::fill(filled.begin() + group.first_row, filled.begin() + group.first_row + group.rows, 0);
  }
  st.rows_from.assign(s.ep_size, {});
  for (int64_t src = 0; src < s.ep_size; ++src) {
    const DispatchMessage& msg = from_rank[src];
    for (size_t i = 0; i < msg.grouped_row_of_entry.size(); ++i) {
      const int64_t row = msg.grouped_row_of_entry[i];
      if (row < 0 || row >= G || filled[row]) {
        throw std::logic_error("dispatch: rank " + std::to_string(src) + " wrote grouped row " +
                               std::to_string(row) + " of rank " + std::to_string(rank) + " twice or out of range");
      }
      filled[row] = 1;
      std::copy_n(msg.token_rows.begin() + msg.token_of_entry[i] * D, D, st.x_GD.begin() + row * D);
      st.rows_from[src].push_back(row);
    }
  }
  if (std::find(filled.begin(), filled.end(), 0) != filled.end()) {
    throw std::logic_error("dispatch: a grouped row of rank " + std::to_string(rank) + " received no token");
  }
}

// Owners send the weights of their replicated experts to the replica ranks.
void send_replica_weights(EngineState& s, int rank, InProcessTransport& transport, const RankInputs& in) {
  RankState& st = s.ranks[rank];
  const int64_t block13 = 2 * s.F() * s.D(), block2 = s.D() * s.F(), local = s.local_experts();
  std::vector<ExpertBlocksMessage> to_rank(s.ep_size);
  for (const plan::ExpertPiece& piece : st.plan.pieces) {
    if (st.plan.owner_of(piece.expert) != rank || piece.rank == rank) continue;
    ExpertBlocksMessage& msg = to_rank[piece.rank];
    const int64_t own_slot = piece.expert % local;
    msg.experts.push_back(piece.expert);
    msg.slots.push_back(piece.slot);
    msg.w13.insert(msg.w13.end(), in.w13.begin() + own_slot * block13, in.w13.begin() + (own_slot + 1) * block13);
    msg.w2.insert(msg.w2.end(), in.w2.begin() + own_slot * block2, in.w2.begin() + (own_slot + 1) * block2);
    if (s.biased) {
      const int64_t F2 = 2 * s.F(), D = s.D();
      msg.b13.insert(msg.b13.end(), in.b13.begin() + own_slot * F2, in.b13.begin() + (own_slot + 1) * F2);
      msg.b2.insert(msg.b2.end(), in.b2.begin() + own_slot * D, in.b2.begin() + (own_slot + 1) * D);
    }
  }
  std::vector<ExpertBlocksMessage> from_rank = transport.all_to_all(rank, std::move(to_rank));
  st.replica_w13.assign(s.replica_slots * block13, kPoison);
  st.replica_w2.assign(s.replica_slots * block2, kPoison);
  const int64_t F2 = 2 * s.F(), D = s.D();
  st.replica_b13.assign(s.biased ? s.replica_slots * F2 : 0, kPoison);
  st.replica_b2.assign(s.biased ? s.replica_slots * D : 0, kPoison);
  for (const ExpertBlocksMessage& msg : from_rank) {
    for (size_t i = 0; i < msg.experts.size(); ++i) {
      const int64_t replica = msg.slots[i] - local;
      std::copy_n(msg.w13.begin() + i * block13, block13, st.replica_w13.begin() + replica * block13);
      std::copy_n(msg.w2.begin() + i * block2, block2, st.replica_w2.begin() + replica * block2);
      if (!s.biased) continue;
      std::copy_n(msg.b13.begin() + i * F2, F2, st.replica_b13.begin() + replica * F2);
      std::copy_n(msg.b2.begin() + i * D, D, st.replica_b2.begin() + replica * D);
    }
  }
}

}  // namespace

const float* group_w13(const EngineState& s, const RankState& st, const RankInputs& in, int64_t slot) {
  const int64_t block = 2 * s.F() * s.D(), local = s.local_experts();
  return slot < local ? in.w13.data() + slot * block : st.replica_w13.data() + (slot - local) * block;
}

const float* group_w2(const EngineState& s, const RankState& st, const RankInputs& in, int64_t slot) {
  const int64_t block = s.D() * s.F(), local = s.local_experts();
  return slot < local ? in.w2.data() + slot * block : st.replica_w2.data() + (slot - local) * block;
}

ExpertBiases group_biases(const EngineState& s, const RankState& st, const RankInputs& in, int64_t slot) {
  if (!s.biased) return {};
  const int64_t F2 = 2 * s.F(), D = s.D(), local = s.local_experts();
  return slot < local ? ExpertBiases{in.b13.data() + slot * F2, in.b2.data() + slot * D}
                      : ExpertBiases{st.replica_b13.data() + (slot - local) * F2, st.replica_b2.data() + (slot - local) * D};
}

namespace {

// One expert group's forward: BF16 or FP8 block-scaled GEMMs (docs/fp8.md; the FP8 path keeps no a,
// its backward recomputes it from h13).
void group_forward(const EngineState& s, RankState& st, const RankInputs& in, const ExpertGroup& group,
                   std::vector<float>& y_GD) {
  const int64_t D = s.D(), F = s.F();
  const float* x = st.x_GD.data() + group.first_row * D;
  float* h13 = st.h13_G2F.data() + group.first_row * 2 * F;
  float* y = y_GD.data() + group.first_row * D;
  const float* w13 = group_w13(s, st, in, group.slot);
  const float* w2 = group_w2(s, st, in, group.slot);
  if (s.config.gemm_precision == GemmPrecision::fp8_block_scaled) {
    expert_forward_fp8(s.shape, s.act, group.rows, numerics::quantize_row_tiles(x, group.rows, D),
                       quantize_expert_weights(s.shape, w13, w2), h13, y);
  } else {
    expert_forward(s.shape, s.act, group.rows, x, w13, w2, h13, st.a_GF.data() + group.first_row * F, y,
                   group_biases(s, st, in, group.slot));
  }
}

}  // namespace

void forward_rank(EngineState& s, int rank, InProcessTransport& transport, const RankInputs& in,
                  std::vector<float>& out_TD) {
  RankState& st = s.ranks[rank];
  const int64_t T = s.T(), D = s.D(), F = s.F(), K = s.K();
  route(s, rank, transport, in);
  dispatch(s, rank, transport, in);
  send_replica_weights(s, rank, transport, in);

  // Experts: every group of the grouped buffer, own and replica slots alike.
  const int64_t G = st.grouped.grouped_rows_per_rank[rank];
  st.h13_G2F.assign(G * 2 * F, 0.0f);
  st.a_GF.assign(G * F, 0.0f);
  std::vector<float> y_GD(G * D, 0.0f);
  for (const ExpertGroup& group : st.grouped.groups_per_rank[rank]) group_forward(s, st, in, group, y_GD);

  // Clip statistics: each rank counts the rows it computed per expert (replicas included) on h13
  // as saved (bf16), the counts are all-gathered and every owner keeps its experts' sums.
  std::vector<int64_t> clips_E2(2 * s.E(), 0);
  if (s.act.kind == Activation::swiglu_clamped) {
    for (const ExpertGroup& group : st.grouped.groups_per_rank[rank]) {
      for (int64_t r = group.first_row; r < group.first_row + group.rows; ++r) {
        const float* h13 = st.h13_G2F.data() + r * 2 * F;
        for (int64_t f = 0; f < F; ++f) {
          clips_E2[2 * group.expert] += h13[s.shape.gate_row(f)] > s.act.limit;
          clips_E2[2 * group.expert + 1] += std::abs(h13[s.shape.up_row(f)]) > s.act.limit;
        }
      }
    }
  }
  const std::vector<std::vector<int64_t>> clips_RE2 = transport.all_gather(rank, clips_E2);
  const int64_t first_expert = rank * s.local_experts();
  st.clip_counts_E2.assign(2 * s.local_experts(), 0);
  for (const std::vector<int64_t>& from : clips_RE2) {
    for (int64_t i = 0; i < 2 * s.local_experts(); ++i) st.clip_counts_E2[i] += from[2 * first_expert + i];
  }

  // Return each source's y rows, in the order it sent its entries.
  std::vector<RowsMessage> to_rank(s.ep_size);
  for (int64_t src = 0; src < s.ep_size; ++src) {
    std::vector<float>& rows = to_rank[src].rows;
    rows.reserve(st.rows_from[src].size() * D);
    for (int64_t row : st.rows_from[src]) rows.insert(rows.end(), y_GD.begin() + row * D, y_GD.begin() + (row + 1) * D);
  }
  std::vector<RowsMessage> from_rank = transport.all_to_all(rank, std::move(to_rank));
  st.y_TKD.assign(T * K * D, kPoison);
  for (int64_t dst = 0; dst < s.ep_size; ++dst) {
    const std::vector<int64_t>& entries = st.dispatch.entries_to[dst];
    for (size_t i = 0; i < entries.size(); ++i) {
      std::copy_n(from_rank[dst].rows.begin() + i * D, D, st.y_TKD.begin() + entries[i] * D);
    }
  }

  // Combine: out[t] = round_bf16(sum over k, in k order, of score[t,k] * y[t,k]) in fp32; free
  // entries (kNoExpert) add nothing, whatever their score.
  out_TD.assign(T * D, kPoison);
  std::vector<float> sum(D);
  for (int64_t t = 0; t < T; ++t) {
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      if (in.ids_TK[t * K + k] == kNoExpert) continue;
      const float score = in.scores_TK[t * K + k];
      const float* y = st.y_TKD.data() + (t * K + k) * D;
      for (int64_t d = 0; d < D; ++d) sum[d] += score * y[d];
    }
    for (int64_t d = 0; d < D; ++d) out_TD[t * D + d] = round_to_bf16(sum[d]);
  }
}

}  // namespace poise::reference
