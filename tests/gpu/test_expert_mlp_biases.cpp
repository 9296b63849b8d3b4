// gpt-oss's experts in the SM90 expert-MLP kernels: expert biases (b13 before the activation, b2
// before the score, their gradients and the score gradient's bias piece) and transposed weights
// (W13[e] stored [D][2F], W2[e] stored [F][D], weight gradients written the same way), against
// float64 on fresh random inputs (seed printed; POISE_TEST_SEED replays). Outputs are poisoned
// before every run; rows no expert owns are NaN in every input and must keep their poison in every
// output. Every case crosses {standard, transposed} x {blocked, interleaved} x {swiglu, clamped
// (alpha 1.702, limit 7, the inputs scaled so the clamps bite)} with one of three shapes: an empty
// expert and a one-row expert with D, F = 64 x odd; one expert holding every row; short groups.

#include <memory>
#include <string>

#include "expert_mlp_checks.hpp"
#include "gpu_test_support.hpp"
#include "testing/rejected_name.hpp"

namespace poise::test {
namespace {

using poise::testing::rejected_name;
using poise::testing::transpose_experts;

// One seed per run, mixed into every case's own.
uint64_t run_seed() {
  static const uint64_t seed = testing::fresh_seed();
  return seed;
}

struct BiasCase {
  std::string name;
  std::vector<int32_t> counts;
  int64_t D, F;
  W13Layout layout;
  bool clamped, transposed, biased;
  uint64_t seed;
};

void PrintTo(const BiasCase& c, std::ostream* os) { *os << c.name; }

// Fixture with gpt-oss's clamp (limit 7, not the kernel tests' 1.5) and the case's layout and biases.
struct BiasFixture : Fixture {
  BiasCase bc;
  uint64_t seed;
  explicit BiasFixture(const BiasCase& c)
      : Fixture(Case{"biases", c.counts, c.D, c.F, c.layout, c.clamped, c.seed}), bc(c),
        seed(c.seed * 1000003u + run_seed()) {
    act.limit = 7.0;
    shape.swiglu_limit = 7.0f;
    shape.weights_transposed = c.transposed;
    shape.biased = c.biased;
  }
  std::string trace() const {
    return bc.name + " seed " + std::to_string(seed) + " (POISE_TEST_SEED=" + std::to_string(run_seed()) + ")";
  }
  // A weight (or its gradient) [E][rows][cols] as the kernels store it.
  template <class T>
  std::vector<T> stored(const std::vector<T>& w, int64_t rows, int64_t cols) const {
    return bc.transposed ? transpose_experts(w, E(), rows, cols) : w;
  }
};

// A layer's random weights and biases: host copies in the standard layout (the float64 model's),
// device copies as the case stores them. W13 ~ N(0, 16/D) and b13 ~ N(0, 1): h13 ~ N(0, 17), so the
// clamp at 7 cuts ~9% of gates and ups. Biases are drawn for every case; unbiased cases ignore them.
struct ExpertWeights {
  std::vector<uint16_t> w13, w2, b13, b2;  // [E][2F][D], [E][D][F], [E][2F], [E][D]
  DeviceBuffer<uint16_t> dw13, dw2, db13, db2;
  ExpertWeights(const BiasFixture& fx, Rng& rng)
      : w13(rng.bf16_normal(fx.E() * 2 * fx.cs.F * fx.cs.D, 4.0f / std::sqrt(float(fx.cs.D)))),
        w2(rng.bf16_normal(fx.E() * fx.cs.D * fx.cs.F, 1.0f / std::sqrt(float(fx.cs.F)))),
        b13(rng.bf16_normal(fx.E() * 2 * fx.cs.F, 1.0f)), b2(rng.bf16_normal(fx.E() * fx.cs.D, 0.5f)),
        dw13(fx.stored(w13, 2 * fx.cs.F, fx.cs.D)), dw2(fx.stored(w2, fx.cs.D, fx.cs.F)), db13(b13), db2(b2) {}
  const void* b13_or_null(const BiasFixture& fx) const { return fx.bc.biased ? db13.ptr : nullptr; }
  const void* b2_or_null(const BiasFixture& fx) const { return fx.bc.biased ? db2.ptr : nullptr; }
};

// ---- the float64 model ---------------------------------------------------------------------------

// rows[r][n] += b[e][n] over every valid row r of expert e (a case without biases adds nothing).
void add_bias(const BiasFixture& fx, std::vector<double>& rows, const std::vector<uint16_t>& b, int64_t N) {
  if (!fx.bc.biased) return;
  for_each_row(fx.l, [&](int64_t e, int64_t r) {
    for (int64_t n = 0; n < N; ++n) rows[r * N + n] += from_bf16(b[e * N + n]);
  });
}

std::vector<double> model_h13(const BiasFixture& fx, const std::vector<uint16_t>& x, const ExpertWeights& w) {
  auto h = ref_rows_gemm(fx.l, to_double(x), fx.cs.D, to_double(w.w13), 2 * fx.cs.F, true);
  add_bias(fx, h, w.b13, 2 * fx.cs.F);
  return h;
}

std::vector<double> model_act(const BiasFixture& fx, const std::vector<double>& h) {
  const int64_t F = fx.cs.F;
  std::vector<double> a(fx.l.rows * F, 0.0);
  for_each_row(fx.l, [&](int64_t, int64_t r) {
    for (int64_t f = 0; f < F; ++f)
      a[r * F + f] = act_forward(h[r * 2 * F + gate_col(f, F, fx.cs.layout)], h[r * 2 * F + up_col(f, F, fx.cs.layout)],
                                 fx.act);
  });
  return a;
}

// y = (a W2^T + b2) * score (scores null: 1).
std::vector<double> model_y(const BiasFixture& fx, const std::vector<double>& a, const ExpertWeights& w,
                            const float* scores) {
  const int64_t D = fx.cs.D;
  auto y = ref_rows_gemm(fx.l, a, fx.cs.F, to_double(w.w2), D, true);
  add_bias(fx, y, w.b2, D);
  if (scores)
    for (int64_t r = 0; r < fx.l.rows; ++r)
      for (int64_t d = 0; d < D; ++d) y[r * D + d] *= scores[r];
  return y;
}

// The bias's part of the score gradient per row: <grad_y[r], b2[e]> (0 without biases).
std::vector<double> model_score_bias(const BiasFixture& fx, const std::vector<double>& gy, const ExpertWeights& w) {
  const int64_t D = fx.cs.D;
  std::vector<double> s(fx.l.rows, 0.0);
  if (!fx.bc.biased) return s;
  for_each_row(fx.l, [&](int64_t e, int64_t r) {
    for (int64_t d = 0; d < D; ++d) s[r] += gy[r * D + d] * from_bf16(w.b2[e * D + d]);
  });
  return s;
}

// DGRAD W2 and the score gradient, split as the kernels split it: the GEMM's pieces and the bias's.
struct DgradW2Model {
  std::vector<double> gh13, a_scaled;        // [R][2F], [R][F] (score * act(h13))
  std::vector<double> score_gemm, score_bias;  // [R]: <grad_y W2, act(h13)>, <grad_y, b2[e]>
};
DgradW2Model model_dgrad_w2(const BiasFixture& fx, const std::vector<double>& gy, const std::vector<double>& h13,
                            const ExpertWeights& w, const std::vector<float>& scores) {
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F;
  const auto gacc = ref_rows_gemm(fx.l, gy, D, to_double(w.w2), F, false);
  DgradW2Model m{std::vector<double>(R * 2 * F, 0.0), std::vector<double>(R * F, 0.0), std::vector<double>(R, 0.0),
                 model_score_bias(fx, gy, w)};
  for_each_row(fx.l, [&](int64_t, int64_t r) {
    for (int64_t f = 0; f < F; ++f) {
      const int64_t gc = gate_col(f, F, fx.cs.layout), uc = up_col(f, F, fx.cs.layout);
      const double a = act_forward(h13[r * 2 * F + gc], h13[r * 2 * F + uc], fx.act);
      act_backward(h13[r * 2 * F + gc], h13[r * 2 * F + uc], scores[r] * gacc[r * F + f], fx.act,
                   m.gh13[r * 2 * F + gc], m.gh13[r * 2 * F + uc]);
      m.a_scaled[r * F + f] = scores[r] * a;
      m.score_gemm[r] += gacc[r * F + f] * a;
    }
  });
  return m;
}

// grad_b13[e] = sum of grad_h13 rows, grad_b2[e] = sum of score * grad_y rows (scores null: 1).
struct BiasGradModel {
  std::vector<double> b13, b2;  // [E][2F], [E][D]
};
BiasGradModel model_bias_grads(const BiasFixture& fx, const std::vector<double>& gh13, const std::vector<double>& gy,
                               const float* scores) {
  const int64_t D = fx.cs.D, F2 = 2 * fx.cs.F;
  BiasGradModel m{std::vector<double>(fx.E() * F2, 0.0), std::vector<double>(fx.E() * D, 0.0)};
  for_each_row(fx.l, [&](int64_t e, int64_t r) {
    for (int64_t j = 0; j < F2; ++j) m.b13[e * F2 + j] += gh13[r * F2 + j];
    for (int64_t d = 0; d < D; ++d) m.b2[e * D + d] += (scores ? scores[r] : 1.0) * gy[r * D + d];
  });
  return m;
}

// grad_W[e] = A[e]^T B[e] ([E][M][N]), or its transpose ([E][N][M]) when the case's weights are transposed.
std::vector<double> model_wgrad(const BiasFixture& fx, const std::vector<double>& A, int64_t M,
                                const std::vector<double>& B, int64_t N) {
  return fx.bc.transposed ? ref_wgrad(fx.l, B, N, A, M) : ref_wgrad(fx.l, A, M, B, N);
}

// ---- weight- and bias-gradient outputs in every mode ----------------------------------------------

// A gradient output in bf16 or fp32, starting from `initial` (exact bf16 values for bf16); read as floats.
class GradBuffer {
 public:
  GradBuffer(DType dtype, const std::vector<float>& initial) {
    if (dtype == DType::fp32) {
      f32_ = std::make_unique<DeviceBuffer<float>>(initial);
      return;
    }
    std::vector<uint16_t> bits(initial.size());
    for (size_t i = 0; i < bits.size(); ++i) bits[i] = to_bf16(initial[i]);
    b16_ = std::make_unique<DeviceBuffer<uint16_t>>(bits);
  }
  void* ptr() const { return f32_ ? static_cast<void*>(f32_->ptr) : static_cast<void*>(b16_->ptr); }
  std::vector<float> download() const {
    if (f32_) return f32_->download();
    const auto bits = b16_->download();
    std::vector<float> v(bits.size());
    for (size_t i = 0; i < v.size(); ++i) v[i] = from_bf16(bits[i]);
    return v;
  }

