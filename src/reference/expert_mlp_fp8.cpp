#include "reference/expert_mlp_fp8.hpp"

#include <algorithm>
#include <array>
#include <vector>

#include "poise/reference.hpp"

namespace poise::reference {

namespace {

using numerics::BlockScaled;
using numerics::kScaleBlock;
using numerics::scale_blocks;

float fp8(uint8_t bits) {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[b] = numerics::from_e4m3(static_cast<uint8_t>(b));
    return t;
  }();
  return table[bits];
}

// sum_k A(k) B(k) over FP8 operands with one scale per 128-long K block each: every block's partial
// sum (fp32, in k order) is multiplied by the two blocks' scales and added into fp32 (the promotion).
template <class A, class B, class ScaleA, class ScaleB>
float promoted_dot(int64_t K, A a, B b, ScaleA scale_a, ScaleB scale_b) {
  float sum = 0.0f;
  for (int64_t k0 = 0, kb = 0; k0 < K; k0 += kScaleBlock, ++kb) {
    float partial = 0.0f;
    for (int64_t k = k0; k < std::min(K, k0 + kScaleBlock); ++k) partial += fp8(a(k)) * fp8(b(k));
    sum += partial * (scale_a(kb) * scale_b(kb));
  }
  return sum;
}

// The group's rows x cols values (row-major) quantized in 128 x 1 column tiles from its first row.
BlockScaled column_tiles(const std::vector<float>& values, int64_t rows, int64_t cols) {
  return numerics::quantize_column_tiles(values.data(), rows, cols, {0}, {rows});
}

// WGRAD of one weight: grad[m][n] += sum over rows of A[row][m] * B[row][n], both in column tiles.
void add_wgrad(const BlockScaled& a, int64_t m_dim, const BlockScaled& b, int64_t n_dim, int64_t rows, float* grad) {
  for (int64_t m = 0; m < m_dim; ++m)
    for (int64_t n = 0; n < n_dim; ++n)
      grad[m * n_dim + n] += promoted_dot(
          rows, [&](int64_t r) { return a.values[r * m_dim + m]; }, [&](int64_t r) { return b.values[r * n_dim + n]; },
          [&](int64_t t) { return a.scales[t * m_dim + m]; }, [&](int64_t t) { return b.scales[t * n_dim + n]; });
}

// The BF16 WGRAD of one weight: grad[m][n] += a[row][m] * b[row][n], row by row in fp32.
void add_wgrad_bf16(const float* a_RM, int64_t m_dim, const float* b_RN, int64_t n_dim, int64_t rows, float* grad) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t m = 0; m < m_dim; ++m)
      for (int64_t n = 0; n < n_dim; ++n) grad[m * n_dim + n] += a_RM[r * m_dim + m] * b_RN[r * n_dim + n];
}

}  // namespace

Fp8ExpertWeights quantize_expert_weights(const ExpertShape& shape, const float* w13_2FD, const float* w2_DF) {
  const int64_t D = shape.hidden, F = shape.intermediate;
  return {numerics::quantize_weight_blocks(w13_2FD, 1, 2 * F, D), numerics::quantize_weight_blocks(w2_DF, 1, D, F)};
}

void expert_forward_fp8(const ExpertShape& shape, const SwigluParams& act, int64_t rows, const BlockScaled& x_rows,
                        const Fp8ExpertWeights& w, float* h13_R2F, float* y_RD) {
  const int64_t D = shape.hidden, F = shape.intermediate, d_blocks = scale_blocks(D), f_blocks = scale_blocks(F);
  std::vector<float> a(F);
  for (int64_t r = 0; r < rows; ++r) {
    float* h13 = h13_R2F + r * 2 * F;
    for (int64_t j = 0; j < 2 * F; ++j)
      h13[j] = promoted_dot(
          D, [&](int64_t k) { return x_rows.values[r * D + k]; }, [&](int64_t k) { return w.w13.values[j * D + k]; },
          [&](int64_t kb) { return x_rows.scales[r * d_blocks + kb]; },
          [&](int64_t kb) { return w.w13.scales[(j / kScaleBlock) * d_blocks + kb]; });
    // a as the GPU keeps it, in BF16 (the rows the W13 epilogue writes and WGRAD reads), then tiled.
    for (int64_t f = 0; f < F; ++f)
      a[f] = round_to_bf16(swiglu_forward(h13[shape.gate_row(f)], h13[shape.up_row(f)], act));
    const BlockScaled a_q = numerics::quantize_row_tiles(a.data(), 1, F);
    for (int64_t d = 0; d < D; ++d)
      y_RD[r * D + d] = round_to_bf16(promoted_dot(
          F, [&](int64_t k) { return a_q.values[k]; }, [&](int64_t k) { return w.w2.values[d * F + k]; },
          [&](int64_t kb) { return a_q.scales[kb]; },
          [&](int64_t kb) { return w.w2.scales[(d / kScaleBlock) * f_blocks + kb]; }));
    for (int64_t j = 0; j < 2 * F; ++j) h13[j] = round_to_bf16(h13[j]);  // kept for backward in bf16
  }
}

