// Support for the EP data-path GPU tests: bf16 on the host, random routings, device buffers per
// rank, and the float64 model of the whole layer across ranks (the oracle).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "poise/config.hpp"

namespace poise::ep::testing {

#define EP_CUDA_OK(expr)                                                                          \
  do {                                                                                            \
    cudaError_t status_ = (expr);                                                                 \
    ASSERT_EQ(status_, cudaSuccess) << #expr << ": " << cudaGetErrorString(status_);            \
  } while (0)

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);                      // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}
inline float from_bf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline double round_bf16(double v) { return from_bf16(to_bf16(static_cast<float>(v))); }

constexpr uint16_t kBf16NaN = 0x7fc0;

enum class Routing {
  random,        // K distinct experts per token, uniform
  hot_expert,    // every token of every rank picks expert 0 first: one expert takes T*R rows
  same_rank,     // all K experts of token t on rank (t mod R): every token row fans out K times
  skip_last,     // no token picks an expert of the last rank: it receives nothing
};

inline const char* to_string(Routing r) {
  switch (r) {
    case Routing::random: return "random";
    case Routing::hot_expert: return "hot_expert";
    case Routing::same_rank: return "same_rank";
    case Routing::skip_last: return "skip_last";
  }
  return "?";
}

// ids [T*K] for one rank.
inline std::vector<int32_t> make_ids(Routing routing, int T, int K, int E, int R, std::mt19937_64& rng) {
  const int E_local = E / R;
  std::vector<int32_t> ids(static_cast<size_t>(T) * K);
  for (int t = 0; t < T; ++t) {
    std::vector<int32_t> pool;
    int first_fixed = -1;
    switch (routing) {
      case Routing::random:
        for (int e = 0; e < E; ++e) pool.push_back(e);
        break;
      case Routing::hot_expert:
        first_fixed = 0;
        for (int e = 1; e < E; ++e) pool.push_back(e);
        break;
      case Routing::same_rank: {
        const int r = t % R;
        for (int j = 0; j < E_local; ++j) pool.push_back(r * E_local + j);
        break;
      }
      case Routing::skip_last:
        for (int e = 0; e < (R > 1 ? E - E_local : E); ++e) pool.push_back(e);
        break;
    }
    std::shuffle(pool.begin(), pool.end(), rng);
    int k0 = 0;
    if (first_fixed >= 0) ids[static_cast<size_t>(t) * K + k0++] = first_fixed;
    for (int k = k0; k < K; ++k) ids[static_cast<size_t>(t) * K + k] = pool[k - k0];
  }
  return ids;
}

// Random bf16 values, uniform in [-scale, scale].
inline std::vector<uint16_t> random_bf16(size_t n, float scale, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = to_bf16(dist(rng));
  return v;
}

// ---- float64 model -------------------------------------------------------------------------

struct ModelShape {
  int R, T, D, F, E, K;
  Activation activation = Activation::swiglu;
  double alpha = 1.702, limit = 7.0;
  int E_local() const { return E / R; }
};

inline double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

inline double swiglu(double g, double u, const ModelShape& s) {
  if (s.activation == Activation::swiglu) return g * sigmoid(g) * u;
  const double gc = std::min(g, s.limit), uc = std::clamp(u, -s.limit, s.limit);
  return gc * sigmoid(s.alpha * gc) * (uc + 1.0);
}

inline void swiglu_grad(double g, double u, double ga, const ModelShape& s, double& dg, double& du) {
  if (s.activation == Activation::swiglu) {
    const double sg = sigmoid(g);
    dg = ga * u * sg * (1.0 + g * (1.0 - sg));
    du = ga * g * sg;
    return;
  }
  const double gc = std::min(g, s.limit), uc = std::clamp(u, -s.limit, s.limit);
  const double sg = sigmoid(s.alpha * gc);
  dg = g <= s.limit ? ga * (uc + 1.0) * sg * (1.0 + s.alpha * gc * (1.0 - sg)) : 0.0;
  du = (u >= -s.limit && u <= s.limit) ? ga * gc * sg : 0.0;
}

struct RankData {  // host copies, bf16 as raw bits
  std::vector<uint16_t> x_TD, w13_E2FD, w2_EDF, grad_out_TD;
  std::vector<int32_t> ids_TK;
  std::vector<float> scores_TK;  // values (already bf16-exact when scores are bf16)
};

