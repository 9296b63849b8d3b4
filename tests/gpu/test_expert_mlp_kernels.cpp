// Expert-MLP kernels (sm90) against float64 host computations on fresh random inputs.
// Outputs are poisoned (NaN) before every run; rows no expert owns are NaN in every input and
// must keep their poison in every output. Shapes cover experts with 0 rows, one expert holding
// all rows, D or F = 64 x odd, many tiles per CTA, both W13 layouts and both activations.

#include "expert_mlp_checks.hpp"

namespace poise::test {
namespace {

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
    check_row_scatter(fx.l, fx.cs.D, fx.cs.seed + 11, dy.download(), [&](const sm90::RowScatter& scatter) {
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
  check_row_scatter(fx.l, fx.cs.D, fx.cs.seed + 12, dgx.download(), [&](const sm90::RowScatter& scatter) {
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
  check_row_scatter(fx.l, fx.cs.D, 55, dy.download(), [&](const sm90::RowScatter& scatter) {
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
  const DgradW2Ref ref = ref_dgrad_w2(fx.l, gacc, h13, scores.data(), F, fx.cs.layout, fx.act);
  const auto &gh_ref = ref.grad_h13, &a_ref = ref.a, &gs_ref = ref.grad_scores;
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