 private:
  std::unique_ptr<DeviceBuffer<float>> f32_;
  std::unique_ptr<DeviceBuffer<uint16_t>> b16_;
};

// What one launch writes per gradient: its float64 value in the output's layout.
struct GradTarget {
  std::string name;
  std::vector<double> ref;
  int64_t per_expert;
};
using GradLaunch = std::function<void(const std::vector<sm90::WgradOutput>&)>;

// The contents an output starts from: NaN to overwrite, random values (exact in dtype) to add to.
std::vector<float> initial_contents(Rng& rng, size_t n, DType dtype, bool accumulate) {
  if (!accumulate) return std::vector<float>(n, fp32_poison());
  auto v = rng.uniform(n, -1.0f, 1.0f);
  if (dtype == DType::bf16)
    for (float& x : v) x = from_bf16(to_bf16(x));
  return v;
}

// The output against initial (when accumulating) + ref; an expert without rows must be left as it
// was when accumulating and zero when overwriting.
void expect_grad(const BiasFixture& fx, const GradTarget& t, const std::vector<float>& initial,
                 const std::vector<float>& got, DType dtype, bool accumulate, const std::string& mode) {
  std::vector<double> want(t.ref);
  if (accumulate)
    for (size_t i = 0; i < want.size(); ++i) want[i] += initial[i];
  expect_close(compare_all(got, want), dtype == DType::fp32 ? kFp32Tolerance : kBf16Tolerance,
               (t.name + " " + mode).c_str());
  int64_t wrong = 0;
  for (int64_t e = 0; e < fx.E(); ++e) {
    if (fx.l.counts[e] != 0) continue;
    for (int64_t i = e * t.per_expert; i < (e + 1) * t.per_expert; ++i)
      wrong += accumulate ? got[i] != initial[i] : got[i] != 0.0f;
  }
  EXPECT_EQ(wrong, 0) << t.name << " " << mode << ": elements of experts without rows";
}

// Runs `launch` four ways (fp32 / bf16 outputs, overwrite / accumulate), each target in its own output.
void check_grad_outputs(const BiasFixture& fx, Rng& rng, const std::vector<GradTarget>& targets,
                        const GradLaunch& launch) {
  for (DType dtype : {DType::fp32, DType::bf16}) {
    for (bool accumulate : {false, true}) {
      const std::string mode =
          std::string(dtype == DType::fp32 ? "fp32" : "bf16") + (accumulate ? " accumulate" : " overwrite");
      std::vector<std::vector<float>> initial;
      std::vector<std::unique_ptr<GradBuffer>> outs;
      std::vector<sm90::WgradOutput> args;
      for (const GradTarget& t : targets) {
        initial.push_back(initial_contents(rng, t.ref.size(), dtype, accumulate));
        outs.push_back(std::make_unique<GradBuffer>(dtype, initial.back()));
        args.push_back({outs.back()->ptr(), dtype, accumulate});
      }
      launch(args);
      cuda_ok(cudaDeviceSynchronize(), mode.c_str());
      for (size_t i = 0; i < targets.size(); ++i)
        expect_grad(fx, targets[i], initial[i], outs[i]->download(), dtype, accumulate, mode);
    }
  }
}

// ---- the kernels one at a time ---------------------------------------------------------------------

class ExpertMlpBiases : public ::testing::TestWithParam<BiasCase> {
 protected:
  void SetUp() override {
    if (!have_sm90()) GTEST_SKIP() << "needs an SM90 GPU";
  }
};

// The clamped cases must reach the clamps (else they test plain SwiGLU twice).
void expect_clamps_bite(const BiasFixture& fx, const std::vector<double>& h13) {
  if (!fx.bc.clamped) return;
  const int64_t F = fx.cs.F;
  int64_t gates = 0, ups = 0;
  for_each_row(fx.l, [&](int64_t, int64_t r) {
    for (int64_t f = 0; f < F; ++f) {
      gates += h13[r * 2 * F + gate_col(f, F, fx.cs.layout)] > fx.act.limit;
      ups += std::abs(h13[r * 2 * F + up_col(f, F, fx.cs.layout)]) > fx.act.limit;
    }
  });
  EXPECT_GT(gates, 0) << "no gate above the limit";
  EXPECT_GT(ups, 0) << "no up outside [-limit, limit]";
}

TEST_P(ExpertMlpBiases, FpropW13AddsTheBiasBeforeTheActivation) {
  BiasFixture fx(GetParam());
  SCOPED_TRACE(fx.trace());
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F;
  Rng rng(fx.seed);
  const auto x = random_rows(rng, fx.l, D, 1.0f);
  const ExpertWeights w(fx, rng);
  DeviceBuffer<uint16_t> dx(x), da(std::vector<uint16_t>(R * F, kBf16Poison)),
      dh(std::vector<uint16_t>(R * 2 * F, kBf16Poison));
  sm90::FpropW13Args args{dx.ptr, w.dw13.ptr, da.ptr, dh.ptr};
  args.b13_E2F = w.b13_or_null(fx);
  sm90::expert_mlp_fprop_w13(fx.rows, fx.shape, args, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "fprop_w13");

  const auto h = model_h13(fx, x, w);
  expect_clamps_bite(fx, h);
  expect_close(compare_rows_bf16(dh.download(), h, fx.l, 2 * F), kBf16Tolerance, "h13_R2F (bias included)");
  expect_close(compare_rows_bf16(da.download(), model_act(fx, h), fx.l, F), kBf16Tolerance, "a_RF");
}

TEST_P(ExpertMlpBiases, FpropW2AddsTheBiasBeforeTheScore) {
  BiasFixture fx(GetParam());
  SCOPED_TRACE(fx.trace());
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F;
  Rng rng(fx.seed + 1);
  const auto a = random_rows(rng, fx.l, F, 1.0f);
  const auto scores = rng.uniform(R, 0.1f, 1.0f);
  const ExpertWeights w(fx, rng);
  DeviceBuffer<uint16_t> da(a);
  DeviceBuffer<float> ds(scores);
  for (const float* scores_R : {static_cast<const float*>(nullptr), static_cast<const float*>(ds.ptr)}) {
    DeviceBuffer<uint16_t> dy(std::vector<uint16_t>(R * D, kBf16Poison));
    sm90::FpropW2Args args{da.ptr, w.dw2.ptr, scores_R, dy.ptr};
    args.b2_ED = w.b2_or_null(fx);
    sm90::expert_mlp_fprop_w2(fx.rows, fx.shape, args, nullptr);
    cuda_ok(cudaDeviceSynchronize(), "fprop_w2");
    const auto y = model_y(fx, to_double(a), w, scores_R ? scores.data() : nullptr);
    expect_close(compare_rows_bf16(dy.download(), y, fx.l, D), kBf16Tolerance, scores_R ? "y_RD (scores)" : "y_RD");
  }
}

// grad_h13, score * a and the GEMM's score-gradient pieces; with biases P counts one more piece,
// the bias's, that this kernel leaves to expert_mlp_bias_grads (checked there).
TEST_P(ExpertMlpBiases, DgradW2MatchesFloat64) {
  BiasFixture fx(GetParam());
  SCOPED_TRACE(fx.trace());
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F;
  Rng rng(fx.seed + 2);
  const auto gy = random_rows(rng, fx.l, D, 1.0f);
  const auto h13 = random_rows(rng, fx.l, 2 * F, 5.0f);  // wide: the clamp at 7 bites
  const auto scores = rng.uniform(R, 0.1f, 1.0f);
  const ExpertWeights w(fx, rng);
  const int64_t P = sm90::dgrad_w2_score_partials(fx.shape), gemm_pieces = P - (fx.bc.biased ? 1 : 0);
  DeviceBuffer<uint16_t> dgy(gy), dh(h13), dgh(std::vector<uint16_t>(R * 2 * F, kBf16Poison)),
      da(std::vector<uint16_t>(R * F, kBf16Poison));
  DeviceBuffer<float> ds(scores), dgs(std::vector<float>(R * P, 0.0f));  // zeros: padding rows must stay 0
  sm90::expert_mlp_dgrad_w2(fx.rows, fx.shape, {dgy.ptr, w.dw2.ptr, dh.ptr, ds.ptr, dgh.ptr, da.ptr, dgs.ptr}, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "dgrad_w2");

  const auto m = model_dgrad_w2(fx, to_double(gy), to_double(h13), w, scores);
  expect_close(compare_rows_bf16(dgh.download(), m.gh13, fx.l, 2 * F), kBf16Tolerance, "grad_h13_R2F");
  expect_close(compare_rows_bf16(da.download(), m.a_scaled, fx.l, F), kBf16Tolerance, "a_RF (score * a)");
  const auto partials = dgs.download();
  ErrorAccumulator acc;
  int64_t padding_written = 0;
  for (int64_t r = 0; r < R; ++r) {
    double sum = 0.0;
    for (int64_t p = 0; p < gemm_pieces; ++p) sum += partials[r * P + p];
    if (fx.l.is_row_valid(r)) acc.add(sum, m.score_gemm[r]);
    else for (int64_t p = 0; p < P; ++p) padding_written += partials[r * P + p] != 0.0f;
  }
  Comparison c = acc.finish();
  c.poison_lost = padding_written;
  expect_close(c, 1e-3, "grad_score_partials_RP (the GEMM's pieces)");
}

TEST_P(ExpertMlpBiases, DgradW13ReadsTheStoredLayout) {
  BiasFixture fx(GetParam());
  SCOPED_TRACE(fx.trace());
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F;
  Rng rng(fx.seed + 3);
  const auto gh = random_rows(rng, fx.l, 2 * F, 1.0f);
  const ExpertWeights w(fx, rng);
  DeviceBuffer<uint16_t> dgh(gh), dgx(std::vector<uint16_t>(R * D, kBf16Poison));
  sm90::expert_mlp_dgrad_w13(fx.rows, fx.shape, {dgh.ptr, w.dw13.ptr, dgx.ptr}, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "dgrad_w13");
  const auto gx = ref_rows_gemm(fx.l, to_double(gh), 2 * F, to_double(w.w13), D, false);
  expect_close(compare_rows_bf16(dgx.download(), gx, fx.l, D), kBf16Tolerance, "grad_x_RD");
}

// Rows scattered to slots (RowScatter, the EP combine's direct store) with the bias and the stored
// layout: every valid row lands in its random slot of one owner bit for bit as the grouped store
// writes it; slots no row names keep their poison.
void expect_scatter_equals_grouped(const BiasFixture& fx, const std::vector<uint16_t>& grouped,
                                   const std::function<void(const sm90::RowScatter&)>& run, const char* what) {
  const int64_t D = fx.cs.D;
  int64_t valid = 0;
  for_each_row(fx.l, [&](int64_t, int64_t) { ++valid; });
  const int64_t S = valid + 5;  // some slots left free
  std::vector<int32_t> slots(S);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), std::mt19937_64(fx.seed));
  std::vector<int32_t> origin(fx.l.rows, -1);
  std::vector<int64_t> row_of_slot(S, -1);
  int64_t next = 0;
  for_each_row(fx.l, [&](int64_t, int64_t r) { row_of_slot[origin[r] = slots[next++]] = r; });
  DeviceBuffer<uint16_t> owner(std::vector<uint16_t>(S * D, kBf16Poison));
  DeviceBuffer<char*> bases(std::vector<char*>{reinterpret_cast<char*>(owner.ptr)});
  DeviceBuffer<int32_t> dorigin(origin);
  run({dorigin.ptr, bases.ptr, 0, S, 1});
  cuda_ok(cudaDeviceSynchronize(), what);
  const auto got = owner.download();
  int64_t wrong = 0, poison_lost = 0;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t d = 0; d < D; ++d) {
      const int64_t r = row_of_slot[s];
      if (r < 0) poison_lost += got[s * D + d] != kBf16Poison;
      else wrong += got[s * D + d] != grouped[r * D + d];
    }
  EXPECT_EQ(wrong, 0) << what << ": elements that differ from the grouped rows";
  EXPECT_EQ(poison_lost, 0) << what << ": elements written outside the named slots";
}

