// The SM90 FP8 block-scaled expert GEMMs (gemm/sm90/expert_mlp_fp8.hpp, docs/fp8.md): FPROP W13
// (blocked layout, swiglu and clamped swiglu), FPROP W2 (scores, row scatter), DGRAD W2 + SwiGLU
// backward and DGRAD W13 (row scatter) against float64 on the DEQUANTIZED operands (from_e4m3(q) *
// scale, exact in double), so what is left is fp32 summation order and the bf16 outputs: every
// element within kElementTolerance of (|want| + its row's rms), and within kRelL2 in relative L2
// overall. DGRAD reads the weights' transposed FP8 copy, built here as the normal orientation's
// blocks transposed (values and scales); the float64 model reads the normal orientation.
//
// Fresh random inputs every run (seed printed in the trace; POISE_TEST_SEED replays), never zeros,
// every 1 x 128 row tile and 128 x 128 weight block scaled by its own power of two, so a scale read
// from the wrong tile or block is far off. Outputs are poisoned (NaN) before every run; rows no expert
// owns are NaN in every input (their FP8 values and scales NaN too) and must keep their poison in
// every output. Also: h13 split by rows (written by FPROP W13, read by DGRAD W2), the pipeline's
// chain with the device's quantization (quant::launch_row_tiles, poise::quantize_fp8_weight_blocks),
// replica experts' weights from other buffers (bitwise the one-buffer run, FPROP and DGRAD), and the
// host validation (label cpu: no GPU needed).

#include <cuda_bf16.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>

#include "expert_mlp_checks.hpp"
#include "gemm/sm90/expert_mlp_fp8.hpp"
#include "gpu_test_support.hpp"
#include "numerics/block_scaling.hpp"
#include "poise/fp8.hpp"
#include "quant/row_tiles.hpp"
#include "testing/rejected_name.hpp"

