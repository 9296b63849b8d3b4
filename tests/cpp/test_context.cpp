// Context lifecycle and host-side argument validation of the routed_experts entry points.
#include <gtest/gtest.h>

#include "poise/poise.hpp"
#include "testing/rejected_name.hpp"

namespace poise {

using poise::testing::rejected_name;
namespace {

Config small_config() {
  Config c;
  c.num_local_input_tokens = 16;
  c.hidden_dim = 64;
  c.intermediate_dim = 64;
  c.top_k = 2;
  c.num_experts = 4;
  return c;
}

// Non-null placeholders: validation must fail on the named argument before anything dereferences them.
ForwardArgs fake_forward_args() {
  static int32_t dummy[4];
  ForwardArgs a;
  a.x_TD = a.scores_TK = a.w13 = a.w2 = dummy;
  a.ids_TK = dummy;
  a.out_TD = dummy;
  return a;
}

TEST(Context, LifecycleAndPlan) {
  auto ctx = Context::create(small_config(), 2, 1);
  EXPECT_EQ(ctx->ep_size(), 2);
  EXPECT_EQ(ctx->rank(), 1);
  EXPECT_EQ(ctx->plan().num_local_experts, 2);
  EXPECT_NO_THROW(ctx->reset());
  ctx->close();
  EXPECT_TRUE(ctx->closed());
  EXPECT_NO_THROW(ctx->close());  // closing twice is harmless
  EXPECT_EQ(rejected_name([&] { ctx->reset(); }), "context");
  EXPECT_EQ(rejected_name([&] { routed_experts_forward(*ctx, fake_forward_args(), nullptr); }), "context");
}

TEST(Context, SelectActivationSlotNamesTheBadArgument) {
  Config c = small_config();
  c.num_activation_slots = 2;
  c.max_moe_layers_per_activation_slot = 3;
  auto ctx = Context::create(c, 1, 0);
  EXPECT_NO_THROW(ctx->select_activation_slot(1, 3));
  EXPECT_EQ(ctx->recomputed_forwards(), 0);
  EXPECT_EQ(rejected_name([&] { ctx->select_activation_slot(2, 1); }), "slot");
  EXPECT_EQ(rejected_name([&] { ctx->select_activation_slot(-1, 1); }), "slot");
  EXPECT_EQ(rejected_name([&] { ctx->select_activation_slot(0, 0); }), "num_moe_layers_in_slot");
  EXPECT_EQ(rejected_name([&] { ctx->select_activation_slot(0, 4); }), "num_moe_layers_in_slot");
  c.inference = true;
  auto inference = Context::create(c, 1, 0);
  EXPECT_EQ(rejected_name([&] { inference->select_activation_slot(0, 1); }), "context");
  ctx->close();
  EXPECT_EQ(rejected_name([&] { ctx->select_activation_slot(0, 1); }), "context");
}

TEST(Context, CreateValidates) {
  EXPECT_EQ(rejected_name([] { Context::create(small_config(), 2, 2); }), "rank");
  EXPECT_EQ(rejected_name([] { Context::create(small_config(), 3, 0); }), "num_experts");
}

TEST(Context, ForwardNamesTheMissingArgument) {
  auto ctx = Context::create(small_config(), 1, 0);
  ForwardArgs a = fake_forward_args();
  a.ids_TK = nullptr;
  EXPECT_EQ(rejected_name([&] { routed_experts_forward(*ctx, a, nullptr); }), "ids_TK");
  a = fake_forward_args();
  a.out_TD = nullptr;
  EXPECT_EQ(rejected_name([&] { routed_experts_forward(*ctx, a, nullptr); }), "out_TD");
}

TEST(Context, StageTimesAreEmptyBeforeAnyGpuCall) {
  auto ctx = Context::create(small_config(), 1, 0);
  ctx->enable_stage_timing(true);
  const StageTimes times = ctx->stage_times(nullptr);
  EXPECT_TRUE(times.forward.empty() && times.backward.empty());
  ctx->close();
  EXPECT_THROW(ctx->stage_times(nullptr), InvalidArgument);
}

TEST(Context, BackwardNamesTheMissingArgument) {
  auto ctx = Context::create(small_config(), 1, 0);
  BackwardArgs b;
  b.forward = fake_forward_args();
  b.grad_out_TD = b.grad_x_TD = b.grad_scores_TK = b.grad_w13 = b.grad_w2 = const_cast<void*>(b.forward.x_TD);
  b.grad_w2 = nullptr;
  b.forward.out_TD = nullptr;  // backward never uses the forward's output: not required
  EXPECT_EQ(rejected_name([&] { routed_experts_backward(*ctx, b, nullptr); }), "grad_w2");
  Config inference = small_config();
  inference.inference = true;
  auto ictx = Context::create(inference, 1, 0);
  EXPECT_EQ(rejected_name([&] { routed_experts_backward(*ictx, b, nullptr); }), "context");
}

TEST(Context, CallsWithoutTheRightPathFailLoudly) {
  // Never a made-up output: a multi-rank context without a communicator, or no GPU, is an error.
  Config c = small_config();
  c.balance = Balance::capacity;
  auto two_ranks = Context::create(c, 2, 0);
  EXPECT_THROW(routed_experts_forward(*two_ranks, fake_forward_args(), nullptr), NotAvailable);
  ForwardArgs two_sets[2] = {fake_forward_args(), fake_forward_args()};
  EXPECT_EQ(rejected_name([&] { routed_experts_forward(*two_ranks, std::span<const ForwardArgs>(two_sets), nullptr); }),
            "args_per_rank");
}

TEST(Context, Fp8ContextsPlanTheirFp8Operands) {
  // gemm_precision = fp8_block_scaled: the rank's buffers gain the call's FP8 operands (e4m3 tokens
  // and a rows, every expert group's weights, fp32 scales per 128 of K; training adds the backward's
  // row tiles of device rows of max(D, 2F) values, and for the BF16 WGRAD x's device rows in bf16 or
  // with fp8_wgrad column tiles of max(F, D) values), each region padded to 256 bytes; the x rows
  // cross the wire in FP8, so each received row holds D + 4 bytes (D = 64) where BF16 holds 2D.
  Config c = small_config();
  c.gemm_precision = GemmPrecision::fp8_block_scaled;
  auto ctx = Context::create(c, 1, 0);  // plans only
  const MemoryPlan& p = ctx->plan();
  const int64_t T = c.num_local_input_tokens, rows = p.device_rows, groups = p.num_local_experts + p.num_replica_slots;
  const int64_t D = c.hidden_dim, F = c.intermediate_dim;  // 64: one scale per row or block
  auto padded = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
  const int64_t forward = padded(T * D) + padded(4 * T) + padded(rows * F) + padded(4 * rows) +
                          padded(groups * 2 * F * D) + padded(4 * groups) + padded(groups * D * F) + padded(4 * groups);
  // grad tiles: rows x 2F values, a scale per row (row tiles) or per 128 rows and column (as many);
  // x rows in bf16; fp8_wgrad: activation tiles instead, rows x D values, a scale per row (more than
  // column tiles' rows / 128 x D).
  const int64_t grad_tiles = padded(rows * 2 * F) + padded(4 * rows);
  const int64_t backward = grad_tiles + padded(2 * rows * D);
  const int64_t expected = forward + backward;
  EXPECT_EQ(p.fp8_operand_bytes, expected);
  Config fp8_wgrad = c;
  fp8_wgrad.fp8_wgrad = true;
  EXPECT_EQ(plan_memory(fp8_wgrad, 1).fp8_operand_bytes, forward + grad_tiles + padded(rows * D) + padded(4 * rows));
  Config inference = c;
  inference.inference = true;
  EXPECT_EQ(plan_memory(inference, 1).fp8_operand_bytes, forward);
  const MemoryPlan bf16 = plan_memory(small_config(), 1);
  EXPECT_EQ(bf16.fp8_operand_bytes, 0);
  EXPECT_EQ(p.device_scratch_bytes - bf16.device_scratch_bytes, expected);
  EXPECT_EQ(p.x_row_wire_bytes, D + 4);
  EXPECT_EQ(bf16.x_row_wire_bytes, 2 * D);
  EXPECT_NE(p.explain().find("of which FP8 operands"), std::string::npos) << p.explain();
  EXPECT_NE(p.explain().find("x rows on the wire: 68 bytes"), std::string::npos) << p.explain();
  EXPECT_EQ(bf16.explain().find("FP8"), std::string::npos);
  EXPECT_EQ(gemm_precision_from_string("fp8_block_scaled"), GemmPrecision::fp8_block_scaled);
  EXPECT_EQ(rejected_name([] { gemm_precision_from_string("fp8"); }), "gemm_precision");
}

TEST(Context, PreparedFp8WeightsDropTheOwnExpertsWeightScratch) {
  // Config::prepared_fp8_weights in an inference context: the own experts' 3 F D e4m3 bytes and
  // scales leave the plan; the replica slots' stay (exact balance at EP 2). A training context keeps
  // them: its backward writes the weights' transposed copies there. It needs FP8 GEMMs.
  Config c = small_config();
  c.gemm_precision = GemmPrecision::fp8_block_scaled;
  c.inference = true;
  Config prepared = c;
  prepared.prepared_fp8_weights = true;
  for (int64_t ep : {1, 2}) {
    const MemoryPlan per_call = plan_memory(c, ep), lean = plan_memory(prepared, ep);
    const int64_t own = c.num_local_experts(ep), F = c.intermediate_dim, D = c.hidden_dim;
    auto padded = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
    const int64_t groups = own + per_call.num_replica_slots, slots = per_call.num_replica_slots;
    auto weights = [&](int64_t g) {  // D = F = 64: one scale per matrix
      return padded(g * 2 * F * D) + padded(4 * g) + padded(g * D * F) + padded(4 * g);
    };
    EXPECT_EQ(per_call.fp8_operand_bytes - lean.fp8_operand_bytes, weights(groups) - weights(slots)) << "ep " << ep;
    EXPECT_EQ(per_call.total_device_bytes - lean.total_device_bytes, weights(groups) - weights(slots));
    EXPECT_NE(lean.explain().find("the own experts' come prepared"), std::string::npos) << lean.explain();
    Config training = prepared, training_per_call = c;
    training.inference = training_per_call.inference = false;
    const MemoryPlan kept = plan_memory(training, ep);
    EXPECT_EQ(kept.fp8_operand_bytes, plan_memory(training_per_call, ep).fp8_operand_bytes) << "ep " << ep;
    EXPECT_NE(kept.explain().find("the backward's transposed copies"), std::string::npos) << kept.explain();
  }
  Config bf16 = small_config();
  bf16.prepared_fp8_weights = true;
  EXPECT_EQ(rejected_name([&] { bf16.validate(1); }), "prepared_fp8_weights");
  Config bf16_fp8_wgrad = small_config();
  bf16_fp8_wgrad.fp8_wgrad = true;  // FP8 WGRAD without FP8 GEMMs
  EXPECT_EQ(rejected_name([&] { bf16_fp8_wgrad.validate(1); }), "fp8_wgrad");
}

TEST(Context, Fp8RowsCrossTheWireAtAboutHalfTheBf16Bytes) {
  // Issue 41's goal, counted: an x row at the DeepSeek-V3 hidden size (7168) carries 7168 e4m3
  // values and 56 fp32 scales, 0.516x of its 14336 BF16 bytes; the window's received rows shrink
  // by the same bytes per row.
  Config c = small_config();
  c.hidden_dim = 7168;
  Config fp8 = c;
  fp8.gemm_precision = GemmPrecision::fp8_block_scaled;
  const MemoryPlan p8 = plan_memory(fp8, 1), p16 = plan_memory(c, 1);
  EXPECT_EQ(p8.x_row_wire_bytes, 7168 + 4 * 56);
  EXPECT_EQ(p16.x_row_wire_bytes, 2 * 7168);
  EXPECT_LE(double(p8.x_row_wire_bytes) / double(p16.x_row_wire_bytes), 0.55);
  EXPECT_LT(p8.communication_bytes, p16.communication_bytes);
}

}  // namespace
}  // namespace poise