TEST_P(ExpertMlpBiases, ScatteredRowsEqualGroupedRowsBitwise) {
  BiasFixture fx(GetParam());
  SCOPED_TRACE(fx.trace());
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F;
  Rng rng(fx.seed + 9);
  const auto a = random_rows(rng, fx.l, F, 1.0f), gh = random_rows(rng, fx.l, 2 * F, 1.0f);
  const ExpertWeights w(fx, rng);
  DeviceBuffer<uint16_t> da(a), dgh(gh), dy(std::vector<uint16_t>(R * D, kBf16Poison)),
      dgx(std::vector<uint16_t>(R * D, kBf16Poison));
  DeviceBuffer<float> ds(rng.uniform(R, 0.1f, 1.0f));
  sm90::FpropW2Args f2{da.ptr, w.dw2.ptr, ds.ptr, dy.ptr};
  f2.b2_ED = w.b2_or_null(fx);
  sm90::expert_mlp_fprop_w2(fx.rows, fx.shape, f2, nullptr);
  sm90::expert_mlp_dgrad_w13(fx.rows, fx.shape, {dgh.ptr, w.dw13.ptr, dgx.ptr}, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "grouped rows");
  expect_scatter_equals_grouped(fx, dy.download(), [&](const sm90::RowScatter& scatter) {
    sm90::FpropW2Args args = f2;
    args.y_RD = nullptr;
    args.scatter = scatter;
    sm90::expert_mlp_fprop_w2(fx.rows, fx.shape, args, nullptr);
  }, "FPROP W2 scattered");
  expect_scatter_equals_grouped(fx, dgx.download(), [&](const sm90::RowScatter& scatter) {
    sm90::DgradW13Args args{dgh.ptr, w.dw13.ptr, nullptr};
    args.scatter = scatter;
    sm90::expert_mlp_dgrad_w13(fx.rows, fx.shape, args, nullptr);
  }, "DGRAD W13 scattered");
}