namespace poise::test {
namespace {

using numerics::BlockScaled;
using numerics::kScaleBlock;
using numerics::scale_blocks;
using poise::testing::rejected_name;

constexpr double kRelL2 = 1e-2;             // ||got - want|| / ||want|| over the valid rows
constexpr double kElementTolerance = 2e-2;  // |got - want| <= tol * (|want| + rms of want's row)

// One seed per run, mixed into every case's own; printed once (and in every failure's trace).
uint64_t run_seed() {
  static const uint64_t seed = [] {
    const uint64_t s = testing::fresh_seed();
    std::fprintf(stderr, "test_expert_mlp_fp8: POISE_TEST_SEED=%llu\n", static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

struct Fp8Case {
  std::string name;
  std::vector<int32_t> counts;  // empty: random_experts experts with counts in [0, max_count], drawn per run
  int64_t D, F;
  uint64_t seed;
  int random_experts = 0;
  int max_count = 0;
};

void PrintTo(const Fp8Case& c, std::ostream* os) { *os << c.name; }

uint64_t case_seed(const Fp8Case& c) { return c.seed * 1000003u + run_seed(); }

std::vector<int32_t> case_counts(const Fp8Case& c) {
  if (!c.counts.empty()) return c.counts;
  std::mt19937_64 gen(case_seed(c) ^ 0x5eed);
  std::uniform_int_distribution<int32_t> count(0, c.max_count);
  std::vector<int32_t> counts(c.random_experts);
  for (int32_t& n : counts) n = count(gen);
  return counts;
}

std::vector<uint16_t> poisoned16(int64_t n) { return std::vector<uint16_t>(n, kBf16Poison); }

// The kernel tests' Fixture (blocked W13, dynamic tile order, fault word) with the case's seed and
// counts; set_activation picks swiglu or clamped swiglu (limit 1.5: the clamps bite).
struct Fp8Fixture : Fixture {
  Fp8Case fc;
  uint64_t seed;
  explicit Fp8Fixture(const Fp8Case& c)
      : Fixture(Case{"fp8", case_counts(c), c.D, c.F, W13Layout::gate_up_blocked, false, c.seed}), fc(c),
        seed(case_seed(c)) {}
  void set_activation(bool clamped) {
    act.clamped = clamped;
    act.limit = clamped ? 1.5 : 7.0;
    shape.activation = clamped ? Activation::swiglu_clamped : Activation::swiglu;
    shape.swiglu_limit = static_cast<float>(act.limit);
  }
  std::string trace() const {
    std::ostringstream s;
    s << fc.name << " D=" << cs.D << " F=" << cs.F << " R=" << l.rows << " counts [";
    for (size_t e = 0; e < l.counts.size(); ++e) s << (e ? " " : "") << l.counts[e];
    s << "] seed " << seed << " (POISE_TEST_SEED=" << run_seed() << ")";
    return s.str();
  }
};

// ---- FP8 operands ----------------------------------------------------------------------------------

// Random bf16 [rows][cols] ~ N(0, stddev), every (block_rows x 128) block scaled by its own power of
// two in [2^-spread, 2^spread] (exact), never zero: a zero draw becomes stddev / 64.
std::vector<uint16_t> blocky_bf16(Rng& rng, int64_t rows, int64_t cols, float stddev, int spread, int64_t block_rows) {
  const int64_t col_blocks = scale_blocks(cols), row_blocks = (rows + block_rows - 1) / block_rows;
  std::uniform_int_distribution<int> exponent(-spread, spread);
  std::vector<float> factor(row_blocks * col_blocks);
  for (float& f : factor) f = std::ldexp(1.0f, exponent(rng.gen));
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<uint16_t> v(rows * cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float x = normal(rng.gen);
      if (to_bf16(x) == 0 || to_bf16(x) == 0x8000) x = stddev / 64;
      v[r * cols + c] = to_bf16(x * factor[(r / block_rows) * col_blocks + c / kScaleBlock]);
    }
  return v;
}

std::vector<float> to_float(const std::vector<uint16_t>& bf16) {
  std::vector<float> f(bf16.size());
  for (size_t i = 0; i < f.size(); ++i) f[i] = from_bf16(bf16[i]);
  return f;
}

// An FP8 operand: the host's bits (numerics, which the device's quantization equals), the float64
// value of every element (e4m3 * scale, exact in double), and the bits on the device.
struct Fp8Operand {
  BlockScaled q;
  std::vector<double> deq;
  DeviceBuffer<uint8_t> values;
  DeviceBuffer<float> scales;
  Fp8Operand(BlockScaled bits, std::vector<double> d)
      : q(std::move(bits)), deq(std::move(d)), values(q.values), scales(q.scales) {}
  sm90::Fp8Rows rows() const { return {values.ptr, scales.ptr}; }
  sm90::Fp8Weights weights() const { return {values.ptr, scales.ptr}; }
};

double dequantized(uint8_t q, float scale) { return double(numerics::from_e4m3(q)) * double(scale); }

// Rows [rows][cols] in 1 x 128 tiles (numerics::quantize_row_tiles); a NaN row (padding) stays NaN.
Fp8Operand row_tiles(const std::vector<uint16_t>& x, int64_t rows, int64_t cols) {
  const auto f = to_float(x);
  BlockScaled q = numerics::quantize_row_tiles(f.data(), rows, cols);
  const int64_t tiles = scale_blocks(cols);
  std::vector<double> deq(rows * cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) deq[r * cols + c] = dequantized(q.values[r * cols + c], q.scales[r * tiles + c / kScaleBlock]);
  return Fp8Operand(std::move(q), std::move(deq));
}

// Weights [E][N][K] in 128 x 128 blocks of each expert's matrix (numerics::quantize_weight_blocks).
Fp8Operand weight_blocks(const std::vector<uint16_t>& w, int64_t E, int64_t N, int64_t K) {
  const auto f = to_float(w);
  BlockScaled q = numerics::quantize_weight_blocks(f.data(), E, N, K);
  const int64_t nb = scale_blocks(N), kb = scale_blocks(K);
  std::vector<double> deq(E * N * K);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t i = (e * N + n) * K + k;
        deq[i] = dequantized(q.values[i], q.scales[(e * nb + n / kScaleBlock) * kb + k / kScaleBlock]);
      }
  return Fp8Operand(std::move(q), std::move(deq));
}

// The DGRAD copy of FP8 weights [E][N][K]: each expert's matrix transposed, values [E][K][N] and
// scales [E][blocks(K)][blocks(N)] (a 128 x 128 block's scale serves both orientations), the float64
// values transposed along.
Fp8Operand transposed_weights(const Fp8Operand& w, int64_t E, int64_t N, int64_t K) {
  const int64_t nb = scale_blocks(N), kb = scale_blocks(K);
  BlockScaled t{std::vector<uint8_t>(E * N * K), std::vector<float>(E * nb * kb)};
  std::vector<double> deq(E * N * K);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        t.values[(e * K + k) * N + n] = w.q.values[(e * N + n) * K + k];
        deq[(e * K + k) * N + n] = w.deq[(e * N + n) * K + k];
      }
    for (int64_t i = 0; i < nb; ++i)
      for (int64_t j = 0; j < kb; ++j) t.scales[(e * kb + j) * nb + i] = w.q.scales[(e * nb + i) * kb + j];
  }
  return Fp8Operand(std::move(t), std::move(deq));
}

// One expert range [first, end) of FP8 weights on the device (replica slots).
struct Fp8WeightSlice {
  DeviceBuffer<uint8_t> values;
  DeviceBuffer<float> scales;
  Fp8WeightSlice(const Fp8Operand& w, int64_t N, int64_t K, int64_t first, int64_t end)
      : values(slice_experts(w.q.values, N * K, first, end)),
        scales(slice_experts(w.q.scales, scale_blocks(N) * scale_blocks(K), first, end)) {}
  sm90::Fp8Weights weights() const { return {values.ptr, scales.ptr}; }
};

// x [R][D] (padding rows NaN), W13 ~ 0.5 / sqrt(D) and W2 ~ 1 / sqrt(F), block by block scaled.
std::vector<uint16_t> random_rows_fp8(Rng& rng, const RowLayout& l, int64_t cols) {
  auto v = blocky_bf16(rng, l.rows, cols, 1.0f, 3, 1);
  poison_padding_rows(v, l, cols);
  return v;
}
std::vector<uint16_t> random_w13(Rng& rng, const Fp8Fixture& fx) {
  return blocky_bf16(rng, fx.E() * 2 * fx.cs.F, fx.cs.D, 0.5f / std::sqrt(float(fx.cs.D)), 2, kScaleBlock);
}
std::vector<uint16_t> random_w2(Rng& rng, const Fp8Fixture& fx) {
  return blocky_bf16(rng, fx.E() * fx.cs.D, fx.cs.F, 1.0f / std::sqrt(float(fx.cs.F)), 2, kScaleBlock);
}

// ---- the float64 model -----------------------------------------------------------------------------

std::vector<double> model_h13(const Fp8Fixture& fx, const Fp8Operand& x, const Fp8Operand& w13) {
  return ref_rows_gemm(fx.l, x.deq, fx.cs.D, w13.deq, 2 * fx.cs.F, true);
}

std::vector<double> model_act(const Fp8Fixture& fx, const std::vector<double>& h) {
  const int64_t F = fx.cs.F;
  std::vector<double> a(fx.l.rows * F, 0.0);
  for_each_row(fx.l, [&](int64_t, int64_t r) {
    for (int64_t f = 0; f < F; ++f)
      a[r * F + f] = act_forward(h[r * 2 * F + gate_col(f, F, W13Layout::gate_up_blocked)],
                                 h[r * 2 * F + up_col(f, F, W13Layout::gate_up_blocked)], fx.act);
  });
  return a;
}

std::vector<double> model_y(const Fp8Fixture& fx, const Fp8Operand& a, const Fp8Operand& w2, const float* scores) {
  const int64_t D = fx.cs.D;
  auto y = ref_rows_gemm(fx.l, a.deq, fx.cs.F, w2.deq, D, true);
  if (scores)
    for_each_row(fx.l, [&](int64_t, int64_t r) {
      for (int64_t d = 0; d < D; ++d) y[r * D + d] *= scores[r];
    });
  return y;
}

// grad_a0 = grad_y . W2[e] (before the score): W2 [E][D][F] read as [K][N].
std::vector<double> model_grad_a0(const Fp8Fixture& fx, const Fp8Operand& grad_y, const Fp8Operand& w2) {
  return ref_rows_gemm(fx.l, grad_y.deq, fx.cs.D, w2.deq, fx.cs.F, false);
}

// grad_x = grad_h13 . W13[e]: W13 [E][2F][D] read as [K][N].
std::vector<double> model_grad_x(const Fp8Fixture& fx, const Fp8Operand& grad_h13, const Fp8Operand& w13) {
  return ref_rows_gemm(fx.l, grad_h13.deq, 2 * fx.cs.F, w13.deq, fx.cs.D, false);
}

// h13 as DGRAD W2 reads it (saved bf16 [R][2F], ~ N(0, 2): the clamps at 1.5 bite; not an FP8
// operand, so plain normal draws), padding rows NaN.
std::vector<uint16_t> random_h13(Rng& rng, const Fp8Fixture& fx) { return random_rows(rng, fx.l, 2 * fx.cs.F, 2.0f); }

// ---- comparison ------------------------------------------------------------------------------------

// A bf16 [R][C] grouped-rows output against float64: relative L2, every element against its row's
// scale, non-finite values, and the poison of rows no expert owns (all as expect_close counts them).
void expect_fp8_close(const std::vector<uint16_t>& out, const std::vector<double>& ref, const RowLayout& l, int64_t C,
                      const std::string& what) {
  const Comparison c = compare_rows_bf16(out, ref, l, C);
  expect_close(c, kRelL2, what.c_str());
  int64_t outliers = 0;
  double worst = 0.0;
  std::string worst_at;
  for_each_row(l, [&](int64_t e, int64_t r) {
    double ss = 0;
    for (int64_t j = 0; j < C; ++j) ss += ref[r * C + j] * ref[r * C + j];
    const double rms = std::sqrt(ss / double(C));
    for (int64_t j = 0; j < C; ++j) {
      const double got = from_bf16(out[r * C + j]), want = ref[r * C + j];
      if (!std::isfinite(got)) continue;  // counted by expect_close
      const double bound = kElementTolerance * (std::abs(want) + rms);
      const double err = std::abs(got - want);
      if (err > bound) ++outliers;
      if (bound > 0 && err / bound > worst) {
        worst = err / bound;
        worst_at = "row " + std::to_string(r) + " (expert " + std::to_string(e) + ") col " + std::to_string(j) +
                   ": got " + std::to_string(got) + " want " + std::to_string(want) + " row rms " + std::to_string(rms);
      }
    }
  });
  EXPECT_EQ(outliers, 0) << what << ": elements beyond " << kElementTolerance
                         << " * (|want| + row rms); worst (err / bound " << worst << ") at " << worst_at;
}

// The routing score's gradient from DGRAD W2's partials [R][P], summed in piece order: every valid
// row within kElementTolerance of (|want| + the L2 norm of its sum's terms), kRelL2 overall; the
// partials of rows no expert owns keep their poison (never written).
void expect_score_grad_close(const std::vector<float>& partials_RP, int64_t P, const DgradW2Ref& ref,
                             const RowLayout& l, const std::string& what) {
  const auto gs = sum_score_partials(partials_RP, P);
  ErrorAccumulator acc;
  int64_t outliers = 0, poison_lost = 0;
  double worst = 0.0;
  std::string worst_at;
  for (int64_t r = 0; r < l.rows; ++r) {
    if (!l.is_row_valid(r)) {
      for (int64_t p = 0; p < P; ++p) poison_lost += std::memcmp(&partials_RP[r * P + p], &kFp32PoisonBits, 4) != 0;
      continue;
    }
    const double got = gs[r], want = ref.grad_scores[r];
    acc.add(got, want);
    if (!std::isfinite(got)) continue;  // counted by expect_close
    const double bound = kElementTolerance * (std::abs(want) + ref.grad_score_terms[r]);
    const double err = std::abs(got - want);
    if (err > bound) ++outliers;
    if (bound > 0 && err / bound > worst) {
      worst = err / bound;
      worst_at = "row " + std::to_string(r) + ": got " + std::to_string(got) + " want " + std::to_string(want) +
                 " terms' norm " + std::to_string(ref.grad_score_terms[r]);
    }
  }
  Comparison c = acc.finish();
  c.poison_lost = poison_lost;
  expect_close(c, kRelL2, what.c_str());
  EXPECT_EQ(outliers, 0) << what << ": rows beyond " << kElementTolerance
                         << " * (|want| + norm of the terms); worst (err / bound " << worst << ") at " << worst_at;
}

// The clamped cases must reach the clamps (else they test plain SwiGLU twice).
void expect_clamps_bite(const Fp8Fixture& fx, const std::vector<double>& h13) {
  if (!fx.act.clamped) return;
  const int64_t F = fx.cs.F;
  int64_t gates = 0, ups = 0, rows = 0;
  for_each_row(fx.l, [&](int64_t, int64_t r) {
    ++rows;
    for (int64_t f = 0; f < F; ++f) {
      gates += h13[r * 2 * F + f] > fx.act.limit;
      ups += std::abs(h13[r * 2 * F + F + f]) > fx.act.limit;
    }
  });
  if (rows < 16) return;
  EXPECT_GT(gates, 0) << "no gate above the limit";
  EXPECT_GT(ups, 0) << "no up outside [-limit, limit]";
}

// ---- the GEMMs one at a time -----------------------------------------------------------------------

class ExpertMlpFp8 : public ::testing::TestWithParam<Fp8Case> {
 protected:
  void SetUp() override {
    if (!have_sm90()) GTEST_SKIP() << "needs an SM90 GPU";
  }
};

TEST_P(ExpertMlpFp8, FpropW13MatchesFloat64OnDequantizedOperands) {
  Fp8Fixture fx(GetParam());
  SCOPED_TRACE(fx.trace());
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F, E = fx.E();
  Rng rng(fx.seed);
  const Fp8Operand x = row_tiles(random_rows_fp8(rng, fx.l, D), R, D);
  const Fp8Operand w13 = weight_blocks(random_w13(rng, fx), E, 2 * F, D);
  const auto h = model_h13(fx, x, w13);
  for (bool clamped : {false, true}) {
    fx.set_activation(clamped);
    SCOPED_TRACE(clamped ? "swiglu_clamped (limit 1.5)" : "swiglu");
    DeviceBuffer<uint16_t> da(poisoned16(R * F)), dh(poisoned16(R * 2 * F));
    sm90::FpropW13Fp8Args args;
    args.x = x.rows();
    args.w13 = w13.weights();
    args.a_RF = da.ptr;
    args.h13_R2F = dh.ptr;
    sm90::expert_mlp_fprop_w13_fp8(fx.rows, fx.shape, args, nullptr);
    cuda_ok(cudaDeviceSynchronize(), "fprop_w13_fp8");
    EXPECT_FALSE(fx.take_fault().occurred) << "device fault";
    expect_clamps_bite(fx, h);
    expect_fp8_close(dh.download(), h, fx.l, 2 * F, "h13_R2F");
    expect_fp8_close(da.download(), model_act(fx, h), fx.l, F, "a_RF");
  }
  // Without h13 (inference): a alone.
  DeviceBuffer<uint16_t> da(poisoned16(R * F));
  sm90::FpropW13Fp8Args args;
  args.x = x.rows();
  args.w13 = w13.weights();
  args.a_RF = da.ptr;
  sm90::expert_mlp_fprop_w13_fp8(fx.rows, fx.shape, args, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "fprop_w13_fp8 (no h13)");
  expect_fp8_close(da.download(), model_act(fx, h), fx.l, F, "a_RF (h13_R2F null)");
}

// h13 split by rows (H13Split): rows [0, split_row) in h13_R2F, the others in hi_R2F (same row
// index); neither buffer is written outside its rows.
TEST_P(ExpertMlpFp8, FpropW13SplitsH13ByRows) {
  Fp8Fixture fx(GetParam());
  SCOPED_TRACE(fx.trace());
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F, E = fx.E();
  const int64_t split = R / 2 / 128 * 128;
  SCOPED_TRACE("split_row " + std::to_string(split));
  Rng rng(fx.seed + 1);
  const Fp8Operand x = row_tiles(random_rows_fp8(rng, fx.l, D), R, D);
  const Fp8Operand w13 = weight_blocks(random_w13(rng, fx), E, 2 * F, D);
  DeviceBuffer<uint16_t> da(poisoned16(R * F)), lo(poisoned16(R * 2 * F)), hi(poisoned16(R * 2 * F));
  sm90::FpropW13Fp8Args args;
  args.x = x.rows();
  args.w13 = w13.weights();
  args.a_RF = da.ptr;
  args.h13_R2F = lo.ptr;
  args.h13_split = {split, hi.ptr};
  sm90::expert_mlp_fprop_w13_fp8(fx.rows, fx.shape, args, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "fprop_w13_fp8 (split h13)");
  EXPECT_FALSE(fx.take_fault().occurred) << "device fault";

  const auto h = model_h13(fx, x, w13);
  const auto got_lo = lo.download(), got_hi = hi.download();
  std::vector<uint16_t> joined(got_lo);
  int64_t stray = 0;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < 2 * F; ++j) {
      const int64_t i = r * 2 * F + j;
      if (r >= split) joined[i] = got_hi[i];
      stray += (r < split ? got_hi[i] : got_lo[i]) != kBf16Poison;
    }
  EXPECT_EQ(stray, 0) << "elements written into the other buffer's rows";
  expect_fp8_close(joined, h, fx.l, 2 * F, "h13 (split)");
  expect_fp8_close(da.download(), model_act(fx, h), fx.l, F, "a_RF");
}

TEST_P(ExpertMlpFp8, FpropW2MatchesFloat64OnDequantizedOperands) {
  Fp8Fixture fx(GetParam());
  SCOPED_TRACE(fx.trace());
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F, E = fx.E();
  Rng rng(fx.seed + 2);
  const Fp8Operand a = row_tiles(random_rows_fp8(rng, fx.l, F), R, F);
  const Fp8Operand w2 = weight_blocks(random_w2(rng, fx), E, D, F);
  const auto scores = rng.uniform(R, 0.1f, 1.0f);
  DeviceBuffer<float> ds(scores);
  for (const float* scores_R : {static_cast<const float*>(nullptr), static_cast<const float*>(ds.ptr)}) {
    SCOPED_TRACE(scores_R ? "scores_R" : "no scores");
    DeviceBuffer<uint16_t> dy(poisoned16(R * D));
    sm90::FpropW2Fp8Args args;
    args.a = a.rows();
    args.w2 = w2.weights();
    args.scores_R = scores_R;
    args.y_RD = dy.ptr;
    sm90::expert_mlp_fprop_w2_fp8(fx.rows, fx.shape, args, nullptr);
    cuda_ok(cudaDeviceSynchronize(), "fprop_w2_fp8");
    EXPECT_FALSE(fx.take_fault().occurred) << "device fault";
    expect_fp8_close(dy.download(), model_y(fx, a, w2, scores_R ? scores.data() : nullptr), fx.l, D, "y_RD");
  }
}

// Rows scattered to slots (RowScatter, the EP combine without its copy pass), checked as the BF16
// GEMMs' (expert_mlp_checks.hpp check_row_scatter): every valid row's bytes land in its slot, bit
// for bit the grouped row; slots no row names and the guard keep their poison.
TEST_P(ExpertMlpFp8, FpropW2RowScatterEqualsGroupedRowsBitwise) {
  Fp8Fixture fx(GetParam());
  SCOPED_TRACE(fx.trace());
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F, E = fx.E();
  Rng rng(fx.seed + 3);
  const Fp8Operand a = row_tiles(random_rows_fp8(rng, fx.l, F), R, F);
  const Fp8Operand w2 = weight_blocks(random_w2(rng, fx), E, D, F);
  DeviceBuffer<float> ds(rng.uniform(R, 0.1f, 1.0f));
  DeviceBuffer<uint16_t> dy(poisoned16(R * D));
  sm90::FpropW2Fp8Args args;
  args.a = a.rows();
  args.w2 = w2.weights();
  args.scores_R = ds.ptr;
  args.y_RD = dy.ptr;
  sm90::expert_mlp_fprop_w2_fp8(fx.rows, fx.shape, args, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "fprop_w2_fp8 grouped");
  check_row_scatter(fx.l, D, fx.seed + 4, dy.download(), [&](const sm90::RowScatter& scatter) {
    args.y_RD = nullptr;
    args.scatter = scatter;
    sm90::expert_mlp_fprop_w2_fp8(fx.rows, fx.shape, args, nullptr);
    cuda_ok(cudaDeviceSynchronize(), "fprop_w2_fp8 scattered");
    EXPECT_FALSE(fx.take_fault().occurred) << "device fault";
  }, "fprop_w2_fp8 scattered");
}

// The forward as the pipeline chains it, every quantization on the device: x rows by
// quant::launch_row_tiles (all R rows: padding rows NaN), weights by poise::quantize_fp8_weight_blocks
// from bf16, FPROP W13, a_RF by launch_row_tiles, FPROP W2 with scores. The float64 model quantizes
// the same bf16 on the host (the same bits, test_fp8_quant_gpu) and reads W2's input from the a_RF
// the kernel wrote (so a's bf16 rounding is not counted twice).
TEST_P(ExpertMlpFp8, ForwardChainWithDeviceQuantization) {
  Fp8Fixture fx(GetParam());
  SCOPED_TRACE(fx.trace());
  fx.set_activation(fx.seed % 2 == 1);
  SCOPED_TRACE(fx.act.clamped ? "swiglu_clamped" : "swiglu");
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F, E = fx.E();
  Rng rng(fx.seed + 4);
  const auto x = random_rows_fp8(rng, fx.l, D), w13 = random_w13(rng, fx), w2 = random_w2(rng, fx);
  const auto scores = rng.uniform(R, 0.1f, 1.0f);
  DeviceBuffer<uint16_t> dx(x), dw13(w13), dw2(w2), da(poisoned16(R * F)), dh(poisoned16(R * 2 * F)),
      dy(poisoned16(R * D));
  DeviceBuffer<float> ds(scores);
  DeviceBuffer<uint8_t> xq(R * D), w13q(E * 2 * F * D), aq(R * F), w2q(E * D * F);
  DeviceBuffer<float> xs(R * scale_blocks(D)), w13s(E * scale_blocks(2 * F) * scale_blocks(D)), as(R * scale_blocks(F)),
      w2s(E * scale_blocks(D) * scale_blocks(F));
  poise::quantize_fp8_weight_blocks(dw13.ptr, E, 2 * F, D, w13q.ptr, w13s.ptr, nullptr);
  poise::quantize_fp8_weight_blocks(dw2.ptr, E, D, F, w2q.ptr, w2s.ptr, nullptr);
  quant::launch_row_tiles(reinterpret_cast<const __nv_bfloat16*>(dx.ptr), R, D, xq.ptr, xs.ptr, nullptr);
  sm90::FpropW13Fp8Args f13;
  f13.x = {xq.ptr, xs.ptr};
  f13.w13 = {w13q.ptr, w13s.ptr};
  f13.a_RF = da.ptr;
  f13.h13_R2F = dh.ptr;
  sm90::expert_mlp_fprop_w13_fp8(fx.rows, fx.shape, f13, nullptr);
  quant::launch_row_tiles(reinterpret_cast<const __nv_bfloat16*>(da.ptr), R, F, aq.ptr, as.ptr, nullptr);
  sm90::FpropW2Fp8Args f2;
  f2.a = {aq.ptr, as.ptr};
  f2.w2 = {w2q.ptr, w2s.ptr};
  f2.scores_R = ds.ptr;
  f2.y_RD = dy.ptr;
  sm90::expert_mlp_fprop_w2_fp8(fx.rows, fx.shape, f2, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "forward chain");
  EXPECT_FALSE(fx.take_fault().occurred) << "device fault";

  const Fp8Operand hx = row_tiles(x, R, D), hw13 = weight_blocks(w13, E, 2 * F, D), hw2 = weight_blocks(w2, E, D, F);
  const auto h = model_h13(fx, hx, hw13);
  const auto got_a = da.download();
  expect_fp8_close(dh.download(), h, fx.l, 2 * F, "h13_R2F");
  expect_fp8_close(got_a, model_act(fx, h), fx.l, F, "a_RF");
  const Fp8Operand ha = row_tiles(got_a, R, F);
  expect_fp8_close(dy.download(), model_y(fx, ha, hw2, scores.data()), fx.l, D, "y_RD");
}

// DGRAD W2's outputs, poisoned: grad_h13 and a_RF bf16 (NaN), the score partials fp32 (NaN).
struct DgradW2Outputs {
  DeviceBuffer<uint16_t> grad_h13, a;
  DeviceBuffer<float> partials;
  DgradW2Outputs(int64_t R, int64_t F, int64_t P)
      : grad_h13(poisoned16(R * 2 * F)), a(poisoned16(R * F)), partials(std::vector<float>(R * P, fp32_poison())) {}
};

// DGRAD W2 + SwiGLU backward, swiglu and clamped swiglu, with and without scores (score 1): grad_a =
// score * (grad_y . W2[e]) from grad_y's row tiles and W2's transposed blocks, then as the BF16 GEMM
// (ref_dgrad_w2 on the saved bf16 h13): grad_h13, a_RF = score * act(h13) and the score's gradient
// (its partials summed). Then h13 read from two buffers split by rows: every output bit for bit the
// one-buffer run.
TEST_P(ExpertMlpFp8, DgradW2MatchesFloat64OnDequantizedOperands) {
  Fp8Fixture fx(GetParam());
  SCOPED_TRACE(fx.trace());
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F, E = fx.E();
  const int64_t P = sm90::dgrad_w2_score_partials(fx.shape);
  Rng rng(fx.seed + 5);
  const Fp8Operand gy = row_tiles(random_rows_fp8(rng, fx.l, D), R, D);
  const Fp8Operand w2 = weight_blocks(random_w2(rng, fx), E, D, F);
  const Fp8Operand w2_t = transposed_weights(w2, E, D, F);
  const auto h13 = random_h13(rng, fx);
  const auto scores = rng.uniform(R, 0.1f, 1.0f);
  DeviceBuffer<uint16_t> dh(h13);
  DeviceBuffer<float> ds(scores);
  const auto grad_a0 = model_grad_a0(fx, gy, w2);

  auto run = [&](const float* scores_R, const void* h13_R2F, const sm90::H13Split& split, DgradW2Outputs& o,
                 const char* what) {
    sm90::DgradW2Fp8Args args;
    args.grad_y = gy.rows();
    args.w2_t = w2_t.weights();
    args.h13_R2F = h13_R2F;
    args.scores_R = scores_R;
    args.grad_h13_R2F = o.grad_h13.ptr;
    args.a_RF = o.a.ptr;
    args.grad_score_partials_RP = o.partials.ptr;
    args.h13_split = split;
    sm90::expert_mlp_dgrad_w2_fp8(fx.rows, fx.shape, args, nullptr);
    cuda_ok(cudaDeviceSynchronize(), what);
    EXPECT_FALSE(fx.take_fault().occurred) << "device fault";
  };
  for (bool clamped : {false, true}) {
    fx.set_activation(clamped);
    SCOPED_TRACE(clamped ? "swiglu_clamped (limit 1.5)" : "swiglu");
    expect_clamps_bite(fx, to_double(h13));
    for (const float* scores_R : {static_cast<const float*>(nullptr), static_cast<const float*>(ds.ptr)}) {
      SCOPED_TRACE(scores_R ? "scores_R" : "no scores");
      DgradW2Outputs o(R, F, P);
      run(scores_R, dh.ptr, {}, o, "dgrad_w2_fp8");
      const DgradW2Ref ref = ref_dgrad_w2(fx.l, grad_a0, h13, scores_R ? scores.data() : nullptr, F,
                                          W13Layout::gate_up_blocked, fx.act);
      expect_fp8_close(o.grad_h13.download(), ref.grad_h13, fx.l, 2 * F, "grad_h13_R2F");
      expect_fp8_close(o.a.download(), ref.a, fx.l, F, "a_RF (score * act(h13))");
      expect_score_grad_close(o.partials.download(), P, ref, fx.l, "grad_score_partials_RP (summed)");
    }
  }

  // h13 split by rows (H13Split): rows [0, split_row) read from h13_R2F, the others from hi_R2F, each
  // NaN in the other's rows (a row read from the wrong buffer turns NaN).
  const int64_t split = R / 2 / 128 * 128;
  SCOPED_TRACE("h13 split_row " + std::to_string(split));
  std::vector<uint16_t> lo(h13), hi(h13);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < 2 * F; ++j) (r < split ? hi : lo)[r * 2 * F + j] = kBf16Poison;
  DeviceBuffer<uint16_t> dlo(lo), dhi(hi);
  DgradW2Outputs one(R, F, P), two(R, F, P);
  run(ds.ptr, dh.ptr, {}, one, "dgrad_w2_fp8 (one h13 buffer)");
  run(ds.ptr, dlo.ptr, {split, dhi.ptr}, two, "dgrad_w2_fp8 (split h13)");
  EXPECT_TRUE(same_bits(one.grad_h13.download(), two.grad_h13.download())) << "grad_h13_R2F differs with h13 split";
  EXPECT_TRUE(same_bits(one.a.download(), two.a.download())) << "a_RF differs with h13 split";
  EXPECT_TRUE(same_bits(one.partials.download(), two.partials.download())) << "score partials differ with h13 split";
}

