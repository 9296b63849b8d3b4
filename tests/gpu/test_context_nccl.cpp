// Context::create_from_nccl with one rank (ncclCommInitRank, nranks = 1): the public entry points
// over a real communicator (NCCL window, LSA pointers) against the CPU reference engine, on fresh
// random inputs with every output poisoned first. Multi-GPU runs need the same binary under one
// process per GPU (a single H200 is what the test machine has).
//
// Run on the device with NCCL >= 2.28 on the loader path, e.g.
//   LD_LIBRARY_PATH=<site-packages>/nvidia/nccl/lib NCCL_NVLS_ENABLE=0 ./test_context_nccl
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "runtime/device_info.hpp"
#include "testing/device_layer.hpp"
#include "poise/errors.hpp"
#include "poise/nccl.hpp"
#include "poise/poise.hpp"
#include "poise/reference.hpp"

namespace poise {
namespace {

double rel_error(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return std::numeric_limits<double>::quiet_NaN();
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::quiet_NaN();
    num += double(got[i] - want[i]) * double(got[i] - want[i]);
    den += double(want[i]) * double(want[i]);
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

uint64_t fresh_seed() { return uint64_t(std::chrono::steady_clock::now().time_since_epoch().count()); }

// One NCCL communicator of one rank on device 0, destroyed after the contexts built on it.
class NcclContext : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0 || !is_sm90_device(0)) GTEST_SKIP() << "needs an SM90 GPU";
    int version = 0;
    ASSERT_EQ(ncclGetVersion(&version), ncclSuccess);
    ASSERT_GE(version, 22800) << "NCCL " << version << " has no window device API: put NCCL >= 2.28 on the "
                              << "loader path (LD_LIBRARY_PATH=<site-packages>/nvidia/nccl/lib)";
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ncclUniqueId id;
    ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
    ASSERT_EQ(ncclCommInitRank(&comm_, 1, id, 0), ncclSuccess);
  }
  void TearDown() override {
    if (comm_) EXPECT_EQ(ncclCommDestroy(comm_), ncclSuccess);
  }
  ncclComm_t comm_ = nullptr;
};

Config layer_config(Balance balance) {
  Config c;
  c.num_local_input_tokens = 100;  // not a multiple of 32
  c.hidden_dim = 192;              // 64 x odd
  c.intermediate_dim = 320;        // 64 x odd
  c.top_k = 4;
  c.num_experts = 8;
  c.activation = Activation::swiglu_clamped;
  c.swiglu_limit = 1.5;
  c.balance = balance;
  c.receive_capacity_factor = 1.0;  // one rank receives exactly its T*K rows
  return c;
}

struct Case {
  Balance balance;
  bool one_expert;  // every token picks expert 0 first: one expert takes T rows, others may get none
  DType scores_dtype;
};

class NcclContextLayer : public NcclContext, public ::testing::WithParamInterface<Case> {};

