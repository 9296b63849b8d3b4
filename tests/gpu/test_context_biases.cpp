// gpt-oss's experts through the public entry points: Context + routed_experts forward/backward with
// expert biases (b13, b2 and their gradients) and/or weights stored transposed (x @ W), on one rank
// and on virtual ranks, against the CPU reference engine (which takes the standard layout: the
// weights are transposed on the host for the GPU, its weight gradients transposed back to compare).
// Fresh inputs every run (seed in the trace; POISE_TEST_SEED replays); outputs poisoned first.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_support.hpp"
#include "poise/poise.hpp"
#include "poise/reference.hpp"
#include "testing/device_layer.hpp"
#include "testing/rejected_name.hpp"

namespace poise {
namespace {

using testing::rejected_name;
using testing::transpose_experts;

constexpr double kTolerance = 1e-2;  // relative L2, as the other Context tests: bf16 rounding, fp32 sums

struct LayerCase {
  std::string name;
  int64_t ranks;
  bool biased, transposed;
  W13Layout layout;
  Activation activation;
  Balance balance;
  bool hot_expert;       // every routed token picks expert 0 first: exact balance replicates it
  double free_fraction;  // entries (t, k) left free (kNoExpert)
  DType wgrad_dtype;
  bool accumulate;       // accumulate_wgrad into random gradients
};

void PrintTo(const LayerCase& c, std::ostream* os) { *os << c.name; }

std::vector<float> random_bf16(int64_t n, float stddev, std::mt19937_64& gen) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = reference::round_to_bf16(dist(gen));
  return v;
}

Config layer_config(const LayerCase& lc) {
  Config c;
  c.num_local_input_tokens = 96;
  c.hidden_dim = 192;        // 64 x odd
  c.intermediate_dim = 320;  // 64 x odd
  c.top_k = 4;
  c.num_experts = lc.ranks == 1 ? 8 : 4 * lc.ranks;
  c.activation = lc.activation;
  c.swiglu_alpha = 1.702;
  c.swiglu_limit = 7.0;  // gpt-oss's; the inputs below are scaled so it bites
  c.balance = lc.balance;
  c.receive_capacity_factor = double(lc.ranks);  // capacity mode: dropless whatever the routing
  c.wgrad_dtype = lc.wgrad_dtype;
  return c;
}

reference::Options reference_options(const Config& c, const LayerCase& lc) {
  reference::Options o;
  o.w13_layout = lc.layout;
  o.replica_slots = plan_memory(c, lc.ranks).num_replica_slots;  // the slots a GPU context plans
  return o;
}

// Every routed token picks expert 0 first and K-1 other distinct experts (free entries stay free).
void make_expert_0_hot(const Config& c, std::vector<reference::RankInputs>& inputs) {
  const int64_t K = c.top_k;
  for (auto& in : inputs)
    for (int64_t t = 0; t < c.num_local_input_tokens; ++t)
      for (int64_t k = 0; k < K; ++k) {
        int32_t& id = in.ids_TK[t * K + k];
        if (id != kNoExpert) id = k == 0 ? 0 : int32_t(1 + (t + k - 1) % (c.num_experts - 1));
      }
}

// Random inputs (reference layout), W13 scaled by 4 (exact in bf16) and b13 ~ N(0, 1): h13 ~ N(0, 17),
// so the clamp at 7 cuts ~9% of gates and ups; b2 ~ N(0, 1): without it out_TD would be ~10% off.
std::vector<reference::RankInputs> layer_inputs(const Config& c, const LayerCase& lc, uint64_t seed,
                                                const reference::Options& options) {
  auto inputs = reference::random_inputs(
      c, lc.ranks, {.seed = seed, .skew = 2.0, .padding_rows = 3, .free_fraction = lc.free_fraction}, options);
  if (lc.hot_expert) make_expert_0_hot(c, inputs);
  std::mt19937_64 gen(seed ^ 0x5eed);
  const int64_t E_local = c.num_local_experts(lc.ranks);
  for (auto& in : inputs) {
    for (float& w : in.w13) w *= 4.0f;
    if (!lc.biased) continue;
    in.b13 = random_bf16(E_local * 2 * c.intermediate_dim, 1.0f, gen);
    in.b2 = random_bf16(E_local * c.hidden_dim, 1.0f, gen);
  }
  return inputs;
}

// The oracle. With accumulate: random gradients of each tensor's own magnitude (so a call that
// overwrites cannot pass), which the reference and the GPU add into.
struct Expected {
  std::vector<std::vector<float>> out;
  std::vector<reference::RankGradients> grads, priors;
  reference::RoutingStats stats;
};

Expected run_engine(const Config& c, int64_t R, const std::vector<reference::RankInputs>& inputs,
                    const std::vector<std::vector<float>>& grad_out, const reference::Options& options,
                    std::vector<reference::RankGradients> grads, bool accumulate) {
  reference::Engine engine(c, R, options);
  Expected want{engine.forward(inputs), {}, {}, engine.routing_stats()};
  want.grads = std::move(grads);
  engine.backward(inputs, grad_out, want.grads, accumulate);
  return want;
}

void randomize_like(std::vector<float>& v, DType dtype, std::mt19937_64& gen) {
  double sum2 = 0;
  for (float x : v) sum2 += double(x) * x;
  const float rms = v.empty() ? 1.0f : float(std::sqrt(sum2 / v.size()));
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (float& x : v) x = dtype == DType::bf16 ? reference::round_to_bf16(u(gen) * rms) : u(gen) * rms;
}

Expected reference_run(const Config& c, const LayerCase& lc, const std::vector<reference::RankInputs>& inputs,
                       const std::vector<std::vector<float>>& grad_out, uint64_t seed) {
  const reference::Options options = reference_options(c, lc);
  Expected want = run_engine(c, lc.ranks, inputs, grad_out, options, {}, false);
  if (!lc.accumulate) return want;
  std::mt19937_64 gen(seed);
  std::vector<reference::RankGradients> priors = want.grads;
  for (auto& g : priors)
    for (auto* v : {&g.grad_w13, &g.grad_w2, &g.grad_b13, &g.grad_b2}) randomize_like(*v, c.wgrad_dtype, gen);
  want = run_engine(c, lc.ranks, inputs, grad_out, options, priors, true);
  want.priors = std::move(priors);
  return want;
}

// ---- the layer on the device -------------------------------------------------------------------

void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw DeviceError(std::string(what) + ": " + cudaGetErrorString(status));
}