TEST_P(ExpertMlpFp8, DgradW13MatchesFloat64OnDequantizedOperands) {
  Fp8Fixture fx(GetParam());
  SCOPED_TRACE(fx.trace());
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F, E = fx.E();
  Rng rng(fx.seed + 6);
  const Fp8Operand gh = row_tiles(random_rows_fp8(rng, fx.l, 2 * F), R, 2 * F);  // tiles along 2F, W13's row order
  const Fp8Operand w13 = weight_blocks(random_w13(rng, fx), E, 2 * F, D);
  const Fp8Operand w13_t = transposed_weights(w13, E, 2 * F, D);
  DeviceBuffer<uint16_t> dgx(poisoned16(R * D));
  sm90::DgradW13Fp8Args args;
  args.grad_h13 = gh.rows();
  args.w13_t = w13_t.weights();
  args.grad_x_RD = dgx.ptr;
  sm90::expert_mlp_dgrad_w13_fp8(fx.rows, fx.shape, args, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "dgrad_w13_fp8");
  EXPECT_FALSE(fx.take_fault().occurred) << "device fault";
  expect_fp8_close(dgx.download(), model_grad_x(fx, gh, w13), fx.l, D, "grad_x_RD");
}

// DGRAD W13's rows scattered to slots, checked as FPROP W2's (check_row_scatter).
TEST_P(ExpertMlpFp8, DgradW13RowScatterEqualsGroupedRowsBitwise) {
  Fp8Fixture fx(GetParam());
  SCOPED_TRACE(fx.trace());
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F, E = fx.E();
  Rng rng(fx.seed + 7);
  const Fp8Operand gh = row_tiles(random_rows_fp8(rng, fx.l, 2 * F), R, 2 * F);
  const Fp8Operand w13_t = transposed_weights(weight_blocks(random_w13(rng, fx), E, 2 * F, D), E, 2 * F, D);
  DeviceBuffer<uint16_t> dgx(poisoned16(R * D));
  sm90::DgradW13Fp8Args args;
  args.grad_h13 = gh.rows();
  args.w13_t = w13_t.weights();
  args.grad_x_RD = dgx.ptr;
  sm90::expert_mlp_dgrad_w13_fp8(fx.rows, fx.shape, args, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "dgrad_w13_fp8 grouped");
  EXPECT_FALSE(fx.take_fault().occurred) << "device fault";
  check_row_scatter(fx.l, D, fx.seed + 8, dgx.download(), [&](const sm90::RowScatter& scatter) {
    args.grad_x_RD = nullptr;
    args.scatter = scatter;
    sm90::expert_mlp_dgrad_w13_fp8(fx.rows, fx.shape, args, nullptr);
    cuda_ok(cudaDeviceSynchronize(), "dgrad_w13_fp8 scattered");
    EXPECT_FALSE(fx.take_fault().occurred) << "device fault";
  }, "dgrad_w13_fp8 scattered");
}

