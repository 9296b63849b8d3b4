// Small helpers every GPU test needs: whether an SM90 device is there, and a fresh seed per run
// (tests print it with SCOPED_TRACE so a failure can be replayed). Below them, what the tests of the
// public entry points share: a layer with the CPU reference engine's answer, and the comparison.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>
#include <vector>

#include "poise/poise.hpp"
#include "poise/reference.hpp"
#include "runtime/device_info.hpp"
#include "testing/device_layer.hpp"

namespace poise::testing {

inline bool have_sm90_gpu() { return cuda_device_count() > 0 && is_sm90_device(0); }

// A new seed every run (tests print it in their trace); POISE_TEST_SEED=<n> replays a failure.
inline uint64_t fresh_seed() {
  if (const char* s = std::getenv("POISE_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  return static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
}

// [E][rows][cols] -> [E][cols][rows]: a stack of expert matrices in the other layout (weights stored
// for x @ W against nn.Linear's).
template <class T>
std::vector<T> transpose_experts(const std::vector<T>& m, int64_t E, int64_t rows, int64_t cols) {
  std::vector<T> t(m.size());
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) t[(e * cols + j) * rows + i] = m[(e * rows + i) * cols + j];
  return t;
}

// An unsigned number from the environment, `fallback` when unset (POISE_FUZZ_CASES and the like).
inline uint64_t env_u64(const char* name, uint64_t fallback) {
  const char* s = std::getenv(name);
  return s && *s ? std::strtoull(s, nullptr, 10) : fallback;
}

// ---- the public entry points against the CPU reference engine ----------------------------------

// One layer's inputs for every rank and the reference engine's forward and backward on them.
struct ReferenceLayer {
  Config config;
  int64_t ranks = 1;
  reference::Options options;
  std::vector<reference::RankInputs> inputs;
  std::vector<std::vector<float>> grad_out, out;
  std::vector<reference::RankGradients> grads;
};

// The engine gets the replica slots a GPU context of this shape plans (none at EP=1).
inline ReferenceLayer reference_layer(const Config& c, int64_t ranks, std::vector<reference::RankInputs> inputs,
                                      std::vector<std::vector<float>> grad_out, reference::Options options = {}) {
  options.replica_slots = plan_memory(c, ranks).num_replica_slots;
  ReferenceLayer l{c, ranks, options, std::move(inputs), std::move(grad_out), {}, {}};
  reference::Engine engine(c, ranks, options);
  l.out = engine.forward(l.inputs);
  engine.backward(l.inputs, l.grad_out, l.grads);
  return l;
}

// Fresh random inputs (x ~ N(0,1), softmax scores, distinct ids) and the reference's answer.
inline ReferenceLayer random_reference_layer(const Config& c, int64_t ranks, uint64_t seed, double skew = 1.0,
                                             reference::Options options = {}) {
  auto inputs = reference::random_inputs(c, ranks, {.seed = seed, .skew = skew}, options);
  return reference_layer(c, ranks, std::move(inputs), reference::random_grad_out(c, ranks, seed + 1), options);
}

inline DeviceLayer device_layer(const ReferenceLayer& l) {
  return DeviceLayer(l.config, l.ranks, l.inputs, l.grad_out, l.options.scores_dtype);
}

inline std::unique_ptr<Context> make_context(const Config& c, int64_t ranks, const ContextOptions& options = {}) {
  return ranks == 1 ? Context::create(c, 1, 0, options) : Context::create_virtual_ranks(c, ranks, options);
}

// ||got - want|| / ||want|| (NaN when got holds a NaN, 0 when both are zero).
inline double relative_error_to(const std::vector<float>& got, const std::vector<float>& want) {
  return reference::relative_error(got, std::vector<double>(want.begin(), want.end()));
}

// Poisons the layer's outputs, runs forward then backward (weights in `layout` on both sides),
// then waits and raises any device fault.
inline void run_forward_backward(Context& context, DeviceLayer& layer, cudaStream_t stream,
                                 W13Layout layout = W13Layout::gate_up_blocked) {
  layer.poison_outputs();
  std::vector<ForwardArgs> fwd(layer.forward_args().begin(), layer.forward_args().end());
  std::vector<BackwardArgs> bwd(layer.backward_args().begin(), layer.backward_args().end());
  for (ForwardArgs& a : fwd) a.w13_layout = layout;
  for (BackwardArgs& b : bwd) b.forward.w13_layout = layout;
  routed_experts_forward(context, fwd, stream);
  routed_experts_backward(context, bwd, stream);
  context.check(stream);
}

// A CUDA stream for one test, destroyed with it.
class TestStream {
 public:
  TestStream() { EXPECT_EQ(cudaStreamCreate(&stream_), cudaSuccess); }
  ~TestStream() { cudaStreamDestroy(stream_); }
  TestStream(const TestStream&) = delete;
  TestStream& operator=(const TestStream&) = delete;
  operator cudaStream_t() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// Per rank: every element NaN (what a faulted call leaves in its outputs).
inline void expect_all_nan(const std::vector<std::vector<float>>& per_rank, const std::string& what) {
  for (size_t r = 0; r < per_rank.size(); ++r) {
    const auto finite = std::count_if(per_rank[r].begin(), per_rank[r].end(), [](float x) { return !std::isnan(x); });
    EXPECT_EQ(finite, 0) << what << ", rank " << r << ": elements that are not NaN";
  }
}

// Every output of every rank set to 0.0 (finite; one argument set per rank of an ep_size context),
// so a NaN read back afterwards was written by a call (poison_outputs' NaN could not tell).
inline void zero_outputs(const DeviceLayer& layer, const Config& c) {
  const int64_t R = static_cast<int64_t>(layer.backward_args().size());
  const int64_t T = c.num_local_input_tokens, D = c.hidden_dim, K = c.top_k;
  const int64_t expert_elements = c.num_local_experts(R) * D * c.intermediate_dim;
  auto bytes = [](DType dtype) { return size_t(dtype == DType::bf16 ? 2 : 4); };
  for (const BackwardArgs& b : layer.backward_args()) {
    ASSERT_EQ(cudaMemset(b.forward.out_TD, 0, size_t(T * D) * 2), cudaSuccess);
    ASSERT_EQ(cudaMemset(b.grad_x_TD, 0, size_t(T * D) * 2), cudaSuccess);
    ASSERT_EQ(cudaMemset(b.grad_scores_TK, 0, size_t(T * K) * bytes(b.forward.scores_dtype)), cudaSuccess);
    ASSERT_EQ(cudaMemset(b.grad_w13, 0, size_t(2 * expert_elements) * bytes(c.wgrad_dtype)), cudaSuccess);
    ASSERT_EQ(cudaMemset(b.grad_w2, 0, size_t(expert_elements) * bytes(c.wgrad_dtype)), cudaSuccess);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// One output of one rank against the reference: relative L2 (NaN when got holds a NaN).
struct OutputError {
  int64_t rank;
  const char* output;
  double error;
};

// Every output of every rank against the reference.
inline std::vector<OutputError> reference_errors(const DeviceLayer& got, const ReferenceLayer& want) {
  const auto out = got.out_TD(), grad_x = got.grad_x_TD(), grad_scores = got.grad_scores_TK();
  const auto grad_w13 = got.grad_w13(), grad_w2 = got.grad_w2();
  std::vector<OutputError> errors;
  for (int64_t r = 0; r < want.ranks; ++r) {
    const reference::RankGradients& g = want.grads[r];
    errors.push_back({r, "out_TD", relative_error_to(out[r], want.out[r])});
    errors.push_back({r, "grad_x_TD", relative_error_to(grad_x[r], g.grad_x_TD)});
    errors.push_back({r, "grad_scores_TK", relative_error_to(grad_scores[r], g.grad_scores_TK)});
    errors.push_back({r, "grad_w13", relative_error_to(grad_w13[r], g.grad_w13)});
    errors.push_back({r, "grad_w2", relative_error_to(grad_w2[r], g.grad_w2)});
  }
  return errors;
}

// Every output of every rank within `tolerance` of the reference (relative L2; a NaN fails).
inline void expect_matches_reference(const DeviceLayer& got, const ReferenceLayer& want, double tolerance = 1e-2) {
  for (const OutputError& e : reference_errors(got, want))
    EXPECT_LT(e.error, tolerance) << e.output << " of rank " << e.rank;
}

}  // namespace poise::testing
