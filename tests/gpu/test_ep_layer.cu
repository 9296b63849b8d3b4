// The staged EP pipeline over virtual ranks against the float64 model of the whole layer:
// forward and backward, R in {1, 2, 4, 8}, random and adversarial routings, capacity mode.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "runtime/device_info.hpp"
#include "gemm/sm90/expert_mlp.hpp"
#include "poise/errors.hpp"
#include "test_ep_world.hpp"
#include "testing/rejected_name.hpp"

namespace poise::ep::testing {

using poise::testing::rejected_name;
namespace {

// Every (t, k) sits in its expert's group on its destination rank, no two share a row, and the
// destination's metadata points back at it (origin) and at the row that carries its bytes (primary).
void check_layout(EpWorld& w, const std::vector<ModelOut>& model) {
  const LayerCase& c = w.c();
  const int EL = c.E / c.R;
  std::vector<LayoutSnapshot> snaps;
  for (int r = 0; r < c.R; ++r) snaps.push_back(w.pipeline().snapshot(r));
  for (int d = 0; d < c.R; ++d) {
    const LayoutSnapshot& s = snaps[d];
    for (int j = 0; j < EL; ++j) {
      EXPECT_EQ(s.group_offsets[j] % 128, 0) << "rank " << d << " group " << j;
      EXPECT_EQ(s.group_counts[j], model[d].rows_per_local_expert[j]) << "rank " << d << " group " << j;
      const int next = j + 1 < EL ? s.group_offsets[j + 1] : s.group_offsets[EL];
      EXPECT_LE(s.group_offsets[j] + s.group_counts[j], next);
    }
  }
  std::set<std::pair<int, int>> used;
  for (int src = 0; src < c.R; ++src) {
    const auto& ids = w.host()[src].ids_TK;
    for (int t = 0; t < c.T; ++t) {
      std::map<int, int> primary_row;  // dest rank -> row of the token's first k there
      for (int k = 0; k < c.K; ++k) {
        const size_t i = size_t(t) * c.K + k;
        const int e = ids[i], d = e / EL, j = e % EL;
        const int row = snaps[src].dest_row_TK[i];
        const LayoutSnapshot& s = snaps[d];
        ASSERT_GE(row, s.group_offsets[j]) << "src " << src << " t " << t << " k " << k;
        ASSERT_LT(row, s.group_offsets[j] + s.group_counts[j]) << "src " << src << " t " << t << " k " << k;
        ASSERT_TRUE(used.insert({d, row}).second) << "row " << row << " of rank " << d << " used twice";
        EXPECT_EQ(s.row_origin[row], src * c.T * c.K + int(i));
        // The primary is the token's first row on a rank; the rank's own entries' rows are all
        // written by its dispatch, the others' copied from the primary (the outputs check both).
        if (!primary_row.count(d)) primary_row[d] = row;
        EXPECT_EQ(s.row_primary[row], primary_row[d]) << "src " << src << " t " << t << " k " << k;
      }
    }
  }
}

class EpLayer : public ::testing::TestWithParam<LayerCase> {};

// Every gradient a backward wrote, as bytes: grad_x, grad_scores, grad_w13, grad_w2.
std::vector<std::vector<uint8_t>> gradient_bytes(const RankDevice& d) {
  std::vector<std::vector<uint8_t>> out;
  for (const DeviceArray* a : {d.grad_x.get(), d.grad_scores.get(), d.grad_w13.get(), d.grad_w2.get()})
    out.push_back(a->download<uint8_t>(a->bytes));
  return out;
}

TEST_P(EpLayer, ForwardBackwardMatchFloat64Model) {
  if (!have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const LayerCase& c = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  EpWorld w(c, seed);
  const auto model = run_model(w.shape(), w.host());
  cudaStream_t stream;
  EP_CUDA_OK(cudaStreamCreate(&stream));
  ASSERT_NO_FATAL_FAILURE(run_pass(w, stream));
  check_layout(w, model);

  std::vector<std::vector<uint16_t>> first_out(c.R);
  std::vector<std::vector<std::vector<uint8_t>>> first_grads(c.R);
  for (int r = 0; r < c.R; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    RankDevice& d = w.dev()[r];
    first_out[r] = d.out->download<uint16_t>(size_t(c.T) * c.D);
    first_grads[r] = gradient_bytes(d);
    check_rows(bf16_values(first_out[r]), model[r].out_TD, c.T, c.D, "out_TD");
    check_rows(bf16_values(d.grad_x->download<uint16_t>(size_t(c.T) * c.D)), model[r].grad_x_TD, c.T, c.D,
               "grad_x_TD", &model[r].grad_x_clamp_slack_T);
    EXPECT_LT(relative_error(w.scores_as_double(*d.grad_scores), model[r].grad_scores_TK), kTolerance)
        << "grad_scores_TK";
    check_weight_grads(w, model, r);
    check_clip_counts(w, model, r);
  }

  // Deterministic: the same inputs give the same bits, forward and backward (every sum has a fixed
  // order; accumulating weight grads add onto the first run's, so only the overwrite case compares).
  w.poison_outputs();
  w.forward(stream);
  if (!c.accumulate) w.backward(stream);
  ASSERT_NO_THROW(w.pipeline().check(stream));
  for (int r = 0; r < c.R; ++r) {
    EXPECT_EQ(w.dev()[r].out->download<uint16_t>(size_t(c.T) * c.D), first_out[r]) << "rank " << r << " run 2";
    if (!c.accumulate) EXPECT_TRUE(gradient_bytes(w.dev()[r]) == first_grads[r]) << "rank " << r << " run 2 gradients";
  }

  EP_CUDA_OK(cudaStreamDestroy(stream));
}

INSTANTIATE_TEST_SUITE_P(
    Routings, EpLayer,
    ::testing::Values(
        LayerCase{1, 100, 192, 128, 8, 4},
        LayerCase{2, 77, 128, 192, 8, 3},
        LayerCase{4, 64, 192, 128, 16, 4},
        LayerCase{8, 48, 192, 128, 32, 4},
        LayerCase{4, 64, 128, 128, 16, 4, Routing::hot_expert, 3.0},
        LayerCase{4, 64, 192, 128, 16, 4, Routing::hot_expert, 3.0},
        LayerCase{8, 40, 128, 128, 32, 4, Routing::same_rank, 2.0},
        LayerCase{4, 64, 192, 192, 16, 4, Routing::skip_last, 2.0},
        LayerCase{2, 64, 128, 128, 8, 2, Routing::random, 2.0, Activation::swiglu_clamped, DType::bf16, false, 0.75},
        LayerCase{8, 48, 128, 128, 16, 2, Routing::random, 2.0, Activation::swiglu, DType::fp32, true},
        LayerCase{4, 64, 192, 128, 16, 4, Routing::random, 2.0, Activation::swiglu_clamped, DType::fp32, false, 0.75,
                  W13Layout::gate_up_interleaved},
        LayerCase{4, 64, 128, 192, 16, 4, Routing::hot_expert, 3.0, Activation::swiglu, DType::fp32, false, 7.0,
                  W13Layout::gate_up_blocked, DType::bf16},
        LayerCase{2, 64, 128, 128, 8, 2, Routing::random, 2.0, Activation::swiglu, DType::bf16, true, 7.0,
                  W13Layout::gate_up_interleaved, DType::bf16}),
    [](const ::testing::TestParamInfo<LayerCase>& info) { return case_name(info.param); });

// Captured once, replayed for a different routing: the call has no host sync and static shapes.
TEST(EpLayerGraph, ReplayFollowsNewRouting) {
  if (!have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const LayerCase c{4, 64, 128, 128, 16, 4};
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  EpWorld w(c, seed);
  cudaStream_t stream;
  EP_CUDA_OK(cudaStreamCreate(&stream));
  // Warm-up outside capture (first launches load modules).
  w.forward(stream);
  w.backward(stream);
  ASSERT_NO_THROW(w.pipeline().check(stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  EP_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  w.forward(stream);
  w.backward(stream);
  EP_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  EP_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (Routing routing : {Routing::random, Routing::hot_expert}) {
    SCOPED_TRACE(to_string(routing));
    w.new_routing(routing);
    w.poison_outputs();
    const auto model = run_model(w.shape(), w.host());
    EP_CUDA_OK(cudaGraphLaunch(exec, stream));
    ASSERT_NO_THROW(w.pipeline().check(stream));
    for (int r = 0; r < c.R; ++r) {
      RankDevice& d = w.dev()[r];
      EXPECT_LT(relative_error(bf16_values(d.out->download<uint16_t>(size_t(c.T) * c.D)), model[r].out_TD),
                kTolerance) << "rank " << r;
      EXPECT_LT(relative_error(bf16_values(d.grad_x->download<uint16_t>(size_t(c.T) * c.D)), model[r].grad_x_TD),
                kTolerance) << "rank " << r;
    }
  }
  EP_CUDA_OK(cudaGraphExecDestroy(exec));
  EP_CUDA_OK(cudaGraphDestroy(graph));
  EP_CUDA_OK(cudaStreamDestroy(stream));
}

// More rows for one rank than planned: reported on every rank (the numbers are global), nothing
// written (no expert GEMM touches a row past the capacity), and the pipeline works again after reset().
TEST(EpLayerErrors, CapacityOverflowIsReportedThenRecovers) {
  if (!have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const LayerCase c{2, 256, 128, 128, 4, 2, Routing::random, 1.0};
  EpWorld w(c, fresh_seed(), 500'000'000ull);
  // Every token of both ranks to experts 0 and 1 (rank 0): rank 0 needs 2*T*K rows, capacity ~T*K.
  for (int r = 0; r < c.R; ++r) {
    for (size_t i = 0; i < w.host()[r].ids_TK.size(); ++i) w.host()[r].ids_TK[i] = int32_t(i % 2);
    w.dev()[r].ids->upload(w.host()[r].ids_TK);
  }
  cudaStream_t stream;
  EP_CUDA_OK(cudaStreamCreate(&stream));
  w.poison_outputs();
  w.forward(stream);
  try {
    w.pipeline().check(stream);
    FAIL() << "overflow not reported";
  } catch (const DeviceError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("capacity overflow"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank 0 would receive"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("timed out"), std::string::npos) << "overflow must stop all ranks together: " << msg;
  }
  // Nothing was combined: the outputs keep their poison.
  auto out = w.dev()[1].out->download<uint16_t>(size_t(c.T) * c.D);
  EXPECT_TRUE(std::isnan(from_bf16(out[0])));
  w.pipeline().reset();
  w.new_routing(Routing::random);
  w.poison_outputs();
  const auto model = run_model(w.shape(), w.host());
  w.forward(stream);
  ASSERT_NO_THROW(w.pipeline().check(stream));
  for (int r = 0; r < c.R; ++r) {
    EXPECT_LT(relative_error(bf16_values(w.dev()[r].out->download<uint16_t>(size_t(c.T) * c.D)), model[r].out_TD),
              kTolerance);
  }
  EP_CUDA_OK(cudaStreamDestroy(stream));
}

// An expert id out of range on one rank: that rank reports it (value and token) and tells its
// peers, which stop at the counts exchange at once (peer_failed), not after their wait bound.
TEST(EpLayerErrors, BadExpertIdIsReportedWithoutHang) {
  if (!have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const LayerCase c{4, 64, 128, 128, 16, 2};
  EpWorld w(c, fresh_seed(), 3'000'000'000ull);
  w.host()[1].ids_TK[7] = c.E + 3;
  w.dev()[1].ids->upload(w.host()[1].ids_TK);
  cudaStream_t stream;
  EP_CUDA_OK(cudaStreamCreate(&stream));
  const auto start = std::chrono::steady_clock::now();
  w.forward(stream);
  try {
    w.pipeline().check(stream);
    FAIL() << "bad id not reported";
  } catch (const DeviceError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("EP device error: rank 1, route (count): ids_TK holds expert id 19 at token 3", 0), 0u)
        << msg;
    EXPECT_NE(msg.find("stopped: rank 1 failed"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("timed out"), std::string::npos) << msg;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 2.0) << "the peers waited for their bound (3 s) instead of stopping at once";
  w.pipeline().reset();
  EP_CUDA_OK(cudaStreamDestroy(stream));
}

// A grouped-GEMM stage that never arrives (fault injection: CTA 0's producer drops its first stage in
// every SM90 expert GEMM): the bounded pipeline waits drain the launches, the pipeline's check()
// reports the GEMM fault by name (CTA, barrier, parity) as a DeviceError instead of a hang or a
// silent wrong result, and the next pass on the same CUDA context is correct again.
TEST(EpLayerErrors, StalledExpertGemmStageIsReportedThenRecovers) {
  if (!have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const LayerCase c{2, 64, 128, 128, 8, 2, Routing::random, 2.0};
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  EpWorld w(c, seed, 2'000'000'000ull);
  cudaStream_t stream;
  EP_CUDA_OK(cudaStreamCreate(&stream));
  ASSERT_NO_THROW(w.pipeline().check(stream)) << "a fault left over from an earlier test";

  w.pipeline().set_gemm_stall_for_tests(20'000'000u, true);  // 20 ms
  w.poison_outputs();
  w.forward(stream);
  std::string msg;
  try {
    w.pipeline().check(stream);
  } catch (const DeviceError& e) {
    msg = e.what();
  }
  w.pipeline().set_gemm_stall_for_tests(sm90::kPipelineWaitTimeoutNs, false);
  ASSERT_FALSE(msg.empty()) << "a dropped GEMM stage was not reported";
  EXPECT_NE(msg.find("SM90 expert GEMM: a pipeline wait timed out (block "), std::string::npos) << msg;
  EXPECT_NE(msg.find("barrier at shared offset"), std::string::npos) << msg;
  EXPECT_NE(msg.find("that launch's outputs are invalid"), std::string::npos) << msg;

  // The fault was read and cleared: the same world runs correctly on the same context.
  w.pipeline().reset();
  w.new_routing(Routing::random);
  const auto model = run_model(w.shape(), w.host());
  ASSERT_NO_FATAL_FAILURE(run_pass(w, stream));
  for (int r = 0; r < c.R; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    check_rows(bf16_values(w.dev()[r].out->download<uint16_t>(size_t(c.T) * c.D)), model[r].out_TD, c.T, c.D,
               "out_TD after the fault");
  }
  EP_CUDA_OK(cudaStreamDestroy(stream));
}

TEST(EpLayerErrors, HostRejectsBadArgumentsBeforeLaunch) {
  if (!have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const LayerCase c{2, 32, 128, 128, 4, 2};
  EpWorld w(c, fresh_seed());
  auto forward_name = [&](const std::vector<ForwardArgs>& bad) {
    return rejected_name([&] { w.pipeline().forward(bad, nullptr); });
  };
  auto args = w.forward_args();
  args[1].x_TD = nullptr;
  EXPECT_EQ(forward_name(args), "args[1].x_TD");
  args = w.forward_args();
  args.pop_back();
  EXPECT_THROW(w.pipeline().forward(args, nullptr), InvalidArgument);
  args = w.forward_args();
  args[0].out_TD = static_cast<char*>(args[0].out_TD) + 2;  // misaligned
  EXPECT_EQ(forward_name(args), "args[0].out_TD");
  // Per-call choices every rank must share: clip counts on all ranks or none, one W13 layout.
  args = w.forward_args();
  args[1].clip_counts_E2 = nullptr;
  EXPECT_EQ(forward_name(args), "args[1].clip_counts_E2");
  args = w.forward_args();
  args[1].w13_layout = W13Layout::gate_up_interleaved;
  EXPECT_EQ(forward_name(args), "args[1].w13_layout");
  // Backward: one weight-gradient dtype per call, refused before anything is launched.
  auto bwd = w.backward_args();
  bwd[1].wgrad_dtype = DType::bf16;
  EXPECT_EQ(rejected_name([&] { w.pipeline().backward(bwd, nullptr); }), "args[1].wgrad_dtype");
  Config exact = make_config(c);
  exact.balance = Balance::exact;
  PipelineOptions too_many_slots;  // exact balance is supported (test_ep_balance.cu); its options are checked
  too_many_slots.replica_slots = exact.num_local_experts(2) + 1;
  EXPECT_THROW(StagedPipeline::create_virtual(exact, 2, too_many_slots), InvalidArgument);
  Config too_many = make_config(c);
  too_many.num_experts = 16;
  EXPECT_THROW(StagedPipeline::create_virtual(too_many, 16), InvalidArgument);  // > 8 virtual ranks
}

}  // namespace
}  // namespace poise::ep::testing