// WGRAD's operand: rows [R][C] in 128 x 1 column tiles from each group's first row
// (numerics::quantize_column_tiles), on the device transposed, [C][R], with scales [R / 128][C] by
// padded row block (blocks in no group: 1), as quant::launch_column_tiles_transposed writes them.
struct Fp8ColumnOperand {
  std::vector<double> deq;  // [R][C], 0 outside the groups
  DeviceBuffer<uint8_t> values;
  DeviceBuffer<float> scales;
  sm90::Fp8ColumnTiles tiles() const { return {values.ptr, scales.ptr}; }
};

Fp8ColumnOperand column_tiles(const std::vector<uint16_t>& x, const RowLayout& l, int64_t C) {
  const auto f = to_float(x);
  const std::vector<int64_t> offsets(l.offsets.begin(), l.offsets.end()), counts(l.counts.begin(), l.counts.end());
  const BlockScaled q = numerics::quantize_column_tiles(f.data(), l.rows, C, offsets, counts);
  std::vector<uint8_t> values_CR(l.rows * C);
  std::vector<float> scales_BC(l.rows / kScaleBlock * C, 1.0f);
  std::vector<double> deq(l.rows * C, 0.0);
  int64_t tile = 0;
  for (size_t e = 0; e < counts.size(); ++e)
    for (int64_t t0 = 0; t0 < counts[e]; t0 += kScaleBlock, ++tile) {
      const int64_t block = (offsets[e] + t0) / kScaleBlock;
      for (int64_t c = 0; c < C; ++c) scales_BC[block * C + c] = q.scales[tile * C + c];
      for (int64_t r = offsets[e] + t0; r < offsets[e] + std::min(counts[e], t0 + kScaleBlock); ++r)
        for (int64_t c = 0; c < C; ++c) deq[r * C + c] = dequantized(q.values[r * C + c], q.scales[tile * C + c]);
    }
  for (int64_t r = 0; r < l.rows; ++r)
    for (int64_t c = 0; c < C; ++c) values_CR[c * l.rows + r] = q.values[r * C + c];
  return {std::move(deq), DeviceBuffer<uint8_t>(values_CR), DeviceBuffer<float>(scales_BC)};
}

