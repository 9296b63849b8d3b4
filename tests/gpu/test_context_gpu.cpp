// The public entry points on the GPU (Context + routed_experts forward/backward) against the CPU
// reference engine, the oracle that defines the semantics: same inputs, outputs poisoned first.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/device_info.hpp"
#include "poise/poise.hpp"
#include "poise/reference.hpp"

namespace poise {
namespace {

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// A device buffer holding bf16 bits (or raw bytes for other types), freed at scope exit.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n) : bytes(n) { EXPECT_EQ(cudaMalloc(&ptr, n), cudaSuccess); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
};

std::vector<uint16_t> bf16(const std::vector<float>& v) { return reference::to_bf16_bits(v); }

void upload(DeviceBuffer& d, const void* host, size_t bytes) {
  ASSERT_EQ(bytes, d.bytes);
  ASSERT_EQ(cudaMemcpy(d.ptr, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
}

void poison(DeviceBuffer& d) { ASSERT_EQ(cudaMemset(d.ptr, 0xff, d.bytes), cudaSuccess); }  // NaN in bf16 and fp32

std::vector<float> download_bf16(const DeviceBuffer& d) {
  std::vector<uint16_t> bits(d.bytes / 2);
  EXPECT_EQ(cudaMemcpy(bits.data(), d.ptr, d.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return reference::from_bf16_bits(bits);
}

std::vector<float> download_fp32(const DeviceBuffer& d) {
  std::vector<float> v(d.bytes / 4);
  EXPECT_EQ(cudaMemcpy(v.data(), d.ptr, d.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

double rel_error(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i])) return std::numeric_limits<double>::quiet_NaN();
    num += double(got[i] - want[i]) * double(got[i] - want[i]);
    den += double(want[i]) * double(want[i]);
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// One rank's device-side tensors.
struct RankBuffers {
  DeviceBuffer x, ids, scores, w13, w2, out, grad_out, grad_x, grad_scores, grad_w13, grad_w2;
  RankBuffers(const Config& c, int64_t ep)
      : x(c.num_local_input_tokens * c.hidden_dim * 2),
        ids(c.num_local_input_tokens * c.top_k * 4),
        scores(c.num_local_input_tokens * c.top_k * 4),
        w13(c.num_local_experts(ep) * 2 * c.intermediate_dim * c.hidden_dim * 2),
        w2(c.num_local_experts(ep) * c.hidden_dim * c.intermediate_dim * 2),
        out(x.bytes), grad_out(x.bytes), grad_x(x.bytes), grad_scores(scores.bytes),
        grad_w13(w13.bytes * 2), grad_w2(w2.bytes * 2) {}
};

struct Case {
  int64_t ranks;
  double skew;
  bool one_expert;  // every token of every rank picks expert 0 first
  Activation activation;
};

class ContextGpu : public ::testing::TestWithParam<Case> {};

TEST_P(ContextGpu, MatchesCpuReferenceForwardAndBackward) {
  if (cuda_device_count() == 0 || !is_sm90_device(0)) GTEST_SKIP() << "needs an SM90 GPU";
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
  std::vector<std::unique_ptr<RankBuffers>> buffers;
  std::vector<ForwardArgs> fwd(R);
  std::vector<BackwardArgs> bwd(R);
  for (int64_t r = 0; r < R; ++r) {
    buffers.push_back(std::make_unique<RankBuffers>(c, R));
    RankBuffers& b = *buffers.back();
    auto x = bf16(inputs[r].x_TD), w13 = bf16(inputs[r].w13), w2 = bf16(inputs[r].w2), go = bf16(grad_out[r]);
    upload(b.x, x.data(), b.x.bytes);
    upload(b.ids, inputs[r].ids_TK.data(), b.ids.bytes);
    upload(b.scores, inputs[r].scores_TK.data(), b.scores.bytes);
    upload(b.w13, w13.data(), b.w13.bytes);
    upload(b.w2, w2.data(), b.w2.bytes);
    upload(b.grad_out, go.data(), b.grad_out.bytes);
    for (DeviceBuffer* p : {&b.out, &b.grad_x, &b.grad_scores, &b.grad_w13, &b.grad_w2}) poison(*p);
    fwd[r] = {.x_TD = b.x.ptr, .ids_TK = static_cast<const int32_t*>(b.ids.ptr), .scores_TK = b.scores.ptr,
              .scores_dtype = DType::fp32, .w13 = b.w13.ptr, .w2 = b.w2.ptr, .out_TD = b.out.ptr};
    bwd[r] = {.forward = fwd[r], .grad_out_TD = b.grad_out.ptr, .grad_x_TD = b.grad_x.ptr,
              .grad_scores_TK = b.grad_scores.ptr, .grad_w13 = b.grad_w13.ptr, .grad_w2 = b.grad_w2.ptr};
  }
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  routed_experts_forward(*context, std::span<const ForwardArgs>(fwd), stream);
  routed_experts_backward(*context, std::span<const BackwardArgs>(bwd), stream);
  context->check(stream);

  for (int64_t r = 0; r < R; ++r) {
    const RankBuffers& b = *buffers[r];
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_LT(rel_error(download_bf16(b.out), want_out[r]), 1e-2);
    EXPECT_LT(rel_error(download_bf16(b.grad_x), want_grads[r].grad_x_TD), 1e-2);
    EXPECT_LT(rel_error(download_fp32(b.grad_scores), want_grads[r].grad_scores_TK), 1e-2);
    EXPECT_LT(rel_error(download_fp32(b.grad_w13), want_grads[r].grad_w13), 1e-2);
    EXPECT_LT(rel_error(download_fp32(b.grad_w2), want_grads[r].grad_w2), 1e-2);
  }
  CUDA_OK(cudaStreamDestroy(stream));
}

INSTANTIATE_TEST_SUITE_P(
    RanksAndRoutings, ContextGpu,
    ::testing::Values(Case{1, 1.0, false, Activation::swiglu}, Case{2, 1.0, false, Activation::swiglu_clamped},
                      Case{4, 3.0, false, Activation::swiglu}, Case{8, 1.0, false, Activation::swiglu},
                      Case{4, 1.0, true, Activation::swiglu}, Case{8, 8.0, false, Activation::swiglu_clamped}));

TEST(ContextGpuErrors, ExpertIdOutOfRangeIsReportedNotHung) {
  if (cuda_device_count() == 0 || !is_sm90_device(0)) GTEST_SKIP() << "needs an SM90 GPU";
  Config c;
  c.num_local_input_tokens = 32;
  c.hidden_dim = 128;
  c.intermediate_dim = 128;
  c.top_k = 2;
  c.num_experts = 4;
  c.balance = Balance::capacity;
  auto context = Context::create(c, 1, 0, {.wait_timeout_ns = 200'000'000});
  RankBuffers b(c, 1);
  reference::Options options;
  auto inputs = reference::random_inputs(c, 1, {.seed = 7}, options);
  inputs[0].ids_TK[3] = 99;  // out of range: must come back as a DeviceError, not a hang or garbage
  auto x = bf16(inputs[0].x_TD), w13 = bf16(inputs[0].w13), w2 = bf16(inputs[0].w2);
  upload(b.x, x.data(), b.x.bytes);
  upload(b.ids, inputs[0].ids_TK.data(), b.ids.bytes);
  upload(b.scores, inputs[0].scores_TK.data(), b.scores.bytes);
  upload(b.w13, w13.data(), b.w13.bytes);
  upload(b.w2, w2.data(), b.w2.bytes);
  ForwardArgs a{.x_TD = b.x.ptr, .ids_TK = static_cast<const int32_t*>(b.ids.ptr), .scores_TK = b.scores.ptr,
                .w13 = b.w13.ptr, .w2 = b.w2.ptr, .out_TD = b.out.ptr};
  routed_experts_forward(*context, a, nullptr);
  EXPECT_THROW(context->check(nullptr), DeviceError);
  context->reset();  // after reset, a good call works again
  inputs[0].ids_TK[3] = 1 + (inputs[0].ids_TK[2] == 1);
  upload(b.ids, inputs[0].ids_TK.data(), b.ids.bytes);
  routed_experts_forward(*context, a, nullptr);
  EXPECT_NO_THROW(context->check(nullptr));
}

}  // namespace
}  // namespace poise
