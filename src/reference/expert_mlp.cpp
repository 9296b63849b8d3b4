#include "reference/expert_mlp.hpp"

#include <vector>

#include "poise/reference.hpp"

namespace poise::reference {

namespace {

float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

}  // namespace

void swiglu_row_bf16(const ExpertShape& shape, const SwigluParams& act, const float* h13_2F, float* a_F) {
  for (int64_t f = 0; f < shape.intermediate; ++f)
    a_F[f] = round_to_bf16(swiglu_forward(h13_2F[shape.gate_row(f)], h13_2F[shape.up_row(f)], act));
}

void swiglu_backward_row_bf16(const ExpertShape& shape, const SwigluParams& act, const float* h13_2F,
                              const float* grad_a_F, float* grad_h13_2F) {
  for (int64_t f = 0; f < shape.intermediate; ++f) {
    const int64_t g = shape.gate_row(f), u = shape.up_row(f);
    float grad_gate, grad_up;
    swiglu_backward(h13_2F[g], h13_2F[u], grad_a_F[f], act, grad_gate, grad_up);
    grad_h13_2F[g] = round_to_bf16(grad_gate);
    grad_h13_2F[u] = round_to_bf16(grad_up);
  }
}

void expert_forward(const ExpertShape& shape, const SwigluParams& act, int64_t rows, const float* x_RD,
                    const float* w13_2FD, const float* w2_DF, float* h13_R2F, float* a_RF, float* y_RD,
                    const ExpertBiases& biases) {
  const int64_t D = shape.hidden, F = shape.intermediate;
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = x_RD + r * D;
    float* h13 = h13_R2F + r * 2 * F;
    float* a = a_RF + r * F;
    float* y = y_RD + r * D;
    for (int64_t j = 0; j < 2 * F; ++j) h13[j] = dot(x, w13_2FD + j * D, D) + (biases.b13_2F ? biases.b13_2F[j] : 0.0f);
    swiglu_row_bf16(shape, act, h13, a);
    for (int64_t d = 0; d < D; ++d) y[d] = round_to_bf16(dot(a, w2_DF + d * F, F) + (biases.b2_D ? biases.b2_D[d] : 0.0f));
    // a came from the fp32 accumulators; what backward sees is h13 as saved, in bf16. The clamped
    // SwiGLU's derivative jumps at +-limit, so backward must read the same bf16 values the GPU does.
    for (int64_t j = 0; j < 2 * F; ++j) h13[j] = round_to_bf16(h13[j]);
  }
}

void expert_backward(const ExpertShape& shape, const SwigluParams& act, int64_t rows, const float* x_RD,
                     const float* h13_R2F, const float* a_RF, const float* grad_y_RD, const float* w13_2FD,
                     const float* w2_DF, float* grad_x_RD, float* grad_w13_2FD, float* grad_w2_DF,
                     float* grad_b13_2F, float* grad_b2_D) {
  const int64_t D = shape.hidden, F = shape.intermediate;
  std::vector<float> grad_a(F), grad_h13(2 * F), grad_x(D);
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = x_RD + r * D;
    const float* h13 = h13_R2F + r * 2 * F;
    const float* a = a_RF + r * F;
    const float* grad_y = grad_y_RD + r * D;

    // grad_a[f] = sum_d grad_y[d] * W2[d][f], summed over d in order.
    std::fill(grad_a.begin(), grad_a.end(), 0.0f);
    for (int64_t d = 0; d < D; ++d) {
      const float* w2_row = w2_DF + d * F;
      for (int64_t f = 0; f < F; ++f) grad_a[f] += grad_y[d] * w2_row[f];
    }
    swiglu_backward_row_bf16(shape, act, h13, grad_a.data(), grad_h13.data());
    // grad_x[d] = sum_j grad_h13[j] * W13[j][d], summed over all gate rows then all up rows,
    // in f order, whatever the layout (so both layouts give the same bits).
    std::fill(grad_x.begin(), grad_x.end(), 0.0f);
    for (int64_t j = 0; j < 2 * F; ++j) {
      const int64_t row = j < F ? shape.gate_row(j) : shape.up_row(j - F);
      const float* w13_row = w13_2FD + row * D;
      for (int64_t d = 0; d < D; ++d) grad_x[d] += grad_h13[row] * w13_row[d];
    }
    for (int64_t d = 0; d < D; ++d) grad_x_RD[r * D + d] = round_to_bf16(grad_x[d]);

    for (int64_t d = 0; d < D; ++d) {
      float* grad_w2_row = grad_w2_DF + d * F;
      for (int64_t f = 0; f < F; ++f) grad_w2_row[f] += grad_y[d] * a[f];
    }
    for (int64_t j = 0; j < 2 * F; ++j) {
      float* grad_w13_row = grad_w13_2FD + j * D;
      for (int64_t d = 0; d < D; ++d) grad_w13_row[d] += grad_h13[j] * x[d];
    }
    for (int64_t j = 0; j < 2 * F && grad_b13_2F; ++j) grad_b13_2F[j] += grad_h13[j];
    for (int64_t d = 0; d < D && grad_b2_D; ++d) grad_b2_D[d] += grad_y[d];
  }
}

}  // namespace poise::reference
