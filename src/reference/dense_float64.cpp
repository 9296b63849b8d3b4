// The float64 oracle: the layer written as plainly as possible, with no ranks, no routing layout
// and no rounding. Deliberately shares no code with the engine.
#include <algorithm>
#include <cmath>
#include <limits>

#include "poise/reference.hpp"
#include "reference/validate.hpp"

namespace poise::reference {

namespace {

double sigmoid64(double v) { return 1.0 / (1.0 + std::exp(-v)); }

struct DenseLayer {
  const Config& config;
  int64_t ep_size;
  const Options& options;
  int64_t D = config.hidden_dim, F = config.intermediate_dim, K = config.top_k;
  int64_t local = config.num_local_experts(ep_size);

  int64_t gate_row(int64_t f) const { return options.w13_layout == W13Layout::gate_up_blocked ? f : 2 * f; }
  int64_t up_row(int64_t f) const {
    return options.w13_layout == W13Layout::gate_up_blocked ? F + f : 2 * f + 1;
  }

  double act(double g, double u) const {
    if (config.activation == Activation::swiglu) return g * sigmoid64(g) * u;
    const double limit = config.swiglu_limit, alpha = config.swiglu_alpha;
    g = std::min(g, limit);
    u = std::clamp(u, -limit, limit);
    return g * sigmoid64(alpha * g) * (u + 1.0);
  }
  // Returns (d act / d g, d act / d u).
  std::pair<double, double> act_grad(double g, double u) const {
    if (config.activation == Activation::swiglu) {
      const double s = sigmoid64(g);
      return {u * (s + g * s * (1.0 - s)), g * s};
    }
    const double limit = config.swiglu_limit, alpha = config.swiglu_alpha;
    const double gc = std::min(g, limit), uc = std::clamp(u, -limit, limit);
    const double s = sigmoid64(alpha * gc);
    // The derivative jumps at +-limit. Which side an element is on is decided on h13 as saved for
    // backward (bf16), as every engine does: otherwise one bf16 rounding step near the limit flips a
    // gradient element between 0 and its full value, which no bf16 implementation could match.
    const double g_saved = round_to_bf16(float(g)), u_saved = round_to_bf16(float(u));
    const double dg = g_saved <= limit ? (uc + 1.0) * (s + alpha * gc * s * (1.0 - s)) : 0.0;
    const double du = (u_saved >= -limit && u_saved <= limit) ? gc * s : 0.0;
    return {dg, du};
  }
};

}  // namespace

DenseFloat64Result dense_float64(const Config& config, int64_t ep_size,
                                 const std::vector<RankInputs>& inputs_per_rank,
                                 const std::vector<std::vector<float>>& grad_out_TD_per_rank,
                                 const Options& options) {
  validate_setup(config, ep_size, options);
  validate_inputs(config, ep_size, options, inputs_per_rank);
  const bool with_backward = !grad_out_TD_per_rank.empty();
  if (with_backward) validate_grad_out(config, ep_size, grad_out_TD_per_rank);

  const DenseLayer L{config, ep_size, options};
  const int64_t T = config.num_local_input_tokens, D = L.D, F = L.F, K = L.K, local = L.local;
  DenseFloat64Result result;
  result.out_TD.assign(ep_size, std::vector<double>(T * D, 0.0));
  if (with_backward) {
    result.grad_x_TD.assign(ep_size, std::vector<double>(T * D, 0.0));
    result.grad_scores_TK.assign(ep_size, std::vector<double>(T * K, 0.0));
    result.grad_w13.assign(ep_size, std::vector<double>(local * 2 * F * D, 0.0));
    result.grad_w2.assign(ep_size, std::vector<double>(local * D * F, 0.0));
  }
  std::vector<double> h(2 * F), a(F), y(D), grad_a(F), grad_h(2 * F);
  for (int64_t r = 0; r < ep_size; ++r) {
    const RankInputs& in = inputs_per_rank[r];
    for (int64_t t = 0; t < T; ++t) {
      const float* x = in.x_TD.data() + t * D;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = in.ids_TK[t * K + k];
        const int64_t owner = e / local, slot = e % local;
        const float* w13 = inputs_per_rank[owner].w13.data() + slot * 2 * F * D;
        const float* w2 = inputs_per_rank[owner].w2.data() + slot * D * F;
        const double score = in.scores_TK[t * K + k];
        for (int64_t j = 0; j < 2 * F; ++j) {
          double sum = 0.0;
          for (int64_t d = 0; d < D; ++d) sum += double{x[d]} * w13[j * D + d];
          h[j] = sum;
        }
        for (int64_t f = 0; f < F; ++f) a[f] = L.act(h[L.gate_row(f)], h[L.up_row(f)]);
        for (int64_t d = 0; d < D; ++d) {
          double sum = 0.0;
          for (int64_t f = 0; f < F; ++f) sum += a[f] * w2[d * F + f];
          y[d] = sum;
          result.out_TD[r][t * D + d] += score * sum;
        }
        if (!with_backward) continue;

        const float* grad_out = grad_out_TD_per_rank[r].data() + t * D;
        double grad_score = 0.0;
        for (int64_t d = 0; d < D; ++d) grad_score += double{grad_out[d]} * y[d];
        result.grad_scores_TK[r][t * K + k] = grad_score;
        // grad_y = score * grad_out
        std::fill(grad_a.begin(), grad_a.end(), 0.0);
        for (int64_t d = 0; d < D; ++d) {
          const double grad_y = score * grad_out[d];
          for (int64_t f = 0; f < F; ++f) grad_a[f] += grad_y * w2[d * F + f];
        }
        for (int64_t f = 0; f < F; ++f) {
          const auto [dg, du] = L.act_grad(h[L.gate_row(f)], h[L.up_row(f)]);
          grad_h[L.gate_row(f)] = grad_a[f] * dg;
          grad_h[L.up_row(f)] = grad_a[f] * du;
        }
        std::vector<double>& grad_x = result.grad_x_TD[r];
        std::vector<double>& grad_w13 = result.grad_w13[owner];
        std::vector<double>& grad_w2 = result.grad_w2[owner];
        for (int64_t j = 0; j < 2 * F; ++j) {
          for (int64_t d = 0; d < D; ++d) {
            grad_x[t * D + d] += grad_h[j] * w13[j * D + d];
            grad_w13[slot * 2 * F * D + j * D + d] += grad_h[j] * x[d];
          }
        }
        for (int64_t d = 0; d < D; ++d) {
          for (int64_t f = 0; f < F; ++f) grad_w2[slot * D * F + d * F + f] += score * grad_out[d] * a[f];
        }
      }
    }
  }
  return result;
}

namespace {

struct ErrorSums {
  double diff = 0.0, norm = 0.0;
  bool mismatched = false;
  void add(std::span<const float> got, std::span<const double> want) {
    if (got.size() != want.size()) mismatched = true;
    for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
      const double delta = double{got[i]} - want[i];
      diff += delta * delta;
      norm += want[i] * want[i];
    }
  }
  double relative() const {
    if (mismatched || std::isnan(diff)) return std::numeric_limits<double>::quiet_NaN();
    if (norm == 0.0) return diff == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
    return std::sqrt(diff / norm);
  }
};

}  // namespace

double relative_error(std::span<const float> got, std::span<const double> want) {
  ErrorSums sums;
  sums.add(got, want);
  return sums.relative();
}

double relative_error(const std::vector<std::vector<float>>& got, const std::vector<std::vector<double>>& want) {
  ErrorSums sums;
  sums.mismatched = got.size() != want.size();
  for (size_t r = 0; r < std::min(got.size(), want.size()); ++r) sums.add(got[r], want[r]);
  return sums.relative();
}

}  // namespace poise::reference