// Weight gradients in the stored layout, four ways (the standard layout: test_expert_mlp).
TEST_P(ExpertMlpBiases, WgradW13InTheStoredLayout) {
  BiasFixture fx(GetParam());
  if (!fx.bc.transposed) GTEST_SKIP() << "the standard layout's wgrad: ExpertMlpKernels";
  SCOPED_TRACE(fx.trace());
  const int64_t D = fx.cs.D, F = fx.cs.F;
  Rng rng(fx.seed + 4);
  const auto gh = random_rows(rng, fx.l, 2 * F, 1.0f), x = random_rows(rng, fx.l, D, 1.0f);
  DeviceBuffer<uint16_t> dgh(gh), dx(x);
  check_grad_outputs(fx, rng, {{"grad_w13 [E][D][2F]", model_wgrad(fx, to_double(gh), 2 * F, to_double(x), D), 2 * F * D}},
                     [&](const std::vector<sm90::WgradOutput>& out) {
                       sm90::expert_mlp_wgrad_w13(fx.rows, fx.shape, dgh.ptr, dx.ptr, out[0], nullptr);
                     });
}

TEST_P(ExpertMlpBiases, WgradW2InTheStoredLayout) {
  BiasFixture fx(GetParam());
  if (!fx.bc.transposed) GTEST_SKIP() << "the standard layout's wgrad: ExpertMlpKernels";
  SCOPED_TRACE(fx.trace());
  const int64_t D = fx.cs.D, F = fx.cs.F;
  Rng rng(fx.seed + 5);
  const auto gy = random_rows(rng, fx.l, D, 1.0f), as = random_rows(rng, fx.l, F, 1.0f);
  DeviceBuffer<uint16_t> dgy(gy), das(as);
  check_grad_outputs(fx, rng, {{"grad_w2 [E][F][D]", model_wgrad(fx, to_double(gy), D, to_double(as), F), D * F}},
                     [&](const std::vector<sm90::WgradOutput>& out) {
                       sm90::expert_mlp_wgrad_w2(fx.rows, fx.shape, dgy.ptr, das.ptr, out[0], nullptr);
                     });
}

