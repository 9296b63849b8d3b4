// The public entry points on the GPU (Context + routed_experts forward/backward) against the CPU
// reference engine, the oracle that defines the semantics: same inputs, outputs poisoned first.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpu_test_support.hpp"
#include "testing/device_layer.hpp"
#include "poise/poise.hpp"
#include "poise/reference.hpp"

namespace poise {
namespace {

// The reference engine's outputs are float: widened to compare with reference::relative_error.
double rel_error(const std::vector<float>& got, const std::vector<float>& want) {
  return reference::relative_error(got, std::vector<double>(want.begin(), want.end()));
}

// The oracle: the reference engine's forward and backward of the same inputs.
struct Expected {
  std::vector<std::vector<float>> out;
  std::vector<reference::RankGradients> grads;
};

Expected reference_run(const Config& c, int64_t R, const std::vector<reference::RankInputs>& inputs,
                       const std::vector<std::vector<float>>& grad_out, const reference::Options& options = {}) {
  reference::Engine engine(c, R, options);
  Expected want{engine.forward(inputs), {}};
  engine.backward(inputs, grad_out, want.grads);
  return want;
}

std::unique_ptr<Context> gpu_context(const Config& c, int64_t R) {
  return R == 1 ? Context::create(c, 1, 0) : Context::create_virtual_ranks(c, R);
}

// Rank r's outputs (out, grad_x, grad_scores, grad_w13, grad_w2) within 1% of the oracle's.
void expect_rank_matches(const DeviceLayer& layer, const Expected& want, int64_t r) {
  EXPECT_LT(rel_error(layer.out_TD()[r], want.out[r]), 1e-2);
  EXPECT_LT(rel_error(layer.grad_x_TD()[r], want.grads[r].grad_x_TD), 1e-2);
  EXPECT_LT(rel_error(layer.grad_scores_TK()[r], want.grads[r].grad_scores_TK), 1e-2);
  EXPECT_LT(rel_error(layer.grad_w13()[r], want.grads[r].grad_w13), 1e-2);
  EXPECT_LT(rel_error(layer.grad_w2()[r], want.grads[r].grad_w2), 1e-2);
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

  const Expected want = reference_run(c, R, inputs, grad_out, options);

  auto context = gpu_context(c, R);
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

  for (int64_t r = 0; r < R; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    expect_rank_matches(layer, want, r);
  }
}

INSTANTIATE_TEST_SUITE_P(
    RanksAndRoutings, ContextGpu,
    ::testing::Values(Case{1, 1.0, false, Activation::swiglu}, Case{2, 1.0, false, Activation::swiglu_clamped},
                      Case{4, 3.0, false, Activation::swiglu}, Case{8, 1.0, false, Activation::swiglu},
                      Case{4, 1.0, true, Activation::swiglu}, Case{8, 8.0, false, Activation::swiglu_clamped}));

// Every rank's routing telemetry (Context::routing_stats, device buffers) equals the reference
// engine's RoutingStats of the same forward: the same counts, the same plan.
void expect_routing_stats(Context& context, const reference::RoutingStats& want, int64_t R, int64_t E,
                          cudaStream_t stream) {
  const size_t per_rank = size_t(E) + 3 * size_t(R) + 1;
  int32_t* all = nullptr;
  ASSERT_EQ(cudaMalloc(&all, sizeof(int32_t) * per_rank * R), cudaSuccess);
  ASSERT_EQ(cudaMemset(all, 0xFF, sizeof(int32_t) * per_rank * R), cudaSuccess);  // -1: unwritten shows
  std::vector<RoutingStatsOut> outs;
  for (int64_t r = 0; r < R; ++r) {
    int32_t* p = all + r * per_rank;
    outs.push_back({p, p + E, p + E + R, p + E + 2 * R, p + E + 3 * R});
  }
  context.routing_stats(outs, stream);
  std::vector<int32_t> host(per_rank * R);
  ASSERT_EQ(cudaMemcpyAsync(host.data(), all, host.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaFree(all);
  auto slice = [&](int64_t r, int64_t at, int64_t n) {
    return std::vector<int64_t>(host.begin() + r * per_rank + at, host.begin() + r * per_rank + at + n);
  };
  for (int64_t r = 0; r < R; ++r) {
    SCOPED_TRACE("routing_stats of rank " + std::to_string(r));
    EXPECT_EQ(slice(r, 0, E), want.expert_rows);
    EXPECT_EQ(slice(r, E, R), want.owner_rows);
    EXPECT_EQ(slice(r, E + R, R), want.computed_rows);
    EXPECT_EQ(slice(r, E + 2 * R, R), want.replicas);
    EXPECT_EQ(slice(r, E + 3 * R, 1)[0], want.received_token_rows[r]);
  }
}

// Free entries (ids_TK == kNoExpert): the GPU matches the reference engine, free entries get exactly
// zero score gradients whatever their score, a token with every entry free gets exactly zero out
// and grad_x, and with every entry free every output is zero (no rows at all). The routing
// telemetry counts the routed rows only.
struct FreeCase {
  int64_t ranks;
  Balance balance;
  double free_fraction;
};

class ContextGpuFreeEntries : public ::testing::TestWithParam<FreeCase> {};

TEST_P(ContextGpuFreeEntries, MatchTheReferenceAndAddNothing) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const FreeCase fc = GetParam();
  const int64_t R = fc.ranks;
  Config c;
  c.num_local_input_tokens = 80;
  c.hidden_dim = 192;
  c.intermediate_dim = 320;
  c.top_k = 4;
  c.num_experts = 4 * R;
  c.balance = fc.balance;
  c.receive_capacity_factor = double(R);
  reference::Options options;
  auto inputs = reference::random_inputs(c, R, {.seed = uint64_t(77 + R), .skew = 2.0, .free_fraction = fc.free_fraction},
                                         options);
  const int64_t K = c.top_k, D = c.hidden_dim, T = c.num_local_input_tokens;
  for (int64_t k = 0; k < K; ++k) inputs[0].ids_TK[9 * K + k] = kNoExpert;  // rank 0's token 9: all free
  const auto grad_out = reference::random_grad_out(c, R, 78);
  reference::Engine engine(c, R, options);
  Expected want{engine.forward(inputs), {}};
  const reference::RoutingStats want_stats = engine.routing_stats();  // of the forward, as routing_stats
  engine.backward(inputs, grad_out, want.grads);

  auto context = gpu_context(c, R);
  DeviceLayer layer(c, R, inputs, grad_out, DType::fp32);
  layer.poison_outputs();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  try {
    context->routing_stats(std::vector<RoutingStatsOut>(R), stream);
    ADD_FAILURE() << "routing_stats before any forward did not raise";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.name(), "context");
  }
  routed_experts_forward(*context, layer.forward_args(), stream);
  expect_routing_stats(*context, want_stats, R, c.num_experts, stream);
  routed_experts_backward(*context, layer.backward_args(), stream);
  context->check(stream);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);