// grad_w [E][M][N] fp32 against float64 on the dequantized operands: relative L2 and per element
// within kElementTolerance of (|want| + the expert's rms); experts without rows exactly 0.
void expect_wgrad_close(const std::vector<float>& got, const std::vector<double>& want, const RowLayout& l,
                        int64_t M, int64_t N, const std::string& what) {
  expect_close(compare_all(got, want), kRelL2, what.c_str());
  int64_t outliers = 0, nonzero_empty = 0;
  for (size_t e = 0; e < l.counts.size(); ++e) {
    double ss = 0;
    for (int64_t i = 0; i < M * N; ++i) ss += want[e * M * N + i] * want[e * M * N + i];
    const double rms = std::sqrt(ss / double(M * N));
    for (int64_t i = 0; i < M * N; ++i) {
      const double g = got[e * M * N + i], w = want[e * M * N + i];
      if (l.counts[e] == 0) nonzero_empty += g != 0.0;
      else outliers += !(std::abs(g - w) <= kElementTolerance * (std::abs(w) + rms));
    }
  }
  EXPECT_EQ(outliers, 0) << what << ": elements beyond " << kElementTolerance << " * (|want| + expert rms)";
  EXPECT_EQ(nonzero_empty, 0) << what << ": an expert without rows has a nonzero gradient";
}

TEST_P(ExpertMlpFp8, WgradW2MatchesFloat64OnDequantizedOperands) {
  Fp8Fixture fx(GetParam());
  SCOPED_TRACE(fx.trace());
  const int64_t D = fx.cs.D, F = fx.cs.F, E = fx.E();
  Rng rng(fx.seed + 9);
  const Fp8ColumnOperand gy = column_tiles(random_rows_fp8(rng, fx.l, D), fx.l, D);
  const Fp8ColumnOperand a = column_tiles(random_rows_fp8(rng, fx.l, F), fx.l, F);
  DeviceBuffer<float> grad_w(std::vector<float>(E * D * F, std::nanf("")));
  sm90::WgradOutput out;
  out.grad_w = grad_w.ptr;
  sm90::expert_mlp_wgrad_w2_fp8(fx.rows, fx.shape, gy.tiles(), a.tiles(), out, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "wgrad_w2_fp8");
  EXPECT_FALSE(fx.take_fault().occurred) << "device fault";
  expect_wgrad_close(grad_w.download(), ref_wgrad(fx.l, gy.deq, D, a.deq, F), fx.l, D, F, "grad_w2");
}

