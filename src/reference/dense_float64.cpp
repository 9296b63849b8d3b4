// The float64 oracle: the layer written as plainly as possible, with no ranks, no routing layout
// and no rounding. Deliberately shares no code with the engine.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <thread>

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
  const bool biased = !inputs_per_rank[0].b13.empty();
  DenseFloat64Result result;
  result.out_TD.assign(ep_size, std::vector<double>(T * D, 0.0));
  if (with_backward) {
    result.grad_x_TD.assign(ep_size, std::vector<double>(T * D, 0.0));
    result.grad_scores_TK.assign(ep_size, std::vector<double>(T * K, 0.0));
    result.grad_score_terms_TK.assign(ep_size, std::vector<double>(T * K, 0.0));
    result.grad_w13.assign(ep_size, std::vector<double>(local * 2 * F * D, 0.0));
    result.grad_w2.assign(ep_size, std::vector<double>(local * D * F, 0.0));
    if (biased) {
      result.grad_b13.assign(ep_size, std::vector<double>(local * 2 * F, 0.0));
      result.grad_b2.assign(ep_size, std::vector<double>(local * D, 0.0));
    }
  }
  std::vector<double> h(2 * F), a(F), y(D), grad_a(F), grad_h(2 * F);
  for (int64_t r = 0; r < ep_size; ++r) {
    const RankInputs& in = inputs_per_rank[r];
    for (int64_t t = 0; t < T; ++t) {
      const float* x = in.x_TD.data() + t * D;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = in.ids_TK[t * K + k];
        if (e == kNoExpert) continue;
        const int64_t owner = e / local, slot = e % local;
        const float* w13 = inputs_per_rank[owner].w13.data() + slot * 2 * F * D;
        const float* w2 = inputs_per_rank[owner].w2.data() + slot * D * F;
        const float* b13 = biased ? inputs_per_rank[owner].b13.data() + slot * 2 * F : nullptr;
        const float* b2 = biased ? inputs_per_rank[owner].b2.data() + slot * D : nullptr;
        const double score = in.scores_TK[t * K + k];
        for (int64_t j = 0; j < 2 * F; ++j) {
          double sum = b13 ? double{b13[j]} : 0.0;
          for (int64_t d = 0; d < D; ++d) sum += double{x[d]} * w13[j * D + d];
          h[j] = sum;
        }
        for (int64_t f = 0; f < F; ++f) a[f] = L.act(h[L.gate_row(f)], h[L.up_row(f)]);
        for (int64_t d = 0; d < D; ++d) {
          double sum = b2 ? double{b2[d]} : 0.0;
          for (int64_t f = 0; f < F; ++f) sum += a[f] * w2[d * F + f];
          y[d] = sum;
          result.out_TD[r][t * D + d] += score * sum;
        }
        if (!with_backward) continue;

        const float* grad_out = grad_out_TD_per_rank[r].data() + t * D;
        double grad_score = 0.0, terms = 0.0;
        for (int64_t d = 0; d < D; ++d) {
          grad_score += double{grad_out[d]} * y[d];
          terms += std::abs(double{grad_out[d]} * y[d]);
        }
        result.grad_scores_TK[r][t * K + k] = grad_score;
        result.grad_score_terms_TK[r][t * K + k] = terms;
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
        if (!biased) continue;
        for (int64_t j = 0; j < 2 * F; ++j) result.grad_b13[owner][slot * 2 * F + j] += grad_h[j];
        for (int64_t d = 0; d < D; ++d) result.grad_b2[owner][slot * D + d] += score * grad_out[d];
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

// ---- the sampled oracle --------------------------------------------------------------------------

namespace {

// One (token, k) pair's share of its token's outputs: y (out = sum_k score * y), the part of grad_x
// that flows through this expert, and grad_score = <grad_out, y>.
struct PairResult {
  std::vector<double> y_D, grad_x_D;
  double grad_score = 0.0;
};

void require_sampled_token(const Config& config, int64_t index, const SampledToken& token) {
  const std::string at = "sampled token " + std::to_string(index) + ": ";
  const auto D = static_cast<size_t>(config.hidden_dim), K = static_cast<size_t>(config.top_k);
  if (token.x_D.size() != D || token.grad_out_D.size() != D || token.ids_K.size() != K || token.scores_K.size() != K) {
    throw InvalidArgument("tokens", at + "needs D values of x and grad_out and K ids and scores");
  }
  const std::string problem = token_ids_problem(token.ids_K, config.num_experts);
  if (!problem.empty()) throw InvalidArgument("tokens", at + problem);
}

PairResult pair_float64(const DenseLayer& L, const SampledToken& token, int64_t k, const std::vector<float>& w13,
                        const std::vector<float>& w2) {
  const int64_t D = L.D, F = L.F;
  const double score = token.scores_K[k];
  std::vector<double> h(2 * F), a(F), grad_a(F, 0.0), grad_h(2 * F);
  for (int64_t j = 0; j < 2 * F; ++j) {
    double sum = 0.0;
    for (int64_t d = 0; d < D; ++d) sum += double{token.x_D[d]} * w13[j * D + d];
    h[j] = sum;
  }
  for (int64_t f = 0; f < F; ++f) a[f] = L.act(h[L.gate_row(f)], h[L.up_row(f)]);
  PairResult r{std::vector<double>(D), std::vector<double>(D, 0.0), 0.0};
  for (int64_t d = 0; d < D; ++d) {
    double sum = 0.0;
    for (int64_t f = 0; f < F; ++f) sum += a[f] * w2[d * F + f];
    r.y_D[d] = sum;
    r.grad_score += double{token.grad_out_D[d]} * sum;
    const double grad_y = score * token.grad_out_D[d];
    for (int64_t f = 0; f < F; ++f) grad_a[f] += grad_y * w2[d * F + f];
  }
  for (int64_t f = 0; f < F; ++f) {
    const auto [dg, du] = L.act_grad(h[L.gate_row(f)], h[L.up_row(f)]);
    grad_h[L.gate_row(f)] = grad_a[f] * dg;
    grad_h[L.up_row(f)] = grad_a[f] * du;
  }
  for (int64_t j = 0; j < 2 * F; ++j) {
    for (int64_t d = 0; d < D; ++d) r.grad_x_D[d] += grad_h[j] * w13[j * D + d];
  }
  return r;
}

}  // namespace

SampledFloat64Result sampled_float64(const Config& config, int64_t ep_size, const std::vector<SampledToken>& tokens,
                                     const ExpertWeightsFn& expert_weights, const Options& options, int threads) {
  validate_setup(config, ep_size, options);
  const DenseLayer L{config, ep_size, options};
  const int64_t D = L.D, F = L.F, K = L.K;
  // The (token, k) pairs of each expert, so every expert's weights are fetched once.
  std::map<int64_t, std::vector<std::pair<size_t, int64_t>>> pairs_of_expert;
  for (size_t i = 0; i < tokens.size(); ++i) {
    require_sampled_token(config, static_cast<int64_t>(i), tokens[i]);
    for (int64_t k = 0; k < K; ++k) {
      if (tokens[i].ids_K[k] != kNoExpert) pairs_of_expert[tokens[i].ids_K[k]].push_back({i, k});
    }
  }
  const std::vector<std::pair<int64_t, std::vector<std::pair<size_t, int64_t>>>> work(pairs_of_expert.begin(),
                                                                                       pairs_of_expert.end());
  std::vector<PairResult> pairs(tokens.size() * K);
  std::atomic<size_t> next{0};
  std::mutex fetch;
  std::exception_ptr failure;
  auto worker = [&] {
    std::vector<float> w13, w2;
    try {
      for (size_t i = next++; i < work.size(); i = next++) {
        const int64_t expert = work[i].first;
        {
          std::lock_guard<std::mutex> lock(fetch);
          if (failure) return;
          expert_weights(expert, w13, w2);
        }
        if (static_cast<int64_t>(w13.size()) != 2 * F * D || static_cast<int64_t>(w2.size()) != D * F) {
          throw InvalidArgument("expert_weights", "expert " + std::to_string(expert) + ": expected 2F*D and D*F values");
        }
        for (const auto& [token, k] : work[i].second) pairs[token * K + k] = pair_float64(L, tokens[token], k, w13, w2);
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(fetch);
      if (!failure) failure = std::current_exception();
    }
  };
  const size_t hardware = std::max(1u, std::thread::hardware_concurrency());
  const size_t count = std::min(work.size(), threads > 0 ? static_cast<size_t>(threads) : hardware);
  std::vector<std::thread> pool;
  for (size_t i = 1; i < count; ++i) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);

  // Sum each token's pairs in k order, as dense_float64 does.
  SampledFloat64Result result;
  for (size_t i = 0; i < tokens.size(); ++i) {
    std::vector<double> out(D, 0.0), grad_x(D, 0.0), grad_scores(K);
    for (int64_t k = 0; k < K; ++k) {
      grad_scores[k] = 0.0;
      if (tokens[i].ids_K[k] == kNoExpert) continue;  // free: contributes nothing
      const PairResult& p = pairs[i * K + k];
      const double score = tokens[i].scores_K[k];
      for (int64_t d = 0; d < D; ++d) {
        out[d] += score * p.y_D[d];
        grad_x[d] += p.grad_x_D[d];
      }
      grad_scores[k] = p.grad_score;
    }
    result.out_D.push_back(std::move(out));
    result.grad_x_D.push_back(std::move(grad_x));
    result.grad_scores_K.push_back(std::move(grad_scores));
  }
  return result;
}

std::vector<SampledToken> sample_tokens(const Config& config, int64_t ep_size,
                                        const std::vector<RankInputs>& inputs_per_rank,
                                        const std::vector<std::vector<float>>& grad_out_TD_per_rank,
                                        const std::vector<std::vector<int64_t>>& tokens_per_rank) {
  validate_setup(config, ep_size, {});
  if (static_cast<int64_t>(inputs_per_rank.size()) != ep_size ||
      static_cast<int64_t>(grad_out_TD_per_rank.size()) != ep_size ||
      static_cast<int64_t>(tokens_per_rank.size()) != ep_size) {
    throw InvalidArgument("sample_tokens", "needs inputs, grad_out and tokens for every rank");
  }
  if (!inputs_per_rank[0].b13.empty()) {
    throw InvalidArgument("b13", "the sampled float64 oracle takes no expert biases (use dense_float64)");
  }
  const int64_t T = config.num_local_input_tokens, D = config.hidden_dim, K = config.top_k;
  std::vector<SampledToken> sampled;
  for (int64_t r = 0; r < ep_size; ++r) {
    const RankInputs& in = inputs_per_rank[r];
    for (int64_t t : tokens_per_rank[r]) {
      if (t < 0 || t >= T) throw InvalidArgument("tokens_per_rank", "token " + std::to_string(t) + " is not in [0, T)");
      sampled.push_back({r, t, std::vector<float>(in.x_TD.begin() + t * D, in.x_TD.begin() + (t + 1) * D),
                         std::vector<int32_t>(in.ids_TK.begin() + t * K, in.ids_TK.begin() + (t + 1) * K),
                         std::vector<float>(in.scores_TK.begin() + t * K, in.scores_TK.begin() + (t + 1) * K),
                         std::vector<float>(grad_out_TD_per_rank[r].begin() + t * D,
                                            grad_out_TD_per_rank[r].begin() + (t + 1) * D)});
    }
  }
  return sampled;
}

ExpertWeightsFn expert_weights_from(const Config& config, int64_t ep_size, const std::vector<RankInputs>& inputs_per_rank) {
  const int64_t local = config.num_local_experts(ep_size);
  const int64_t block13 = 2 * config.intermediate_dim * config.hidden_dim;
  const int64_t block2 = config.hidden_dim * config.intermediate_dim;
  return [&inputs_per_rank, local, block13, block2](int64_t expert, std::vector<float>& w13_2FD,
                                                    std::vector<float>& w2_DF) {
    const RankInputs& owner = inputs_per_rank.at(expert / local);
    const int64_t slot = expert % local;
    w13_2FD.assign(owner.w13.begin() + slot * block13, owner.w13.begin() + (slot + 1) * block13);
    w2_DF.assign(owner.w2.begin() + slot * block2, owner.w2.begin() + (slot + 1) * block2);
  };
}

}  // namespace poise::reference