size_t element_bytes(DType dtype) { return dtype == DType::bf16 ? 2 : 4; }

void upload_as(void* dst, const std::vector<float>& values, DType dtype) {
  if (dtype == DType::fp32) {
    cuda_check(cudaMemcpy(dst, values.data(), values.size() * 4, cudaMemcpyHostToDevice), "upload");
    return;
  }
  const auto bits = reference::to_bf16_bits(values);
  cuda_check(cudaMemcpy(dst, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice), "upload");
}

std::vector<float> download_as(const void* src, int64_t n, DType dtype) {
  cuda_check(cudaDeviceSynchronize(), "synchronize");
  if (dtype == DType::fp32) {
    std::vector<float> v(n);
    cuda_check(cudaMemcpy(v.data(), src, n * 4, cudaMemcpyDeviceToHost), "download");
    return v;
  }
  std::vector<uint16_t> bits(n);
  cuda_check(cudaMemcpy(bits.data(), src, n * 2, cudaMemcpyDeviceToHost), "download");
  return reference::from_bf16_bits(bits);
}

// One device tensor of bf16 or fp32 elements, freed with it.
class DeviceTensor {
 public:
  DeviceTensor(int64_t elements, DType dtype) : elements_(elements), dtype_(dtype) {
    cuda_check(cudaMalloc(&data_, size_t(elements) * element_bytes(dtype)), "cudaMalloc");
  }
  ~DeviceTensor() { cudaFree(data_); }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  void* data() const { return data_; }
  void upload(const std::vector<float>& values) const { upload_as(data_, values, dtype_); }
  std::vector<float> download() const { return download_as(data_, elements_, dtype_); }
  void poison() const { cuda_check(cudaMemset(data_, 0xff, size_t(elements_) * element_bytes(dtype_)), "poison"); }