TEST_P(ExpertMlpFp8, WgradW13MatchesFloat64OnDequantizedOperands) {
  Fp8Fixture fx(GetParam());
  SCOPED_TRACE(fx.trace());
  const int64_t D = fx.cs.D, F = fx.cs.F, E = fx.E();
  Rng rng(fx.seed + 10);
  const Fp8ColumnOperand gh = column_tiles(random_rows_fp8(rng, fx.l, 2 * F), fx.l, 2 * F);
  const Fp8ColumnOperand x = column_tiles(random_rows_fp8(rng, fx.l, D), fx.l, D);
  DeviceBuffer<float> grad_w(std::vector<float>(E * 2 * F * D, std::nanf("")));
  sm90::WgradOutput out;
  out.grad_w = grad_w.ptr;
  sm90::expert_mlp_wgrad_w13_fp8(fx.rows, fx.shape, gh.tiles(), x.tiles(), out, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "wgrad_w13_fp8");
  EXPECT_FALSE(fx.take_fault().occurred) << "device fault";
  expect_wgrad_close(grad_w.download(), ref_wgrad(fx.l, gh.deq, 2 * F, x.deq, D), fx.l, 2 * F, D, "grad_w13");
}

std::vector<Fp8Case> fp8_cases() {
  return {
      {"small_D128_F128_E2", {100, 200}, 128, 128, 1},
      {"dims_64x3_64x5_empty_expert", {130, 0, 300, 1}, 192, 320, 2},  // D, F = 64 x odd; a 0-row and a 1-row expert
      {"tiny_dims_D64_F64", {1, 128, 129}, 64, 64, 3},                 // one half-width K block in each GEMM
      {"one_expert_all_rows", {0, 517, 0}, 256, 192, 4},
      {"E8_random_counts", {}, 384, 256, 5, 8, 250},                   // counts drawn per run (trace)
      {"R1664_many_k_blocks", {600, 0, 513, 129}, 1024, 320, 6},       // 8 K blocks in W13, R = 1664
      {"no_rows_at_all", {0, 0}, 128, 64, 7},
  };
}

INSTANTIATE_TEST_SUITE_P(Shapes, ExpertMlpFp8, ::testing::ValuesIn(fp8_cases()),
                         [](const ::testing::TestParamInfo<Fp8Case>& info) { return info.param.name; });

// ---- replica experts -------------------------------------------------------------------------------

// EP exact balance: experts [first_replica, E) read their FP8 weights from replica_w13 / replica_w2
// (index e - first_replica). Every output equals, bit for bit, the same experts run from one buffer;
// both against float64. first_replica 3 (own expert 1 and replica 3 without rows) and 0 (all replicas).
TEST(ExpertMlpFp8Replicas, SplitWeightsEqualOneBufferBitwise) {
  if (!have_sm90()) GTEST_SKIP() << "needs an SM90 GPU";
  Fp8Fixture fx(Fp8Case{"replicas", {200, 0, 333, 0, 129, 64}, 192, 320, 41});
  SCOPED_TRACE(fx.trace());
  fx.set_activation(true);
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F, E = fx.E();
  Rng rng(fx.seed);
  const Fp8Operand x = row_tiles(random_rows_fp8(rng, fx.l, D), R, D);
  const Fp8Operand a = row_tiles(random_rows_fp8(rng, fx.l, F), R, F);
  const Fp8Operand w13 = weight_blocks(random_w13(rng, fx), E, 2 * F, D);
  const Fp8Operand w2 = weight_blocks(random_w2(rng, fx), E, D, F);
  DeviceBuffer<float> ds(rng.uniform(R, 0.1f, 1.0f));
  const auto scores = ds.download();

  struct Outputs {
    DeviceBuffer<uint16_t> a, h13, y;
  };
  auto run = [&](const GroupedRows& rows, sm90::Fp8Weights w13_own, sm90::Fp8Weights w13_rep, sm90::Fp8Weights w2_own,
                 sm90::Fp8Weights w2_rep, Outputs& o) {
    sm90::FpropW13Fp8Args f13;
    f13.x = x.rows();
    f13.w13 = w13_own;
    f13.replica_w13 = w13_rep;
    f13.a_RF = o.a.ptr;
    f13.h13_R2F = o.h13.ptr;
    sm90::expert_mlp_fprop_w13_fp8(rows, fx.shape, f13, nullptr);
    sm90::FpropW2Fp8Args f2;
    f2.a = a.rows();
    f2.w2 = w2_own;
    f2.replica_w2 = w2_rep;
    f2.scores_R = ds.ptr;
    f2.y_RD = o.y.ptr;
    sm90::expert_mlp_fprop_w2_fp8(rows, fx.shape, f2, nullptr);
    cuda_ok(cudaDeviceSynchronize(), "fp8 forward");
    EXPECT_FALSE(fx.take_fault().occurred) << "device fault";
  };
  Outputs one{DeviceBuffer<uint16_t>(poisoned16(R * F)), DeviceBuffer<uint16_t>(poisoned16(R * 2 * F)),
              DeviceBuffer<uint16_t>(poisoned16(R * D))};
  run(fx.rows, w13.weights(), {}, w2.weights(), {}, one);
  const auto h = model_h13(fx, x, w13);
  expect_fp8_close(one.h13.download(), h, fx.l, 2 * F, "h13_R2F (one buffer)");
  expect_fp8_close(one.a.download(), model_act(fx, h), fx.l, F, "a_RF (one buffer)");
  expect_fp8_close(one.y.download(), model_y(fx, a, w2, scores.data()), fx.l, D, "y_RD (one buffer)");

  for (int64_t own : {int64_t{3}, int64_t{0}}) {
    SCOPED_TRACE("first_replica " + std::to_string(own));
    const Fp8WeightSlice w13_own(w13, 2 * F, D, 0, own), w13_rep(w13, 2 * F, D, own, E), w2_own(w2, D, F, 0, own),
        w2_rep(w2, D, F, own, E);
    GroupedRows rows = fx.rows;
    rows.first_replica = own;
    Outputs split{DeviceBuffer<uint16_t>(poisoned16(R * F)), DeviceBuffer<uint16_t>(poisoned16(R * 2 * F)),
                  DeviceBuffer<uint16_t>(poisoned16(R * D))};
    run(rows, w13_own.weights(), w13_rep.weights(), w2_own.weights(), w2_rep.weights(), split);
    EXPECT_TRUE(same_bits(one.a.download(), split.a.download())) << "a_RF differs between one buffer and split weights";
    EXPECT_TRUE(same_bits(one.h13.download(), split.h13.download())) << "h13_R2F differs";
    EXPECT_TRUE(same_bits(one.y.download(), split.y.download())) << "y_RD differs";
  }
}

