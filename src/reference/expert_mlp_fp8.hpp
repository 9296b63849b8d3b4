// One expert's MLP over a group of rows with FP8 block-scaled GEMMs (docs/fp8.md): the same steps
// as expert_mlp.hpp, each GEMM operand quantized where the kernels quantize it, each 128-wide K
// block's FP8 partial sum promoted into fp32 with its two scales. Plain loops in a fixed order.
#pragma once

#include <cstdint>

#include "numerics/block_scaling.hpp"
#include "reference/expert_mlp.hpp"

namespace poise::reference {

// One expert's weights in 128 x 128 blocks: W13 [2F, D] and W2 [D, F].
struct Fp8ExpertWeights {
  numerics::BlockScaled w13, w2;
};

Fp8ExpertWeights quantize_expert_weights(const ExpertShape& shape, const float* w13_2FD, const float* w2_DF);

// x_rows: the group's rows in 1 x 128 tiles over D, as dispatched. Writes, per row:
//   h13_R2F = FP8 GEMM(x, W13), saved rounded to bf16; a = act(h13) in fp32, quantized in 1 x 128
//   tiles over F; y_RD = FP8 GEMM(a, W2) rounded to bf16.
void expert_forward_fp8(const ExpertShape& shape, const SwigluParams& act, int64_t rows,
                        const numerics::BlockScaled& x_rows, const Fp8ExpertWeights& w, float* h13_R2F,
                        float* y_RD);

// The backward as the GPU runs it (docs/fp8.md steps 5-8): grad_out_RD, the rows' grad_out (bf16
// values) as they crossed, not yet scaled by their scores_R; h13_R2F as saved. Per row, g =
// FP8 GEMM(row_tiles(grad_out), W2^T), grad_a = score * g, grad_h13 = SwiGLU backward in bf16,
// grad_x_RD = FP8 GEMM(row_tiles(grad_h13), W13^T) (bf16 values) and grad_score_R = sum_f g a (a in
// fp32 from h13). Adds the group's weight gradients into grad_w13_2FD and grad_w2_DF (fp32), of
// grad_out and bf16(score * a) for W2, of grad_h13 and x (dequantized from x_rows) for W13: with
// fp8_wgrad (Config::fp8_wgrad) over 128 x 1 column tiles of the group's rows, else in fp32 over
// the bf16 values (x dequantized and rounded to bf16), row by row.
void expert_backward_fp8(const ExpertShape& shape, const SwigluParams& act, int64_t rows,
                         const numerics::BlockScaled& x_rows, const float* h13_R2F, const float* grad_out_RD,
                         const float* scores_R, const Fp8ExpertWeights& w, bool fp8_wgrad, float* grad_x_RD,
                         float* grad_score_R, float* grad_w13_2FD, float* grad_w2_DF);

}  // namespace poise::reference
