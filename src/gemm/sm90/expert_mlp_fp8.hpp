// Host API of the SM90 FP8 block-scaled expert GEMMs (the DeepSeek-V3 recipe, docs/fp8.md): E4M3
// operands, rows in 1 x 128 tiles along K, weights in 128 x 128 blocks, the products of each
// 128-wide K block summed by wgmma and promoted into fp32 with the block's two scales.
//
// Grouped rows, shapes, faults and outputs as in expert_mlp.hpp (the BF16 GEMMs); what differs is
// the operands. FP8 wgmma reads both operands K-major: the forward reads the weights as stored
// ([E, 2F, D], [E, D, F]); DGRAD reads them transposed, from an FP8 copy quantized in that
// orientation (quant::launch_weight_blocks_transposed: the same values and scales, transposed).
// WGRAD reads both operands along the rows, from column tiles written transposed
// (quant::launch_column_tiles_transposed). Built: FPROP, DGRAD and WGRAD of the blocked W13 layout;
// the interleaved layout, transposed weights and biases raise poise::NotAvailable.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "gemm/sm90/expert_mlp.hpp"

namespace poise::sm90 {

// Rows of an FP8 GEMM operand: e4m3 values [R][K] and fp32 scales [R][ceil(K/128)] (row tile t
// scales columns [128 t, 128 t + 128)), as quant::launch_row_tiles writes them.
struct Fp8Rows {
  const void* values_RK = nullptr;
  const float* scales_RKb = nullptr;
};

// Per-expert FP8 weights: e4m3 values [E][N][K] and fp32 scales [E][ceil(N/128)][ceil(K/128)], as
// poise::quantize_fp8_weight_blocks writes them.
struct Fp8Weights {
  const void* values = nullptr;
  const float* scales = nullptr;
};

// h13 = x . W13[e]^T, a = act(h13), with x and W13 in FP8: a_RF and h13_R2F bf16 as in FpropW13Args.
struct FpropW13Fp8Args {
  Fp8Rows x;            // K = D
  Fp8Weights w13;       // [E_own, 2F, D]
  Fp8Weights replica_w13;  // with GroupedRows::first_replica
  void* a_RF = nullptr;
  void* h13_R2F = nullptr;  // nullable
  H13Split h13_split;
};
void expert_mlp_fprop_w13_fp8(const GroupedRows& rows, const ExpertMlpShape& shape, const FpropW13Fp8Args& args,
                              cudaStream_t stream);

// y = (a . W2[e]^T) * score, with a and W2 in FP8: into y_RD or scattered to slots as FpropW2Args.
struct FpropW2Fp8Args {
  Fp8Rows a;           // K = F
  Fp8Weights w2;       // [E_own, D, F]
  Fp8Weights replica_w2;  // with GroupedRows::first_replica
  const float* scores_R = nullptr;  // nullable
  void* y_RD = nullptr;             // null when scatter.row_origin_R is set
  RowScatter scatter;
};
void expert_mlp_fprop_w2_fp8(const GroupedRows& rows, const ExpertMlpShape& shape, const FpropW2Fp8Args& args,
                             cudaStream_t stream);

// grad_a = score * (grad_y . W2[e]), then as expert_mlp_dgrad_w2 (DgradW2Args): grad_h13 =
// swiglu_backward(h13, grad_a), a_RF = score * act(h13) and the score pieces, BF16 / fp32 as there.
// grad_y in FP8 row tiles (K = D); W2 transposed: e4m3 [E][F][D], scales [E][ceil(F/128)][ceil(D/128)].
struct DgradW2Fp8Args {
  Fp8Rows grad_y;           // K = D
  Fp8Weights w2_t;          // W2[e]^T [E_own, F, D]
  Fp8Weights replica_w2_t;  // with GroupedRows::first_replica
  const void* h13_R2F = nullptr;
  const float* scores_R = nullptr;  // nullable
  void* grad_h13_R2F = nullptr;
  void* a_RF = nullptr;                     // nullable
  float* grad_score_partials_RP = nullptr;  // nullable, fp32 [R][dgrad_w2_score_partials(shape)]
  H13Split h13_split;
};
void expert_mlp_dgrad_w2_fp8(const GroupedRows& rows, const ExpertMlpShape& shape, const DgradW2Fp8Args& args,
                             cudaStream_t stream);

// grad_x = grad_h13 . W13[e], with grad_h13 in FP8 row tiles along 2F (W13's row order) and W13
// transposed: e4m3 [E][D][2F], scales [E][ceil(D/128)][ceil(2F/128)]. Into grad_x_RD or slots.
struct DgradW13Fp8Args {
  Fp8Rows grad_h13;          // K = 2F
  Fp8Weights w13_t;          // W13[e]^T [E_own, D, 2F]
  Fp8Weights replica_w13_t;  // with GroupedRows::first_replica
  void* grad_x_RD = nullptr;  // null when scatter.row_origin_R is set
  RowScatter scatter;
};
void expert_mlp_dgrad_w13_fp8(const GroupedRows& rows, const ExpertMlpShape& shape, const DgradW13Fp8Args& args,
                              cudaStream_t stream);

// WGRAD's FP8 operand: grouped rows (R = GroupedRows::max_rows, a multiple of 128) quantized in
// 128 x 1 column tiles from each group's first row and written transposed, as
// quant::launch_column_tiles_transposed writes them: e4m3 values [C][R], fp32 scales [R / 128][C].
struct Fp8ColumnTiles {
  const void* values_CR = nullptr;
  const float* scales_BC = nullptr;
};

// grad_W2[e] = grad_y[e]^T . a[e] (a as expert_mlp_dgrad_w2 writes it, score-scaled), both in FP8
// column tiles; each 128-row block's products summed by wgmma and promoted with the block's A-column
// and B-column scales. Outputs as expert_mlp_wgrad_w2 (WgradOutput).
void expert_mlp_wgrad_w2_fp8(const GroupedRows& rows, const ExpertMlpShape& shape, const Fp8ColumnTiles& grad_y,
                             const Fp8ColumnTiles& a, const WgradOutput& out, cudaStream_t stream);
// grad_W13[e] = grad_h13[e]^T . x[e], grad_h13 (W13's row order) and x in FP8 column tiles.
void expert_mlp_wgrad_w13_fp8(const GroupedRows& rows, const ExpertMlpShape& shape, const Fp8ColumnTiles& grad_h13,
                              const Fp8ColumnTiles& x, const WgradOutput& out, cudaStream_t stream);

}  // namespace poise::sm90