// The same for the DGRAD GEMMs on the weights' transposed copies: DGRAD W2 (grad_h13, a_RF, score
// partials) and DGRAD W13 (grad_x), bit for bit the one-buffer run, which matches float64.
TEST(ExpertMlpFp8Replicas, DgradSplitWeightsEqualOneBufferBitwise) {
  if (!have_sm90()) GTEST_SKIP() << "needs an SM90 GPU";
  Fp8Fixture fx(Fp8Case{"dgrad_replicas", {200, 0, 333, 0, 129, 64}, 192, 320, 42});
  SCOPED_TRACE(fx.trace());
  fx.set_activation(true);
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F, E = fx.E();
  const int64_t P = sm90::dgrad_w2_score_partials(fx.shape);
  Rng rng(fx.seed);
  const Fp8Operand gy = row_tiles(random_rows_fp8(rng, fx.l, D), R, D);
  const Fp8Operand gh = row_tiles(random_rows_fp8(rng, fx.l, 2 * F), R, 2 * F);
  const Fp8Operand w2 = weight_blocks(random_w2(rng, fx), E, D, F);
  const Fp8Operand w13 = weight_blocks(random_w13(rng, fx), E, 2 * F, D);
  const Fp8Operand w2_t = transposed_weights(w2, E, D, F), w13_t = transposed_weights(w13, E, 2 * F, D);
  const auto h13 = random_h13(rng, fx);
  const auto scores = rng.uniform(R, 0.1f, 1.0f);
  DeviceBuffer<uint16_t> dh(h13);
  DeviceBuffer<float> ds(scores);

  auto run = [&](const GroupedRows& rows, sm90::Fp8Weights w2_own, sm90::Fp8Weights w2_rep,
                 sm90::Fp8Weights w13_own, sm90::Fp8Weights w13_rep, DgradW2Outputs& o, DeviceBuffer<uint16_t>& gx) {
    sm90::DgradW2Fp8Args d2;
    d2.grad_y = gy.rows();
    d2.w2_t = w2_own;
    d2.replica_w2_t = w2_rep;
    d2.h13_R2F = dh.ptr;
    d2.scores_R = ds.ptr;
    d2.grad_h13_R2F = o.grad_h13.ptr;
    d2.a_RF = o.a.ptr;
    d2.grad_score_partials_RP = o.partials.ptr;
    sm90::expert_mlp_dgrad_w2_fp8(rows, fx.shape, d2, nullptr);
    sm90::DgradW13Fp8Args d13;
    d13.grad_h13 = gh.rows();
    d13.w13_t = w13_own;
    d13.replica_w13_t = w13_rep;
    d13.grad_x_RD = gx.ptr;
    sm90::expert_mlp_dgrad_w13_fp8(rows, fx.shape, d13, nullptr);
    cuda_ok(cudaDeviceSynchronize(), "fp8 dgrad");
    EXPECT_FALSE(fx.take_fault().occurred) << "device fault";
  };
  DgradW2Outputs one(R, F, P);
  DeviceBuffer<uint16_t> one_gx(poisoned16(R * D));
  run(fx.rows, w2_t.weights(), {}, w13_t.weights(), {}, one, one_gx);
  const DgradW2Ref ref =
      ref_dgrad_w2(fx.l, model_grad_a0(fx, gy, w2), h13, scores.data(), F, W13Layout::gate_up_blocked, fx.act);
  expect_fp8_close(one.grad_h13.download(), ref.grad_h13, fx.l, 2 * F, "grad_h13_R2F (one buffer)");
  expect_fp8_close(one.a.download(), ref.a, fx.l, F, "a_RF (one buffer)");
  expect_score_grad_close(one.partials.download(), P, ref, fx.l, "score partials (one buffer)");
  expect_fp8_close(one_gx.download(), model_grad_x(fx, gh, w13), fx.l, D, "grad_x_RD (one buffer)");

  for (int64_t own : {int64_t{3}, int64_t{0}}) {
    SCOPED_TRACE("first_replica " + std::to_string(own));
    // W2^T is [E][F][D], W13^T [E][D][2F].
    const Fp8WeightSlice w2_own(w2_t, F, D, 0, own), w2_rep(w2_t, F, D, own, E), w13_own(w13_t, D, 2 * F, 0, own),
        w13_rep(w13_t, D, 2 * F, own, E);
    GroupedRows rows = fx.rows;
    rows.first_replica = own;
    DgradW2Outputs split(R, F, P);
    DeviceBuffer<uint16_t> split_gx(poisoned16(R * D));
    run(rows, w2_own.weights(), w2_rep.weights(), w13_own.weights(), w13_rep.weights(), split, split_gx);
    EXPECT_TRUE(same_bits(one.grad_h13.download(), split.grad_h13.download()))
        << "grad_h13_R2F differs between one buffer and split weights";
    EXPECT_TRUE(same_bits(one.a.download(), split.a.download())) << "a_RF differs";
    EXPECT_TRUE(same_bits(one.partials.download(), split.partials.download())) << "score partials differ";
    EXPECT_TRUE(same_bits(one_gx.download(), split_gx.download())) << "grad_x_RD differs";
  }
}

// ---- host validation (no GPU needed: ctest's test_expert_mlp_fp8_validation, label cpu) ----------

sm90::FpropW13Fp8Args fake_w13_args() {
  const void* fake = kFakeAddress;
  const float* fake_f = reinterpret_cast<const float*>(kFakeAddress);
  sm90::FpropW13Fp8Args args;
  args.x = {fake, fake_f};
  args.w13 = {fake, fake_f};
  args.a_RF = kFakeAddress;
  return args;
}

sm90::FpropW2Fp8Args fake_w2_args() {
  const void* fake = kFakeAddress;
  const float* fake_f = reinterpret_cast<const float*>(kFakeAddress);
  sm90::FpropW2Fp8Args args;
  args.a = {fake, fake_f};
  args.w2 = {fake, fake_f};
  args.y_RD = kFakeAddress;
  return args;
}

sm90::DgradW2Fp8Args fake_dgrad_w2_args() {
  const void* fake = kFakeAddress;
  const float* fake_f = reinterpret_cast<const float*>(kFakeAddress);
  sm90::DgradW2Fp8Args args;
  args.grad_y = {fake, fake_f};
  args.w2_t = {fake, fake_f};
  args.h13_R2F = fake;
  args.grad_h13_R2F = kFakeAddress;
  return args;
}

sm90::DgradW13Fp8Args fake_dgrad_w13_args() {
  const void* fake = kFakeAddress;
  const float* fake_f = reinterpret_cast<const float*>(kFakeAddress);
  sm90::DgradW13Fp8Args args;
  args.grad_h13 = {fake, fake_f};
  args.w13_t = {fake, fake_f};
  args.grad_x_RD = kFakeAddress;
  return args;
}

// The argument a GEMM call names when `clear` spoils one field of an otherwise valid set.
template <class Args, class Call, class Clear>
std::string rejected_without(Args args, Call call, Clear clear) {
  clear(args);
  return rejected_name([&] { call(fake_grouped_rows(), args); });
}

// With replica slots (experts 2, 3), a call requires their weights too: values, then scales.
template <class Args, class Call>
void expect_replicas_named(Args args, sm90::Fp8Weights Args::*replica, const std::string& name, Call call) {
  GroupedRows with_replicas = fake_grouped_rows();
  with_replicas.first_replica = 2;
  const void* fake = kFakeAddress;
  const float* fake_f = reinterpret_cast<const float*>(kFakeAddress);
  args.*replica = {nullptr, fake_f};
  EXPECT_EQ(rejected_name([&] { call(with_replicas, args); }), name + ".values");
  args.*replica = {fake, nullptr};
  EXPECT_EQ(rejected_name([&] { call(with_replicas, args); }), name + ".scales");
}

TEST(ExpertMlpFp8Validation, NullOperandsAreNamedBeforeAnyLaunch) {
  const ExpertMlpShape shape = validation_shape();
  const auto fprop_w13 = [&](const GroupedRows& rows, const sm90::FpropW13Fp8Args& a) {
    sm90::expert_mlp_fprop_w13_fp8(rows, shape, a, nullptr);
  };
  const auto fprop_w2 = [&](const GroupedRows& rows, const sm90::FpropW2Fp8Args& a) {
    sm90::expert_mlp_fprop_w2_fp8(rows, shape, a, nullptr);
  };
  const auto w13 = fake_w13_args();
  const auto w2 = fake_w2_args();
  EXPECT_EQ(rejected_without(w13, fprop_w13, [](auto& a) { a.x.values_RK = nullptr; }), "x.values_RK");
  EXPECT_EQ(rejected_without(w13, fprop_w13, [](auto& a) { a.x.scales_RKb = nullptr; }), "x.scales_RKb");
  EXPECT_EQ(rejected_without(w13, fprop_w13, [](auto& a) { a.w13.values = nullptr; }), "w13.values");
  EXPECT_EQ(rejected_without(w13, fprop_w13, [](auto& a) { a.w13.scales = nullptr; }), "w13.scales");
  EXPECT_EQ(rejected_without(w13, fprop_w13, [](auto& a) { a.a_RF = nullptr; }), "a_RF");
  EXPECT_EQ(rejected_without(w2, fprop_w2, [](auto& a) { a.a.values_RK = nullptr; }), "a.values_RK");
  EXPECT_EQ(rejected_without(w2, fprop_w2, [](auto& a) { a.a.scales_RKb = nullptr; }), "a.scales_RKb");
  EXPECT_EQ(rejected_without(w2, fprop_w2, [](auto& a) { a.w2.values = nullptr; }), "w2.values");
  EXPECT_EQ(rejected_without(w2, fprop_w2, [](auto& a) { a.w2.scales = nullptr; }), "w2.scales");
  EXPECT_EQ(rejected_without(w2, fprop_w2, [](auto& a) { a.y_RD = nullptr; }), "y_RD");
  expect_replicas_named(w13, &sm90::FpropW13Fp8Args::replica_w13, "replica_w13", fprop_w13);
  expect_replicas_named(w2, &sm90::FpropW2Fp8Args::replica_w2, "replica_w2", fprop_w2);

  // The shape is checked as the BF16 GEMMs check it.
  ExpertMlpShape odd = shape;
  odd.hidden_dim = 96;
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_fprop_w13_fp8(fake_grouped_rows(), odd, w13, nullptr); }),
            "hidden_dim");
}

