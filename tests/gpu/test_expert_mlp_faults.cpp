// Expert-MLP faults: a stalled stage is bounded and reported, faults read as their kind, bad
// arguments are named before any launch (the validation tests run without a GPU).

#include "expert_mlp_checks.hpp"
#include "testing/rejected_name.hpp"

namespace poise::test {

using poise::testing::rejected_name;
namespace {

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
  int32_t* fake = kFakeAddress;
  const GroupedRows rows = fake_grouped_rows();
  const ExpertMlpShape shape = validation_shape();
  const sm90::FpropW13Args ok{fake, fake, fake, nullptr};
  ExpertMlpShape bad = shape;
  bad.hidden_dim = 100;
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_fprop_w13(rows, bad, ok, nullptr); }), "hidden_dim");
  bad = shape;
  bad.intermediate_dim = 0;
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_fprop_w2(rows, bad, {fake, fake, nullptr, fake}, nullptr); }), "intermediate_dim");
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_fprop_w13(rows, shape, {nullptr, fake, fake, nullptr}, nullptr); }), "x_RD");
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_dgrad_w2(rows, shape, {fake, fake, nullptr, nullptr, fake, nullptr, nullptr}, nullptr); }), "h13_R2F");
  GroupedRows no_experts = rows;
  no_experts.num_experts = 0;
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_fprop_w13(no_experts, shape, ok, nullptr); }), "num_experts");
  GroupedRows no_offsets = rows;
  no_offsets.row_offsets_E = nullptr;
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_dgrad_w13(no_offsets, shape, {fake, fake, fake}, nullptr); }), "row_offsets_E");
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_wgrad_w2(rows, shape, fake, fake, {nullptr, DType::fp32, false}, nullptr); }), "grad_w");
  ExpertMlpShape clamp = shape;
  clamp.activation = Activation::swiglu_clamped;
  clamp.swiglu_limit = -1.0f;
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_fprop_w13(rows, clamp, ok, nullptr); }), "swiglu_limit");
  GroupedRows misaligned_counters = rows;
  misaligned_counters.tile_counters = reinterpret_cast<int32_t*>(0x1002);
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_fprop_w13(misaligned_counters, shape, ok, nullptr); }), "tile_counters");
  GroupedRows bad_split = rows;
  bad_split.first_replica = 5;
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_fprop_w13(bad_split, shape, ok, nullptr); }), "first_replica");
  GroupedRows split = rows;
  split.first_replica = 2;
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_fprop_w13(split, shape, ok, nullptr); }), "replica_w13_E2FD");
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_fprop_w2(split, shape, {fake, fake, nullptr, fake}, nullptr); }), "replica_w2_EDF");
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_wgrad_w13(split, shape, fake, fake, {fake, DType::fp32, false}, nullptr); }),
            "replica_grad_w");
  sm90::FpropW13Args h13_split{fake, fake, fake, fake};
  h13_split.h13_split = {100, fake};  // not a multiple of 128
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_fprop_w13(rows, shape, h13_split, nullptr); }), "h13_split.split_row");
  h13_split.h13_split = {2048, fake};  // past max_rows
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_fprop_w13(rows, shape, h13_split, nullptr); }), "h13_split.split_row");
  sm90::DgradW2Args dgrad_split{fake, fake, fake, nullptr, fake, nullptr, nullptr};
  dgrad_split.h13_split = {128, nullptr};
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_dgrad_w2(rows, shape, dgrad_split, nullptr); }), "h13_split.hi_R2F");
  auto row_scatter = [&](void* y, const sm90::RowScatter& scatter) {
    sm90::FpropW2Args f{fake, fake, nullptr, y};
    f.scatter = scatter;
    return rejected_name([&] { sm90::expert_mlp_fprop_w2(rows, shape, f, nullptr); });
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
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_dgrad_w13(rows, shape, dgrad_scatter, nullptr); }), "grad_x_RD");
  GroupedRows no_fault_word = rows;
  no_fault_word.faults.word = nullptr;
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_fprop_w13(no_fault_word, shape, ok, nullptr); }), "faults.word");
  GroupedRows no_wait = rows;
  no_wait.faults.wait_timeout_ns = 0;
  EXPECT_EQ(rejected_name([&] { sm90::expert_mlp_fprop_w13(no_wait, shape, ok, nullptr); }), "faults.wait_timeout_ns");
  EXPECT_EQ(rejected_name([&] { sm90::take_pipeline_fault(no_fault_word.faults, nullptr); }), "faults.word");
}

// The SwiGLU-backward GEMM loads h13 by TMA: a buffer TMA cannot read is named before any launch.
// (Its descriptors come after those of the GEMM operands, which need the CUDA driver.)
TEST(ExpertMlpValidation, MisalignedH13IsNamedBeforeLaunch) {
  if (!have_sm90()) GTEST_SKIP() << "needs an SM90 GPU (the driver encodes the operand descriptors first)";
  int32_t* fake = kFakeAddress;
  const GroupedRows rows = fake_grouped_rows();
  const ExpertMlpShape shape = validation_shape();
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