void expert_backward_fp8(const ExpertShape& shape, const SwigluParams& act, int64_t rows, const BlockScaled& x_rows,
                         const float* h13_R2F, const float* grad_out_RD, const float* scores_R,
                         const Fp8ExpertWeights& w, bool fp8_wgrad, float* grad_x_RD, float* grad_score_R,
                         float* grad_w13_2FD, float* grad_w2_DF) {
  const int64_t D = shape.hidden, F = shape.intermediate, d_blocks = scale_blocks(D), f_blocks = scale_blocks(F);
  std::vector<float> g(F), a(F), grad_a(F), grad_h13_R2F(rows * 2 * F), score_a_RF(rows * F), x_RD(rows * D);
  for (int64_t r = 0; r < rows; ++r) {
    const float* h13 = h13_R2F + r * 2 * F;
    float* grad_h13 = grad_h13_R2F.data() + r * 2 * F;
    const float score = scores_R[r];
    const BlockScaled gy_q = numerics::quantize_row_tiles(grad_out_RD + r * D, 1, D);
    float grad_score = 0.0f;
    for (int64_t f = 0; f < F; ++f) {
      g[f] = promoted_dot(
          D, [&](int64_t k) { return gy_q.values[k]; }, [&](int64_t k) { return w.w2.values[k * F + f]; },
          [&](int64_t kb) { return gy_q.scales[kb]; },
          [&](int64_t kb) { return w.w2.scales[kb * f_blocks + f / kScaleBlock]; });
      a[f] = swiglu_forward(h13[shape.gate_row(f)], h13[shape.up_row(f)], act);
      grad_a[f] = score * g[f];
      grad_score += g[f] * a[f];
      score_a_RF[r * F + f] = round_to_bf16(score * a[f]);
    }
    grad_score_R[r] = grad_score;
    swiglu_backward_row_bf16(shape, act, h13, grad_a.data(), grad_h13);
    const BlockScaled gh_q = numerics::quantize_row_tiles(grad_h13, 1, 2 * F);
    for (int64_t d = 0; d < D; ++d)
      grad_x_RD[r * D + d] = round_to_bf16(promoted_dot(
          2 * F, [&](int64_t k) { return gh_q.values[k]; }, [&](int64_t k) { return w.w13.values[k * D + d]; },
          [&](int64_t kb) { return gh_q.scales[kb]; },
          [&](int64_t kb) { return w.w13.scales[kb * d_blocks + d / kScaleBlock]; }));
    for (int64_t d = 0; d < D; ++d) x_RD[r * D + d] = numerics::dequantize(x_rows.values[r * D + d], x_rows.scales[r * d_blocks + d / kScaleBlock]);
  }
  if (!fp8_wgrad) {
    for (float& v : x_RD) v = round_to_bf16(v);  // the dequantized rows the BF16 WGRAD reads
    add_wgrad_bf16(grad_out_RD, D, score_a_RF.data(), F, rows, grad_w2_DF);
    add_wgrad_bf16(grad_h13_R2F.data(), 2 * F, x_RD.data(), D, rows, grad_w13_2FD);
    return;
  }
  const std::vector<float> grad_out(grad_out_RD, grad_out_RD + rows * D);
  add_wgrad(column_tiles(grad_out, rows, D), D, column_tiles(score_a_RF, rows, F), F, rows, grad_w2_DF);
  add_wgrad(column_tiles(grad_h13_R2F, rows, 2 * F), 2 * F, column_tiles(x_RD, rows, D), D, rows, grad_w13_2FD);
}

}  // namespace poise::reference