TEST(ExpertMlpFp8Validation, DgradNullOperandsAreNamedBeforeAnyLaunch) {
  const ExpertMlpShape shape = validation_shape();
  const auto dgrad_w2 = [&](const GroupedRows& rows, const sm90::DgradW2Fp8Args& a) {
    sm90::expert_mlp_dgrad_w2_fp8(rows, shape, a, nullptr);
  };
  const auto dgrad_w13 = [&](const GroupedRows& rows, const sm90::DgradW13Fp8Args& a) {
    sm90::expert_mlp_dgrad_w13_fp8(rows, shape, a, nullptr);
  };
  const auto w2 = fake_dgrad_w2_args();
  const auto w13 = fake_dgrad_w13_args();
  EXPECT_EQ(rejected_without(w2, dgrad_w2, [](auto& a) { a.grad_y.values_RK = nullptr; }), "grad_y.values_RK");
  EXPECT_EQ(rejected_without(w2, dgrad_w2, [](auto& a) { a.grad_y.scales_RKb = nullptr; }), "grad_y.scales_RKb");
  EXPECT_EQ(rejected_without(w2, dgrad_w2, [](auto& a) { a.w2_t.values = nullptr; }), "w2_t.values");
  EXPECT_EQ(rejected_without(w2, dgrad_w2, [](auto& a) { a.w2_t.scales = nullptr; }), "w2_t.scales");
  EXPECT_EQ(rejected_without(w2, dgrad_w2, [](auto& a) { a.h13_R2F = nullptr; }), "h13_R2F");
  EXPECT_EQ(rejected_without(w2, dgrad_w2, [](auto& a) { a.grad_h13_R2F = nullptr; }), "grad_h13_R2F");
  EXPECT_EQ(rejected_without(w13, dgrad_w13, [](auto& a) { a.grad_h13.values_RK = nullptr; }), "grad_h13.values_RK");
  EXPECT_EQ(rejected_without(w13, dgrad_w13, [](auto& a) { a.grad_h13.scales_RKb = nullptr; }),
            "grad_h13.scales_RKb");
  EXPECT_EQ(rejected_without(w13, dgrad_w13, [](auto& a) { a.w13_t.values = nullptr; }), "w13_t.values");
  EXPECT_EQ(rejected_without(w13, dgrad_w13, [](auto& a) { a.w13_t.scales = nullptr; }), "w13_t.scales");
  EXPECT_EQ(rejected_without(w13, dgrad_w13, [](auto& a) { a.grad_x_RD = nullptr; }), "grad_x_RD");
  expect_replicas_named(w2, &sm90::DgradW2Fp8Args::replica_w2_t, "replica_w2_t", dgrad_w2);
  expect_replicas_named(w13, &sm90::DgradW13Fp8Args::replica_w13_t, "replica_w13_t", dgrad_w13);
}

// FP8 WGRAD names a missing operand, an unaligned scale pointer, a row count in partial blocks and a
// missing output before any launch.
TEST(ExpertMlpFp8Validation, WgradArgumentsAreNamedBeforeAnyLaunch) {
  const ExpertMlpShape shape = validation_shape();
  const void* fake = kFakeAddress;
  const sm90::Fp8ColumnTiles tiles{fake, static_cast<const float*>(fake)};
  sm90::WgradOutput out;
  out.grad_w = const_cast<void*>(fake);
  auto w2 = [&](const GroupedRows& rows, sm90::Fp8ColumnTiles gy, sm90::Fp8ColumnTiles a, sm90::WgradOutput o) {
    return rejected_name([&] { sm90::expert_mlp_wgrad_w2_fp8(rows, shape, gy, a, o, nullptr); });
  };
  const GroupedRows rows = fake_grouped_rows();
  EXPECT_EQ(w2(rows, {nullptr, tiles.scales_BC}, tiles, out), "grad_y.values_CR");
  EXPECT_EQ(w2(rows, tiles, {fake, nullptr}, out), "a.scales_BC");
  EXPECT_EQ(w2(rows, tiles, {fake, reinterpret_cast<const float*>(static_cast<const char*>(fake) + 2)}, out),
            "a.scales_BC");
  GroupedRows partial = rows;
  partial.max_rows = 1000;
  EXPECT_EQ(w2(partial, tiles, tiles, out), "rows.max_rows");
  EXPECT_EQ(w2(rows, tiles, tiles, sm90::WgradOutput{}), "grad_w");
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_wgrad_w13_fp8(rows, shape, tiles, {nullptr, nullptr}, out, nullptr); }),
            "x.values_CR");
}

TEST(ExpertMlpFp8Validation, UnbuiltVariantsAreNotAvailable) {
  const GroupedRows rows = fake_grouped_rows();
  const ExpertMlpShape shape = validation_shape();
  ExpertMlpShape biased = shape, transposed = shape, interleaved = shape;
  biased.biased = true;
  transposed.weights_transposed = true;
  interleaved.w13_layout = W13Layout::gate_up_interleaved;
  const auto f13 = fake_w13_args();
  const auto f2 = fake_w2_args();
  EXPECT_THROW(sm90::expert_mlp_fprop_w13_fp8(rows, biased, f13, nullptr), poise::NotAvailable) << "biased W13";
  EXPECT_THROW(sm90::expert_mlp_fprop_w13_fp8(rows, transposed, f13, nullptr), poise::NotAvailable) << "transposed W13";
  EXPECT_THROW(sm90::expert_mlp_fprop_w13_fp8(rows, interleaved, f13, nullptr), poise::NotAvailable)
      << "interleaved W13";
  EXPECT_THROW(sm90::expert_mlp_fprop_w2_fp8(rows, biased, f2, nullptr), poise::NotAvailable) << "biased W2";
  EXPECT_THROW(sm90::expert_mlp_fprop_w2_fp8(rows, transposed, f2, nullptr), poise::NotAvailable) << "transposed W2";
  const auto d2 = fake_dgrad_w2_args();
  const auto d13 = fake_dgrad_w13_args();
  EXPECT_THROW(sm90::expert_mlp_dgrad_w2_fp8(rows, biased, d2, nullptr), poise::NotAvailable) << "biased DGRAD W2";
  EXPECT_THROW(sm90::expert_mlp_dgrad_w2_fp8(rows, transposed, d2, nullptr), poise::NotAvailable)
      << "transposed DGRAD W2";
  EXPECT_THROW(sm90::expert_mlp_dgrad_w2_fp8(rows, interleaved, d2, nullptr), poise::NotAvailable)
      << "interleaved DGRAD W2";
  EXPECT_THROW(sm90::expert_mlp_dgrad_w13_fp8(rows, biased, d13, nullptr), poise::NotAvailable) << "biased DGRAD W13";
  EXPECT_THROW(sm90::expert_mlp_dgrad_w13_fp8(rows, transposed, d13, nullptr), poise::NotAvailable)
      << "transposed DGRAD W13";
}

}  // namespace
}  // namespace poise::test