 private:
  void* data_ = nullptr;
  int64_t elements_;
  DType dtype_;
};

// What a rank gets back, in the reference's layout.
struct RankResult {
  std::vector<float> out, grad_x, grad_scores, grad_w13, grad_w2, grad_b13, grad_b2;
};

// A layer as a Context call takes it: DeviceLayer's tensors (weights stored transposed when the case
// says so) plus the biases and their gradients, and the call arguments over them.
class BiasedLayer {
 public:
  BiasedLayer(const Config& c, const LayerCase& lc, const std::vector<reference::RankInputs>& inputs,
              const std::vector<std::vector<float>>& grad_out)
      : c_(c), lc_(lc), E_local_(c.num_local_experts(lc.ranks)),
        layer_(c, lc.ranks, stored(inputs), grad_out, DType::fp32) {
    if (!lc.biased) return;
    const int64_t F2 = 2 * c.intermediate_dim, D = c.hidden_dim;
    for (const auto& in : inputs) {
      b13_.push_back(std::make_unique<DeviceTensor>(E_local_ * F2, DType::bf16));
      b2_.push_back(std::make_unique<DeviceTensor>(E_local_ * D, DType::bf16));
      grad_b13_.push_back(std::make_unique<DeviceTensor>(E_local_ * F2, c.wgrad_dtype));
      grad_b2_.push_back(std::make_unique<DeviceTensor>(E_local_ * D, c.wgrad_dtype));
      b13_.back()->upload(in.b13);
      b2_.back()->upload(in.b2);
    }
  }

  std::vector<ForwardArgs> forward_args() const {
    std::vector<ForwardArgs> args(layer_.forward_args().begin(), layer_.forward_args().end());
    for (size_t r = 0; r < args.size(); ++r) set_forward(args[r], r);
    return args;
  }
  std::vector<BackwardArgs> backward_args() const {
    std::vector<BackwardArgs> args(layer_.backward_args().begin(), layer_.backward_args().end());
    for (size_t r = 0; r < args.size(); ++r) {
      set_forward(args[r].forward, r);
      args[r].accumulate_wgrad = lc_.accumulate;
      if (lc_.biased) args[r].grad_b13 = grad_b13_[r]->data(), args[r].grad_b2 = grad_b2_[r]->data();
    }
    return args;
  }

  // NaN in every output; with accumulate, the priors (stored layout) in the gradients.
  void prepare_outputs(const std::vector<reference::RankGradients>& priors) {
    layer_.poison_outputs();
    for (const auto& t : grad_b13_) t->poison();
    for (const auto& t : grad_b2_) t->poison();
    if (!lc_.accumulate) return;
    const auto bwd = layer_.backward_args();
    for (size_t r = 0; r < priors.size(); ++r) {
      upload_as(bwd[r].grad_w13, stored_w13(priors[r].grad_w13), c_.wgrad_dtype);
      upload_as(bwd[r].grad_w2, stored_w2(priors[r].grad_w2), c_.wgrad_dtype);
      if (!lc_.biased) continue;
      grad_b13_[r]->upload(priors[r].grad_b13);
      grad_b2_[r]->upload(priors[r].grad_b2);
    }
  }