// grad_b13 / grad_b2 four ways, and without scores (score 1).
TEST_P(ExpertMlpBiases, BiasGradsMatchFloat64) {
  BiasFixture fx(GetParam());
  if (!fx.bc.biased) GTEST_SKIP() << "no biases in this case";
  SCOPED_TRACE(fx.trace());
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F;
  Rng rng(fx.seed + 6);
  const auto gy = random_rows(rng, fx.l, D, 1.0f), gh = random_rows(rng, fx.l, 2 * F, 1.0f);
  const auto scores = rng.uniform(R, 0.1f, 1.0f);
  const ExpertWeights w(fx, rng);
  DeviceBuffer<uint16_t> dgy(gy), dgh(gh);
  DeviceBuffer<float> ds(scores);
  for (const float* scores_R : {static_cast<const float*>(ds.ptr), static_cast<const float*>(nullptr)}) {
    SCOPED_TRACE(scores_R ? "scores" : "no scores");
    const auto m = model_bias_grads(fx, to_double(gh), to_double(gy), scores_R ? scores.data() : nullptr);
    check_grad_outputs(fx, rng, {{"grad_b13", m.b13, 2 * F}, {"grad_b2", m.b2, D}},
                       [&](const std::vector<sm90::WgradOutput>& out) {
                         sm90::BiasGradArgs args;
                         args.grad_y_RD = dgy.ptr;
                         args.grad_h13_R2F = dgh.ptr;
                         args.scores_R = scores_R;
                         args.b2_ED = w.db2.ptr;
                         args.grad_b13 = out[0];
                         args.grad_b2 = out[1];
                         sm90::expert_mlp_bias_grads(fx.rows, fx.shape, args, nullptr);
                       });
  }
}

