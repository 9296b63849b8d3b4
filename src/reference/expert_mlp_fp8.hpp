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

// grad_y_RD: bf16 values; h13_R2F as saved. Writes grad_x_RD (bf16 values) and adds the group's
// weight gradients into grad_w13_2FD and grad_w2_DF (fp32), WGRAD over 128 x 1 column tiles of
// the group's rows (x dequantized from x_rows, a recomputed from h13 and rounded to bf16).
void expert_backward_fp8(const ExpertShape& shape, const SwigluParams& act, int64_t rows,
                         const numerics::BlockScaled& x_rows, const float* h13_R2F, const float* grad_y_RD,
                         const Fp8ExpertWeights& w, float* grad_x_RD, float* grad_w13_2FD, float* grad_w2_DF);

}  // namespace poise::reference