  std::vector<RankResult> results() const {
    const auto out = layer_.out_TD(), grad_x = layer_.grad_x_TD(), grad_scores = layer_.grad_scores_TK();
    const auto grad_w13 = layer_.grad_w13(), grad_w2 = layer_.grad_w2();
    std::vector<RankResult> res(out.size());
    const int64_t D = c_.hidden_dim, F = c_.intermediate_dim;
    for (size_t r = 0; r < res.size(); ++r) {
      res[r] = {out[r], grad_x[r], grad_scores[r], grad_w13[r], grad_w2[r], {}, {}};
      if (lc_.transposed) {  // stored [E][D][2F] and [E][F][D]: back to the reference's layout
        res[r].grad_w13 = transpose_experts(grad_w13[r], E_local_, D, 2 * F);
        res[r].grad_w2 = transpose_experts(grad_w2[r], E_local_, F, D);
      }
      if (lc_.biased) res[r].grad_b13 = grad_b13_[r]->download(), res[r].grad_b2 = grad_b2_[r]->download();
    }
    return res;
  }

 private:
  std::vector<float> stored_w13(const std::vector<float>& w) const {
    return lc_.transposed ? transpose_experts(w, E_local_, 2 * c_.intermediate_dim, c_.hidden_dim) : w;
  }
  std::vector<float> stored_w2(const std::vector<float>& w) const {
    return lc_.transposed ? transpose_experts(w, E_local_, c_.hidden_dim, c_.intermediate_dim) : w;
  }
  std::vector<reference::RankInputs> stored(std::vector<reference::RankInputs> inputs) const {
    for (auto& in : inputs) in.w13 = stored_w13(in.w13), in.w2 = stored_w2(in.w2);
    return inputs;
  }
  void set_forward(ForwardArgs& a, size_t r) const {
    a.w13_layout = lc_.layout;
    a.weights_transposed = lc_.transposed;
    if (lc_.biased) a.b13 = b13_[r]->data(), a.b2 = b2_[r]->data();
  }

  Config c_;
  LayerCase lc_;
  int64_t E_local_;
  DeviceLayer layer_;
  std::vector<std::unique_ptr<DeviceTensor>> b13_, b2_, grad_b13_, grad_b2_;
};

void run_forward_backward(Context& context, BiasedLayer& layer, const Expected& want, cudaStream_t stream) {
  layer.prepare_outputs(want.priors);
  routed_experts_forward(context, layer.forward_args(), stream);
  routed_experts_backward(context, layer.backward_args(), stream);
  context.check(stream);
}

// Every output of every rank within kTolerance of the oracle; free entries' score gradients exactly 0.
void expect_matches(const std::vector<RankResult>& got, const Expected& want,
                    const std::vector<reference::RankInputs>& inputs, bool biased) {
  using testing::relative_error_to;
  for (size_t r = 0; r < got.size(); ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_LT(relative_error_to(got[r].out, want.out[r]), kTolerance) << "out_TD";
    EXPECT_LT(relative_error_to(got[r].grad_x, want.grads[r].grad_x_TD), kTolerance) << "grad_x_TD";
    EXPECT_LT(relative_error_to(got[r].grad_scores, want.grads[r].grad_scores_TK), kTolerance) << "grad_scores_TK";
    EXPECT_LT(relative_error_to(got[r].grad_w13, want.grads[r].grad_w13), kTolerance) << "grad_w13";
    EXPECT_LT(relative_error_to(got[r].grad_w2, want.grads[r].grad_w2), kTolerance) << "grad_w2";
    if (biased) {
      EXPECT_LT(relative_error_to(got[r].grad_b13, want.grads[r].grad_b13), kTolerance) << "grad_b13";
      EXPECT_LT(relative_error_to(got[r].grad_b2, want.grads[r].grad_b2), kTolerance) << "grad_b2";
    }
    int64_t free_nonzero = 0;
    for (size_t i = 0; i < inputs[r].ids_TK.size(); ++i)
      free_nonzero += inputs[r].ids_TK[i] == kNoExpert && got[r].grad_scores[i] != 0.0f;
    EXPECT_EQ(free_nonzero, 0) << "free entries with a score gradient";
  }
}