struct ModelOut {  // per rank
  std::vector<double> out_TD, grad_x_TD, grad_scores_TK, grad_w13_E2FD, grad_w2_EDF;
  std::vector<int64_t> rows_per_local_expert;
  std::vector<int64_t> clip_counts_E2;  // clamped SwiGLU: [E_local][2] gate > limit, |up| > limit on bf16(h13)
  // Clamped SwiGLU: how far each token row of grad_x may legitimately differ from this model. The
  // clamps' gradient is discontinuous at +-limit: where an h13 value lies so close to a bf16
  // rounding boundary next to the limit that the GPU's fp32 accumulation may round it to the other
  // side, the GPU may take the other branch, and that gradient element is off by its whole size.
  // The row's slack is the sum of those elements' effects, |grad element| * ||its W13 row||.
  std::vector<double> grad_x_clamp_slack_T;
  // The same flips in grad_w13 of each local expert: the sum of |grad element| * ||x row||.
  std::vector<double> grad_w13_clamp_slack_E;
};

// True when h (accumulated from terms whose absolute values sum to `magnitude`) could round to
// bf16 values on both sides of a clamp: the fp32 accumulation error of a dot product is bounded
// by ~D * 2^-24 * magnitude; 4e-5 covers D up to ~600.
inline bool clamp_ambiguous(double h, double magnitude, const ModelShape& s, bool gate) {
  const double eps = 4e-5 * magnitude;
  const double lo = round_bf16(h - eps), hi = round_bf16(h + eps);
  if (gate) return (lo <= s.limit) != (hi <= s.limit);
  return (lo >= -s.limit && lo <= s.limit) != (hi >= -s.limit && hi <= s.limit);
}

