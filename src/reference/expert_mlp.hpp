// One expert's MLP over a group of rows: W13 -> SwiGLU -> W2, and its backward.
// Plain loops with fp32 accumulation in a fixed order, so a row's result does not depend on
// which rank computes it or which other rows share its group.
#pragma once

#include <cstdint>

#include "poise/context.hpp"  // W13Layout
#include "reference/swiglu.hpp"

namespace poise::reference {

struct ExpertShape {
  int64_t hidden = 0;        // D
  int64_t intermediate = 0;  // F
  W13Layout w13_layout = W13Layout::gate_up_blocked;

  // Rows of a [2F, D] W13 block (and columns of h13) holding gate f and up f.
  int64_t gate_row(int64_t f) const {
    return w13_layout == W13Layout::gate_up_blocked ? f : 2 * f;
  }
  int64_t up_row(int64_t f) const {
    return w13_layout == W13Layout::gate_up_blocked ? intermediate + f : 2 * f + 1;
  }
};

// One row: a_F[f] = act(gate f, up f) of h13_2F, rounded to bf16.
void swiglu_row_bf16(const ExpertShape& shape, const SwigluParams& act, const float* h13_2F, float* a_F);

// One row: grad_h13_2F (in h13's layout, rounded to bf16) = SwiGLU backward at h13_2F of grad_a_F.
void swiglu_backward_row_bf16(const ExpertShape& shape, const SwigluParams& act, const float* h13_2F,
                              const float* grad_a_F, float* grad_h13_2F);

// An expert's biases (nullable: none): b13 in W13's row order, b2 over D; bf16 values.
struct ExpertBiases {
  const float* b13_2F = nullptr;
  const float* b2_D = nullptr;
};

// x_RD, w13_2FD, w2_DF: bf16 values. Writes, per row:
//   h13_R2F = x . W13^T + b13 (fp32, column j from W13 row j), a_RF = act(gate, up) rounded to bf16,
//   y_RD = a . W2^T + b2 rounded to bf16.
void expert_forward(const ExpertShape& shape, const SwigluParams& act, int64_t rows, const float* x_RD,
                    const float* w13_2FD, const float* w2_DF, float* h13_R2F, float* a_RF, float* y_RD,
                    const ExpertBiases& biases = {});

// grad_y_RD: bf16 values. Writes, per row:
//   grad_a = grad_y . W2 (fp32), grad_h13 = SwiGLU backward at h13 rounded to bf16,
//   grad_x_RD = grad_h13 . W13 rounded to bf16;
// and adds, row after row, grad_y^T a into grad_w2_DF and grad_h13^T x into grad_w13_2FD (fp32),
// and, where given (nullable), grad_y into grad_b2_D and grad_h13 into grad_b13_2F (fp32).
void expert_backward(const ExpertShape& shape, const SwigluParams& act, int64_t rows, const float* x_RD,
                     const float* h13_R2F, const float* a_RF, const float* grad_y_RD, const float* w13_2FD,
                     const float* w2_DF, float* grad_x_RD, float* grad_w13_2FD, float* grad_w2_DF,
                     float* grad_b13_2F = nullptr, float* grad_b2_D = nullptr);

}  // namespace poise::reference