// What a case claims to exercise, checked on the reference's run (else it tests less than it says).
void expect_case_exercised(const LayerCase& lc, const std::vector<reference::RankInputs>& inputs,
                           const Expected& want) {
  if (lc.hot_expert && lc.balance == Balance::exact && lc.ranks > 1) {
    int64_t replicas = 0;
    for (int64_t n : want.stats.replicas) replicas += n;
    EXPECT_GT(replicas, 0) << "the hot expert was not replicated";
  }
  if (lc.free_fraction > 0) {
    int64_t free = 0;
    for (const auto& in : inputs) free += std::count(in.ids_TK.begin(), in.ids_TK.end(), kNoExpert);
    EXPECT_GT(free, 0) << "no free entry";
  }
}

class ContextBiases : public ::testing::TestWithParam<LayerCase> {};

TEST_P(ContextBiases, MatchTheReferenceEngine) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const LayerCase& lc = GetParam();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Config c = layer_config(lc);
  const auto inputs = layer_inputs(c, lc, seed, reference_options(c, lc));
  const auto grad_out = reference::random_grad_out(c, lc.ranks, seed + 1);
  const Expected want = reference_run(c, lc, inputs, grad_out, seed + 2);
  expect_case_exercised(lc, inputs, want);

  auto context = testing::make_context(c, lc.ranks);
  BiasedLayer layer(c, lc, inputs, grad_out);
  testing::TestStream stream;
  run_forward_backward(*context, layer, want, stream);
  expect_matches(layer.results(), want, inputs, lc.biased);
}

constexpr auto kBlocked = W13Layout::gate_up_blocked;
constexpr auto kInterleaved = W13Layout::gate_up_interleaved;
constexpr auto kSwiglu = Activation::swiglu;
constexpr auto kClamped = Activation::swiglu_clamped;

INSTANTIATE_TEST_SUITE_P(
    RanksAndLayouts, ContextBiases,
    ::testing::Values(
        // name, ranks, biased, transposed, layout, activation, balance, hot, free, wgrad dtype, accumulate
        LayerCase{"R1_biased", 1, true, false, kBlocked, kSwiglu, Balance::exact, false, 0.0, DType::fp32, false},
        LayerCase{"R1_biased_transposed_bf16", 1, true, true, kInterleaved, kClamped, Balance::exact, false, 0.2,
                  DType::bf16, false},
        LayerCase{"R1_transposed_accumulate", 1, false, true, kBlocked, kClamped, Balance::exact, false, 0.0,
                  DType::fp32, true},
        LayerCase{"R2_hot_biased_transposed_accumulate", 2, true, true, kInterleaved, kClamped, Balance::exact, true,
                  0.2, DType::fp32, true},
        LayerCase{"R4_hot_biased_bf16_accumulate", 4, true, false, kBlocked, kSwiglu, Balance::exact, true, 0.3,
                  DType::bf16, true},
        LayerCase{"R4_hot_transposed", 4, false, true, kInterleaved, kSwiglu, Balance::exact, true, 0.1, DType::fp32,
                  false},
        LayerCase{"R4_hot_biased_transposed_bf16", 4, true, true, kBlocked, kClamped, Balance::exact, true, 0.0,
                  DType::bf16, false},
        LayerCase{"R4_capacity_biased_transposed", 4, true, true, kInterleaved, kClamped, Balance::capacity, true, 0.2,
                  DType::fp32, true}),
    [](const ::testing::TestParamInfo<LayerCase>& info) { return info.param.name; });

