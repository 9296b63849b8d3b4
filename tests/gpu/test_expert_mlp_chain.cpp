// The expert-MLP GEMMs chained as the pipeline chains them, and what must not change a bit:
// tile order, h13 split across buffers, replica weight maps, CUDA graph replay.

#include "expert_mlp_checks.hpp"

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

}  // namespace
}  // namespace poise::test
