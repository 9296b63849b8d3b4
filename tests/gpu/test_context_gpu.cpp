// The public entry points on the GPU (Context + routed_experts forward/backward) against the CPU
// reference engine, the oracle that defines the semantics: same inputs, outputs poisoned first.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gpu_test_support.hpp"
#include "moe/device_layer.hpp"
#include "poise/poise.hpp"
#include "poise/reference.hpp"

namespace poise {
namespace {

// The reference engine's outputs are float: widened to compare with reference::relative_error.
double rel_error(const std::vector<float>& got, const std::vector<float>& want) {
  return reference::relative_error(got, std::vector<double>(want.begin(), want.end()));
}

struct Case {
  int64_t ranks;
  double skew;
  bool one_expert;  // every token of every rank picks expert 0 first
  Activation activation;
};

class ContextGpu : public ::testing::TestWithParam<Case> {};

TEST_P(ContextGpu, MatchesCpuReferenceForwardAndBackward) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const Case tc = GetParam();
  Config c;
  c.num_local_input_tokens = 96;
  c.hidden_dim = 192;        // 64 x odd
  c.intermediate_dim = 320;  // 64 x odd
  c.top_k = 4;
  c.num_experts = 8 * tc.ranks / (tc.ranks > 4 ? 2 : 1);
  c.activation = tc.activation;
  c.swiglu_limit = 1.5;
  c.balance = Balance::capacity;
  c.receive_capacity_factor = double(tc.ranks);  // dropless even when every row lands on one rank
  const int64_t R = tc.ranks;

  reference::Options options;
  reference::RandomInputsSpec spec{.seed = uint64_t(1000 + 17 * R) ^ uint64_t(tc.skew * 10), .skew = tc.skew,
                                   .padding_rows = 5};
  std::vector<reference::RankInputs> inputs = reference::random_inputs(c, R, spec, options);
  if (tc.one_expert) {
    for (auto& in : inputs) {
      for (int64_t t = 0; t < c.num_local_input_tokens; ++t) {
        // expert 0 first, the other k distinct and not 0
        for (int64_t k = 0; k < c.top_k; ++k) in.ids_TK[t * c.top_k + k] = int32_t(k == 0 ? 0 : c.num_experts - k);
      }
    }
  }
  const auto grad_out = reference::random_grad_out(c, R, spec.seed + 1);

  reference::Engine engine(c, R, options);
  const auto want_out = engine.forward(inputs);
  std::vector<reference::RankGradients> want_grads;
  engine.backward(inputs, grad_out, want_grads);

  auto context = R == 1 ? Context::create(c, 1, 0) : Context::create_virtual_ranks(c, R);
  DeviceLayer layer(c, R, inputs, grad_out, DType::fp32);
  layer.poison_outputs();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  context->enable_stage_timing(true);  // the pipeline may not exist yet (R == 1: first call makes it)
  routed_experts_forward(*context, layer.forward_args(), stream);
  routed_experts_backward(*context, layer.backward_args(), stream);
  context->check(stream);
  // Stage timing: every stage of both calls, in order, each a non-negative duration.
  const StageTimes times = context->stage_times(stream);
  auto names = [](const std::vector<StageTime>& v) {
    std::vector<std::string> out;
    for (const StageTime& t : v) out.push_back(t.stage);
    return out;
  };
  EXPECT_EQ(names(times.forward), (std::vector<std::string>{"route", "dispatch", "fanout", "experts", "combine_push",
                                                             "combine_reduce"}));
  // No grad_scores stage: with the SM90 experts DGRAD W2 computes the score gradients.
  EXPECT_EQ(names(times.backward),
            (std::vector<std::string>{"dispatch", "fanout", "experts", "combine_push", "combine_reduce"}));
  for (const auto* v : {&times.forward, &times.backward})
    for (const StageTime& t : *v) EXPECT_GE(t.ms, 0.0) << t.stage;
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);

  const auto out = layer.out_TD(), grad_x = layer.grad_x_TD(), grad_scores = layer.grad_scores_TK();
  const auto grad_w13 = layer.grad_w13(), grad_w2 = layer.grad_w2();
  for (int64_t r = 0; r < R; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_LT(rel_error(out[r], want_out[r]), 1e-2);
    EXPECT_LT(rel_error(grad_x[r], want_grads[r].grad_x_TD), 1e-2);
    EXPECT_LT(rel_error(grad_scores[r], want_grads[r].grad_scores_TK), 1e-2);
    EXPECT_LT(rel_error(grad_w13[r], want_grads[r].grad_w13), 1e-2);
    EXPECT_LT(rel_error(grad_w2[r], want_grads[r].grad_w2), 1e-2);
  }
}

INSTANTIATE_TEST_SUITE_P(
    RanksAndRoutings, ContextGpu,
    ::testing::Values(Case{1, 1.0, false, Activation::swiglu}, Case{2, 1.0, false, Activation::swiglu_clamped},
                      Case{4, 3.0, false, Activation::swiglu}, Case{8, 1.0, false, Activation::swiglu},
                      Case{4, 1.0, true, Activation::swiglu}, Case{8, 8.0, false, Activation::swiglu_clamped}));

TEST(ContextGpuErrors, ExpertIdOutOfRangeIsReportedNotHung) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  Config c;
  c.num_local_input_tokens = 32;
  c.hidden_dim = 128;
  c.intermediate_dim = 128;
  c.top_k = 2;
  c.num_experts = 4;
  c.balance = Balance::capacity;
  auto context = Context::create(c, 1, 0, {.wait_timeout_ns = 200'000'000});
  reference::Options options;
  auto inputs = reference::random_inputs(c, 1, {.seed = 7}, options);
  inputs[0].ids_TK[3] = 99;  // out of range: must come back as a DeviceError, not a hang or garbage
  const auto grad_out = reference::random_grad_out(c, 1, 8);
  {
    DeviceLayer bad(c, 1, inputs, grad_out, DType::fp32);
    routed_experts_forward(*context, bad.forward_args(), nullptr);
    EXPECT_THROW(context->check(nullptr), DeviceError);
  }
  context->reset();  // after reset, a good call works again
  inputs[0].ids_TK[3] = 1 + (inputs[0].ids_TK[2] == 1);
  DeviceLayer good(c, 1, inputs, grad_out, DType::fp32);
  routed_experts_forward(*context, good.forward_args(), nullptr);
  EXPECT_NO_THROW(context->check(nullptr));
}

}  // namespace
}  // namespace poise