TEST_P(NcclContextLayer, ForwardBackwardMatchCpuReference) {
  const Case tc = GetParam();
  const Config c = layer_config(tc.balance);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));

  auto context = Context::create_from_nccl(c, comm_, {.wait_timeout_ns = 2'000'000'000ull});
  EXPECT_EQ(context->ep_size(), 1);
  EXPECT_EQ(context->rank(), 0);
  EXPECT_EQ(context->launch_ranks(), 1);
  EXPECT_EQ(context->plan().ep_size, 1);

  reference::Options options{.scores_dtype = tc.scores_dtype, .replica_slots = context->plan().num_replica_slots};
  auto inputs = reference::random_inputs(c, 1, {.seed = seed, .skew = 1.0, .padding_rows = 3}, options);
  if (tc.one_expert) {
    for (int64_t t = 0; t < c.num_local_input_tokens; ++t) {
      for (int64_t k = 0; k < c.top_k; ++k) inputs[0].ids_TK[t * c.top_k + k] = int32_t(k == 0 ? 0 : k + 3);
    }
  }
  const auto grad_out = reference::random_grad_out(c, 1, seed + 1);
  reference::Engine engine(c, 1, options);
  const auto want_out = engine.forward(inputs);
  std::vector<reference::RankGradients> want;
  engine.backward(inputs, grad_out, want);

  DeviceLayer layer(c, 1, inputs, grad_out, tc.scores_dtype);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  for (int call = 0; call < 2; ++call) {  // the second call reuses the window and the epochs
    SCOPED_TRACE("call " + std::to_string(call));
    layer.poison_outputs();
    routed_experts_forward(*context, layer.forward_args(), stream);
    routed_experts_backward(*context, layer.backward_args(), stream);
    ASSERT_NO_THROW(context->check(stream));
    EXPECT_LT(rel_error(layer.out_TD()[0], want_out[0]), 1e-2);
    EXPECT_LT(rel_error(layer.grad_x_TD()[0], want[0].grad_x_TD), 1e-2);
    EXPECT_LT(rel_error(layer.grad_scores_TK()[0], want[0].grad_scores_TK), 1e-2);
    EXPECT_LT(rel_error(layer.grad_w13()[0], want[0].grad_w13), 1e-2);
    EXPECT_LT(rel_error(layer.grad_w2()[0], want[0].grad_w2), 1e-2);
  }
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  context->close();
  EXPECT_TRUE(context->closed());
  EXPECT_THROW(routed_experts_forward(*context, layer.forward_args(), nullptr), InvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(
    Balances, NcclContextLayer,
    ::testing::Values(Case{Balance::capacity, false, DType::fp32}, Case{Balance::exact, false, DType::fp32},
                      Case{Balance::capacity, true, DType::bf16}, Case{Balance::exact, true, DType::fp32}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return std::string(to_string(info.param.balance)) + (info.param.one_expert ? "_one_hot_expert" : "_random") +
             "_scores_" + to_string(info.param.scores_dtype);
    });

TEST_F(NcclContext, BadExpertIdIsReportedThenResetRecovers) {
  const Config c = layer_config(Balance::capacity);
  auto context = Context::create_from_nccl(c, comm_, {.wait_timeout_ns = 200'000'000ull});
  reference::Options options;
  auto inputs = reference::random_inputs(c, 1, {.seed = fresh_seed()}, options);
  const auto grad_out = reference::random_grad_out(c, 1, 5);
  {
    auto bad = inputs;
    bad[0].ids_TK[7] = int32_t(c.num_experts);  // out of range
    DeviceLayer layer(c, 1, bad, grad_out, DType::fp32);
    routed_experts_forward(*context, layer.forward_args(), nullptr);
    EXPECT_THROW(context->check(nullptr), DeviceError);
  }
  context->reset();  // collective: an all-reduce over the communicator
  reference::Engine engine(c, 1, options);
  const auto want_out = engine.forward(inputs);
  DeviceLayer layer(c, 1, inputs, grad_out, DType::fp32);
  layer.poison_outputs();
  routed_experts_forward(*context, layer.forward_args(), nullptr);
  ASSERT_NO_THROW(context->check(nullptr));
  EXPECT_LT(rel_error(layer.out_TD()[0], want_out[0]), 1e-2);
}

TEST_F(NcclContext, TwoContextsShareOneCommunicator) {
  // Two layers, each with its own window on the same communicator.
  Config a = layer_config(Balance::capacity), b = layer_config(Balance::exact);
  b.hidden_dim = 128;
  auto first = Context::create_from_nccl(a, comm_);
  auto second = Context::create_from_nccl(b, comm_);
  reference::Options options;
  for (auto* pair : {&a, &b}) {
    const Config& c = *pair;
    Context& context = pair == &a ? *first : *second;
    auto inputs = reference::random_inputs(c, 1, {.seed = fresh_seed()}, options);
    reference::Engine engine(c, 1, options);
    const auto want_out = engine.forward(inputs);
    DeviceLayer layer(c, 1, inputs, reference::random_grad_out(c, 1, 9), DType::fp32);
    layer.poison_outputs();
    routed_experts_forward(context, layer.forward_args(), nullptr);
    ASSERT_NO_THROW(context.check(nullptr));
    EXPECT_LT(rel_error(layer.out_TD()[0], want_out[0]), 1e-2);
  }
}

TEST_F(NcclContext, BadArgumentsAreNamedBeforeAnyAllocation) {
  Config c = layer_config(Balance::capacity);
  try {
    Context::create_from_nccl(c, nullptr);
    ADD_FAILURE() << "a null communicator was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.name(), "comm");
  }
  c.hidden_dim = 100;  // not a multiple of 64
  try {
    Context::create_from_nccl(c, comm_);
    ADD_FAILURE() << "hidden_dim=100 was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.name(), "hidden_dim");
  }
}

}  // namespace
}  // namespace poise