  const auto out = layer.out_TD(), grad_x = layer.grad_x_TD(), grad_scores = layer.grad_scores_TK();
  const auto grad_w13 = layer.grad_w13(), grad_w2 = layer.grad_w2();
  for (int64_t r = 0; r < R; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    for (int64_t i = 0; i < T * K; ++i) {
      if (inputs[r].ids_TK[i] == kNoExpert) ASSERT_EQ(grad_scores[r][i], 0.0f) << "free entry " << i;
    }
    if (fc.free_fraction == 1.0) {  // nothing routed: every output is zero, none left poisoned
      for (const auto* v : {&out[r], &grad_x[r], &grad_w13[r], &grad_w2[r]})
        for (float x : *v) ASSERT_EQ(x, 0.0f);
      continue;
    }
    if (r == 0) {
      for (int64_t d = 0; d < D; ++d) {
        ASSERT_EQ(out[0][9 * D + d], 0.0f);
        ASSERT_EQ(grad_x[0][9 * D + d], 0.0f);
      }
    }
    expect_rank_matches(layer, want, r);
  }
}

INSTANTIATE_TEST_SUITE_P(
    RanksAndBalance, ContextGpuFreeEntries,
    ::testing::Values(FreeCase{1, Balance::exact, 0.5}, FreeCase{2, Balance::exact, 0.3},
                      FreeCase{4, Balance::exact, 0.6}, FreeCase{8, Balance::exact, 0.5},
                      FreeCase{4, Balance::capacity, 0.5}, FreeCase{2, Balance::exact, 1.0},
                      FreeCase{4, Balance::capacity, 1.0}),
    [](const ::testing::TestParamInfo<FreeCase>& info) {
      return "R" + std::to_string(info.param.ranks) + "_" + to_string(info.param.balance) + "_free" +
             std::to_string(int(info.param.free_fraction * 100));
    });

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

// Activation slots: a slot sized for one layer whole, one light (no x rows: its backward sends them
// again) and one partial (h13 of its first 256 rows: its backward also recomputes h13 for the rest,
// rows the device picks from the kept layout). Layers 0-2 take those, layer 3 runs from the working
// buffers (past the 3 selected layers), then all four backwards run in reverse order: none
// rebuilds its forward, though layer 3 overwrote the working buffers that the light and partial
// layers share. Then layer 3 runs forward twice (the working buffers), and the backward of the
// first must rebuild it. Exact balance with hot experts: layers use replicas, so a backward from a
// kept layer must also push its replica weights again. Capacity mode (no replicas; receive rows
// past the balanced ones) runs the same sequence. Every result against the CPU reference; every
// output poisoned first.
class ContextGpuSlots : public ::testing::TestWithParam<Balance> {};

TEST_P(ContextGpuSlots, KeptLayersRunFromTheirSlotTheRestRecompute) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  Config c;
  c.num_local_input_tokens = 96;
  c.hidden_dim = 192;
  c.intermediate_dim = 320;
  c.top_k = 4;
  c.num_experts = 16;
  c.balance = GetParam();
  c.receive_capacity_factor = 4.0;  // capacity mode: dropless when every token picks rank 0's experts
  c.max_moe_layers_per_activation_slot = 3;
  const int64_t R = 4;
  const MemoryPlan sizes = plan_memory(c, R);
  // light record = routing layout + h13 of every receive row (4F bytes a row)
  const int64_t h13_row_bytes = 4 * c.intermediate_dim;
  const int64_t layout_bytes = sizes.activation_light_record_bytes - sizes.device_rows * h13_row_bytes;
  c.activation_slot_bytes = sizes.activation_record_bytes + sizes.activation_light_record_bytes + layout_bytes +
                            256 * h13_row_bytes;
  const MemoryPlan plan = plan_memory(c, R);
  ASSERT_EQ(plan.activation_records_per_slot, 1);
  ASSERT_EQ(plan.activation_light_records_per_slot, 1);
  ASSERT_EQ(plan.activation_partial_record_rows, 256);

