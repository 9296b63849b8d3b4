// Expert-MLP kernels (sm90) against float64 host computations on fresh random inputs.
// Outputs are poisoned (NaN) before every run; rows no expert owns are NaN in every input and
// must keep their poison in every output. Shapes cover experts with 0 rows, one expert holding
// all rows, D or F = 64 x odd, many tiles per CTA, both W13 layouts and both activations.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <cuda_runtime_api.h>

#include "runtime/device_info.hpp"
#include "gemm/sm90/expert_mlp.hpp"
#include "poise/errors.hpp"
#include "expert_mlp_test_support.hpp"

namespace poise::test {
namespace {

using sm90::ExpertMlpShape;
using sm90::GroupedRows;

constexpr double kBf16Tolerance = 1e-2;  // bf16 outputs: rounding alone gives ~3e-3
constexpr double kFp32Tolerance = 1e-4;  // fp32 outputs from bf16 operands, fp32 accumulation

bool have_sm90() { return cuda_device_count() > 0 && is_sm90_device(0); }

std::vector<double> to_double(const std::vector<uint16_t>& v) {
  std::vector<double> d(v.size());
  for (size_t i = 0; i < v.size(); ++i) d[i] = from_bf16(v[i]);
  return d;
}

// out[r][n] = sum_k A[r][k] * W_e(n, k) over valid rows. W is [E][N][K] (nk) or [E][K][N] (kn).
std::vector<double> ref_rows_gemm(const RowLayout& l, const std::vector<double>& A, int64_t K,
                                  const std::vector<double>& W, int64_t N, bool w_is_nk) {
  std::vector<double> out(l.rows * N, 0.0);
  parallel_for(l.rows, [&](int64_t r) {
    for (size_t e = 0; e < l.counts.size(); ++e) {
      if (r < l.offsets[e] || r >= l.offsets[e] + l.counts[e]) continue;
      const double* w = W.data() + e * N * K;
      for (int64_t n = 0; n < N; ++n) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += A[r * K + k] * (w_is_nk ? w[n * K + k] : w[k * N + n]);
        out[r * N + n] = s;
      }
    }
  });
  return out;
}

// out[e][m][n] = sum over expert e's rows of A[r][m] * B[r][n].
std::vector<double> ref_wgrad(const RowLayout& l, const std::vector<double>& A, int64_t M,
                              const std::vector<double>& B, int64_t N) {
  const int64_t E = l.counts.size();
  std::vector<double> out(E * M * N, 0.0);
  parallel_for(E * M, [&](int64_t em) {
    const int64_t e = em / M, m = em % M;
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t r = l.offsets[e]; r < l.offsets[e] + l.counts[e]; ++r) s += A[r * M + m] * B[r * N + n];
      out[em * N + n] = s;
    }
  });
  return out;
}

// Random bf16 rows [R][cols] (normal, stddev), the rows no expert owns poisoned.
std::vector<uint16_t> random_rows(Rng& rng, const RowLayout& l, int64_t cols, float stddev) {
  auto v = rng.bf16_normal(l.rows * cols, stddev);
  poison_padding_rows(v, l, cols);
  return v;
}

// Index of gate / up of activation column f inside a [2F] row, per W13 layout.
// The routing score's gradient per row from DGRAD W2's per-tile pieces, summed in piece order
// (as every consumer must, for the same bits on every run).
std::vector<float> sum_score_partials(const std::vector<float>& partials_RP, int64_t P) {
  std::vector<float> out(partials_RP.size() / P, 0.0f);
  for (size_t r = 0; r < out.size(); ++r)
    for (int64_t p = 0; p < P; ++p) out[r] += partials_RP[r * P + p];
  return out;
}

int64_t gate_col(int64_t f, int64_t F, W13Layout lay) { return lay == W13Layout::gate_up_blocked ? f : 2 * f; }
int64_t up_col(int64_t f, int64_t F, W13Layout lay) { return lay == W13Layout::gate_up_blocked ? F + f : 2 * f + 1; }

// Compares a bf16 [R][C] grouped-rows output: valid rows against ref, other rows must keep poison.
Comparison compare_rows_bf16(const std::vector<uint16_t>& out, const std::vector<double>& ref,
                             const RowLayout& l, int64_t C) {
  ErrorAccumulator acc;
  for (int64_t r = 0; r < l.rows; ++r) {
    const bool valid = l.is_row_valid(r);
    for (int64_t c = 0; c < C; ++c) {
      if (valid) acc.add(from_bf16(out[r * C + c]), ref[r * C + c]);
      else if (out[r * C + c] != kBf16Poison) ++acc.c.poison_lost;
    }
  }
  return acc.finish();
}

template <class T>
Comparison compare_all(const std::vector<T>& out, const std::vector<double>& ref) {
  ErrorAccumulator acc;
  for (size_t i = 0; i < out.size(); ++i) {
    if constexpr (std::is_same_v<T, uint16_t>) acc.add(from_bf16(out[i]), ref[i]);
    else acc.add(out[i], ref[i]);
  }
  return acc.finish();
}

void expect_close(const Comparison& c, double tol, const char* what) {
  EXPECT_GT(c.compared, -1) << what;
  EXPECT_EQ(c.non_finite, 0) << what << ": " << c.describe();
  EXPECT_EQ(c.poison_lost, 0) << what << ": " << c.describe();
  EXPECT_LT(c.rel_error, tol) << what << ": " << c.describe();
}

struct Case {
  const char* name;
  std::vector<int32_t> counts;
  int64_t D, F;
  W13Layout layout;
  bool clamped;
  uint64_t seed;
};

// Everything one case needs on the device: layout, weights and per-kernel random inputs.
struct Fixture {
  Case cs;
  RowLayout l;
  Act act;
  ExpertMlpShape shape;
  DeviceBuffer<int32_t> offsets, counts;
  DeviceBuffer<int32_t> tile_counters{std::vector<int32_t>{0, 0}};  // the dynamic tile order, as a Context runs it
  DeviceBuffer<unsigned long long> fault_word{std::vector<unsigned long long>{0}};
  GroupedRows rows;

  explicit Fixture(const Case& c) : cs(c), l(make_layout(c.counts)), offsets(l.offsets), counts(l.counts) {
    act.clamped = c.clamped;
    act.limit = c.clamped ? 1.5 : 7.0;  // small limit: the clamps are exercised
    shape.hidden_dim = c.D;
    shape.intermediate_dim = c.F;
    shape.activation = c.clamped ? Activation::swiglu_clamped : Activation::swiglu;
    shape.swiglu_alpha = static_cast<float>(act.alpha);
    shape.swiglu_limit = static_cast<float>(act.limit);
    shape.w13_layout = c.layout;
    rows.row_offsets_E = offsets.ptr;
    rows.row_counts_E = counts.ptr;
    rows.num_experts = static_cast<int64_t>(c.counts.size());
    rows.max_rows = l.rows;
    rows.tile_counters = tile_counters.ptr;
    rows.faults.word = fault_word.ptr;
  }
  sm90::PipelineFault take_fault() const { return sm90::take_pipeline_fault(rows.faults, nullptr); }
  int64_t E() const { return static_cast<int64_t>(cs.counts.size()); }
};

// The random inputs of the two GEMMs that write rows of D, drawn in a fixed order for a seed: host
// copies for the float64 references, device copies for the kernels.
struct FpropW2Inputs {  // a_RF, W2, scores_R
  std::vector<uint16_t> a, w2;
  std::vector<float> scores;
  DeviceBuffer<uint16_t> da, dw2;
  DeviceBuffer<float> ds;
  FpropW2Inputs(const Fixture& fx, Rng& rng)
      : a(random_rows(rng, fx.l, fx.cs.F, 1.0f)),
        w2(rng.bf16_normal(fx.E() * fx.cs.D * fx.cs.F, 1.0f / std::sqrt(float(fx.cs.F)))),
        scores(rng.uniform(fx.l.rows, 0.1f, 1.0f)), da(a), dw2(w2), ds(scores) {}
};
struct DgradW13Inputs {  // grad_h13_R2F, W13
  std::vector<uint16_t> gh, w13;
  DeviceBuffer<uint16_t> dgh, dw13;
  DgradW13Inputs(const Fixture& fx, Rng& rng)
      : gh(random_rows(rng, fx.l, 2 * fx.cs.F, 1.0f)),
        w13(rng.bf16_normal(fx.E() * 2 * fx.cs.F * fx.cs.D, 1.0f / std::sqrt(float(2 * fx.cs.F)))),
        dgh(gh), dw13(w13) {}
};