// Activation records with biases and transposed weights (as ContextGpuSlots without them): a slot
// keeps layer 0 whole, layer 1 light (its backward sends the x rows again, with the replica weights
// and biases) and layer 2 partly (its backward recomputes h13, bias included, for the rows past
// 256); layer 3 runs from the working buffers. All four backwards run in reverse order, none
// rebuilding its forward; then layer 3 runs forward twice and the first one's backward rebuilds it.
class ContextBiasesSlots : public ::testing::TestWithParam<Balance> {};

TEST_P(ContextBiasesSlots, KeptAndRecomputedLayersAddTheBiases) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const LayerCase lc{"slots", 4, true, true, kInterleaved, kClamped, GetParam(), false, 0.1, DType::fp32, false};
  Config c = layer_config(lc);
  c.receive_capacity_factor = 4.0;
  c.max_moe_layers_per_activation_slot = 3;
  const MemoryPlan sizes = plan_memory(c, lc.ranks);
  const int64_t h13_row_bytes = 4 * c.intermediate_dim;  // a light record = routing layout + h13 of every row
  const int64_t layout_bytes = sizes.activation_light_record_bytes - sizes.device_rows * h13_row_bytes;
  c.activation_slot_bytes =
      sizes.activation_record_bytes + sizes.activation_light_record_bytes + layout_bytes + 256 * h13_row_bytes;
  const MemoryPlan plan = plan_memory(c, lc.ranks);
  ASSERT_EQ(plan.activation_records_per_slot, 1);
  ASSERT_EQ(plan.activation_light_records_per_slot, 1);
  ASSERT_EQ(plan.activation_partial_record_rows, 256);

  struct Layer {
    std::vector<reference::RankInputs> inputs;
    std::vector<std::vector<float>> grad_out;
    Expected want;
    std::unique_ptr<BiasedLayer> device;
  };
  std::vector<Layer> layers(4);
  for (size_t i = 0; i < layers.size(); ++i) {
    LayerCase li = lc;
    li.hot_expert = i % 2 == 0;  // replicas in layers 0 and 2 (exact balance)
    Layer& l = layers[i];
    l.inputs = layer_inputs(c, li, seed + 31 * i, reference_options(c, li));
    l.grad_out = reference::random_grad_out(c, lc.ranks, seed + 31 * i + 1);
    l.want = reference_run(c, li, l.inputs, l.grad_out, seed + 31 * i + 2);
    l.device = std::make_unique<BiasedLayer>(c, li, l.inputs, l.grad_out);
    l.device->prepare_outputs({});
  }
  auto context = Context::create_virtual_ranks(c, lc.ranks);
  testing::TestStream stream;
  context->select_activation_slot(0, 3);
  std::vector<ActivationRecord> records;
  for (Layer& l : layers) records.push_back(routed_experts_forward(*context, l.device->forward_args(), stream));
  EXPECT_EQ(records[0].index, 1);  // kept whole
  EXPECT_EQ(records[1].index, 2);  // kept light
  EXPECT_EQ(records[2].index, 3);  // kept partly
  EXPECT_EQ(records[3].index, 0);  // the working buffers
  for (int i = 3; i >= 0; --i) routed_experts_backward(*context, layers[i].device->backward_args(), stream, &records[i]);
  context->check(stream);
  EXPECT_EQ(context->recomputed_forwards(), 0);

  Layer& last = layers[3];
  last.device->prepare_outputs({});
  const ActivationRecord first = routed_experts_forward(*context, last.device->forward_args(), stream);
  routed_experts_forward(*context, last.device->forward_args(), stream);
  routed_experts_backward(*context, last.device->backward_args(), stream, &first);
  context->check(stream);
  EXPECT_EQ(context->recomputed_forwards(), 1);

  for (size_t i = 0; i < layers.size(); ++i) {
    SCOPED_TRACE("layer " + std::to_string(i));
    expect_matches(layers[i].device->results(), layers[i].want, layers[i].inputs, true);
  }
}