// The bias's piece of the score gradient, <grad_y[r], b2[e]>, goes to the last piece of each valid
// row; the GEMM's pieces (written before by DGRAD W2) and every padding row keep their bits.
TEST_P(ExpertMlpBiases, BiasGradsWriteOnlyTheLastScorePiece) {
  BiasFixture fx(GetParam());
  if (!fx.bc.biased) GTEST_SKIP() << "no biases in this case";
  SCOPED_TRACE(fx.trace());
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F, E = fx.E();
  const int64_t P = sm90::dgrad_w2_score_partials(fx.shape);
  Rng rng(fx.seed + 7);
  const auto gy = random_rows(rng, fx.l, D, 1.0f), gh = random_rows(rng, fx.l, 2 * F, 1.0f);
  const auto scores = rng.uniform(R, 0.1f, 1.0f);
  const ExpertWeights w(fx, rng);
  // Random GEMM pieces on valid rows; NaN in their last piece and everywhere on padding rows.
  auto before = rng.uniform(R * P, -1.0f, 1.0f);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t p = fx.l.is_row_valid(r) ? P - 1 : 0; p < P; ++p) before[r * P + p] = fp32_poison();
  DeviceBuffer<uint16_t> dgy(gy), dgh(gh);
  DeviceBuffer<float> ds(scores), dgs(before), gb13(std::vector<float>(E * 2 * F, fp32_poison())),
      gb2(std::vector<float>(E * D, fp32_poison()));
  sm90::BiasGradArgs args;
  args.grad_y_RD = dgy.ptr;
  args.grad_h13_R2F = dgh.ptr;
  args.scores_R = ds.ptr;
  args.b2_ED = w.db2.ptr;
  args.grad_score_partials_RP = dgs.ptr;
  args.grad_b13 = {gb13.ptr, DType::fp32, false};
  args.grad_b2 = {gb2.ptr, DType::fp32, false};
  sm90::expert_mlp_bias_grads(fx.rows, fx.shape, args, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "bias_grads");

  const auto after = dgs.download();
  const auto score_bias = model_score_bias(fx, to_double(gy), w);
  ErrorAccumulator acc;
  int64_t changed = 0;
  for (int64_t r = 0; r < R; ++r) {
    const bool valid = fx.l.is_row_valid(r);
    for (int64_t p = 0; p < P; ++p) {
      const size_t i = size_t(r * P + p);
      if (valid && p == P - 1) acc.add(after[i], score_bias[r]);
      else changed += std::memcmp(&after[i], &before[i], 4) != 0;
    }
  }
  expect_close(acc.finish(), kFp32Tolerance, "the bias's score piece");
  EXPECT_EQ(changed, 0) << "score pieces other than the valid rows' last one were written";
}

// ---- the chain -------------------------------------------------------------------------------------

// A chain's inputs: x and grad_y rows, scores, the layer's weights.
struct ChainInputs {
  std::vector<uint16_t> x, gy;
  std::vector<float> scores;
  ExpertWeights w;
  DeviceBuffer<uint16_t> dx, dgy;
  DeviceBuffer<float> ds;
  ChainInputs(const BiasFixture& fx, Rng& rng)
      : x(random_rows(rng, fx.l, fx.cs.D, 1.0f)), gy(random_rows(rng, fx.l, fx.cs.D, 1.0f)),
        scores(rng.uniform(fx.l.rows, 0.1f, 1.0f)), w(fx, rng), dx(x), dgy(gy), ds(scores) {}
};

// Where a chain reads its weights: experts [0, own) from the main pointers, the rest from the
// replica ones (GroupedRows::first_replica; null without replicas).
struct WeightPointers {
  const void *w13, *w2, *b13, *b2;
  const void *rep_w13 = nullptr, *rep_w2 = nullptr, *rep_b13 = nullptr, *rep_b2 = nullptr;
};

// Every output of a chain, poisoned; gradients fp32, overwritten. rep_*: the replica slots' gradients.
struct ChainOutputs {
  DeviceBuffer<uint16_t> a, h13, y, gh, as, gx;
  DeviceBuffer<float> gs, gw13, gw2, gb13, gb2, rep_gw13, rep_gw2, rep_gb13, rep_gb2;
  ChainOutputs(const BiasFixture& fx, int64_t own)
      : a(poisoned16(fx.l.rows * fx.cs.F)), h13(poisoned16(fx.l.rows * 2 * fx.cs.F)), y(poisoned16(fx.l.rows * fx.cs.D)),
        gh(poisoned16(fx.l.rows * 2 * fx.cs.F)), as(poisoned16(fx.l.rows * fx.cs.F)), gx(poisoned16(fx.l.rows * fx.cs.D)),
        gs(poisoned32(fx.l.rows * sm90::dgrad_w2_score_partials(fx.shape))),
        gw13(poisoned32(own * 2 * fx.cs.F * fx.cs.D)), gw2(poisoned32(own * fx.cs.D * fx.cs.F)),
        gb13(poisoned32(own * 2 * fx.cs.F)), gb2(poisoned32(own * fx.cs.D)),
        rep_gw13(poisoned32((fx.E() - own) * 2 * fx.cs.F * fx.cs.D)),
        rep_gw2(poisoned32((fx.E() - own) * fx.cs.D * fx.cs.F)),
        rep_gb13(poisoned32((fx.E() - own) * 2 * fx.cs.F)), rep_gb2(poisoned32((fx.E() - own) * fx.cs.D)) {}
  static std::vector<uint16_t> poisoned16(int64_t n) { return std::vector<uint16_t>(n, kBf16Poison); }
  static std::vector<float> poisoned32(int64_t n) { return std::vector<float>(n, fp32_poison()); }
};

// The six GEMMs and the bias gradients, in the pipeline's order.
void run_chain(const BiasFixture& fx, const GroupedRows& rows, const ChainInputs& in, const WeightPointers& w,
               ChainOutputs& o) {
  const bool biased = fx.bc.biased;
  sm90::FpropW13Args f13{in.dx.ptr, w.w13, o.a.ptr, o.h13.ptr, w.rep_w13};
  if (biased) f13.b13_E2F = w.b13, f13.replica_b13_E2F = w.rep_b13;
  sm90::FpropW2Args f2{o.a.ptr, w.w2, in.ds.ptr, o.y.ptr, w.rep_w2};
  if (biased) f2.b2_ED = w.b2, f2.replica_b2_ED = w.rep_b2;
  sm90::DgradW2Args g2{in.dgy.ptr, w.w2, o.h13.ptr, in.ds.ptr, o.gh.ptr, o.as.ptr, o.gs.ptr, w.rep_w2};
  sm90::expert_mlp_fprop_w13(rows, fx.shape, f13, nullptr);
  sm90::expert_mlp_fprop_w2(rows, fx.shape, f2, nullptr);
  sm90::expert_mlp_dgrad_w2(rows, fx.shape, g2, nullptr);
  if (biased) {
    sm90::BiasGradArgs bg;
    bg.grad_y_RD = in.dgy.ptr;
    bg.grad_h13_R2F = o.gh.ptr;
    bg.scores_R = in.ds.ptr;
    bg.b2_ED = w.b2;
    bg.replica_b2_ED = w.rep_b2;
    bg.grad_score_partials_RP = o.gs.ptr;
    bg.grad_b13 = {o.gb13.ptr, DType::fp32, false, o.rep_gb13.ptr, DType::fp32};
    bg.grad_b2 = {o.gb2.ptr, DType::fp32, false, o.rep_gb2.ptr, DType::fp32};
    sm90::expert_mlp_bias_grads(rows, fx.shape, bg, nullptr);
  }
  sm90::expert_mlp_dgrad_w13(rows, fx.shape, {o.gh.ptr, w.w13, o.gx.ptr, w.rep_w13}, nullptr);
  sm90::expert_mlp_wgrad_w2(rows, fx.shape, in.dgy.ptr, o.as.ptr, {o.gw2.ptr, DType::fp32, false, o.rep_gw2.ptr}, nullptr);
  sm90::expert_mlp_wgrad_w13(rows, fx.shape, o.gh.ptr, in.dx.ptr, {o.gw13.ptr, DType::fp32, false, o.rep_gw13.ptr}, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "chain");
}