// The layer in float64 from the bf16 inputs. Intermediates the GPU stores in bf16 (h13, a, y) are
// rounded to bf16 the same way, so the comparison measures arithmetic error, not storage choices.
inline std::vector<ModelOut> run_model(const ModelShape& s, const std::vector<RankData>& in) {
  const int EL = s.E_local();
  const size_t F2 = 2 * static_cast<size_t>(s.F);
  std::vector<ModelOut> out(s.R);
  for (int r = 0; r < s.R; ++r) {
    out[r].out_TD.assign(static_cast<size_t>(s.T) * s.D, 0.0);
    out[r].grad_x_TD.assign(static_cast<size_t>(s.T) * s.D, 0.0);
    out[r].grad_scores_TK.assign(static_cast<size_t>(s.T) * s.K, 0.0);
    out[r].grad_w13_E2FD.assign(static_cast<size_t>(EL) * F2 * s.D, 0.0);
    out[r].grad_w2_EDF.assign(static_cast<size_t>(EL) * s.D * s.F, 0.0);
    out[r].rows_per_local_expert.assign(EL, 0);
    out[r].clip_counts_E2.assign(2 * static_cast<size_t>(EL), 0);
    out[r].grad_x_clamp_slack_T.assign(s.T, 0.0);
    out[r].grad_w13_clamp_slack_E.assign(EL, 0.0);
  }
  std::vector<uint8_t> ambiguous(F2);
  std::vector<double> x(s.D), h(F2), h_magnitude(F2), a(s.F), y(s.D), go(s.D), gy(s.D), ga(s.F), gh(F2);
  for (int src = 0; src < s.R; ++src) {
    const RankData& d = in[src];
    for (int t = 0; t < s.T; ++t) {
      for (int k = 0; k < s.K; ++k) {
        const int e = d.ids_TK[static_cast<size_t>(t) * s.K + k];
        const int owner = e / EL, j = e % EL;
        const double score = d.scores_TK[static_cast<size_t>(t) * s.K + k];
        const RankData& w = in[owner];
        ModelOut& mo = out[owner];
        mo.rows_per_local_expert[j]++;
        const uint16_t* w13 = w.w13_E2FD.data() + static_cast<size_t>(j) * F2 * s.D;
        const uint16_t* w2 = w.w2_EDF.data() + static_cast<size_t>(j) * s.D * s.F;
        for (int c = 0; c < s.D; ++c) x[c] = from_bf16(d.x_TD[static_cast<size_t>(t) * s.D + c]);
        for (size_t n = 0; n < F2; ++n) {
          double acc = 0, magnitude = 0;
          for (int c = 0; c < s.D; ++c) {
            const double term = x[c] * from_bf16(w13[n * s.D + c]);
            acc += term;
            magnitude += std::abs(term);
          }
          h[n] = acc;
          h_magnitude[n] = magnitude;
        }
        for (int f = 0; f < s.F; ++f) a[f] = round_bf16(swiglu(h[f], h[s.F + f], s));
        if (s.activation == Activation::swiglu_clamped) {
          for (int f = 0; f < s.F; ++f) {
            mo.clip_counts_E2[2 * j] += round_bf16(h[f]) > s.limit;
            mo.clip_counts_E2[2 * j + 1] += std::abs(round_bf16(h[s.F + f])) > s.limit;
            ambiguous[f] = clamp_ambiguous(h[f], h_magnitude[f], s, true);
            ambiguous[s.F + f] = clamp_ambiguous(h[s.F + f], h_magnitude[s.F + f], s, false);
          }
        }
        for (int c = 0; c < s.D; ++c) {
          double acc = 0;
          for (int f = 0; f < s.F; ++f) acc += a[f] * from_bf16(w2[static_cast<size_t>(c) * s.F + f]);
          y[c] = round_bf16(acc);
          out[src].out_TD[static_cast<size_t>(t) * s.D + c] += score * y[c];
        }
        // backward
        double gs = 0;
        for (int c = 0; c < s.D; ++c) {
          go[c] = from_bf16(d.grad_out_TD[static_cast<size_t>(t) * s.D + c]);
          gs += go[c] * y[c];
          gy[c] = score * go[c];
        }
        out[src].grad_scores_TK[static_cast<size_t>(t) * s.K + k] = gs;
        for (int f = 0; f < s.F; ++f) {
          double acc = 0;
          for (int c = 0; c < s.D; ++c) acc += gy[c] * from_bf16(w2[static_cast<size_t>(c) * s.F + f]);
          ga[f] = acc;
        }
        for (int f = 0; f < s.F; ++f) {
          double dg, du;
          swiglu_grad(round_bf16(h[f]), round_bf16(h[s.F + f]), ga[f], s, dg, du);
          gh[f] = dg;
          gh[s.F + f] = du;
          if (s.activation == Activation::swiglu_clamped && (ambiguous[f] || ambiguous[s.F + f])) {
            // The gradients on the clamps' passing side (the other side's are 0).
            ModelShape open = s;
            open.limit = INFINITY;
            double dg_pass, du_pass;
            swiglu_grad(std::min(round_bf16(h[f]), s.limit), std::clamp(round_bf16(h[s.F + f]), -s.limit, s.limit),
                        ga[f], open, dg_pass, du_pass);
            double x2 = 0;
            for (int c = 0; c < s.D; ++c) x2 += x[c] * x[c];
            for (size_t n : {size_t(f), s.F + size_t(f)}) {
              if (!ambiguous[n]) continue;
              double w2 = 0;
              for (int c = 0; c < s.D; ++c) w2 += from_bf16(w13[n * s.D + c]) * from_bf16(w13[n * s.D + c]);
              const double flip = std::abs(n < size_t(s.F) ? dg_pass : du_pass);
              out[src].grad_x_clamp_slack_T[t] += flip * std::sqrt(w2);
              mo.grad_w13_clamp_slack_E[j] += flip * std::sqrt(x2);
            }
          }
        }
        for (int c = 0; c < s.D; ++c) {
          double acc = 0;
          for (size_t n = 0; n < F2; ++n) acc += gh[n] * from_bf16(w13[n * s.D + c]);
          out[src].grad_x_TD[static_cast<size_t>(t) * s.D + c] += acc;
        }
        double* gw2 = mo.grad_w2_EDF.data() + static_cast<size_t>(j) * s.D * s.F;
        for (int c = 0; c < s.D; ++c)
          for (int f = 0; f < s.F; ++f) gw2[static_cast<size_t>(c) * s.F + f] += gy[c] * a[f];
        double* gw13 = mo.grad_w13_E2FD.data() + static_cast<size_t>(j) * F2 * s.D;
        for (size_t n = 0; n < F2; ++n)
          for (int c = 0; c < s.D; ++c) gw13[n * s.D + c] += gh[n] * x[c];
      }
    }
  }
  return out;
}