class ExpertMlpKernels : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!have_sm90()) GTEST_SKIP() << "needs an SM90 GPU";
  }
};

TEST_P(ExpertMlpKernels, FpropW13SwigluMatchesFloat64) {
  Fixture fx(GetParam());
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F, E = fx.E();
  Rng rng(fx.cs.seed);
  auto x = random_rows(rng, fx.l, D, 1.0f);
  const auto w13 = rng.bf16_normal(E * 2 * F * D, 2.0f / std::sqrt(float(D)));
  DeviceBuffer<uint16_t> dx(x), dw(w13), da(std::vector<uint16_t>(R * F, kBf16Poison)),
      dh(std::vector<uint16_t>(R * 2 * F, kBf16Poison));
  sm90::expert_mlp_fprop_w13(fx.rows, fx.shape, {dx.ptr, dw.ptr, da.ptr, dh.ptr}, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "fprop_w13");

  const auto h_ref = ref_rows_gemm(fx.l, to_double(x), D, to_double(w13), 2 * F, true);
  std::vector<double> a_ref(R * F, 0.0);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t f = 0; f < F; ++f)
      a_ref[r * F + f] = act_forward(h_ref[r * 2 * F + gate_col(f, F, fx.cs.layout)],
                                     h_ref[r * 2 * F + up_col(f, F, fx.cs.layout)], fx.act);
  expect_close(compare_rows_bf16(dh.download(), h_ref, fx.l, 2 * F), kBf16Tolerance, "h13_R2F");
  expect_close(compare_rows_bf16(da.download(), a_ref, fx.l, F), kBf16Tolerance, "a_RF");
}

TEST_P(ExpertMlpKernels, FpropW2ScoredMatchesFloat64) {
  Fixture fx(GetParam());
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F;
  Rng rng(fx.cs.seed + 1);
  const FpropW2Inputs in(fx, rng);
  DeviceBuffer<uint16_t> dy(std::vector<uint16_t>(R * D, kBf16Poison)),
      dy_plain(std::vector<uint16_t>(R * D, kBf16Poison));
  sm90::expert_mlp_fprop_w2(fx.rows, fx.shape, {in.da.ptr, in.dw2.ptr, in.ds.ptr, dy.ptr}, nullptr);
  sm90::expert_mlp_fprop_w2(fx.rows, fx.shape, {in.da.ptr, in.dw2.ptr, nullptr, dy_plain.ptr}, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "fprop_w2");

  auto y_ref = ref_rows_gemm(fx.l, to_double(in.a), F, to_double(in.w2), D, true);
  expect_close(compare_rows_bf16(dy_plain.download(), y_ref, fx.l, D), kBf16Tolerance, "y_RD (no scores)");
  for (int64_t r = 0; r < R; ++r)
    for (int64_t d = 0; d < D; ++d) y_ref[r * D + d] *= in.scores[r];
  expect_close(compare_rows_bf16(dy.download(), y_ref, fx.l, D), kBf16Tolerance, "y_RD (scores)");
}

// Rows scattered to slots (sm90::RowScatter, the EP pipeline's direct combine): every valid row's
// bytes land in its slot of its owner's buffer, bit for bit the grouped row the plain store writes;
// slots no row names keep their poison. Two owners of S slots each, 256 guard bytes before slot 0
// (slot_offset); valid rows take a random slot each (an injective draw), padding rows name none.
// bad_rows: valid rows given an origin outside the owners' slots, which must be stored nowhere.
void check_row_scatter(const Fixture& fx, uint64_t seed, const std::vector<uint16_t>& grouped,
                       const std::function<void(const sm90::RowScatter&)>& run, const char* what,
                       const std::vector<int64_t>& bad_rows = {}) {
  const int64_t R = fx.l.rows, D = fx.cs.D, owners = 2, guard = 256 / 2;  // guard in bf16 elements
  int64_t valid_rows = 0;
  for (int32_t c : fx.cs.counts) valid_rows += c;
  const int64_t S = std::max<int64_t>(1, (valid_rows + 1) / 2 + 3);  // slots per owner, some left free
  std::vector<int32_t> slots(owners * S);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), std::mt19937_64(seed));
  std::vector<int32_t> origin(R, -1);
  int64_t next = 0;
  for (int64_t r = 0; r < R; ++r)
    if (fx.l.is_row_valid(r)) origin[r] = slots[next++];
  for (size_t i = 0; i < bad_rows.size(); ++i) origin[bad_rows[i]] = i % 2 ? -5 : static_cast<int32_t>(owners * S);
  std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> owner_rows;
  std::vector<char*> bases;
  for (int64_t o = 0; o < owners; ++o) {
    owner_rows.push_back(std::make_unique<DeviceBuffer<uint16_t>>(std::vector<uint16_t>(guard + S * D, kBf16Poison)));
    bases.push_back(reinterpret_cast<char*>(owner_rows.back()->ptr));
  }
  DeviceBuffer<char*> dbases(bases);
  DeviceBuffer<int32_t> dorigin(origin);
  run({dorigin.ptr, dbases.ptr, guard * 2, S, owners});
  cuda_ok(cudaDeviceSynchronize(), what);
  std::vector<int64_t> row_of_slot(owners * S, -1);
  for (int64_t r = 0; r < R; ++r)
    if (fx.l.is_row_valid(r) && std::find(bad_rows.begin(), bad_rows.end(), r) == bad_rows.end())
      row_of_slot[origin[r]] = r;
  int64_t wrong = 0, poison_lost = 0;
  for (int64_t o = 0; o < owners; ++o) {
    const auto got = owner_rows[o]->download();
    for (int64_t i = 0; i < guard; ++i) poison_lost += got[i] != kBf16Poison;
    for (int64_t s = 0; s < S; ++s) {
      const int64_t r = row_of_slot[o * S + s];
      for (int64_t d = 0; d < D; ++d) {
        const uint16_t v = got[guard + s * D + d];
        if (r < 0) poison_lost += v != kBf16Poison;
        else wrong += v != grouped[r * D + d];
      }
    }
  }
  EXPECT_EQ(wrong, 0) << what << ": elements that differ from the grouped rows";
  EXPECT_EQ(poison_lost, 0) << what << ": elements written outside the named slots";
}

TEST_P(ExpertMlpKernels, RowScatterEqualsGroupedRowsBitwise) {
  Fixture fx(GetParam());
  const int64_t R = fx.l.rows, D = fx.cs.D;
  Rng rng(fx.cs.seed + 10);
  // FPROP W2, unscaled and scored.
  const FpropW2Inputs w2in(fx, rng);
  DeviceBuffer<uint16_t> dy(std::vector<uint16_t>(R * D, kBf16Poison));
  for (const float* scores_R : {static_cast<const float*>(nullptr), static_cast<const float*>(w2in.ds.ptr)}) {
    sm90::expert_mlp_fprop_w2(fx.rows, fx.shape, {w2in.da.ptr, w2in.dw2.ptr, scores_R, dy.ptr}, nullptr);
    cuda_ok(cudaDeviceSynchronize(), "fprop_w2 grouped");
    check_row_scatter(fx, fx.cs.seed + 11, dy.download(), [&](const sm90::RowScatter& scatter) {
      sm90::FpropW2Args args{w2in.da.ptr, w2in.dw2.ptr, scores_R, nullptr};
      args.scatter = scatter;
      sm90::expert_mlp_fprop_w2(fx.rows, fx.shape, args, nullptr);
    }, scores_R ? "FPROP W2 scattered (scores)" : "FPROP W2 scattered");
  }
  // DGRAD W13 (grad_x).
  const DgradW13Inputs w13in(fx, rng);
  DeviceBuffer<uint16_t> dgx(std::vector<uint16_t>(R * D, kBf16Poison));
  sm90::expert_mlp_dgrad_w13(fx.rows, fx.shape, {w13in.dgh.ptr, w13in.dw13.ptr, dgx.ptr}, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "dgrad_w13 grouped");
  check_row_scatter(fx, fx.cs.seed + 12, dgx.download(), [&](const sm90::RowScatter& scatter) {
    sm90::DgradW13Args args{w13in.dgh.ptr, w13in.dw13.ptr, nullptr};
    args.scatter = scatter;
    sm90::expert_mlp_dgrad_w13(fx.rows, fx.shape, args, nullptr);
  }, "DGRAD W13 scattered");
}