// The chain forward and backward as the pipeline chains it (h13 saved in bf16, the score fused into
// FPROP W2 and DGRAD W2, the score gradient summed over every piece) against one float64 computation.
TEST_P(ExpertMlpBiases, ChainMatchesFloat64) {
  BiasFixture fx(GetParam());
  SCOPED_TRACE(fx.trace());
  const int64_t D = fx.cs.D, F = fx.cs.F;
  Rng rng(fx.seed + 8);
  const ChainInputs in(fx, rng);
  ChainOutputs o(fx, fx.E());
  run_chain(fx, fx.rows, in, {in.w.dw13.ptr, in.w.dw2.ptr, in.w.db13.ptr, in.w.db2.ptr}, o);

  const auto xd = to_double(in.x), gyd = to_double(in.gy);
  const auto h = model_h13(fx, in.x, in.w);
  const auto y = model_y(fx, model_act(fx, h), in.w, in.scores.data());
  auto h_saved = h;  // backward reads h13 as saved, in bf16: the clamps' derivative jumps at +-limit
  for (double& v : h_saved) v = from_bf16(to_bf16(float(v)));
  const auto m = model_dgrad_w2(fx, gyd, h_saved, in.w, in.scores);
  const auto gx = ref_rows_gemm(fx.l, m.gh13, 2 * F, to_double(in.w.w13), D, false);

  constexpr double kChainTolerance = 2e-2;  // bf16 intermediates (h13, a, grad_h13) compound
  expect_close(compare_rows_bf16(o.h13.download(), h, fx.l, 2 * F), kBf16Tolerance, "h13_R2F");
  expect_close(compare_rows_bf16(o.y.download(), y, fx.l, D), kChainTolerance, "y_RD");
  expect_close(compare_rows_bf16(o.gx.download(), gx, fx.l, D), kChainTolerance, "grad_x_RD");
  expect_close(compare_all(o.gw2.download(), model_wgrad(fx, gyd, D, m.a_scaled, F)), kChainTolerance, "grad_w2");
  expect_close(compare_all(o.gw13.download(), model_wgrad(fx, m.gh13, 2 * F, xd, D)), kChainTolerance, "grad_w13");
  if (fx.bc.biased) {
    const auto bg = model_bias_grads(fx, m.gh13, gyd, in.scores.data());
    expect_close(compare_all(o.gb13.download(), bg.b13), kChainTolerance, "grad_b13");
    expect_close(compare_all(o.gb2.download(), bg.b2), kChainTolerance, "grad_b2");
  }
  const int64_t P = sm90::dgrad_w2_score_partials(fx.shape);
  const auto gs = sum_score_partials(o.gs.download(), P);  // every piece: NaN where one was not written
  ErrorAccumulator acc;
  for_each_row(fx.l, [&](int64_t, int64_t r) { acc.add(gs[r], m.score_gemm[r] + m.score_bias[r]); });
  expect_close(acc.finish(), kChainTolerance, "grad_scores_R (GEMM and bias pieces)");
}

