#include "pipeline/expert_compute.hpp"

#include <cstddef>

#include "gemm/sm90/expert_mlp.hpp"
#include "gemm/sm90/expert_mlp_fp8.hpp"
#include "numerics/block_scaling.hpp"
#include "quant/column_tiles.hpp"
#include "quant/row_tiles.hpp"
#include "quant/weight_blocks.hpp"

namespace poise::ep {
namespace {

const bf16* workspace_rows(const EpLaunch& l, int slot, size_t offset) {
  return reinterpret_cast<const bf16*>(l.scratch.rank[slot].workspace + offset);
}

// Exact balance: the replica slots' weights (pushed by their owners during dispatch) and fp32
// weight gradients (collected by the owners after the backward combine), in the workspace.
const bf16* replica_w13(const EpLaunch& l, int slot) { return workspace_rows(l, slot, l.ws.replica_w13); }
const bf16* replica_w2(const EpLaunch& l, int slot) { return workspace_rows(l, slot, l.ws.replica_w2); }
void* replica_grad_w13(const EpLaunch& l, int slot) { return l.scratch.rank[slot].workspace + l.ws.replica_grad_w13; }
void* replica_grad_w2(const EpLaunch& l, int slot) { return l.scratch.rank[slot].workspace + l.ws.replica_grad_w2; }
// With expert biases, the replica slots' biases and fp32 bias gradients likewise.
const bf16* replica_b13(const EpLaunch& l, int slot) { return workspace_rows(l, slot, l.ws.replica_b13); }
const bf16* replica_b2(const EpLaunch& l, int slot) { return workspace_rows(l, slot, l.ws.replica_b2); }

// The SM90 kernels cover a rank's own experts and its replica slots in one grouped GEMM each:
// groups [0, E_local) use the call's weights and gradients, [E_local, E_local + B) the replica
// weights and fp32 gradient slots in the workspace (unused slots get no tiles).
sm90::GroupedRows sm90_rows(const EpLaunch& l, int slot) {
  sm90::GroupedRows rows;
  rows.row_offsets_E = l.scratch.rank[slot].group_offsets;
  rows.row_counts_E = l.scratch.rank[slot].group_counts;
  rows.num_experts = l.dims.groups;
  rows.max_rows = l.dims.capacity_rows;
  rows.first_replica = l.dims.balanced && l.dims.replica_slots > 0 ? l.dims.E_local : -1;
  rows.tile_counters = l.scratch.rank[slot].gemm_tile_counters;
  rows.faults = {l.scratch.rank[slot].gemm_fault_word, l.gemm_wait_timeout_ns, l.gemm_drop_first_stage};
  return rows;
}

// Where FPROP W2 / DGRAD W13 put their rows: each valid row into slot origin % (T*K) of rank
// origin / (T*K)'s combine buffer, through this rank's peer table.
sm90::RowScatter combine_scatter(const EpLaunch& l, int slot) {
  sm90::RowScatter s;
  s.row_origin_R = reinterpret_cast<const int32_t*>(l.scratch.rank[slot].workspace + l.ws.row_origin);
  // The table lives on the device: its base array's address, not read here.
  s.owner_bases = reinterpret_cast<char* const*>(reinterpret_cast<const char*>(l.tables + slot) +
                                                 offsetof(comm::PeerTable, base));
  s.slot_offset = static_cast<int64_t>(l.ws.combine);
  s.slots_per_owner = static_cast<int64_t>(l.dims.T) * l.dims.K;
  s.owners = l.dims.world;
  return s;
}

// h13 of a partial activation record: rows past the split in the working record's buffer.
sm90::H13Split h13_split(const EpLaunch& l, const RankScratch& rs) {
  if (rs.h13_split >= l.dims.capacity_rows) return {};
  return {rs.h13_split, rs.h13_hi_R2F};
}

// gemm_precision fp8_block_scaled (docs/fp8.md): the call's operands quantized into the rank's
// Fp8Scratch, then the FP8 GEMMs. Weights: the own experts' from the call, the replica slots' from
// the workspace (their owners' BF16 weights, so the same bits as the owner's own quantization).
struct Fp8GroupWeights {
  sm90::Fp8Weights w13, w2;
};
// The FP8 weights of groups [first, ...) in the rank's Fp8Scratch.
Fp8GroupWeights fp8_weights_from(const Fp8Scratch& q, int64_t first, int64_t D, int64_t F) {
  using numerics::scale_blocks;
  return {{q.w13 + first * 2 * F * D, q.w13_scales + first * scale_blocks(2 * F) * scale_blocks(D)},
          {q.w2 + first * D * F, q.w2_scales + first * scale_blocks(D) * scale_blocks(F)}};
}

// bf16 w13 [groups][2F][D] and w2 [groups][D][F] (nullable: W13 only) into `into`, as stored (the
// forward's) or transposed (DGRAD's: [groups][D][2F], [groups][F][D]), but for the groups no row
// reads (rows_G[g] == 0: a rank's empty experts, its unused replica slots).
void quantize_group_weights(const bf16* w13, const bf16* w2, int64_t groups, const int32_t* rows_G, int64_t D,
                            int64_t F, bool transposed, const Fp8GroupWeights& into, cudaStream_t stream) {
  auto values = [](const sm90::Fp8Weights& w) { return static_cast<uint8_t*>(const_cast<void*>(w.values)); };
  auto scales = [](const sm90::Fp8Weights& w) { return const_cast<float*>(w.scales); };
  const auto quantize = transposed ? quant::launch_weight_blocks_transposed : quant::launch_weight_blocks;
  quantize(w13, groups, 2 * F, D, values(into.w13), scales(into.w13), stream, rows_G);
  if (w2) quantize(w2, groups, D, F, values(into.w2), scales(into.w2), stream, rows_G);
}

// Rank s's FP8 weights for the call, as stored (the forward's) or transposed (DGRAD's): its own
// experts' as the caller prepared them (ForwardArgs::w13_fp8 ..., BackwardArgs::w13_fp8_t ...) or
// else quantized here from the call's BF16 weights into the scratch; its replica slots' quantized
// from the workspace (their owners' BF16 weights: the same bits as the owner's own quantization).
// W2 too when with_w2.
struct RankFp8Weights {
  Fp8GroupWeights own, replica;
};
RankFp8Weights rank_fp8_weights(const EpLaunch& l, const RankIo& in, int s, const sm90::GroupedRows& rows,
                                bool with_w2, bool transposed, cudaStream_t stream) {
  const int64_t D = l.dims.D, F = l.dims.F, own_groups = l.dims.E_local;
  const Fp8Scratch& q = l.scratch.rank[s].fp8;
  const Fp8GroupWeights prepared =
      transposed ? Fp8GroupWeights{{in.w13_fp8_t, in.w13_fp8_t_scales}, {in.w2_fp8_t, in.w2_fp8_t_scales}}
                 : Fp8GroupWeights{{in.w13_fp8, in.w13_fp8_scales}, {in.w2_fp8, in.w2_fp8_scales}};
  const bool own_prepared = prepared.w13.values != nullptr;
  // The scratch holds the replica slots' only where the own experts' always come prepared.
  const RankFp8Weights w{own_prepared ? prepared : fp8_weights_from(q, 0, D, F),
                         fp8_weights_from(q, l.dims.fp8_weights_prepared ? 0 : own_groups, D, F)};
  if (!own_prepared) {
    quantize_group_weights(in.w13_E2FD, with_w2 ? in.w2_EDF : nullptr, own_groups, rows.row_counts_E, D, F, transposed,
                           w.own, stream);
  }
  if (rows.first_replica >= 0) {
    quantize_group_weights(replica_w13(l, s), with_w2 ? replica_w2(l, s) : nullptr, l.dims.groups - own_groups,
                           rows.row_counts_E + own_groups, D, F, transposed, w.replica, stream);
  }
  return w;
}

}  // namespace

void quantize_tokens_fp8(const EpLaunch& l, const LaunchIo& io, cudaStream_t stream) {
  if (!l.dims.fp8) return;
  for (int s = 0; s < l.launch_ranks; ++s) {
    const Fp8Scratch& q = l.scratch.rank[s].fp8;
    quant::launch_row_tiles(io.rank[s].x_TD, l.dims.T, l.dims.D, q.x_TD, q.x_scales, stream);
  }
}

namespace {

void fp8_forward(const EpLaunch& l, const LaunchIo& io, int s, const sm90::GroupedRows& rows, bool with_w2,
                 cudaStream_t stream) {
  const sm90::ExpertMlpShape shape = expert_mlp_shape(l.dims);
  const RankScratch& rs = l.scratch.rank[s];
  const Fp8Scratch& q = rs.fp8;
  const int64_t F = l.dims.F, capacity = l.dims.capacity_rows;
  const bool replicas = rows.first_replica >= 0;
  const RankFp8Weights w = rank_fp8_weights(l, io.rank[s], s, rows, with_w2, /*transposed=*/false, stream);
  // x rows arrived in FP8 (quantize_tokens_fp8 before dispatch); a is quantized up to the last
  // group's end, rows past it are read by no GEMM.
  const int32_t* rows_end = rs.group_offsets + l.dims.groups;
  const sm90::Fp8Rows x{rs.workspace + l.ws.recv_x, reinterpret_cast<const float*>(rs.workspace + l.ws.recv_x_scales)};
  sm90::FpropW13Fp8Args a13{.x = x, .w13 = w.own.w13, .a_RF = rs.a_RF, .h13_R2F = rs.h13_R2F,
                            .h13_split = h13_split(l, rs)};
  sm90::FpropW2Fp8Args a2{.a = {q.a_RF, q.a_scales}, .w2 = w.own.w2, .scatter = combine_scatter(l, s)};
  if (replicas) a13.replica_w13 = w.replica.w13, a2.replica_w2 = w.replica.w2;
  sm90::expert_mlp_fprop_w13_fp8(rows, shape, a13, stream);
  if (!with_w2) return;
  quant::launch_row_tiles(rs.a_RF, capacity, F, q.a_RF, q.a_scales, stream, rows_end);
  sm90::expert_mlp_fprop_w2_fp8(rows, shape, a2, stream);
}

// with_w2 = false: only h13 (and a), what a recomputed forward must give backward. tail_only: the
// rows of a partial record's groups past its split (RankScratch::tail_offsets / tail_counts).
void sm90_forward(const EpLaunch& l, const LaunchIo& io, bool with_w2, bool tail_only, cudaStream_t stream) {
  const sm90::ExpertMlpShape shape = expert_mlp_shape(l.dims);
  for (int s = 0; s < l.launch_ranks; ++s) {
    const RankScratch& rs = l.scratch.rank[s];
    sm90::GroupedRows rows = sm90_rows(l, s);
    if (tail_only) rows.row_offsets_E = rs.tail_offsets, rows.row_counts_E = rs.tail_counts;
    if (l.dims.fp8) {
      fp8_forward(l, io, s, rows, with_w2, stream);
      continue;
    }
    sm90::FpropW13Args w13{workspace_rows(l, s, l.ws.recv_x), io.rank[s].w13_E2FD, rs.a_RF, rs.h13_R2F};
    w13.h13_split = h13_split(l, rs);
    w13.b13_E2F = io.rank[s].b13_E2F;
    sm90::FpropW2Args w2{rs.a_RF, io.rank[s].w2_EDF};
    w2.scatter = combine_scatter(l, s);
    w2.b2_ED = io.rank[s].b2_ED;
    if (rows.first_replica >= 0) {
      w13.replica_w13_E2FD = replica_w13(l, s);
      w2.replica_w2_EDF = replica_w2(l, s);
      w13.replica_b13_E2F = replica_b13(l, s);
      w2.replica_b2_ED = replica_b2(l, s);
    }
    sm90::expert_mlp_fprop_w13(rows, shape, w13, stream);
    if (with_w2) sm90::expert_mlp_fprop_w2(rows, shape, w2, stream);
  }
}

// Expert biases: their gradients (replica slots' overwritten, in fp32, like their weights') and the
// bias's piece of the scores' gradient, from the grad_h13 that DGRAD W2 just wrote.
void bias_backward(const EpLaunch& l, const LaunchIo& io, int s, const sm90::GroupedRows& rows,
                   const sm90::ExpertMlpShape& shape, bool accumulate, cudaStream_t stream) {
  const RankScratch& rs = l.scratch.rank[s];
  const DType own_dtype = l.dims.wgrad_bf16 ? DType::bf16 : DType::fp32;
  sm90::BiasGradArgs a;
  a.grad_y_RD = workspace_rows(l, s, l.ws.recv_grad);
  a.grad_h13_R2F = rs.grad_h13_R2F;
  a.scores_R = reinterpret_cast<const float*>(rs.workspace + l.ws.row_score);
  a.b2_ED = io.rank[s].b2_ED;
  a.grad_score_partials_RP = rs.grad_score_partials_RP;
  a.grad_b13 = {io.rank[s].grad_b13_E2F, own_dtype, accumulate};
  a.grad_b2 = {io.rank[s].grad_b2_ED, own_dtype, accumulate};
  if (rows.first_replica >= 0) {
    a.replica_b2_ED = replica_b2(l, s);
    a.grad_b13.replica_grad_w = rs.workspace + l.ws.replica_grad_b13;
    a.grad_b2.replica_grad_w = rs.workspace + l.ws.replica_grad_b2;
  }
  sm90::expert_mlp_bias_grads(rows, shape, a, stream);
}

// Config::fp8_wgrad: grad_W2 = grad_y^T . (score * a), grad_W13 = grad_h13^T . x in FP8, both
// operands quantized in 128 x 1 column tiles, written [cols][rows]; x from its FP8 rows.
void fp8_wgrad(const EpLaunch& l, int s, const sm90::GroupedRows& rows, const sm90::DgradW2Args& b,
               const sm90::WgradOutput& wgrad_w2, const sm90::WgradOutput& wgrad_w13, cudaStream_t stream) {
  const sm90::ExpertMlpShape shape = expert_mlp_shape(l.dims);
  const RankScratch& rs = l.scratch.rank[s];
  const Fp8Scratch& q = rs.fp8;
  const int64_t D = l.dims.D, F = l.dims.F, capacity = l.dims.capacity_rows;
  const quant::RowGroups groups{rs.group_offsets, rs.group_counts, l.dims.groups};
  const sm90::Fp8ColumnTiles grad_cols{q.grad_tiles, q.grad_tile_scales};
  const sm90::Fp8ColumnTiles activation_cols{q.activation_tiles, q.activation_tile_scales};
  auto column_tiles = [&](const void* rows_RC, int64_t cols, const sm90::Fp8ColumnTiles& into) {
    quant::launch_column_tiles_transposed(static_cast<const bf16*>(rows_RC), capacity, cols, groups,
                                          static_cast<uint8_t*>(const_cast<void*>(into.values_CR)),
                                          const_cast<float*>(into.scales_BC), stream);
  };
  column_tiles(b.grad_y_RD, D, grad_cols);
  column_tiles(rs.a_RF, F, activation_cols);
  sm90::expert_mlp_wgrad_w2_fp8(rows, shape, grad_cols, activation_cols, wgrad_w2, stream);
  column_tiles(rs.grad_h13_R2F, 2 * F, grad_cols);
  quant::launch_column_tiles_transposed(reinterpret_cast<const uint8_t*>(rs.workspace + l.ws.recv_x),
                                        reinterpret_cast<const float*>(rs.workspace + l.ws.recv_x_scales), capacity,
                                        D, groups, q.activation_tiles, q.activation_tile_scales, stream);
  sm90::expert_mlp_wgrad_w13_fp8(rows, shape, grad_cols, activation_cols, wgrad_w13, stream);
}

// The FP8 backward (docs/fp8.md steps 5-8) through the rank's Fp8Scratch: the weights' transposed
// copies (the own experts' prepared or from the call's BF16 weights, the replica slots' from the
// workspace) for DGRAD, which reads grad_y and then grad_h13 in row tiles; then WGRAD: in BF16 on
// the bf16 rows and x's FP8 rows (as they crossed the wire) dequantized, or (Config::fp8_wgrad)
// fp8_wgrad.
void fp8_backward(const EpLaunch& l, const LaunchIo& io, int s, const sm90::GroupedRows& rows,
                  const sm90::DgradW2Args& bf16_dgrad_w2, const sm90::WgradOutput& wgrad_w2,
                  const sm90::WgradOutput& wgrad_w13, cudaStream_t stream) {
  const sm90::ExpertMlpShape shape = expert_mlp_shape(l.dims);
  const RankScratch& rs = l.scratch.rank[s];
  const Fp8Scratch& q = rs.fp8;
  const int64_t D = l.dims.D, F = l.dims.F, capacity = l.dims.capacity_rows;
  const bool replicas = rows.first_replica >= 0;
  const RankFp8Weights w_t = rank_fp8_weights(l, io.rank[s], s, rows, /*with_w2=*/true, /*transposed=*/true, stream);
  const int32_t* rows_end = rs.group_offsets + l.dims.groups;
  const sm90::Fp8Rows grad_rows{q.grad_tiles, q.grad_tile_scales};
  const sm90::DgradW2Args& b = bf16_dgrad_w2;
  sm90::DgradW2Fp8Args dgrad_w2{.grad_y = grad_rows, .w2_t = w_t.own.w2, .h13_R2F = b.h13_R2F, .scores_R = b.scores_R,
                                .grad_h13_R2F = b.grad_h13_R2F, .a_RF = b.a_RF,
                                .grad_score_partials_RP = b.grad_score_partials_RP, .h13_split = b.h13_split};
  sm90::DgradW13Fp8Args dgrad_w13{.grad_h13 = grad_rows, .w13_t = w_t.own.w13, .scatter = combine_scatter(l, s)};
  if (replicas) dgrad_w2.replica_w2_t = w_t.replica.w2, dgrad_w13.replica_w13_t = w_t.replica.w13;
  quant::launch_row_tiles(static_cast<const bf16*>(b.grad_y_RD), capacity, D, q.grad_tiles, q.grad_tile_scales, stream, rows_end);
  sm90::expert_mlp_dgrad_w2_fp8(rows, shape, dgrad_w2, stream);
  quant::launch_row_tiles(static_cast<const bf16*>(rs.grad_h13_R2F), capacity, 2 * F, q.grad_tiles, q.grad_tile_scales, stream, rows_end);
  sm90::expert_mlp_dgrad_w13_fp8(rows, shape, dgrad_w13, stream);
  if (l.dims.fp8_wgrad) {
    fp8_wgrad(l, s, rows, b, wgrad_w2, wgrad_w13, stream);
    return;
  }
  // BF16 WGRAD on the bf16 rows backward has, x's FP8 rows dequantized (Config::fp8_wgrad off).
  const uint8_t* x_values = reinterpret_cast<const uint8_t*>(rs.workspace + l.ws.recv_x);
  const float* x_scales = reinterpret_cast<const float*>(rs.workspace + l.ws.recv_x_scales);
  quant::launch_dequantize_row_tiles(x_values, x_scales, capacity, D, q.wgrad_x_RD, stream, rows_end);
  sm90::expert_mlp_wgrad_w2(rows, shape, b.grad_y_RD, rs.a_RF, wgrad_w2, stream);
  sm90::expert_mlp_wgrad_w13(rows, shape, rs.grad_h13_R2F, q.wgrad_x_RD, wgrad_w13, stream);
}

// grad_y rows are the dispatched grad_out rows, unscaled, in the receive buffer: DGRAD W2 applies
// each row's score (grad_a = score * grad_y . W2), writes score * a for the W2 weight gradient, and
// the score's gradient pieces that combine-push sends home. Replica slots' weight gradients are
// always overwritten (the owners accumulate them).
void sm90_backward(const EpLaunch& l, const LaunchIo& io, bool accumulate, cudaStream_t stream) {
  const sm90::ExpertMlpShape shape = expert_mlp_shape(l.dims);
  for (int s = 0; s < l.launch_ranks; ++s) {
    const RankScratch& rs = l.scratch.rank[s];
    const sm90::GroupedRows rows = sm90_rows(l, s);
    const bool has_replicas = rows.first_replica >= 0;
    const bf16* grad_y_RD = workspace_rows(l, s, l.ws.recv_grad);
    sm90::DgradW2Args dgrad_w2;
    dgrad_w2.grad_y_RD = grad_y_RD;
    dgrad_w2.w2_EDF = io.rank[s].w2_EDF;
    dgrad_w2.h13_R2F = rs.h13_R2F;
    dgrad_w2.h13_split = h13_split(l, rs);
    dgrad_w2.scores_R = reinterpret_cast<const float*>(rs.workspace + l.ws.row_score);
    dgrad_w2.grad_h13_R2F = rs.grad_h13_R2F;
    dgrad_w2.a_RF = rs.a_RF;
    dgrad_w2.grad_score_partials_RP = rs.grad_score_partials_RP;
    sm90::DgradW13Args dgrad_w13{rs.grad_h13_R2F, io.rank[s].w13_E2FD};
    dgrad_w13.scatter = combine_scatter(l, s);
    const DType own_dtype = l.dims.wgrad_bf16 ? DType::bf16 : DType::fp32;
    const DType replica_dtype = l.dims.replica_grad_bf16 ? DType::bf16 : DType::fp32;
    sm90::WgradOutput wgrad_w2{io.rank[s].grad_w2_EDF, own_dtype, accumulate, nullptr, replica_dtype};
    sm90::WgradOutput wgrad_w13{io.rank[s].grad_w13_E2FD, own_dtype, accumulate, nullptr, replica_dtype};
    if (has_replicas) {
      dgrad_w2.replica_w2_EDF = replica_w2(l, s);
      dgrad_w13.replica_w13_E2FD = replica_w13(l, s);
      wgrad_w2.replica_grad_w = replica_grad_w2(l, s);
      wgrad_w13.replica_grad_w = replica_grad_w13(l, s);
    }
    if (l.dims.fp8) {
      fp8_backward(l, io, s, rows, dgrad_w2, wgrad_w2, wgrad_w13, stream);
      continue;
    }
    sm90::expert_mlp_dgrad_w2(rows, shape, dgrad_w2, stream);
    if (shape.biased) bias_backward(l, io, s, rows, shape, accumulate, stream);
    sm90::expert_mlp_dgrad_w13(rows, shape, dgrad_w13, stream);
    sm90::expert_mlp_wgrad_w2(rows, shape, grad_y_RD, rs.a_RF, wgrad_w2, stream);
    sm90::expert_mlp_wgrad_w13(rows, shape, rs.grad_h13_R2F, workspace_rows(l, s, l.ws.recv_x), wgrad_w13, stream);
  }
}

}  // namespace

sm90::ExpertMlpShape expert_mlp_shape(const EpDims& d) {
  sm90::ExpertMlpShape shape;
  shape.hidden_dim = d.D;
  shape.intermediate_dim = d.F;
  shape.activation = d.swiglu_clamped ? Activation::swiglu_clamped : Activation::swiglu;
  shape.swiglu_alpha = d.swiglu_alpha;
  shape.swiglu_limit = d.swiglu_limit;
  shape.w13_layout = d.w13_interleaved ? W13Layout::gate_up_interleaved : W13Layout::gate_up_blocked;
  shape.weights_transposed = d.weights_transposed != 0;
  shape.biased = d.biased != 0;
  return shape;
}

void expert_forward_h13(const EpLaunch& l, const LaunchIo& io, bool tail_only, cudaStream_t stream) {
  sm90_forward(l, io, /*with_w2=*/false, tail_only, stream);
}

void expert_forward(const EpLaunch& l, const LaunchIo& io, cudaStream_t stream) {
  sm90_forward(l, io, /*with_w2=*/true, /*tail_only=*/false, stream);
}

void expert_backward(const EpLaunch& l, const LaunchIo& io, bool accumulate_wgrad, cudaStream_t stream) {
  sm90_backward(l, io, accumulate_wgrad, stream);
}

}  // namespace poise::ep
