// NaN and Inf inputs: what they reach and what they must not (see NanPropagation).

#include "trust_checks.hpp"

namespace poise {
namespace {

using namespace trust_test;

// ---- NaN propagation -------------------------------------------------------------------------------
//
// The semantics (the reference engine's, checked here to hold there too, and the GPU's):
//  - A NaN in token t's x row makes h13 of each of its K expert rows all NaN, hence a and y, hence
//    out[t] (every column), grad_x[t] and grad_scores[t, :] (every k: d out / d score_k = y_k), and
//    every element of grad_w13 and grad_w2 of each expert t visited (their sums over rows include
//    t's row; after exact balance, a replica's partial sums reach the owner's). Nothing else: every
//    other token's rows and every other expert's weight gradients are finite and match the
//    reference.
//  - A NaN in score[t, k] reaches out[t] (score * y summed over k), grad_x[t] (grad_a of that row is
//    score * grad_out . W2) and every element of expert ids[t, k]'s grad_w13 and grad_w2 (the rows'
//    sums include s * a and grad_h13 of that row). Not grad_scores: d out / d score_k = y_k does not
//    involve any score, so grad_scores[t, :] stays finite; nor the other experts t visited (their
//    rows carry finite scores).
// Capacity balance, so each expert's rows are computed by its owner. Plain SwiGLU only: the clamped
// one keeps a NaN through its clamps as the reference's std::min / std::clamp do, but is not run here.

enum class NanIn { x, score };

struct NanSite {
  int64_t rank, token, k;
  NanIn where;
};

using Masks = std::vector<std::vector<char>>;  // per rank, 1 where the element must be NaN

struct NanMasks {
  Masks out, grad_x, grad_scores, grad_w13, grad_w2;
};

NanMasks nan_masks(const Config& c, int64_t R, const std::vector<reference::RankInputs>& in, const NanSite& s) {
  const int64_t T = c.num_local_input_tokens, D = c.hidden_dim, F = c.intermediate_dim, K = c.top_k;
  const int64_t local = c.num_local_experts(R);
  NanMasks m{Masks(R, std::vector<char>(T * D, 0)), Masks(R, std::vector<char>(T * D, 0)),
             Masks(R, std::vector<char>(T * K, 0)), Masks(R, std::vector<char>(local * 2 * F * D, 0)),
             Masks(R, std::vector<char>(local * D * F, 0))};
  std::fill_n(m.out[s.rank].begin() + s.token * D, D, 1);
  std::fill_n(m.grad_x[s.rank].begin() + s.token * D, D, 1);
  if (s.where == NanIn::x) std::fill_n(m.grad_scores[s.rank].begin() + s.token * K, K, 1);
  for (int64_t k = 0; k < K; ++k) {
    if (s.where == NanIn::score && k != s.k) continue;
    const int32_t e = in[s.rank].ids_TK[s.token * K + k];
    std::fill_n(m.grad_w13[e / local].begin() + (e % local) * 2 * F * D, 2 * F * D, 1);
    std::fill_n(m.grad_w2[e / local].begin() + (e % local) * D * F, D * F, 1);
  }
  return m;
}

// NaN exactly where the mask says; the other elements within tolerance of `want` (which must be
// finite there too).
void expect_nan_exactly(const std::vector<std::vector<float>>& got, const Masks& mask,
                        const std::vector<std::vector<float>>& want, const std::string& what) {
  for (size_t r = 0; r < got.size(); ++r) {
    int64_t wrong = 0, first = -1;
    std::vector<float> got_finite, want_finite;
    for (size_t i = 0; i < got[r].size(); ++i) {
      if (std::isnan(got[r][i]) != bool(mask[r][i])) {
        if (wrong++ == 0) first = int64_t(i);
      } else if (!mask[r][i]) {
        got_finite.push_back(got[r][i]);
        want_finite.push_back(want[r][i]);
      }
    }
    EXPECT_EQ(wrong, 0) << what << ", rank " << r << ": elements NaN where they must not be or the reverse, first at "
                        << first;
    EXPECT_LT(testing::relative_error_to(got_finite, want_finite), kTolerance) << what << ", rank " << r;
  }
}

template <class Get>
std::vector<std::vector<float>> each_rank(const std::vector<reference::RankGradients>& grads, Get get) {
  std::vector<std::vector<float>> v;
  for (const auto& g : grads) v.push_back(get(g));
  return v;
}

struct Results {
  std::vector<std::vector<float>> out, grad_x, grad_scores, grad_w13, grad_w2;
};

Results results_of(const ReferenceLayer& l) {
  return {l.out, each_rank(l.grads, [](const auto& g) { return g.grad_x_TD; }),
          each_rank(l.grads, [](const auto& g) { return g.grad_scores_TK; }),
          each_rank(l.grads, [](const auto& g) { return g.grad_w13; }),
          each_rank(l.grads, [](const auto& g) { return g.grad_w2; })};
}

Results results_of(const DeviceLayer& l) {
  return {l.out_TD(), l.grad_x_TD(), l.grad_scores_TK(), l.grad_w13(), l.grad_w2()};
}

void expect_nan_pattern(const Results& got, const NanMasks& m, const Results& want, const std::string& who) {
  expect_nan_exactly(got.out, m.out, want.out, who + " out_TD");
  expect_nan_exactly(got.grad_x, m.grad_x, want.grad_x, who + " grad_x_TD");
  expect_nan_exactly(got.grad_scores, m.grad_scores, want.grad_scores, who + " grad_scores_TK");
  expect_nan_exactly(got.grad_w13, m.grad_w13, want.grad_w13, who + " grad_w13");
  expect_nan_exactly(got.grad_w2, m.grad_w2, want.grad_w2, who + " grad_w2");
}

class NanPropagation : public ::testing::TestWithParam<NanIn> {};

TEST_P(NanPropagation, ReachesItsTokenAndItsExpertsOnly) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Config c = layer_config(96, 192, 320, 8, 4, Balance::capacity, 2.0);
  const int64_t R = 2;
  std::mt19937_64 rng(seed);
  const NanSite site{1, std::uniform_int_distribution<int64_t>(0, c.num_local_input_tokens - 1)(rng),
                     std::uniform_int_distribution<int64_t>(0, c.top_k - 1)(rng), GetParam()};
  SCOPED_TRACE("NaN at rank 1, token " + std::to_string(site.token) +
               (site.where == NanIn::x ? ", x column 5" : ", score k=" + std::to_string(site.k)));
  auto inputs = reference::random_inputs(c, R, {.seed = seed}, {});
  const float nan = std::numeric_limits<float>::quiet_NaN();
  if (site.where == NanIn::x) inputs[1].x_TD[site.token * c.hidden_dim + 5] = nan;
  else inputs[1].scores_TK[site.token * c.top_k + site.k] = nan;
  const ReferenceLayer want = testing::reference_layer(c, R, inputs, reference::random_grad_out(c, R, seed + 1));
  const NanMasks masks = nan_masks(c, R, inputs, site);
  const Results reference_results = results_of(want);
  expect_nan_pattern(reference_results, masks, reference_results, "reference");

  auto context = testing::make_context(c, R);
  TestStream stream;
  DeviceLayer layer = testing::device_layer(want);
  ASSERT_NO_THROW(testing::run_forward_backward(*context, layer, stream)) << "a NaN value is no fault";
  expect_nan_pattern(results_of(layer), masks, reference_results, "GPU");

  // Nothing of the NaN outlives its call: the next call on the context, its rows over the buffers
  // the NaN rows used, matches the reference.
  const ReferenceLayer next = testing::random_reference_layer(c, R, seed + 2);
  DeviceLayer next_layer = testing::device_layer(next);
  ASSERT_NO_THROW(testing::run_forward_backward(*context, next_layer, stream));
  testing::expect_matches_reference(next_layer, next, kTolerance);
}

INSTANTIATE_TEST_SUITE_P(XAndScore, NanPropagation, ::testing::Values(NanIn::x, NanIn::score),
                         [](const ::testing::TestParamInfo<NanIn>& info) {
                           return std::string(info.param == NanIn::x ? "nan_in_x" : "nan_in_score");
                         });

}  // namespace
}  // namespace poise