TEST(ExpertMlpRowScatter, OriginOutOfRangeIsReportedAndStoredNowhere) {
  if (!have_sm90()) GTEST_SKIP() << "needs an SM90 GPU";
  Fixture fx(Case{"bad_origin", {300, 0, 129}, 192, 128, W13Layout::gate_up_blocked, false, 53});
  const int64_t R = fx.l.rows, D = fx.cs.D;
  Rng rng(54);
  const FpropW2Inputs in(fx, rng);
  DeviceBuffer<uint16_t> dy(std::vector<uint16_t>(R * D, kBf16Poison));
  sm90::expert_mlp_fprop_w2(fx.rows, fx.shape, {in.da.ptr, in.dw2.ptr, nullptr, dy.ptr}, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "fprop_w2 grouped");
  ASSERT_FALSE(fx.take_fault().occurred) << "no fault before the bad origins";
  const std::vector<int64_t> bad_rows = {5, fx.l.offsets[2] + 7};  // valid rows of experts 0 and 2
  check_row_scatter(fx, 55, dy.download(), [&](const sm90::RowScatter& scatter) {
    sm90::FpropW2Args args{in.da.ptr, in.dw2.ptr, nullptr, nullptr};
    args.scatter = scatter;
    sm90::expert_mlp_fprop_w2(fx.rows, fx.shape, args, nullptr);
  }, "FPROP W2 scattered without the bad rows", bad_rows);
  const sm90::PipelineFault fault = fx.take_fault();
  EXPECT_TRUE(fault.occurred && fault.bad_origin) << "the out-of-range origins are reported";
  EXPECT_FALSE(fx.take_fault().occurred) << "the record is cleared once read";
}

TEST_P(ExpertMlpKernels, DgradW2SwigluBackwardMatchesFloat64) {
  Fixture fx(GetParam());
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F, E = fx.E();
  Rng rng(fx.cs.seed + 2);
  auto gy = random_rows(rng, fx.l, D, 1.0f);
  auto h13 = random_rows(rng, fx.l, 2 * F, 2.0f);
  const auto w2 = rng.bf16_normal(E * D * F, 1.0f / std::sqrt(float(F)));
  const auto scores = rng.uniform(R, 0.1f, 1.0f);
  DeviceBuffer<uint16_t> dgy(gy), dh(h13), dw(w2), dgh(std::vector<uint16_t>(R * 2 * F, kBf16Poison)),
      da(std::vector<uint16_t>(R * F, kBf16Poison));
  const int64_t P = sm90::dgrad_w2_score_partials(fx.shape);
  DeviceBuffer<float> ds(scores), dgs(std::vector<float>(R * P, 0.0f));  // zeros: padding rows must stay 0
  sm90::DgradW2Args args{dgy.ptr, dw.ptr, dh.ptr, ds.ptr, dgh.ptr, da.ptr, dgs.ptr};
  sm90::expert_mlp_dgrad_w2(fx.rows, fx.shape, args, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "dgrad_w2");

  const auto gacc = ref_rows_gemm(fx.l, to_double(gy), D, to_double(w2), F, false);
  std::vector<double> gh_ref(R * 2 * F, 0.0), a_ref(R * F, 0.0), gs_ref(R, 0.0);
  for (int64_t r = 0; r < R; ++r) {
    if (!fx.l.is_row_valid(r)) continue;
    for (int64_t f = 0; f < F; ++f) {
      const int64_t gc = gate_col(f, F, fx.cs.layout), uc = up_col(f, F, fx.cs.layout);
      const double g = from_bf16(h13[r * 2 * F + gc]), u = from_bf16(h13[r * 2 * F + uc]);
      const double a = act_forward(g, u, fx.act);
      double dg, du;
      act_backward(g, u, scores[r] * gacc[r * F + f], fx.act, dg, du);
      gh_ref[r * 2 * F + gc] = dg;
      gh_ref[r * 2 * F + uc] = du;
      a_ref[r * F + f] = scores[r] * a;
      gs_ref[r] += gacc[r * F + f] * a;
    }
  }
  expect_close(compare_rows_bf16(dgh.download(), gh_ref, fx.l, 2 * F), kBf16Tolerance, "grad_h13_R2F");
  expect_close(compare_rows_bf16(da.download(), a_ref, fx.l, F), kBf16Tolerance, "a_RF (score * a)");
  const auto gs = sum_score_partials(dgs.download(), P);
  ErrorAccumulator acc;
  int64_t padding_written = 0;
  for (int64_t r = 0; r < R; ++r) {
    if (fx.l.is_row_valid(r)) acc.add(gs[r], gs_ref[r]);
    else if (gs[r] != 0.0f) ++padding_written;
  }
  auto c = acc.finish();
  c.poison_lost = padding_written;
  expect_close(c, 1e-3, "grad_scores_R");
}

TEST_P(ExpertMlpKernels, DgradW13MatchesFloat64) {
  Fixture fx(GetParam());
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F;
  Rng rng(fx.cs.seed + 3);
  const DgradW13Inputs in(fx, rng);
  DeviceBuffer<uint16_t> dgx(std::vector<uint16_t>(R * D, kBf16Poison));
  sm90::expert_mlp_dgrad_w13(fx.rows, fx.shape, {in.dgh.ptr, in.dw13.ptr, dgx.ptr}, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "dgrad_w13");
  const auto gx_ref = ref_rows_gemm(fx.l, to_double(in.gh), 2 * F, to_double(in.w13), D, false);
  expect_close(compare_rows_bf16(dgx.download(), gx_ref, fx.l, D), kBf16Tolerance, "grad_x_RD");
}

// Runs one wgrad four ways: fp32 / bf16 output, overwrite / accumulate into random contents.
void check_wgrad(const Fixture& fx, int64_t M, int64_t N, bool is_w2, uint64_t seed) {
  const int64_t E = fx.E();
  Rng rng(seed);
  auto A = random_rows(rng, fx.l, M, 1.0f);
  auto B = random_rows(rng, fx.l, N, 1.0f);
  DeviceBuffer<uint16_t> dA(A), dB(B);
  const auto ref = ref_wgrad(fx.l, to_double(A), M, to_double(B), N);
  auto run = [&](void* out, DType dt, bool accumulate) {
    const sm90::WgradOutput o{out, dt, accumulate};
    if (is_w2) sm90::expert_mlp_wgrad_w2(fx.rows, fx.shape, dA.ptr, dB.ptr, o, nullptr);
    else sm90::expert_mlp_wgrad_w13(fx.rows, fx.shape, dA.ptr, dB.ptr, o, nullptr);
    cuda_ok(cudaDeviceSynchronize(), "wgrad");
  };
  const char* name = is_w2 ? "grad_w2" : "grad_w13";
  {  // fp32 overwrite of a poisoned buffer
    DeviceBuffer<float> out(std::vector<float>(E * M * N, fp32_poison()));
    run(out.ptr, DType::fp32, false);
    expect_close(compare_all(out.download(), ref), kFp32Tolerance, (std::string(name) + " fp32 overwrite").c_str());
  }
  {  // bf16 overwrite
    DeviceBuffer<uint16_t> out(std::vector<uint16_t>(E * M * N, kBf16Poison));
    run(out.ptr, DType::bf16, false);
    expect_close(compare_all(out.download(), ref), kBf16Tolerance, (std::string(name) + " bf16 overwrite").c_str());
  }
  {  // fp32 accumulate: experts without rows keep their contents bit for bit
    const auto before = rng.uniform(E * M * N, -1.0f, 1.0f);
    DeviceBuffer<float> out(before);
    run(out.ptr, DType::fp32, true);
    const auto after = out.download();
    std::vector<double> expect(ref);
    for (size_t i = 0; i < expect.size(); ++i) expect[i] += before[i];
    expect_close(compare_all(after, expect), kFp32Tolerance, (std::string(name) + " fp32 accumulate").c_str());
    for (int64_t e = 0; e < E; ++e)
      if (fx.l.counts[e] == 0)
        EXPECT_EQ(0, std::memcmp(after.data() + e * M * N, before.data() + e * M * N, M * N * 4))
            << name << ": expert " << e << " has no rows but its gradient changed";
  }
  {  // bf16 accumulate
    std::vector<uint16_t> before(E * M * N);
    const auto values = rng.uniform(E * M * N, -1.0f, 1.0f);
    for (size_t i = 0; i < before.size(); ++i) before[i] = to_bf16(values[i]);
    DeviceBuffer<uint16_t> out(before);
    run(out.ptr, DType::bf16, true);
    std::vector<double> expect(ref);
    for (size_t i = 0; i < expect.size(); ++i) expect[i] += from_bf16(before[i]);
    expect_close(compare_all(out.download(), expect), kBf16Tolerance, (std::string(name) + " bf16 accumulate").c_str());
  }
}