  reference::Options options;
  struct Layer {
    std::vector<reference::RankInputs> inputs;
    std::vector<std::vector<float>> grad_out;
    Expected want;
  };
  std::vector<Layer> layers(4);
  for (size_t i = 0; i < layers.size(); ++i) {
    Layer& l = layers[i];
    l.inputs = reference::random_inputs(c, R, {.seed = 500 + 31 * i, .skew = 1.0, .padding_rows = 3}, options);
    if (i % 2 == 0) {  // hot expert: the plan replicates it onto every other rank
      for (auto& in : l.inputs)
        for (int64_t t = 0; t < c.num_local_input_tokens; ++t) in.ids_TK[t * c.top_k] = 0, in.ids_TK[t * c.top_k + 1] = 1;
      for (auto& in : l.inputs)
        for (int64_t t = 0; t < c.num_local_input_tokens; ++t)
          for (int64_t k = 2; k < c.top_k; ++k) in.ids_TK[t * c.top_k + k] = int32_t(2 + (t + k) % (c.num_experts - 2));
    }
    l.grad_out = reference::random_grad_out(c, R, 900 + i);
    l.want = reference_run(c, R, l.inputs, l.grad_out, options);
  }
  auto context = Context::create_virtual_ranks(c, R);
  std::vector<std::unique_ptr<DeviceLayer>> device;
  for (const Layer& l : layers) {
    device.push_back(std::make_unique<DeviceLayer>(c, R, l.inputs, l.grad_out, DType::fp32));
    device.back()->poison_outputs();
  }
  context->select_activation_slot(0, 3);
  std::vector<ActivationRecord> records;
  for (int i = 0; i < 4; ++i) records.push_back(routed_experts_forward(*context, device[i]->forward_args(), nullptr));
  EXPECT_EQ(records[0].index, 1);  // kept whole in the slot
  EXPECT_EQ(records[1].index, 2);  // kept light
  EXPECT_EQ(records[2].index, 3);  // kept partly
  EXPECT_EQ(records[3].index, 0);  // past the selected layers: the working buffers
  const ActivationRecord bad{context->plan().activation_records_per_slot + 100, 1};
  try {
    routed_experts_backward(*context, device[0]->backward_args(), nullptr, &bad);
    ADD_FAILURE() << "a record index past the pipeline's records was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.name(), "record");
  }
  for (int i = 3; i >= 0; --i) routed_experts_backward(*context, device[i]->backward_args(), nullptr, &records[i]);
  context->check(nullptr);
  EXPECT_EQ(context->recomputed_forwards(), 0);

  // Layer 3 forward twice from the working buffers: the first one's backward must rebuild it.
  device[3]->poison_outputs();
  const ActivationRecord first = routed_experts_forward(*context, device[3]->forward_args(), nullptr);
  routed_experts_forward(*context, device[3]->forward_args(), nullptr);
  routed_experts_backward(*context, device[3]->backward_args(), nullptr, &first);
  EXPECT_EQ(context->recomputed_forwards(), 1);
  context->check(nullptr);

  for (size_t i = 0; i < layers.size(); ++i) {
    for (int64_t r = 0; r < R; ++r) {
      SCOPED_TRACE("layer " + std::to_string(i) + " rank " + std::to_string(r));
      expect_rank_matches(*device[i], layers[i].want, r);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(BalanceModes, ContextGpuSlots, ::testing::Values(Balance::exact, Balance::capacity));

}  // namespace
}  // namespace poise
