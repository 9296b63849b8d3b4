// Random layer inputs for tests and the demo, with a tunable routing skew.
#include <cmath>
#include <random>

#include "poise/reference.hpp"
#include "reference/validate.hpp"

namespace poise::reference {

namespace {

// Popularity of each expert. Rank 0's experts weigh `hot`, the others 1, so rank 0 receives a
// fraction hot / (hot + R - 1) of the draws, i.e. skew times the mean (before the distinct-k
// constraint, which flattens the most extreme targets).
std::vector<double> expert_popularity(int64_t num_experts, int64_t ep_size, double skew) {
  const int64_t local = num_experts / ep_size;
  double hot = 1.0;
  if (ep_size > 1 && skew > 1.0) {
    hot = skew < static_cast<double>(ep_size) ? skew * (ep_size - 1) / (ep_size - skew) : 1e9;
  }
  std::vector<double> weight(num_experts, 1.0);
  for (int64_t e = 0; e < local; ++e) weight[e] = hot;
  return weight;
}

// Draws one token's K distinct experts (each by popularity among those not yet picked), frees each
// with probability free_fraction (kNoExpert), then its scores, a softmax over K random logits (zero
// for a padding row; a free entry keeps its score, which must then count for nothing).
class TokenRouter {
 public:
  TokenRouter(std::mt19937_64& rng, const std::vector<double>& popularity, int64_t top_k, DType scores_dtype,
              double free_fraction)
      : rng_(rng), popularity_(popularity), K_(top_k), scores_dtype_(scores_dtype), free_fraction_(free_fraction),
        exp_logits_(top_k) {}

  void draw(bool padding, int32_t* ids_K, float* scores_K) {
    const auto E = static_cast<int64_t>(popularity_.size());
    weight_ = popularity_;
    for (int64_t k = 0; k < K_; ++k) {
      double total = 0.0;
      for (double w : weight_) total += w;
      double pick = uniform_(rng_) * total;
      int64_t e = 0;
      while (e < E - 1 && (weight_[e] == 0.0 || pick >= weight_[e])) pick -= weight_[e++];
      while (weight_[e] == 0.0) --e;  // rounding at the end of the range: the last unpicked expert
      weight_[e] = 0.0;
      ids_K[k] = static_cast<int32_t>(e);
    }
    for (int64_t k = 0; k < K_ && free_fraction_ > 0.0; ++k) {
      if (uniform_(rng_) < free_fraction_) ids_K[k] = kNoExpert;
    }
    float sum = 0.0f;
    for (int64_t k = 0; k < K_; ++k) {
      exp_logits_[k] = std::exp(logit_(rng_));
      sum += exp_logits_[k];
    }
    for (int64_t k = 0; k < K_; ++k) {
      float score = padding ? 0.0f : exp_logits_[k] / sum;
      if (scores_dtype_ == DType::bf16) score = round_to_bf16(score);
      scores_K[k] = score;
    }
  }

 private:
  std::mt19937_64& rng_;
  const std::vector<double>& popularity_;
  int64_t K_;
  DType scores_dtype_;
  double free_fraction_;
  std::uniform_real_distribution<double> uniform_{0.0, 1.0};
  std::normal_distribution<float> logit_{0.0f, 1.0f};
  std::vector<double> weight_;
  std::vector<float> exp_logits_;
};

void validate_spec(const Config& config, const RandomInputsSpec& spec) {
  if (!(spec.skew >= 1.0)) throw InvalidArgument("skew", "must be >= 1 (1 = uniform), got " + std::to_string(spec.skew));
  if (spec.padding_rows < 0 || spec.padding_rows > config.num_local_input_tokens) {
    throw InvalidArgument("padding_rows", "must be in [0, T], got " + std::to_string(spec.padding_rows));
  }
  if (!(spec.free_fraction >= 0.0 && spec.free_fraction <= 1.0)) {
    throw InvalidArgument("free_fraction", "must be in [0, 1], got " + std::to_string(spec.free_fraction));
  }
}

std::vector<float> normal_bf16(std::mt19937_64& rng, int64_t count, float stddev) {
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> values(count);
  for (float& v : values) v = round_to_bf16(normal(rng));
  return values;
}

}  // namespace

std::vector<RankInputs> random_inputs(const Config& config, int64_t ep_size, const RandomInputsSpec& spec,
                                      const Options& options) {
  validate_setup(config, ep_size, options);
  validate_spec(config, spec);
  const int64_t T = config.num_local_input_tokens, D = config.hidden_dim, F = config.intermediate_dim;
  const int64_t K = config.top_k, local = config.num_local_experts(ep_size);
  const std::vector<double> popularity = expert_popularity(config.num_experts, ep_size, spec.skew);

  std::vector<RankInputs> inputs(ep_size);
  for (int64_t r = 0; r < ep_size; ++r) {
    std::mt19937_64 rng(spec.seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(r));
    RankInputs& in = inputs[r];
    in.x_TD = normal_bf16(rng, T * D, 1.0f);
    in.w13 = normal_bf16(rng, local * 2 * F * D, 1.0f / std::sqrt(static_cast<float>(D)));
    in.w2 = normal_bf16(rng, local * D * F, 1.0f / std::sqrt(static_cast<float>(F)));
    in.ids_TK.resize(T * K);
    in.scores_TK.resize(T * K);
    TokenRouter router(rng, popularity, K, options.scores_dtype, spec.free_fraction);
    for (int64_t t = 0; t < T; ++t) {
      router.draw(t >= T - spec.padding_rows, in.ids_TK.data() + t * K, in.scores_TK.data() + t * K);
    }
    if (spec.biases) {  // drawn last, so the other draws of a seed stay what they were
      in.b13 = normal_bf16(rng, local * 2 * F, 0.1f);
      in.b2 = normal_bf16(rng, local * D, 0.1f);
    }
  }
  return inputs;
}

RandomRouting random_routing(const Config& config, int64_t ep_size, const RandomInputsSpec& spec,
                             const Options& options) {
  validate_setup(config, ep_size, options);
  validate_spec(config, spec);
  const int64_t T = config.num_local_input_tokens, K = config.top_k;
  const std::vector<double> popularity = expert_popularity(config.num_experts, ep_size, spec.skew);
  RandomRouting routing;
  for (int64_t r = 0; r < ep_size; ++r) {
    std::mt19937_64 rng(spec.seed * 0xD1B54A32D192ED03ull + 0x632BE59BD9B4E019ull * static_cast<uint64_t>(r + 1));
    routing.ids_TK.emplace_back(T * K);
    routing.scores_TK.emplace_back(T * K);
    TokenRouter router(rng, popularity, K, options.scores_dtype, spec.free_fraction);
    for (int64_t t = 0; t < T; ++t) {
      router.draw(t >= T - spec.padding_rows, routing.ids_TK[r].data() + t * K, routing.scores_TK[r].data() + t * K);
    }
  }
  return routing;
}

std::vector<std::vector<float>> random_grad_out(const Config& config, int64_t ep_size, uint64_t seed) {
  std::vector<std::vector<float>> grad_out(ep_size);
  for (int64_t r = 0; r < ep_size; ++r) {
    std::mt19937_64 rng(seed * 0x2545F4914F6CDD1Dull + 7919u * static_cast<uint64_t>(r + 1));
    grad_out[r] = normal_bf16(rng, config.num_local_input_tokens * config.hidden_dim, 1.0f);
  }
  return grad_out;
}

}  // namespace poise::reference