TEST_P(ExpertMlpKernels, WgradW2MatchesFloat64) {
  Fixture fx(GetParam());
  check_wgrad(fx, fx.cs.D, fx.cs.F, true, fx.cs.seed + 4);
}

TEST_P(ExpertMlpKernels, WgradW13MatchesFloat64) {
  Fixture fx(GetParam());
  check_wgrad(fx, 2 * fx.cs.F, fx.cs.D, false, fx.cs.seed + 5);
}

std::vector<int32_t> random_counts(int experts, int max_rows, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> c(experts);
  for (auto& v : c) v = static_cast<int32_t>(rng.uniform(1, 0.0f, float(max_rows))[0]);
  c[3] = 0;
  c[17] = 0;
  c[20] = 128;
  return c;
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ExpertMlpKernels,
    ::testing::Values(
        Case{"mixed_D64x3_F64x5", {130, 0, 300, 1}, 192, 320, W13Layout::gate_up_blocked, false, 11},
        Case{"one_expert_all_rows", {0, 517, 0}, 256, 128, W13Layout::gate_up_blocked, false, 12},
        Case{"tiny_dims_clamped", {1, 128, 129}, 64, 64, W13Layout::gate_up_blocked, true, 13},
        Case{"interleaved_clamped_F64x3", {77, 250, 0, 64}, 384, 192, W13Layout::gate_up_interleaved, true, 14},
        Case{"interleaved_swiglu", {200, 3}, 320, 128, W13Layout::gate_up_interleaved, false, 15},
        Case{"many_tiles_per_cta", random_counts(32, 600, 16), 512, 256, W13Layout::gate_up_blocked, false, 16},
        Case{"no_rows_at_all", {0, 0}, 128, 64, W13Layout::gate_up_blocked, false, 17},
        // wgrad's last K block of each expert: rows past 64 ending on and between its k16 slices
        Case{"wgrad_tail_slices", {16, 17, 96, 33, 112, 49, 63, 64, 1}, 128, 192, W13Layout::gate_up_blocked, false,
             18}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace poise::test

namespace poise::test {
namespace {

// The whole expert MLP, forward and backward, chained as the pipeline chains it (h13 saved in
// bf16, score fused into the W2 epilogue and the dgrad), against one float64 computation.
TEST(ExpertMlpChain, ForwardBackwardMatchesFloat64) {
  if (!have_sm90()) GTEST_SKIP() << "needs an SM90 GPU";
  Fixture fx(Case{"chain", {200, 0, 333, 64, 129}, 256, 192, W13Layout::gate_up_blocked, false, 21});
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F, E = fx.E();
  Rng rng(21);
  auto x = random_rows(rng, fx.l, D, 1.0f);
  auto gy = random_rows(rng, fx.l, D, 1.0f);
  const auto w13 = rng.bf16_normal(E * 2 * F * D, 2.0f / std::sqrt(float(D)));
  const auto w2 = rng.bf16_normal(E * D * F, 1.0f / std::sqrt(float(F)));
  const auto scores = rng.uniform(R, 0.1f, 1.0f);
  DeviceBuffer<uint16_t> dx(x), dgy(gy), dw13(w13), dw2(w2);
  const int64_t P = sm90::dgrad_w2_score_partials(fx.shape);
  DeviceBuffer<float> ds(scores), dgs(std::vector<float>(R * P, fp32_poison()));
  DeviceBuffer<uint16_t> da(std::vector<uint16_t>(R * F, kBf16Poison)), dh(std::vector<uint16_t>(R * 2 * F, kBf16Poison)),
      dy(std::vector<uint16_t>(R * D, kBf16Poison)), dgh(std::vector<uint16_t>(R * 2 * F, kBf16Poison)),
      dgx(std::vector<uint16_t>(R * D, kBf16Poison));
  DeviceBuffer<float> dgw2(std::vector<float>(E * D * F, fp32_poison())), dgw13(std::vector<float>(E * 2 * F * D, fp32_poison()));

  sm90::expert_mlp_fprop_w13(fx.rows, fx.shape, {dx.ptr, dw13.ptr, da.ptr, dh.ptr}, nullptr);
  sm90::expert_mlp_fprop_w2(fx.rows, fx.shape, {da.ptr, dw2.ptr, ds.ptr, dy.ptr}, nullptr);
  sm90::expert_mlp_dgrad_w2(fx.rows, fx.shape, {dgy.ptr, dw2.ptr, dh.ptr, ds.ptr, dgh.ptr, da.ptr, dgs.ptr}, nullptr);
  sm90::expert_mlp_wgrad_w2(fx.rows, fx.shape, dgy.ptr, da.ptr, {dgw2.ptr, DType::fp32, false}, nullptr);
  sm90::expert_mlp_dgrad_w13(fx.rows, fx.shape, {dgh.ptr, dw13.ptr, dgx.ptr}, nullptr);
  sm90::expert_mlp_wgrad_w13(fx.rows, fx.shape, dgh.ptr, dx.ptr, {dgw13.ptr, DType::fp32, false}, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "chain");

  // float64 chain from the same inputs.
  const auto xd = to_double(x), gyd = to_double(gy), w13d = to_double(w13), w2d = to_double(w2);
  const auto h = ref_rows_gemm(fx.l, xd, D, w13d, 2 * F, true);
  std::vector<double> a(R * F, 0.0), as(R * F, 0.0);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t f = 0; f < F; ++f) {
      a[r * F + f] = act_forward(h[r * 2 * F + f], h[r * 2 * F + F + f], fx.act);
      as[r * F + f] = scores[r] * a[r * F + f];
    }
  const auto y = ref_rows_gemm(fx.l, as, F, w2d, D, true);
  const auto gacc = ref_rows_gemm(fx.l, gyd, D, w2d, F, false);
  std::vector<double> gh(R * 2 * F, 0.0), gs(R, 0.0);
  for (int64_t r = 0; r < R; ++r) {
    if (!fx.l.is_row_valid(r)) continue;
    for (int64_t f = 0; f < F; ++f) {
      act_backward(h[r * 2 * F + f], h[r * 2 * F + F + f], scores[r] * gacc[r * F + f], fx.act,
                   gh[r * 2 * F + f], gh[r * 2 * F + F + f]);
      gs[r] += gacc[r * F + f] * a[r * F + f];
    }
  }
  const auto gx = ref_rows_gemm(fx.l, gh, 2 * F, w13d, D, false);
  const auto gw2 = ref_wgrad(fx.l, gyd, D, as, F);
  const auto gw13 = ref_wgrad(fx.l, gh, 2 * F, xd, D);

  constexpr double kChainTolerance = 2e-2;  // bf16 intermediates (h13, a, grad_h13) compound
  expect_close(compare_rows_bf16(dy.download(), y, fx.l, D), kChainTolerance, "y_RD");
  expect_close(compare_rows_bf16(dgx.download(), gx, fx.l, D), kChainTolerance, "grad_x_RD");
  expect_close(compare_all(dgw2.download(), gw2), kChainTolerance, "grad_w2");
  expect_close(compare_all(dgw13.download(), gw13), kChainTolerance, "grad_w13");
  const auto gs_out = sum_score_partials(dgs.download(), P);
  ErrorAccumulator acc;
  for (int64_t r = 0; r < R; ++r)
    if (fx.l.is_row_valid(r)) acc.add(gs_out[r], gs[r]);
  expect_close(acc.finish(), kChainTolerance, "grad_scores_R");
}

// Random x and grad_y rows, weights and scores for a fixture, on the device (the bitwise tests'
// inputs; the order of the draws fixes them for a seed).
struct DeviceInputs {
  DeviceBuffer<uint16_t> dx, dgy, dw13, dw2;
  DeviceBuffer<float> ds;
  int64_t P;  // score-gradient pieces per row (DGRAD W2)
  DeviceInputs(const Fixture& fx, uint64_t seed) : DeviceInputs(fx, Rng(seed)) {}

 private:
  DeviceInputs(const Fixture& fx, Rng rng)
      : dx(random_rows(rng, fx.l, fx.cs.D, 1.0f)),
        dgy(random_rows(rng, fx.l, fx.cs.D, 1.0f)),
        dw13(rng.bf16_normal(fx.E() * 2 * fx.cs.F * fx.cs.D, 2.0f / std::sqrt(float(fx.cs.D)))),
        dw2(rng.bf16_normal(fx.E() * fx.cs.D * fx.cs.F, 1.0f / std::sqrt(float(fx.cs.F)))),
        ds(rng.uniform(fx.l.rows, 0.1f, 1.0f)),
        P(sm90::dgrad_w2_score_partials(fx.shape)) {}
};

// The fprop and dgrad GEMMs take their tiles in order from GroupedRows::tile_counters (the
// dynamic order) or walk the static blockIdx + k * gridDim sequence (null). The order must not
// change a single bit of any output, the counters must be zero again after every launch, and a
// second round on the same counters must give the same bits. Enough tiles that every CTA claims
// several (280 fprop W13 tiles, 140 for the 1-CTA dgrad W2), zero-row and one-row experts, D a
// multiple of 64 but not of 128, F not a multiple of 256.
TEST(ExpertMlpTileOrder, DynamicOrderEqualsStaticOrderBitwise) {
  if (!have_sm90()) GTEST_SKIP() << "needs an SM90 GPU";
  Fixture fx(Case{"tile_order", {300, 0, 2000, 64, 129, 700, 1, 513, 0, 1500, 77, 640, 256, 900, 3, 400},
                  704, 448, W13Layout::gate_up_blocked, false, 71});
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F;
  DeviceInputs in(fx, 71);
  const int64_t P = in.P;
  auto &dx = in.dx, &dgy = in.dgy, &dw13 = in.dw13, &dw2 = in.dw2;
  auto& ds = in.ds;
  struct Outputs {
    std::vector<uint16_t> a, h13, y, gh13, as, gx;
    std::vector<float> gs;
  };
  auto run = [&](const GroupedRows& rows) {
    auto poisoned = [](int64_t n) { return DeviceBuffer<uint16_t>(std::vector<uint16_t>(n, kBf16Poison)); };
    DeviceBuffer<uint16_t> a = poisoned(R * F), h = poisoned(R * 2 * F), y = poisoned(R * D), gh = poisoned(R * 2 * F),
                           as = poisoned(R * F), gx = poisoned(R * D);
    DeviceBuffer<float> gs(std::vector<float>(R * P, fp32_poison()));
    sm90::expert_mlp_fprop_w13(rows, fx.shape, {dx.ptr, dw13.ptr, a.ptr, h.ptr}, nullptr);
    sm90::expert_mlp_fprop_w2(rows, fx.shape, {a.ptr, dw2.ptr, ds.ptr, y.ptr}, nullptr);
    sm90::expert_mlp_dgrad_w2(rows, fx.shape, {dgy.ptr, dw2.ptr, h.ptr, ds.ptr, gh.ptr, as.ptr, gs.ptr}, nullptr);
    sm90::expert_mlp_dgrad_w13(rows, fx.shape, {gh.ptr, dw13.ptr, gx.ptr}, nullptr);
    cuda_ok(cudaDeviceSynchronize(), "tile order");
    return Outputs{a.download(), h.download(), y.download(), gh.download(), as.download(), gx.download(), gs.download()};
  };
  GroupedRows static_rows = fx.rows;
  static_rows.tile_counters = nullptr;
  const Outputs reference = run(static_rows);
  for (int round = 0; round < 2; ++round) {
    const Outputs dynamic = run(fx.rows);
    EXPECT_TRUE(dynamic.a == reference.a) << "a_RF, round " << round;
    EXPECT_TRUE(dynamic.h13 == reference.h13) << "h13_R2F, round " << round;
    EXPECT_TRUE(dynamic.y == reference.y) << "y_RD, round " << round;
    EXPECT_TRUE(dynamic.gh13 == reference.gh13) << "grad_h13_R2F, round " << round;
    EXPECT_TRUE(dynamic.as == reference.as) << "s * a (dgrad), round " << round;
    EXPECT_TRUE(dynamic.gx == reference.gx) << "grad_x_RD, round " << round;
    EXPECT_TRUE(std::memcmp(dynamic.gs.data(), reference.gs.data(), dynamic.gs.size() * sizeof(float)) == 0)
        << "grad_score_partials_RP, round " << round;
    EXPECT_EQ(fx.tile_counters.download(), (std::vector<int32_t>{0, 0})) << "counters after round " << round;
  }
  // The reference must itself be real output: every valid row of y written (no poison left).
  int64_t poisoned_rows = 0;
  for (int64_t r = 0; r < R; ++r) poisoned_rows += fx.l.is_row_valid(r) && reference.y[size_t(r * D)] == kBf16Poison;
  EXPECT_EQ(poisoned_rows, 0);
}

// EP activation records that keep part of a layer hold h13 rows [0, split) in one buffer, the
// rest in another (same row index): FPROP W13 writes and DGRAD W2 reads across both. Every output
// must equal, bit for bit, one buffer; the rows below the split stay untouched in the high buffer.
TEST(ExpertMlpH13Split, SplitBuffersEqualOneBufferBitwise) {
  if (!have_sm90()) GTEST_SKIP() << "needs an SM90 GPU";
  // Groups at rows 0, 256, 384, 640: a split at 384 falls between groups, rows past it in two groups.
  Fixture fx(Case{"h13_split", {200, 100, 250, 77}, 192, 320, W13Layout::gate_up_blocked, true, 43});
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F, split = 384;
  ASSERT_LT(split, R);
  DeviceInputs in(fx, 43);
  const int64_t P = in.P;
  auto &dx = in.dx, &dgy = in.dgy, &dw13 = in.dw13, &dw2 = in.dw2;
  auto& ds = in.ds;
  auto poisoned = [](int64_t n) { return DeviceBuffer<uint16_t>(std::vector<uint16_t>(n, kBf16Poison)); };
  // One buffer.
  DeviceBuffer<uint16_t> a1 = poisoned(R * F), h1 = poisoned(R * 2 * F), gh1 = poisoned(R * 2 * F), as1 = poisoned(R * F);
  DeviceBuffer<float> gs1(std::vector<float>(R * P, 0.0f));
  sm90::expert_mlp_fprop_w13(fx.rows, fx.shape, {dx.ptr, dw13.ptr, a1.ptr, h1.ptr}, nullptr);
  sm90::expert_mlp_dgrad_w2(fx.rows, fx.shape, {dgy.ptr, dw2.ptr, h1.ptr, ds.ptr, gh1.ptr, as1.ptr, gs1.ptr}, nullptr);
  // Split: rows [0, split) in lo (split rows), the rest in hi (R rows).
  DeviceBuffer<uint16_t> a2 = poisoned(R * F), lo = poisoned(split * 2 * F), hi = poisoned(R * 2 * F),
                         gh2 = poisoned(R * 2 * F), as2 = poisoned(R * F);
  DeviceBuffer<float> gs2(std::vector<float>(R * P, 0.0f));
  sm90::FpropW13Args f{dx.ptr, dw13.ptr, a2.ptr, lo.ptr};
  f.h13_split = {split, hi.ptr};
  sm90::expert_mlp_fprop_w13(fx.rows, fx.shape, f, nullptr);
  sm90::DgradW2Args g{dgy.ptr, dw2.ptr, lo.ptr, ds.ptr, gh2.ptr, as2.ptr, gs2.ptr};
  g.h13_split = {split, hi.ptr};
  sm90::expert_mlp_dgrad_w2(fx.rows, fx.shape, g, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "h13 split");

  const auto one = h1.download(), low = lo.download(), high = hi.download();
  int64_t low_bad = 0, high_bad = 0, untouched_lost = 0;
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < 2 * F; ++c) {
      const size_t i = size_t(r * 2 * F + c);
      if (r < split) {
        low_bad += fx.l.is_row_valid(r) && low[i] != one[i];
        untouched_lost += high[i] != kBf16Poison;
      } else {
        high_bad += fx.l.is_row_valid(r) && high[i] != one[i];
      }
    }
  }
  EXPECT_EQ(low_bad, 0) << "h13 rows below the split";
  EXPECT_EQ(high_bad, 0) << "h13 rows past the split";
  EXPECT_EQ(untouched_lost, 0) << "the high buffer's rows below the split were written";
  EXPECT_TRUE(a1.download() == a2.download()) << "a_RF";
  EXPECT_TRUE(gh1.download() == gh2.download()) << "grad_h13_R2F";
  EXPECT_TRUE(as1.download() == as2.download()) << "a_RF (dgrad)";
  EXPECT_TRUE(gs1.download() == gs2.download()) << "grad_score_partials_RP";
}

// EP exact balance runs one GEMM over a rank's own experts and its replica slots, whose weights
// and weight gradients live in separate buffers (GroupedRows::first_replica). Every output must
// equal, bit for bit, the same experts run from one buffer; an empty replica slot's gradient
// target keeps its poison; own gradients may accumulate while replicas are overwritten.
TEST(ExpertMlpReplicas, SplitWeightsEqualOneBufferBitwise) {
  if (!have_sm90()) GTEST_SKIP() << "needs an SM90 GPU";
  // Experts 0-2 own, 3-5 replicas; replica 3 has no rows, own expert 1 neither.
  Fixture fx(Case{"replicas", {200, 0, 333, 0, 129, 64}, 256, 192, W13Layout::gate_up_blocked, true, 41});
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F, E = fx.E(), own = 3, reps = E - own;
  const int64_t w13_n = 2 * F * D, w2_n = D * F;
  Rng rng(41);
  const auto x = random_rows(rng, fx.l, D, 1.0f), gy = random_rows(rng, fx.l, D, 1.0f);
  const auto w13 = rng.bf16_normal(E * w13_n, 2.0f / std::sqrt(float(D)));
  const auto w2 = rng.bf16_normal(E * w2_n, 1.0f / std::sqrt(float(F)));
  const auto scores = rng.uniform(R, 0.1f, 1.0f);
  const auto prior_w13 = rng.uniform(own * w13_n, -1.0f, 1.0f), prior_w2 = rng.uniform(own * w2_n, -1.0f, 1.0f);
  DeviceBuffer<uint16_t> dx(x), dgy(gy), dw13(w13), dw2(w2);
  DeviceBuffer<uint16_t> dw13_own(std::vector<uint16_t>(w13.begin(), w13.begin() + own * w13_n)),
      dw13_rep(std::vector<uint16_t>(w13.begin() + own * w13_n, w13.end())),
      dw2_own(std::vector<uint16_t>(w2.begin(), w2.begin() + own * w2_n)),
      dw2_rep(std::vector<uint16_t>(w2.begin() + own * w2_n, w2.end()));
  DeviceBuffer<float> ds(scores);

  struct Outputs {  // every output of the six kernels, poisoned
    DeviceBuffer<uint16_t> a, h13, y, gh, a2, gx;
    DeviceBuffer<float> gs, gw2, gw13, rep_gw2, rep_gw13;
    Outputs(int64_t R, int64_t D, int64_t F, int64_t E_own, int64_t E_rep, int64_t P)
        : a(std::vector<uint16_t>(R * F, kBf16Poison)), h13(std::vector<uint16_t>(R * 2 * F, kBf16Poison)),
          y(std::vector<uint16_t>(R * D, kBf16Poison)), gh(std::vector<uint16_t>(R * 2 * F, kBf16Poison)),
          a2(std::vector<uint16_t>(R * F, kBf16Poison)), gx(std::vector<uint16_t>(R * D, kBf16Poison)),
          gs(std::vector<float>(R * P, 0.0f)), gw2(std::vector<float>(E_own * D * F, fp32_poison())),
          gw13(std::vector<float>(E_own * 2 * F * D, fp32_poison())),
          rep_gw2(std::vector<float>(std::max<int64_t>(E_rep, 1) * D * F, fp32_poison())),
          rep_gw13(std::vector<float>(std::max<int64_t>(E_rep, 1) * 2 * F * D, fp32_poison())) {}
  };
  auto run = [&](const GroupedRows& rows, Outputs& o, const void* w13_own, const void* w13_rep, const void* w2_own,
                 const void* w2_rep, bool accumulate) {
    sm90::FpropW13Args f13{dx.ptr, w13_own, o.a.ptr, o.h13.ptr};
    f13.replica_w13_E2FD = w13_rep;
    sm90::FpropW2Args f2{o.a.ptr, w2_own, ds.ptr, o.y.ptr};
    f2.replica_w2_EDF = w2_rep;
    sm90::DgradW2Args g2{dgy.ptr, w2_own, o.h13.ptr, ds.ptr, o.gh.ptr, o.a2.ptr, o.gs.ptr};
    g2.replica_w2_EDF = w2_rep;
    sm90::DgradW13Args g13{o.gh.ptr, w13_own, o.gx.ptr};
    g13.replica_w13_E2FD = w13_rep;
    sm90::WgradOutput o2{o.gw2.ptr, DType::fp32, accumulate, o.rep_gw2.ptr};
    sm90::WgradOutput o13{o.gw13.ptr, DType::fp32, accumulate, o.rep_gw13.ptr};
    sm90::expert_mlp_fprop_w13(rows, fx.shape, f13, nullptr);
    sm90::expert_mlp_fprop_w2(rows, fx.shape, f2, nullptr);
    sm90::expert_mlp_dgrad_w2(rows, fx.shape, g2, nullptr);
    sm90::expert_mlp_dgrad_w13(rows, fx.shape, g13, nullptr);
    sm90::expert_mlp_wgrad_w2(rows, fx.shape, dgy.ptr, o.a2.ptr, o2, nullptr);
    sm90::expert_mlp_wgrad_w13(rows, fx.shape, o.gh.ptr, dx.ptr, o13, nullptr);
    cuda_ok(cudaDeviceSynchronize(), "replica run");
  };
  const int64_t P = sm90::dgrad_w2_score_partials(fx.shape);
  Outputs one(R, D, F, E, 0, P), split(R, D, F, own, reps, P);
  run(fx.rows, one, dw13.ptr, nullptr, dw2.ptr, nullptr, false);
  GroupedRows rows = fx.rows;
  rows.first_replica = own;
  split.gw2.upload(prior_w2);
  split.gw13.upload(prior_w13);
  run(rows, split, dw13_own.ptr, dw13_rep.ptr, dw2_own.ptr, dw2_rep.ptr, true);

  for (auto [a, b, what] : {std::tuple{&one.a, &split.a, "a_RF"}, {&one.h13, &split.h13, "h13_R2F"},
                            {&one.y, &split.y, "y_RD"}, {&one.gh, &split.gh, "grad_h13_R2F"},
                            {&one.a2, &split.a2, "a_RF (dgrad)"}, {&one.gx, &split.gx, "grad_x_RD"}})
    EXPECT_TRUE(a->download() == b->download()) << what << " differs between one buffer and split weights";
  EXPECT_TRUE(one.gs.download() == split.gs.download())
      << "grad_score_partials_RP differs between one buffer and split weights";

  auto check_wgrad = [&](const DeviceBuffer<float>& ref_all, const DeviceBuffer<float>& own_out,
                         const DeviceBuffer<float>& rep_out, const std::vector<float>& prior, int64_t per_expert,
                         const char* what) {
    const auto ref = ref_all.download(), got_own = own_out.download(), got_rep = rep_out.download();
    int64_t own_bad = 0, rep_bad = 0, poison_lost = 0;
    for (int64_t i = 0; i < own * per_expert; ++i) own_bad += got_own[i] != prior[i] + ref[i];
    for (int64_t e = 0; e < reps; ++e) {
      const bool empty = fx.cs.counts[own + e] == 0;
      for (int64_t i = 0; i < per_expert; ++i) {
        const float v = got_rep[e * per_expert + i];
        if (empty) poison_lost += !std::isnan(v);
        else rep_bad += v != ref[(own + e) * per_expert + i];
      }
    }
    EXPECT_EQ(own_bad, 0) << what << ": own experts != prior + one-buffer gradient";
    EXPECT_EQ(rep_bad, 0) << what << ": replica gradients != one-buffer gradient";
    EXPECT_EQ(poison_lost, 0) << what << ": an empty replica slot was written";
  };
  check_wgrad(one.gw2, split.gw2, split.rep_gw2, prior_w2, w2_n, "grad_w2");
  check_wgrad(one.gw13, split.gw13, split.rep_gw13, prior_w13, w13_n, "grad_w13");
}

// One wgrad launch writing fp32 gradients for the own experts and bf16 ones for the replicas: the
// general wgrad kernel then runs TMA-staged fp32 tiles and direct bf16 tiles, whose warp staging
// reuses the buffer the fp32 tiles' TMA stores read from (D = 2048, F = 512: 160-320 tiles, so
// clusters run several and cross from own to replica experts). The own gradients must equal a one-buffer fp32 run bit
// for bit, the replicas a one-buffer bf16 run (the bf16-overwrite kernel), an empty replica slot
// keeps its poison.
TEST(ExpertMlpReplicas, Fp32OwnAndBf16ReplicaGradientsInOneLaunch) {
  if (!have_sm90()) GTEST_SKIP() << "needs an SM90 GPU";
  // Experts 0-2 own, 3-5 replicas; replica 3 has no rows.
  Fixture fx(Case{"mixed_wgrad", {300, 77, 129, 0, 200, 64}, 2048, 512, W13Layout::gate_up_blocked, false, 53});
  const int64_t D = fx.cs.D, F = fx.cs.F, E = fx.E(), own = 3, reps = E - own;
  Rng rng(53);
  DeviceBuffer<uint16_t> gy(random_rows(rng, fx.l, D, 1.0f)), a(random_rows(rng, fx.l, F, 1.0f)),
      gh(random_rows(rng, fx.l, 2 * F, 1.0f)), x(random_rows(rng, fx.l, D, 1.0f));
  GroupedRows split_rows = fx.rows;
  split_rows.first_replica = own;
  for (const bool w13 : {false, true}) {
    SCOPED_TRACE(w13 ? "wgrad_w13" : "wgrad_w2");
    const int64_t per_expert = w13 ? 2 * F * D : D * F;
    auto launch = [&](const GroupedRows& rows, const sm90::WgradOutput& out) {
      if (w13) sm90::expert_mlp_wgrad_w13(rows, fx.shape, gh.ptr, x.ptr, out, nullptr);
      else sm90::expert_mlp_wgrad_w2(rows, fx.shape, gy.ptr, a.ptr, out, nullptr);
      cuda_ok(cudaDeviceSynchronize(), "wgrad");
    };
    DeviceBuffer<float> ref32(std::vector<float>(E * per_expert, fp32_poison()));
    DeviceBuffer<uint16_t> ref16(std::vector<uint16_t>(E * per_expert, kBf16Poison));
    launch(fx.rows, {ref32.ptr, DType::fp32, false});
    launch(fx.rows, {ref16.ptr, DType::bf16, false});
    DeviceBuffer<float> own32(std::vector<float>(own * per_expert, fp32_poison()));
    DeviceBuffer<uint16_t> rep16(std::vector<uint16_t>(reps * per_expert, kBf16Poison));
    launch(split_rows, {own32.ptr, DType::fp32, false, rep16.ptr, DType::bf16});

    const auto want32 = ref32.download(), got32 = own32.download();
    const auto want16 = ref16.download(), got16 = rep16.download();
    int64_t own_bad = 0, rep_bad = 0, poison_lost = 0;
    for (int64_t i = 0; i < own * per_expert; ++i) own_bad += std::memcmp(&got32[i], &want32[i], 4) != 0;
    for (int64_t e = 0; e < reps; ++e) {
      const bool empty = fx.cs.counts[own + e] == 0;
      for (int64_t i = 0; i < per_expert; ++i) {
        const uint16_t v = got16[e * per_expert + i];
        if (empty) poison_lost += v != kBf16Poison;
        else rep_bad += v != want16[(own + e) * per_expert + i];
      }
    }
    EXPECT_EQ(own_bad, 0) << "own fp32 gradients != the one-buffer fp32 run";
    EXPECT_EQ(rep_bad, 0) << "replica bf16 gradients != the one-buffer bf16 run";
    EXPECT_EQ(poison_lost, 0) << "an empty replica slot was written";
  }
}

// A graph captured once replays for any routing: change counts/offsets on the device, replay.
TEST(ExpertMlpGraph, ReplaysWithNewRoutingWithoutRecapture) {
  if (!have_sm90()) GTEST_SKIP() << "needs an SM90 GPU";
  const int64_t D = 192, F = 128, E = 3, R = 1024;
  Rng rng(31);
  const auto w2 = rng.bf16_normal(E * D * F, 1.0f / std::sqrt(float(F)));
  auto a = rng.bf16_normal(R * F, 1.0f);
  DeviceBuffer<uint16_t> da(a), dw(w2), dy(R * D);
  DeviceBuffer<int32_t> offsets(3), counts(3), tile_counters(std::vector<int32_t>{0, 0});
  DeviceBuffer<unsigned long long> fault_word(std::vector<unsigned long long>{0});
  ExpertMlpShape shape;
  shape.hidden_dim = D;
  shape.intermediate_dim = F;
  GroupedRows rows{offsets.ptr, counts.ptr, E, R};
  rows.tile_counters = tile_counters.ptr;  // each replay must leave them zero for the next
  rows.faults.word = fault_word.ptr;

  cudaStream_t stream;
  cuda_ok(cudaStreamCreate(&stream), "stream");
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  sm90::expert_mlp_fprop_w2(rows, shape, {da.ptr, dw.ptr, nullptr, dy.ptr}, stream);
  cuda_ok(cudaStreamEndCapture(stream, &graph), "end capture");
  cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");

  for (const auto& routing : {std::vector<int32_t>{100, 200, 0}, std::vector<int32_t>{0, 50, 700}}) {
    const RowLayout l = make_layout(routing);
    ASSERT_LE(l.rows, R);
    offsets.upload(l.offsets);
    counts.upload(l.counts);
    cuda_ok(cudaMemset(dy.ptr, 0xff, R * D * 2), "poison");  // 0xffff: bf16 NaN
    cuda_ok(cudaGraphLaunch(exec, stream), "graph launch");
    cuda_ok(cudaStreamSynchronize(stream), "replay");
    RowLayout lr = l;
    lr.rows = R;
    const auto ref = ref_rows_gemm(lr, to_double(a), F, to_double(w2), D, true);
    const auto out = dy.download();
    ErrorAccumulator acc;
    int64_t written_padding = 0;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t d = 0; d < D; ++d) {
        if (lr.is_row_valid(r)) acc.add(from_bf16(out[r * D + d]), ref[r * D + d]);
        else if (out[r * D + d] != 0xffff) ++written_padding;
      }
    auto c = acc.finish();
    c.poison_lost = written_padding;
    expect_close(c, kBf16Tolerance, "y_RD after graph replay");
    EXPECT_EQ(tile_counters.download(), (std::vector<int32_t>{0, 0})) << "tile counters after a replay";
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// A stage whose load never arrives (fault injection, CTA 0's first stage): every pipeline wait is
// bounded, so the launch gives up instead of hanging the stream, take_pipeline_fault names the
// CTA and barrier, and the next launch on the same CUDA context is correct again. The fprop W2
// kernel runs on 2-CTA clusters.
TEST(ExpertMlpWatchdog, StalledStageIsReportedAndTheNextLaunchIsCorrect) {
  if (!have_sm90()) GTEST_SKIP() << "needs an SM90 GPU";
  Fixture fx(Case{"watchdog", {300, 0, 129, 500}, 192, 128, W13Layout::gate_up_blocked, false, 41});
  const int64_t R = fx.l.rows, D = fx.cs.D, F = fx.cs.F;
  Rng rng(43);
  const FpropW2Inputs in(fx, rng);
  DeviceBuffer<uint16_t> dy(std::vector<uint16_t>(R * D, kBf16Poison));
  GroupedRows stalled = fx.rows;
  stalled.faults.wait_timeout_ns = 20'000'000u;  // 20 ms
  stalled.faults.drop_first_stage_for_tests = true;
  sm90::expert_mlp_fprop_w2(stalled, fx.shape, {in.da.ptr, in.dw2.ptr, nullptr, dy.ptr}, nullptr);
  const sm90::PipelineFault fault = fx.take_fault();  // returns: the launch drained
  EXPECT_TRUE(fault.occurred);
  // CTA 0 dropped the stage; its pair peer misses CTA 0's multicast half and may time out first.
  EXPECT_LT(fault.block, 2) << "only CTA 0 dropped a stage";
  EXPECT_FALSE(fx.take_fault().occurred) << "the record is cleared once read";
  EXPECT_EQ(fx.tile_counters.download(), (std::vector<int32_t>{0, 0})) << "the drained launch reset its counters";

  dy.upload(std::vector<uint16_t>(R * D, kBf16Poison));
  sm90::expert_mlp_fprop_w2(fx.rows, fx.shape, {in.da.ptr, in.dw2.ptr, nullptr, dy.ptr}, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "fprop_w2 after the fault");
  EXPECT_FALSE(fx.take_fault().occurred);
  const auto y_ref = ref_rows_gemm(fx.l, to_double(in.a), F, to_double(in.w2), D, true);
  expect_close(compare_rows_bf16(dy.download(), y_ref, fx.l, D), kBf16Tolerance, "y_RD after the fault");
}

// Each kind of device fault reads as what it is (runs without a GPU: ctest's test_expert_mlp_validation).
TEST(ExpertMlpValidation, PipelineFaultsAreDescribedByKind) {
  sm90::PipelineFault f;
  EXPECT_EQ(sm90::describe(f), "");
  f.occurred = true;
  f.block = 3;
  f.thread = 130;
  f.barrier = 0x1c040;
  f.parity = 1;
  EXPECT_EQ(sm90::describe(f), "a pipeline wait timed out (block 3, thread 130, barrier at shared offset 114752, "
                               "parity 1); that launch's outputs are invalid");
  f.barrier = f.parity = 0;
  f.bad_origin = true;
  EXPECT_EQ(sm90::describe(f), "a row's row_origin_R entry named no slot of its owners (block 3, thread 130): the "
                               "row scatter stored it nowhere");
}

// Host validation names the argument and launches nothing, before any TMA descriptor is encoded
// (runs without a GPU too: ctest's test_expert_mlp_validation, label cpu).
TEST(ExpertMlpValidation, RejectsBadArgumentsByName) {
  int32_t* fake = reinterpret_cast<int32_t*>(0x1000);
  GroupedRows rows{fake, fake, 4, 1024};
  rows.faults.word = reinterpret_cast<unsigned long long*>(fake);
  ExpertMlpShape shape;
  shape.hidden_dim = 256;
  shape.intermediate_dim = 128;
  const sm90::FpropW13Args ok{fake, fake, fake, nullptr};
  auto name_of = [](auto&& fn) -> std::string {
    try { fn(); } catch (const InvalidArgument& e) { return e.name(); }
    return "<no error>";
  };
  ExpertMlpShape bad = shape;
  bad.hidden_dim = 100;
  EXPECT_EQ(name_of([&] { sm90::expert_mlp_fprop_w13(rows, bad, ok, nullptr); }), "hidden_dim");
  bad = shape;
  bad.intermediate_dim = 0;
  EXPECT_EQ(name_of([&] { sm90::expert_mlp_fprop_w2(rows, bad, {fake, fake, nullptr, fake}, nullptr); }), "intermediate_dim");
  EXPECT_EQ(name_of([&] { sm90::expert_mlp_fprop_w13(rows, shape, {nullptr, fake, fake, nullptr}, nullptr); }), "x_RD");
  EXPECT_EQ(name_of([&] { sm90::expert_mlp_dgrad_w2(rows, shape, {fake, fake, nullptr, nullptr, fake, nullptr, nullptr}, nullptr); }), "h13_R2F");
  GroupedRows no_experts = rows;
  no_experts.num_experts = 0;
  EXPECT_EQ(name_of([&] { sm90::expert_mlp_fprop_w13(no_experts, shape, ok, nullptr); }), "num_experts");
  GroupedRows no_offsets = rows;
  no_offsets.row_offsets_E = nullptr;
  EXPECT_EQ(name_of([&] { sm90::expert_mlp_dgrad_w13(no_offsets, shape, {fake, fake, fake}, nullptr); }), "row_offsets_E");
  EXPECT_EQ(name_of([&] { sm90::expert_mlp_wgrad_w2(rows, shape, fake, fake, {nullptr, DType::fp32, false}, nullptr); }), "grad_w");
  ExpertMlpShape clamp = shape;
  clamp.activation = Activation::swiglu_clamped;
  clamp.swiglu_limit = -1.0f;
  EXPECT_EQ(name_of([&] { sm90::expert_mlp_fprop_w13(rows, clamp, ok, nullptr); }), "swiglu_limit");
  GroupedRows misaligned_counters = rows;
  misaligned_counters.tile_counters = reinterpret_cast<int32_t*>(0x1002);
  EXPECT_EQ(name_of([&] { sm90::expert_mlp_fprop_w13(misaligned_counters, shape, ok, nullptr); }), "tile_counters");
  GroupedRows bad_split = rows;
  bad_split.first_replica = 5;
  EXPECT_EQ(name_of([&] { sm90::expert_mlp_fprop_w13(bad_split, shape, ok, nullptr); }), "first_replica");
  GroupedRows split = rows;
  split.first_replica = 2;
  EXPECT_EQ(name_of([&] { sm90::expert_mlp_fprop_w13(split, shape, ok, nullptr); }), "replica_w13_E2FD");
  EXPECT_EQ(name_of([&] { sm90::expert_mlp_fprop_w2(split, shape, {fake, fake, nullptr, fake}, nullptr); }), "replica_w2_EDF");
  EXPECT_EQ(name_of([&] { sm90::expert_mlp_wgrad_w13(split, shape, fake, fake, {fake, DType::fp32, false}, nullptr); }),
            "replica_grad_w");
  sm90::FpropW13Args h13_split{fake, fake, fake, fake};
  h13_split.h13_split = {100, fake};  // not a multiple of 128
  EXPECT_EQ(name_of([&] { sm90::expert_mlp_fprop_w13(rows, shape, h13_split, nullptr); }), "h13_split.split_row");
  h13_split.h13_split = {2048, fake};  // past max_rows
  EXPECT_EQ(name_of([&] { sm90::expert_mlp_fprop_w13(rows, shape, h13_split, nullptr); }), "h13_split.split_row");
  sm90::DgradW2Args dgrad_split{fake, fake, fake, nullptr, fake, nullptr, nullptr};
  dgrad_split.h13_split = {128, nullptr};
  EXPECT_EQ(name_of([&] { sm90::expert_mlp_dgrad_w2(rows, shape, dgrad_split, nullptr); }), "h13_split.hi_R2F");
  auto row_scatter = [&](void* y, const sm90::RowScatter& scatter) {
    sm90::FpropW2Args f{fake, fake, nullptr, y};
    f.scatter = scatter;
    return name_of([&] { sm90::expert_mlp_fprop_w2(rows, shape, f, nullptr); });
  };
  char* const* fake_bases = reinterpret_cast<char* const*>(fake);
  const int32_t* fake_origin = reinterpret_cast<const int32_t*>(fake);
  EXPECT_EQ(row_scatter(fake, {fake_origin, fake_bases, 0, 8, 2}), "y_RD");
  EXPECT_EQ(row_scatter(nullptr, {fake_origin, nullptr, 0, 8, 2}), "scatter.owner_bases");
  EXPECT_EQ(row_scatter(nullptr, {fake_origin, fake_bases, 8, 8, 2}), "scatter.slot_offset");
  EXPECT_EQ(row_scatter(nullptr, {fake_origin, fake_bases, 0, 0, 2}), "scatter.slots_per_owner");
  EXPECT_EQ(row_scatter(nullptr, {fake_origin, fake_bases, 0, int64_t{1} << 30, 2}), "scatter.owners");
  sm90::DgradW13Args dgrad_scatter{fake, fake, fake};
  dgrad_scatter.scatter = {fake_origin, fake_bases, 0, 8, 2};
  EXPECT_EQ(name_of([&] { sm90::expert_mlp_dgrad_w13(rows, shape, dgrad_scatter, nullptr); }), "grad_x_RD");
  GroupedRows no_fault_word = rows;
  no_fault_word.faults.word = nullptr;
  EXPECT_EQ(name_of([&] { sm90::expert_mlp_fprop_w13(no_fault_word, shape, ok, nullptr); }), "faults.word");
  GroupedRows no_wait = rows;
  no_wait.faults.wait_timeout_ns = 0;
  EXPECT_EQ(name_of([&] { sm90::expert_mlp_fprop_w13(no_wait, shape, ok, nullptr); }), "faults.wait_timeout_ns");
  EXPECT_EQ(name_of([&] { sm90::take_pipeline_fault(no_fault_word.faults, nullptr); }), "faults.word");
}

// The SwiGLU-backward GEMM loads h13 by TMA: a buffer TMA cannot read is named before any launch.
// (Its descriptors come after those of the GEMM operands, which need the CUDA driver.)
TEST(ExpertMlpValidation, MisalignedH13IsNamedBeforeLaunch) {
  if (!have_sm90()) GTEST_SKIP() << "needs an SM90 GPU (the driver encodes the operand descriptors first)";
  int32_t* fake = reinterpret_cast<int32_t*>(0x1000);
  GroupedRows rows{fake, fake, 4, 1024};
  rows.faults.word = reinterpret_cast<unsigned long long*>(fake);
  ExpertMlpShape shape;
  shape.hidden_dim = 256;
  shape.intermediate_dim = 128;
  void* misaligned = reinterpret_cast<uint8_t*>(fake) + 2;
  std::string name = "<no error>";
  try {
    sm90::expert_mlp_dgrad_w2(rows, shape, {fake, fake, misaligned, nullptr, fake, nullptr, nullptr}, nullptr);
  } catch (const InvalidArgument& e) {
    name = e.name();
  }
  EXPECT_EQ(name, "h13_R2F");
}

}  // namespace
}  // namespace poise::test