// ||got - want||^2 and ||want||^2 over [begin, end); finite: every element of got is.
struct SquaredNorms {
  double error2 = 0, want2 = 0;
  bool finite = true;
};
template <typename Got>
SquaredNorms squared_norms(const std::vector<Got>& got, const std::vector<double>& want, size_t begin = 0,
                           size_t end = SIZE_MAX) {
  end = std::min(end, want.size());
  SquaredNorms n;
  for (size_t i = begin; i < end; ++i) {
    const double g = static_cast<double>(got[i]);
    if (!std::isfinite(g)) return {0, 0, false};
    n.error2 += (g - want[i]) * (g - want[i]);
    n.want2 += want[i] * want[i];
  }
  return n;
}

// ||got - want|| / ||want|| (absolute for a zero want); infinite if any element of got is not finite.
template <typename Got>
double relative_error(const std::vector<Got>& got, const std::vector<double>& want, size_t begin = 0,
                      size_t end = SIZE_MAX) {
  const SquaredNorms n = squared_norms(got, want, begin, end);
  if (!n.finite) return INFINITY;
  return n.want2 > 0 ? std::sqrt(n.error2 / n.want2) : std::sqrt(n.error2);
}

// Layer outputs against the float64 model: norm-wise over a whole tensor (bf16 storage of
// intermediates), and for any single token row / expert block.
inline constexpr double kTolerance = 1e-2;
inline constexpr double kRowTolerance = 4e-2;

// ||got - want|| over [begin, end), less an absolute `slack` (clamp flips, ModelOut), relative to
// ||want|| (absolute for a zero want); infinite if any element of got is not finite.
template <typename Got>
double relative_error_beyond(const std::vector<Got>& got, const std::vector<double>& want, double slack,
                             size_t begin = 0, size_t end = SIZE_MAX) {
  const SquaredNorms n = squared_norms(got, want, begin, end);
  if (!n.finite) return INFINITY;
  const double beyond = std::max(0.0, std::sqrt(n.error2) - slack);
  return n.want2 > 0 ? beyond / std::sqrt(n.want2) : beyond;
}

// A [rows][cols] tensor within kTolerance as a whole and kRowTolerance in every row; a row may
// exceed that by its `row_slack` (ModelOut::grad_x_clamp_slack_T), absolute, and so may its share
// of the whole tensor's error.
inline void check_rows(const std::vector<double>& got, const std::vector<double>& want, int rows, int cols,
                       const std::string& what, const std::vector<double>* row_slack = nullptr) {
  double worst = 0, beyond2 = 0, want2 = 0;  // worst: error / bound
  int worst_row = -1, slack_rows = 0;
  for (int r = 0; r < rows; ++r) {
    const SquaredNorms n = squared_norms(got, want, size_t(r) * cols, size_t(r + 1) * cols);
    const double norm = n.want2 > 0 ? std::sqrt(n.want2) : 1.0;  // a zero row: absolute error, as relative_error
    const double err = n.finite ? std::sqrt(n.error2) : INFINITY;
    const double slack = row_slack ? (*row_slack)[r] : 0.0;
    slack_rows += slack > 0;
    const double e = err / (kRowTolerance * norm + slack);
    if (e > worst) worst = e, worst_row = r;
    beyond2 += std::pow(std::max(0.0, err - slack), 2);
    want2 += n.want2;
  }
  EXPECT_LT(want2 > 0 ? std::sqrt(beyond2 / want2) : std::sqrt(beyond2), kTolerance)
      << what << " (beyond the clamp slack of " << slack_rows << " rows)";
  EXPECT_LT(worst, 1.0) << what << ": worst row " << worst_row << " at " << worst
                        << " of its bound (4% of its norm, plus the clamp slack of " << slack_rows << " rows)";
}

inline std::vector<double> bf16_values(const std::vector<uint16_t>& v) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = from_bf16(v[i]);
  return out;
}

}  // namespace poise::ep::testing