INSTANTIATE_TEST_SUITE_P(BalanceModes, ContextBiasesSlots, ::testing::Values(Balance::exact, Balance::capacity),
                         [](const ::testing::TestParamInfo<Balance>& info) { return std::string(to_string(info.param)); });

// Biases and the stored layout are per-call choices every rank must share, each bias needs its
// partner and its gradient: refused before anything is enqueued (the pipeline's checks, named per
// rank), after which the same context runs the valid call correctly.
TEST(ContextBiasesValidation, CallsThatDisagreeAreRefusedByName) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const LayerCase lc{"validation", 2, true, false, kBlocked, kSwiglu, Balance::exact, true, 0.0, DType::fp32, false};
  const Config c = layer_config(lc);
  const auto inputs = layer_inputs(c, lc, seed, reference_options(c, lc));
  const auto grad_out = reference::random_grad_out(c, lc.ranks, seed + 1);
  const Expected want = reference_run(c, lc, inputs, grad_out, seed + 2);
  auto context = Context::create_virtual_ranks(c, lc.ranks);
  BiasedLayer layer(c, lc, inputs, grad_out);
  layer.prepare_outputs({});
  testing::TestStream stream;

  auto forward_name = [&](auto&& mutate) {
    auto args = layer.forward_args();
    mutate(args);
    return rejected_name([&] { routed_experts_forward(*context, args, stream); });
  };
  EXPECT_EQ(forward_name([](auto& a) { a[0].b2 = nullptr; }), "args[0].b2");    // b13 without b2
  EXPECT_EQ(forward_name([](auto& a) { a[1].b13 = nullptr; }), "args[1].b13");  // b2 without b13
  EXPECT_EQ(forward_name([](auto& a) { a[1].b13 = a[1].b2 = nullptr; }), "args[1].b13");  // rank 0's only
  EXPECT_EQ(forward_name([](auto& a) { a[0].b13 = a[0].b2 = nullptr; }), "args[1].b13");  // rank 1's only
  EXPECT_EQ(forward_name([](auto& a) { a[1].weights_transposed = true; }), "args[1].weights_transposed");
  // The replica push and the bias-score kernel read biases 16 bytes at a time.
  EXPECT_EQ(forward_name([](auto& a) { a[0].b13 = static_cast<const char*>(a[0].b13) + 2; }), "args[0].b13");
  EXPECT_EQ(forward_name([](auto& a) { a[1].b2 = static_cast<const char*>(a[1].b2) + 2; }), "args[1].b2");
  routed_experts_forward(*context, layer.forward_args(), stream);

  auto backward_name = [&](auto&& mutate) {
    auto args = layer.backward_args();
    mutate(args);
    return rejected_name([&] { routed_experts_backward(*context, args, stream); });
  };
  EXPECT_EQ(backward_name([](auto& b) { b[1].grad_b13 = nullptr; }), "args[1].grad_b13");
  EXPECT_EQ(backward_name([](auto& b) { b[0].grad_b2 = nullptr; }), "args[0].grad_b2");
  EXPECT_EQ(backward_name([](auto& b) { b[1].grad_b13 = static_cast<char*>(b[1].grad_b13) + 4; }), "args[1].grad_b13");
  EXPECT_EQ(backward_name([](auto& b) { b[1].forward.weights_transposed = true; }), "args[1].weights_transposed");
  EXPECT_EQ(backward_name([](auto& b) { b[1].forward.b13 = b[1].forward.b2 = nullptr; }), "args[1].b13");
  // Without biases, bias gradients must be null (a caller passing them expects them written).
  EXPECT_EQ(backward_name([](auto& b) {
              for (BackwardArgs& a : b) a.forward.b13 = a.forward.b2 = nullptr;
            }),
            "args[0].grad_b13");
  routed_experts_backward(*context, layer.backward_args(), stream);
  context->check(stream);
  expect_matches(layer.results(), want, inputs, true);
}

}  // namespace
}  // namespace poise