std::vector<BiasCase> bias_cases() {
  struct Shape {
    const char* name;
    std::vector<int32_t> counts;
    int64_t D, F;
  };
  const Shape shapes[] = {
      {"mixed", {130, 0, 300, 1}, 192, 320},          // an empty expert, a one-row one; D, F = 64 x odd
      {"one_expert", {0, 517, 0}, 320, 192},          // one expert holds every row
      {"short_groups", {16, 17, 96, 0, 33, 200}, 128, 192},  // groups ending inside wgrad's k16 slices
  };
  std::vector<BiasCase> cases;
  uint64_t i = 0;
  for (auto [transposed, biased] : {std::pair{false, true}, std::pair{true, true}, std::pair{true, false}}) {
    for (W13Layout layout : {W13Layout::gate_up_blocked, W13Layout::gate_up_interleaved}) {
      for (bool clamped : {false, true}) {
        const Shape& s = shapes[i % 3];
        const std::string name = std::string(biased ? "biased" : "unbiased") + (transposed ? "_transposed" : "_standard") +
                                  (layout == W13Layout::gate_up_blocked ? "_blocked" : "_interleaved") +
                                  (clamped ? "_clamped_" : "_swiglu_") + s.name;
        cases.push_back({name, s.counts, s.D, s.F, layout, clamped, transposed, biased, 300 + i});
        ++i;
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(LayoutsAndShapes, ExpertMlpBiases, ::testing::ValuesIn(bias_cases()),
                         [](const ::testing::TestParamInfo<BiasCase>& info) { return info.param.name; });

// ---- replica experts -------------------------------------------------------------------------------

// EP exact balance: one launch covers a rank's own experts and its replica slots, whose weights,
// biases and gradients live in other buffers. Every output must equal, bit for bit, the same
// experts run from one buffer; an empty replica slot's gradient targets keep their poison.
TEST(ExpertMlpBiasReplicas, SplitWeightsAndBiasesEqualOneBufferBitwise) {
  if (!have_sm90()) GTEST_SKIP() << "needs an SM90 GPU";
  // Experts 0-2 own, 3-5 replicas; own expert 1 and replica 3 have no rows.
  BiasFixture fx(BiasCase{"replicas", {200, 0, 333, 0, 129, 64}, 192, 320, W13Layout::gate_up_interleaved, true,
                          true, true, 41});
  SCOPED_TRACE(fx.trace());
  const int64_t D = fx.cs.D, F = fx.cs.F, E = fx.E(), own = 3;
  Rng rng(fx.seed);
  const ChainInputs in(fx, rng);
  ChainOutputs one(fx, E), split(fx, own);
  run_chain(fx, fx.rows, in, {in.w.dw13.ptr, in.w.dw2.ptr, in.w.db13.ptr, in.w.db2.ptr}, one);

  // The stored (transposed) weights and the biases, cut at the first replica.
  const auto w13 = fx.stored(in.w.w13, 2 * F, D), w2 = fx.stored(in.w.w2, D, F);
  const DeviceBuffer<uint16_t> w13_own(slice_experts(w13, 2 * F * D, 0, own)),
      w13_rep(slice_experts(w13, 2 * F * D, own, E)),
      w2_own(slice_experts(w2, D * F, 0, own)), w2_rep(slice_experts(w2, D * F, own, E)),
      b13_own(slice_experts(in.w.b13, 2 * F, 0, own)), b13_rep(slice_experts(in.w.b13, 2 * F, own, E)),
      b2_own(slice_experts(in.w.b2, D, 0, own)), b2_rep(slice_experts(in.w.b2, D, own, E));
  GroupedRows rows = fx.rows;
  rows.first_replica = own;
  run_chain(fx, rows, in,
            {w13_own.ptr, w2_own.ptr, b13_own.ptr, b2_own.ptr, w13_rep.ptr, w2_rep.ptr, b13_rep.ptr, b2_rep.ptr}, split);

  for (auto [a, b, what] : {std::tuple{&one.a, &split.a, "a_RF"}, {&one.h13, &split.h13, "h13_R2F"},
                            {&one.y, &split.y, "y_RD"}, {&one.gh, &split.gh, "grad_h13_R2F"},
                            {&one.as, &split.as, "a_RF (dgrad)"}, {&one.gx, &split.gx, "grad_x_RD"}})
    EXPECT_TRUE(same_bits(a->download(), b->download())) << what << " differs between one buffer and split weights";
  EXPECT_TRUE(same_bits(one.gs.download(), split.gs.download())) << "grad_score_partials_RP";

  // Own experts' gradients equal the one-buffer run's; replicas' too, but an empty one keeps its poison.
  auto check = [&](const DeviceBuffer<float>& all, const DeviceBuffer<float>& own_out, const DeviceBuffer<float>& rep_out,
                   int64_t per_expert, const char* what) {
    const auto ref = all.download(), got_rep = rep_out.download();
    EXPECT_TRUE(same_bits(own_out.download(), slice_experts(ref, per_expert, 0, own))) << what << ": own experts";
    for (int64_t e = own; e < E; ++e) {
      const auto got = slice_experts(got_rep, per_expert, e - own, e - own + 1);
      const bool empty = fx.l.counts[e] == 0;
      const auto want = empty ? std::vector<float>(per_expert, fp32_poison()) : slice_experts(ref, per_expert, e, e + 1);
      EXPECT_TRUE(same_bits(got, want)) << what << ": replica slot " << e - own << (empty ? " (no rows: left as is)" : "");
    }
  };
  check(one.gw13, split.gw13, split.rep_gw13, 2 * F * D, "grad_w13");
  check(one.gw2, split.gw2, split.rep_gw2, D * F, "grad_w2");
  check(one.gb13, split.gb13, split.rep_gb13, 2 * F, "grad_b13");
  check(one.gb2, split.gb2, split.rep_gb2, D, "grad_b2");
}

// ---- host validation (no GPU needed: ctest's test_expert_mlp_biases_validation, label cpu) -------

TEST(ExpertMlpBiasValidation, MissingBiasesAreNamedBeforeAnyLaunch) {
  int32_t* fake = kFakeAddress;
  float* fake_f = reinterpret_cast<float*>(kFakeAddress);
  const GroupedRows rows = fake_grouped_rows();
  const ExpertMlpShape shape = validation_shape();
  ExpertMlpShape biased = shape;
  biased.biased = true;
  EXPECT_EQ(sm90::dgrad_w2_score_partials(biased), sm90::dgrad_w2_score_partials(shape) + 1) << "the bias's piece";
  biased.weights_transposed = true;
  EXPECT_EQ(sm90::dgrad_w2_score_partials(biased), sm90::dgrad_w2_score_partials(shape) + 1) << "transposed";

  sm90::FpropW13Args f13{fake, fake, fake, nullptr};
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_fprop_w13(rows, biased, f13, nullptr); }), "b13_E2F");
  sm90::FpropW2Args f2{fake, fake, nullptr, fake};
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_fprop_w2(rows, biased, f2, nullptr); }), "b2_ED");

  GroupedRows with_replicas = rows;  // experts 2, 3: replica slots
  with_replicas.first_replica = 2;
  f13.b13_E2F = fake;
  f13.replica_w13_E2FD = fake;
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_fprop_w13(with_replicas, biased, f13, nullptr); }),
            "replica_b13_E2F");
  f2.b2_ED = fake;
  f2.replica_w2_EDF = fake;
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_fprop_w2(with_replicas, biased, f2, nullptr); }), "replica_b2_ED");

  sm90::BiasGradArgs bg;
  bg.grad_y_RD = bg.grad_h13_R2F = fake;
  bg.grad_score_partials_RP = fake_f;  // the bias's score piece needs b2
  bg.grad_b13 = {fake};
  bg.grad_b2 = {fake};
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_bias_grads(rows, biased, bg, nullptr); }), "b2_ED");
  bg.b2_ED = fake;
  bg.grad_b13 = {};
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_bias_grads(rows, biased, bg, nullptr); }), "grad_b13.grad_w");
  bg.grad_b13 = {fake};
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_bias_grads(rows, shape, bg, nullptr); }), "shape.biased");
}

}  // namespace
}  // namespace poise::test
