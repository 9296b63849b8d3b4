#include "demo_gpu.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <vector>

#include "demo_verify.hpp"
#include "poise/context.hpp"
#include "poise/errors.hpp"
#include "testing/device_layer.hpp"
#include "testing/synthetic_layer.hpp"

namespace poise::demo {
namespace {

inline constexpr int kTimedCalls = 5;

struct Events {
  cudaEvent_t e[3] = {};
  Events() {
    for (cudaEvent_t& event : e) cuda_ok(cudaEventCreate(&event));
  }
  ~Events() {
    for (cudaEvent_t event : e) cudaEventDestroy(event);
  }
  float ms(int from, int to) const {
    float ms = 0;
    cuda_ok(cudaEventElapsedTime(&ms, e[from], e[to]));
    return ms;
  }
};

// Forward + backward through the public entry points: a warm-up call (allocates, loads modules),
// outputs poisoned, then kTimedCalls timed calls (CUDA events; the median is printed). The outputs
// are the last call's. Throws NotAvailable when the GPU path lacks a feature.
template <class Layer>
void time_on_gpu(const Setup& s, Layer& layer) {
  const Config& c = s.config();
  auto context = s.ranks() == 1 ? poise::Context::create(c, 1, 0) : poise::Context::create_virtual_ranks(c, s.ranks());
  cudaStream_t stream;
  cuda_ok(cudaStreamCreate(&stream));
  const std::unique_ptr<CUstream_st, cudaError_t (*)(cudaStream_t)> stream_owner(stream, cudaStreamDestroy);
  const auto start = std::chrono::steady_clock::now();
  poise::routed_experts_forward(*context, layer.forward_args(), stream);
  poise::routed_experts_backward(*context, layer.backward_args(), stream);
  context->check(stream);
  const double warm_up_ms = milliseconds_since(start);
  layer.poison_outputs();
  std::vector<float> forward_ms, backward_ms;
  const Events events;
  for (int i = 0; i < kTimedCalls; ++i) {
    cuda_ok(cudaEventRecord(events.e[0], stream));
    poise::routed_experts_forward(*context, layer.forward_args(), stream);
    cuda_ok(cudaEventRecord(events.e[1], stream));
    poise::routed_experts_backward(*context, layer.backward_args(), stream);
    cuda_ok(cudaEventRecord(events.e[2], stream));
    context->check(stream);
    forward_ms.push_back(events.ms(0, 1));
    backward_ms.push_back(events.ms(1, 2));
  }
  std::sort(forward_ms.begin(), forward_ms.end());
  std::sort(backward_ms.begin(), backward_ms.end());
  std::printf("\nTime (GPU, %lld virtual ranks on one GPU, CUDA events, median of %d calls after a warm-up of "
              "%.0f ms): forward %.3f ms, backward %.3f ms\n",
              static_cast<long long>(s.ranks()), kTimedCalls, warm_up_ms, forward_ms[kTimedCalls / 2],
              backward_ms[kTimedCalls / 2]);
}

std::vector<ref::SampledToken> sampled_tokens_of(const Setup& s, const poise::SyntheticLayer& layer) {
  const int64_t K = s.config().top_k;
  std::vector<ref::SampledToken> tokens;
  for (int64_t r = 0; r < s.ranks(); ++r) {
    const std::vector<int32_t>& ids = s.routing.ids_TK[r];
    const std::vector<float>& scores = s.routing.scores_TK[r];
    for (int64_t t : s.sampled_tokens[r]) {
      tokens.push_back({r, t, layer.x_row(r, t), std::vector<int32_t>(ids.begin() + t * K, ids.begin() + (t + 1) * K),
                        std::vector<float>(scores.begin() + t * K, scores.begin() + (t + 1) * K),
                        layer.grad_out_row(r, t)});
    }
  }
  return tokens;
}

}  // namespace

int run_gpu_full(const Setup& s) {
  const HostInputs h = make_host_inputs(s);
  poise::DeviceLayer layer(s.config(), s.ranks(), h.inputs, h.grad_out, s.flags.scores_dtype);
  try {
    time_on_gpu(s, layer);
  } catch (const poise::NotAvailable& e) {
    std::printf("GPU path: not available for this configuration: %s\n", e.what());
    return check_host_results(s, "CPU reference", run_engine(s, h), h);
  }
  return check_host_results(s, "GPU",
                            {layer.out_TD(), layer.grad_x_TD(), layer.grad_scores_TK(), layer.grad_w13(),
                             layer.grad_w2()},
                            h);
}

int run_gpu_generated(const Setup& s) {
  const auto start = std::chrono::steady_clock::now();
  poise::SyntheticLayer layer(s.config(), s.ranks(), s.routing.ids_TK, s.routing.scores_TK, s.flags.scores_dtype,
                              s.flags.seed);
  std::printf("\nInputs: x, weights and grad_out generated on the GPU from the seed, routing drawn on the host, "
              "%.1f ms\n",
              milliseconds_since(start));
  try {
    time_on_gpu(s, layer);
  } catch (const poise::NotAvailable& e) {
    std::printf("GPU path: not available for this configuration: %s\nresult: FAIL (--device cpu runs the CPU "
                "reference engine)\n",
                e.what());
    return 1;
  }
  if (s.check == Check::none) return report_unchecked();
  const auto row = [&layer](auto method) {
    return [&layer, method](int64_t r, int64_t t) { return (layer.*method)(r, t); };
  };
  return check_sampled(
      s, "GPU", sampled_tokens_of(s, layer),
      [&layer](int64_t e, std::vector<float>& w13, std::vector<float>& w2) { layer.expert_weights(e, w13, w2); },
      {row(&poise::SyntheticLayer::out_row), row(&poise::SyntheticLayer::grad_x_row),
       row(&poise::SyntheticLayer::grad_scores_row)});
}

}  // namespace poise::demo
