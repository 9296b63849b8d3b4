// FP8 block-scaled experts through the public entry points (Config::gemm_precision =
// fp8_block_scaled, docs/fp8.md): a GPU context's forward quantizes every call's weights (128 x 128
// blocks), the received x rows and the SwiGLU output a (1 x 128 tiles) and runs FP8 GEMMs; its
// backward quantizes the weights transposed, grad_y and grad_h13 in row tiles (DGRAD), and runs
// WGRAD in BF16 on x's FP8 rows dequantized or (Config::fp8_wgrad) on column tiles of every WGRAD
// operand. Checked against the CPU reference engine in FP8 mode, which quantizes the same operands
// the same way, so what is left is fp32 summation order (and now and then an e4m3 value that rounds
// the other way): out within kOutRelL2 in relative L2 and every element within kOutElement x (|want|
// + its row's rms); grad_x, grad_scores and each expert's weight gradients within GradBounds (wider
// for grad_x and grad_w13 behind the clamps' masks: see there). Against the BF16 reference the same
// results are a few percent off (E4M3 keeps 3 mantissa bits), printed and recorded (RecordProperty)
// for every rank.
//
// Cases: one rank (Context::create) and virtual ranks (R = 2, 4) in exact balance and capacity mode,
// WGRAD in BF16 (the default) or FP8, a hot expert (exact balance replicates it), the last expert
// given no rows, D = 192 and F = 320 (64 mod 128: a last scale block 64 wide), swiglu and
// swiglu_clamped, two layers in a row on one context (the second with other weights: quantized
// again), the first layer's backward right after its forward and again after the second forward
// (restored: the same bits). Also: the call options the FP8 GEMMs do not take (interleaved W13,
// transposed weights, biases) are refused by name, before any kernel; prepared weights give the bits
// of the call's quantization, forward and backward; the device bytes a context holds against its
// plan (FP8 operands included).
// Fresh inputs every run (seed in the trace; POISE_TEST_SEED replays); outputs poisoned (NaN) first.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "gpu_test_support.hpp"
#include "poise/poise.hpp"
#include "poise/reference.hpp"
#include "testing/device_layer.hpp"

namespace poise {
namespace {

using testing::relative_error_to;

// GPU against the FP8 reference engine (the same quantized operands, fp32 sums in another order).
// Measured on the H200: 2.4e-3 - 6.0e-3 relative L2. Elementwise up to 0.058 x (|want| + row rms):
// where the order flips a bf16 rounding of a, its e4m3 value can move one E4M3 step (6-12%), and that
// one product moves the output element.
constexpr double kOutRelL2 = 1.5e-2;
constexpr double kOutElement = 0.1;  // |got - want| <= kOutElement * (|want| + rms of want's row)
// GPU FP8 against the BF16 reference engine: what E4M3 costs on these inputs (x ~ N(0, 1), weights
// ~ N(0, 1/fan-in)). The two CPU reference engines differ by 5.8% - 6.5% relative L2 on out for
// every shape, balance, activation and routing below (4 seeds each; exact and capacity alike);
// the GPU adds its distance to the FP8 reference (< kOutRelL2) either way.
constexpr double kFp8GapLow = 4e-2;  // below: not the FP8 GEMMs (BF16 is ~0.3% from float64)
constexpr double kFp8GapHigh = 9e-2;
// The backward against the FP8 reference (which runs the GPU's steps, docs/fp8.md): grad_x,
// grad_scores and each expert's weight gradients, relative L2. Against the BF16 reference: what E4M3
// costs the gradients (a few percent; printed).
struct GradBounds {
  double vs_fp8;        // grad_scores, grad_w2 always; grad_x, grad_w13 with plain SwiGLU
  double masked_vs_fp8;  // grad_x, grad_w13: behind the clamps' gradient masks
  double vs_bf16;
};
// Plain SwiGLU: measured on the H200 4e-3 - 6.3e-3 against the FP8 reference, ~7% against BF16.
constexpr GradBounds kSwigluGradBounds{1.5e-2, 1.5e-2, 0.15};
// Clamped SwiGLU: its derivative jumps at +-limit, and the H200's FP8 MMA sums with fewer mantissa
// bits than the reference's fp32, so now and then an h13 value (bf16) lands on the other side of the
// limit and one grad_h13 element is zero in one and whole in the other: it moves its token's grad_x
// row and its grad_w13 row. Emulated on the CPU (the reference's partial sums truncated to 14 mantissa
// bits, which gives plain SwiGLU the H200's 4e-3 - 8e-3) at limit 1.5 (h13 ~ N(0, 1)): grad_x up to
// 3.0e-2 and the worst expert's grad_w13 up to 7.3e-2 over 60 seeds, and up to 21% against BF16
// (whose h13 differs everywhere); grad_scores and grad_w2 (continuous in h13) stay below 7e-3. The
// FP8 DGRAD W2 epilogue's clamped path is checked against float64 on given h13 in
// test_expert_mlp_fp8 (DgradW2MatchesFloat64OnDequantizedOperands).
constexpr GradBounds kClampedGradBounds{1.5e-2, 0.15, 0.3};

Config fp8_config(int64_t ranks, Balance balance, Activation activation, bool fp8_wgrad = false) {
  Config c;
  c.fp8_wgrad = fp8_wgrad;
  c.num_local_input_tokens = 96;
  c.hidden_dim = 192;        // 64 mod 128: the last scale block of x, W13 and W2 is 64 wide
  c.intermediate_dim = 320;  // 64 mod 128 too (a's last tile, W2's last block column)
  c.top_k = 4;
  c.num_experts = ranks == 1 ? 8 : 4 * ranks;
  c.activation = activation;
  c.swiglu_alpha = 1.702;
  c.swiglu_limit = 1.5;  // h13 ~ N(0, 1): the clamp bites
  c.balance = balance;
  c.receive_capacity_factor = double(ranks);  // capacity mode: dropless whatever the routing
  c.gemm_precision = GemmPrecision::fp8_block_scaled;
  return c;
}

// The expert no token picks (on the last rank): its weights are quantized, its group has no rows.
int32_t empty_expert(const Config& c) { return int32_t(c.num_experts - 1); }

// Every token's K distinct picks: with `hot`, expert 0 first (exact balance replicates it) and K-1
// others; never empty_expert.
void shape_routing(const Config& c, std::vector<reference::RankInputs>& inputs, bool hot) {
  const int64_t K = c.top_k;
  const int32_t empty = empty_expert(c);
  for (auto& in : inputs) {
    for (int64_t t = 0; t < c.num_local_input_tokens; ++t) {
      int32_t* ids = &in.ids_TK[t * K];
      if (hot) {  // 0, then K-1 consecutive experts (mod E-2) in [1, E-2]
        for (int64_t k = 0; k < K; ++k) ids[k] = k == 0 ? 0 : int32_t(1 + (t + k - 1) % (c.num_experts - 2));
        continue;
      }
      for (int64_t k = 0; k < K; ++k) {
        if (ids[k] != empty) continue;
        for (int32_t e = 0; e < empty; ++e) {
          if (std::find(ids, ids + K, e) == ids + K) {
            ids[k] = e;
            break;
          }
        }
      }
    }
  }
}

// x ~ N(0, 1), softmax scores (the last 3 tokens of every rank padding: zero scores), skewed toward
// rank 0's experts, then shape_routing.
std::vector<reference::RankInputs> fp8_inputs(const Config& c, int64_t R, uint64_t seed, bool hot) {
  auto inputs = reference::random_inputs(c, R, {.seed = seed, .skew = 2.0, .padding_rows = 3}, reference::Options{});
  shape_routing(c, inputs, hot);
  return inputs;
}

// The oracle: out of the FP8 reference engine (with the replica slots a GPU context plans) and of
// the BF16 one on the same inputs, and the FP8 forward's routing.
struct Want {
  std::vector<std::vector<float>> fp8, bf16;
  reference::RoutingStats stats;
  std::vector<reference::RankGradients> fp8_grads, bf16_grads;  // of grad_out
};

Want reference_outputs(const Config& c, int64_t R, const std::vector<reference::RankInputs>& inputs,
                       const std::vector<std::vector<float>>& grad_out) {
  reference::Options options;
  options.replica_slots = plan_memory(c, R).num_replica_slots;
  reference::Engine fp8(c, R, options);
  Want want{fp8.forward(inputs), {}, fp8.routing_stats(), {}, {}};
  fp8.backward(inputs, grad_out, want.fp8_grads);
  Config bf16 = c;
  bf16.gemm_precision = GemmPrecision::bf16;
  bf16.fp8_wgrad = false;
  options.replica_slots = plan_memory(bf16, R).num_replica_slots;
  reference::Engine bf16_engine(bf16, R, options);
  want.bf16 = bf16_engine.forward(inputs);
  bf16_engine.backward(inputs, grad_out, want.bf16_grads);
  return want;
}

// What the inputs claim to exercise, checked on the reference's run (else the case tests less).
void expect_routing_exercised(const Config& c, int64_t R, bool hot, const Want& want) {
  EXPECT_EQ(want.stats.expert_rows[empty_expert(c)], 0) << "the empty expert got rows";
  if (hot && c.balance == Balance::exact && R > 1) {
    int64_t replicas = 0;
    for (int64_t n : want.stats.replicas) replicas += n;
    EXPECT_GT(replicas, 0) << "the hot expert was not replicated";
  }
}

// got against want (bf16 [T, D]): relative L2, and each element against kOutElement * (|want| + the
// rms of want's row). A NaN counts as outside; padding rows (all zero) must be exactly zero.
struct OutComparison {
  double rel_l2 = 0;
  double worst = 0;  // max |got - want| / (|want| + row rms) over the elements that are not NaN
  int64_t outside = 0;
};

OutComparison compare_out(const std::vector<float>& got, const std::vector<float>& want, int64_t D) {
  OutComparison cmp{relative_error_to(got, want), 0.0, 0};
  for (size_t row = 0; row * D < want.size(); ++row) {
    const float* w = &want[row * D];
    const float* g = &got[row * D];
    double sum2 = 0;
    for (int64_t d = 0; d < D; ++d) sum2 += double(w[d]) * w[d];
    const double rms = std::sqrt(sum2 / double(D));
    for (int64_t d = 0; d < D; ++d) {
      const double diff = std::abs(double(g[d]) - double(w[d])), scale = std::abs(double(w[d])) + rms;
      if (!(diff <= kOutElement * scale)) ++cmp.outside;
      const double ratio = scale > 0 ? diff / scale : (diff == 0 ? 0.0 : std::numeric_limits<double>::infinity());
      if (ratio > cmp.worst) cmp.worst = ratio;  // a NaN is counted in `outside`
    }
  }
  return cmp;
}

std::string format_double(double v) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.3e", v);
  return buffer;
}

// Every rank's out against the FP8 reference (tolerances above) and the BF16 one (the FP8 gap),
// the numbers printed and recorded as test properties (`label`_rank<r>_...).
void expect_out_matches(const std::vector<std::vector<float>>& got, const Want& want, const Config& c,
                        const std::string& label) {
  for (size_t r = 0; r < got.size(); ++r) {
    SCOPED_TRACE(label + ", rank " + std::to_string(r));
    const OutComparison cmp = compare_out(got[r], want.fp8[r], c.hidden_dim);
    const double gap = relative_error_to(got[r], want.bf16[r]);
    const double reference_gap = relative_error_to(want.fp8[r], want.bf16[r]);
    EXPECT_LT(cmp.rel_l2, kOutRelL2) << "out_TD against the FP8 reference (relative L2)";
    EXPECT_EQ(cmp.outside, 0) << "out_TD elements beyond " << kOutElement
                              << " x (|want| + row rms) of the FP8 reference; worst " << cmp.worst;
    EXPECT_GT(gap, kFp8GapLow) << "out_TD is as close to the BF16 reference as BF16 is: the FP8 path did not run";
    EXPECT_LT(gap, kFp8GapHigh) << "out_TD against the BF16 reference (relative L2)";
    std::printf("[ fp8      ] %s rank %zu: out vs FP8 reference %.3e rel L2 (worst element %.4f of |want| + row "
                "rms), vs BF16 reference %.3e (the FP8 reference's own: %.3e)\n",
                label.c_str(), r, cmp.rel_l2, cmp.worst, gap, reference_gap);
    const std::string key = label + "_rank" + std::to_string(r);
    ::testing::Test::RecordProperty(key + "_vs_fp8_reference", format_double(cmp.rel_l2));
    ::testing::Test::RecordProperty(key + "_worst_element", format_double(cmp.worst));
    ::testing::Test::RecordProperty(key + "_vs_bf16_reference", format_double(gap));
  }
}

// got against want, one block of `block` values at a time (an expert's weight gradient): the largest
// relative L2 over the blocks; a block the reference leaves zero (an expert without rows) must be
// zero, else it counts as infinitely far.
double worst_block_error(const std::vector<float>& got, const std::vector<float>& want, size_t block) {
  double worst = 0;
  for (size_t first = 0; first < want.size(); first += block) {
    const std::vector<float> g(got.begin() + first, got.begin() + first + block);
    const std::vector<float> w(want.begin() + first, want.begin() + first + block);
    const bool zero = std::all_of(w.begin(), w.end(), [](float v) { return v == 0.0f; });
    const double e = zero ? (std::all_of(g.begin(), g.end(), [](float v) { return v == 0.0f; })
                                 ? 0.0
                                 : std::numeric_limits<double>::infinity())
                          : relative_error_to(g, w);
    worst = std::isnan(e) ? std::numeric_limits<double>::infinity() : std::max(worst, e);
  }
  return worst;
}

// Every rank's gradients against the FP8 reference (weight gradients per expert) and the BF16 one,
// within the activation's GradBounds, printed and recorded as test properties.
void expect_grads_match(const DeviceLayer& device, const Want& want, const Config& c, const std::string& label) {
  const auto grad_x = device.grad_x_TD(), grad_scores = device.grad_scores_TK();
  const auto grad_w13 = device.grad_w13(), grad_w2 = device.grad_w2();
  const size_t block13 = size_t(2 * c.intermediate_dim * c.hidden_dim), block2 = size_t(c.hidden_dim * c.intermediate_dim);
  const GradBounds& bounds = c.activation == Activation::swiglu_clamped ? kClampedGradBounds : kSwigluGradBounds;
  for (size_t r = 0; r < grad_x.size(); ++r) {
    SCOPED_TRACE(label + ", rank " + std::to_string(r));
    const reference::RankGradients &f = want.fp8_grads[r], &b = want.bf16_grads[r];
    struct Row {
      const char* name;
      bool masked;  // behind the clamps' gradient masks
      double vs_fp8, vs_bf16;
    };
    const Row rows[] = {
        {"grad_x_TD", true, relative_error_to(grad_x[r], f.grad_x_TD), relative_error_to(grad_x[r], b.grad_x_TD)},
        {"grad_scores_TK", false, relative_error_to(grad_scores[r], f.grad_scores_TK),
         relative_error_to(grad_scores[r], b.grad_scores_TK)},
        {"grad_w13 (worst expert)", true, worst_block_error(grad_w13[r], f.grad_w13, block13),
         worst_block_error(grad_w13[r], b.grad_w13, block13)},
        {"grad_w2 (worst expert)", false, worst_block_error(grad_w2[r], f.grad_w2, block2),
         worst_block_error(grad_w2[r], b.grad_w2, block2)}};
    for (const Row& row : rows) {
      EXPECT_LT(row.vs_fp8, row.masked ? bounds.masked_vs_fp8 : bounds.vs_fp8)
          << row.name << " against the FP8 reference (relative L2)";
      EXPECT_LT(row.vs_bf16, bounds.vs_bf16) << row.name << " against the BF16 reference (relative L2)";
      std::printf("[ fp8      ] %s rank %zu: %s vs FP8 reference %.3e rel L2, vs BF16 reference %.3e\n", label.c_str(),
                  r, row.name, row.vs_fp8, row.vs_bf16);
      const std::string key = label + "_rank" + std::to_string(r) + "_" + std::string(row.name).substr(0, 8);
      ::testing::Test::RecordProperty(key + "_vs_fp8_reference", format_double(row.vs_fp8));
      ::testing::Test::RecordProperty(key + "_vs_bf16_reference", format_double(row.vs_bf16));
    }
  }
}

// Two sets of per-rank results with the same bits (NaN matching NaN).
int64_t differing_values(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  int64_t differing = 0;
  for (size_t r = 0; r < a.size(); ++r)
    for (size_t i = 0; i < a[r].size(); ++i) differing += !(a[r][i] == b[r][i] || (std::isnan(a[r][i]) && std::isnan(b[r][i])));
  return differing;
}

// The gradients of one backward, to compare another's bits with.
struct Grads {
  std::vector<std::vector<float>> grad_x, grad_scores, grad_w13, grad_w2;
  explicit Grads(const DeviceLayer& d)
      : grad_x(d.grad_x_TD()), grad_scores(d.grad_scores_TK()), grad_w13(d.grad_w13()), grad_w2(d.grad_w2()) {}
};

void expect_same_bits(const Grads& got, const Grads& want, const std::string& what) {
  EXPECT_EQ(differing_values(got.grad_x, want.grad_x), 0) << "grad_x_TD " << what;
  EXPECT_EQ(differing_values(got.grad_scores, want.grad_scores), 0) << "grad_scores_TK " << what;
  EXPECT_EQ(differing_values(got.grad_w13, want.grad_w13), 0) << "grad_w13 " << what;
  EXPECT_EQ(differing_values(got.grad_w2, want.grad_w2), 0) << "grad_w2 " << what;
}

// Context::device_bytes (per rank, after a call) against the plan, FP8 operands included: never
// more than the plan beyond 1% + 1 MiB of bookkeeping, not grossly less (the plan rounds the window
// to 2 MiB granules). As tests/python/test_torch_gpu.py checks it for BF16 contexts.
void expect_holds_its_plan(const Context& context) {
  const MemoryPlan& plan = context.plan();
  EXPECT_GT(plan.fp8_operand_bytes, 0);
  const double held = double(context.device_bytes()), planned = double(plan.total_device_bytes);
  const double mib = double(1 << 20);
  EXPECT_LE(held, planned * 1.01 + mib) << "held " << held << " bytes, planned " << planned;
  EXPECT_GE(held, planned * 0.9 - 4 * mib) << "held " << held << " bytes, planned " << planned;
}

// One layer: inputs, the oracle, its device tensors (outputs poisoned).
struct Layer {
  std::vector<reference::RankInputs> inputs;
  Want want;
  std::unique_ptr<DeviceLayer> device;
};

Layer make_layer(const Config& c, int64_t R, uint64_t seed, bool hot) {
  Layer l{fp8_inputs(c, R, seed, hot), {}, nullptr};
  const auto grad_out = reference::random_grad_out(c, R, seed + 1);
  l.want = reference_outputs(c, R, l.inputs, grad_out);
  expect_routing_exercised(c, R, hot, l.want);
  l.device = std::make_unique<DeviceLayer>(c, R, l.inputs, grad_out, DType::fp32);
  l.device->poison_outputs();
  return l;
}

// ---- the forward against the reference -----------------------------------------------------------

struct Fp8Case {
  std::string name;
  int64_t ranks;
  Balance balance;
  Activation activation;
  bool hot_expert;
  bool fp8_wgrad = false;  // Config::fp8_wgrad: WGRAD in FP8 too (else BF16)
};

void PrintTo(const Fp8Case& c, std::ostream* os) { *os << c.name; }

class ContextFp8 : public ::testing::TestWithParam<Fp8Case> {};

// Two layers on one context, each against the reference; the second has other weights (each call
// quantizes its own) and runs without keeping state for backward. The first layer's backward runs
// right after its forward and again after the second forward, from its record (restored: recomputed
// or dispatched again), with the same bits.
TEST_P(ContextFp8, ForwardAndBackwardMatchTheFp8Reference) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const Fp8Case& fc = GetParam();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Config c = fp8_config(fc.ranks, fc.balance, fc.activation, fc.fp8_wgrad);
  const int64_t R = fc.ranks;
  Layer first = make_layer(c, R, seed, fc.hot_expert);
  Layer second = make_layer(c, R, seed + 7919, fc.hot_expert);

  auto context = testing::make_context(c, R);
  testing::TestStream stream;
  const ActivationRecord record = routed_experts_forward(*context, first.device->forward_args(), stream);
  context->check(stream);
  expect_out_matches(first.device->out_TD(), first.want, c, fc.name + "_layer0");
  routed_experts_backward(*context, first.device->backward_args(), stream);
  context->check(stream);
  expect_grads_match(*first.device, first.want, c, fc.name + "_layer0");
  const Grads right_after(*first.device);

  routed_experts_forward(*context, second.device->forward_args(), stream, /*keep_for_backward=*/false);
  context->check(stream);
  expect_out_matches(second.device->out_TD(), second.want, c, fc.name + "_layer1");
  first.device->poison_outputs();
  routed_experts_backward(*context, first.device->backward_args(), stream, &record);
  context->check(stream);
  expect_same_bits(Grads(*first.device), right_after, "of the restored record");
  expect_holds_its_plan(*context);
}

constexpr auto kSwiglu = Activation::swiglu;
constexpr auto kClamped = Activation::swiglu_clamped;

INSTANTIATE_TEST_SUITE_P(
    RanksAndBalance, ContextFp8,
    ::testing::Values(
        // name, ranks, balance, activation, hot expert, WGRAD in FP8
        Fp8Case{"R1_swiglu", 1, Balance::exact, kSwiglu, false},
        Fp8Case{"R1_clamped_hot_fp8wgrad", 1, Balance::capacity, kClamped, true, true},
        Fp8Case{"R2_exact_hot_swiglu_fp8wgrad", 2, Balance::exact, kSwiglu, true, true},
        Fp8Case{"R2_capacity_hot_clamped", 2, Balance::capacity, kClamped, true},
        Fp8Case{"R4_exact_hot_clamped", 4, Balance::exact, kClamped, true},
        Fp8Case{"R4_exact_skewed_swiglu_fp8wgrad", 4, Balance::exact, kSwiglu, false, true},
        Fp8Case{"R4_capacity_hot_swiglu", 4, Balance::capacity, kSwiglu, true}),
    [](const ::testing::TestParamInfo<Fp8Case>& info) { return info.param.name; });

// ---- what is refused -----------------------------------------------------------------------------

// The message of the exception `call` throws, "NotAvailable: ..." (or "<other>: ..."), "(accepted)"
// when it throws none.
template <class Call>
std::string refusal(Call&& call) {
  try {
    call();
  } catch (const NotAvailable& e) {
    return std::string("NotAvailable: ") + e.what();
  } catch (const InvalidArgument& e) {
    return std::string("InvalidArgument: ") + e.what();
  } catch (const std::exception& e) {
    return std::string("another exception: ") + e.what();
  }
  return "(accepted)";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

class ContextFp8Refusals : public ::testing::TestWithParam<int64_t> {};

// A device buffer of `bytes` zero bytes, freed with it.
class DeviceBytes {
 public:
  explicit DeviceBytes(size_t bytes) {
    EXPECT_EQ(cudaMalloc(&data_, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemset(data_, 0, bytes), cudaSuccess);
  }
  ~DeviceBytes() { cudaFree(data_); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
};

// The call options the FP8 GEMMs do not take (set on every rank, otherwise valid) are refused with
// NotAvailable naming the argument (and gemm_precision) before anything is enqueued (out keeps its
// poison); the same context then runs the plain call correctly.
TEST_P(ContextFp8Refusals, UnbuiltCallOptionsAreRefusedByName) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const int64_t R = GetParam();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Config c = fp8_config(R, Balance::exact, kSwiglu);
  Layer layer = make_layer(c, R, seed, /*hot=*/true);
  const int64_t E_local = c.num_local_experts(R);
  std::vector<std::unique_ptr<DeviceBytes>> b13, b2;  // bf16 [E_local, 2F] and [E_local, D] per rank
  for (int64_t r = 0; r < R; ++r) {
    b13.push_back(std::make_unique<DeviceBytes>(size_t(E_local * 2 * c.intermediate_dim) * 2));
    b2.push_back(std::make_unique<DeviceBytes>(size_t(E_local * c.hidden_dim) * 2));
  }
  auto context = testing::make_context(c, R);
  testing::TestStream stream;

  auto refused = [&](auto&& mutate) {
    std::vector<ForwardArgs> args(layer.device->forward_args().begin(), layer.device->forward_args().end());
    for (size_t r = 0; r < args.size(); ++r) mutate(args[r], r);
    return refusal([&] { routed_experts_forward(*context, args, stream); });
  };
  const std::string interleaved =
      refused([](ForwardArgs& a, size_t) { a.w13_layout = W13Layout::gate_up_interleaved; });
  const std::string transposed = refused([](ForwardArgs& a, size_t) { a.weights_transposed = true; });
  const std::string biased = refused([&](ForwardArgs& a, size_t r) { a.b13 = b13[r]->data(), a.b2 = b2[r]->data(); });
  for (const auto& [why, name] : {std::pair{interleaved, "args[0].w13_layout"},
                                  std::pair{transposed, "args[0].weights_transposed"},
                                  std::pair{biased, "args[0].b13"}}) {
    EXPECT_TRUE(contains(why, "NotAvailable: ") && contains(why, name) && contains(why, "gemm_precision"))
        << name << ": " << why;
  }
  EXPECT_NO_THROW(context->check(stream));
  testing::expect_all_nan(layer.device->out_TD(), "out_TD after the refused calls");

  routed_experts_forward(*context, layer.device->forward_args(), stream);
  context->check(stream);
  expect_out_matches(layer.device->out_TD(), layer.want, c, "options_R" + std::to_string(R));
}

// One rank's prepared FP8 weights in device buffers: its w13 and w2 (ForwardArgs) quantized by
// poise::quantize_fp8_weight_blocks, or each matrix transposed (quantize_fp8_weight_blocks_transposed).
struct Prepared {
  std::unique_ptr<DeviceBytes> w13, w13_scales, w2, w2_scales;
};
Prepared prepare(const ForwardArgs& a, int64_t E, int64_t D, int64_t F, bool transposed, cudaStream_t stream) {
  const auto quantize = transposed ? quantize_fp8_weight_blocks_transposed : quantize_fp8_weight_blocks;
  auto blocks = [](int64_t n) { return (n + 127) / 128; };
  Prepared p;
  p.w13 = std::make_unique<DeviceBytes>(size_t(E * 2 * F * D));
  p.w13_scales = std::make_unique<DeviceBytes>(size_t(E * blocks(2 * F) * blocks(D)) * 4);
  p.w2 = std::make_unique<DeviceBytes>(size_t(E * D * F));
  p.w2_scales = std::make_unique<DeviceBytes>(size_t(E * blocks(D) * blocks(F)) * 4);
  quantize(a.w13, E, 2 * F, D, static_cast<uint8_t*>(p.w13->data()), static_cast<float*>(p.w13_scales->data()),
           stream);
  quantize(a.w2, E, D, F, static_cast<uint8_t*>(p.w2->data()), static_cast<float*>(p.w2_scales->data()), stream);
  return p;
}

// Prepared weights (ForwardArgs::w13_fp8 ..., quantized by poise::quantize_fp8_weight_blocks as an
// optimizer step would) give the bits of the call's own quantization: the same kernel, the same
// blocks; so do the backward's prepared transposed copies (BackwardArgs::w13_fp8_t ...). Then a
// half-set, a set on one rank only, and prepared weights on a BF16 context are refused by name
// before anything is enqueued.
TEST_P(ContextFp8Refusals, PreparedWeightsGiveTheBitsOfTheCallsQuantization) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const int64_t R = GetParam();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Config c = fp8_config(R, Balance::exact, kSwiglu);
  Layer layer = make_layer(c, R, seed, /*hot=*/true);
  const int64_t E = c.num_local_experts(R), D = c.hidden_dim, F = c.intermediate_dim;
  testing::TestStream stream;
  std::vector<Prepared> prepared;
  std::vector<ForwardArgs> args(layer.device->forward_args().begin(), layer.device->forward_args().end());
  for (int64_t r = 0; r < R; ++r) prepared.push_back(prepare(args[r], E, D, F, /*transposed=*/false, stream));
  auto context = testing::make_context(c, R);
  routed_experts_forward(*context, layer.device->forward_args(), stream);
  context->check(stream);
  const std::vector<std::vector<float>> quantized_in_call = layer.device->out_TD();
  expect_out_matches(quantized_in_call, layer.want, c, "prepared_R" + std::to_string(R) + "_in_call");

  layer.device->poison_outputs();
  for (int64_t r = 0; r < R; ++r) {
    args[r].w13_fp8 = prepared[r].w13->data();
    args[r].w13_fp8_scales = static_cast<const float*>(prepared[r].w13_scales->data());
    args[r].w2_fp8 = prepared[r].w2->data();
    args[r].w2_fp8_scales = static_cast<const float*>(prepared[r].w2_scales->data());
  }
  routed_experts_forward(*context, args, stream);
  context->check(stream);
  const auto expect_bits_of_the_call = [&](const std::vector<std::vector<float>>& out, const std::string& what) {
    for (int64_t r = 0; r < R; ++r) {
      int64_t differing = 0;
      for (size_t i = 0; i < out[r].size(); ++i) {
        const float a = out[r][i], b = quantized_in_call[r][i];
        differing += !(a == b || (std::isnan(a) && std::isnan(b)));
      }
      EXPECT_EQ(differing, 0) << "rank " << r << ": out " << what << " differs from the call's quantization";
    }
  };
  expect_bits_of_the_call(layer.device->out_TD(), "from prepared weights");
  // Its backward (the BF16 weights quantized transposed in the call), against the reference.
  routed_experts_backward(*context, layer.device->backward_args(), stream);
  context->check(stream);
  expect_grads_match(*layer.device, layer.want, c, "prepared_R" + std::to_string(R));
  const Grads per_call(*layer.device);

  layer.device->poison_outputs();
  auto refused = [&](auto&& mutate, const Context& on) {
    std::vector<ForwardArgs> changed = args;
    for (size_t r = 0; r < changed.size(); ++r) mutate(changed[r], r);
    return refusal([&] { routed_experts_forward(const_cast<Context&>(on), changed, stream); });
  };
  const std::string half = refused([](ForwardArgs& a, size_t) { a.w2_fp8_scales = nullptr; }, *context);
  EXPECT_TRUE(contains(half, "InvalidArgument: ") && contains(half, "args[0].w2_fp8_scales")) << half;
  if (R > 1) {
    const std::string one_rank = refused([](ForwardArgs& a, size_t r) {
      if (r == 1) a.w13_fp8 = nullptr, a.w13_fp8_scales = nullptr, a.w2_fp8 = nullptr, a.w2_fp8_scales = nullptr;
    }, *context);
    EXPECT_TRUE(contains(one_rank, "InvalidArgument: ") && contains(one_rank, "args[1].w13_fp8")) << one_rank;
  }
  // Config::prepared_fp8_weights of an inference context: the plan drops the own experts' weight
  // scratch (the replica slots keep theirs, at its start), the same bits come out, and a call
  // without them is refused.
  Config prepared_only = c;
  prepared_only.prepared_fp8_weights = true;
  prepared_only.inference = true;
  auto lean = testing::make_context(prepared_only, R);
  EXPECT_LT(lean->plan().fp8_operand_bytes, context->plan().fp8_operand_bytes - E * 3 * F * D + 1);
  routed_experts_forward(*lean, args, stream);
  lean->check(stream);
  expect_bits_of_the_call(layer.device->out_TD(), "of a prepared_fp8_weights context");
  layer.device->poison_outputs();
  const std::string unprepared = refusal([&] { routed_experts_forward(*lean, layer.device->forward_args(), stream); });
  EXPECT_TRUE(contains(unprepared, "InvalidArgument: ") && contains(unprepared, "args[0].w13_fp8") &&
              contains(unprepared, "prepared_fp8_weights"))
      << unprepared;
  // A training context with prepared_fp8_weights keeps the weight scratch (its backward quantizes
  // the transposed copies there) and gives the same bits forward and backward.
  Config prepared_training = c;
  prepared_training.prepared_fp8_weights = true;
  auto kept = testing::make_context(prepared_training, R);
  EXPECT_EQ(kept->plan().fp8_operand_bytes, context->plan().fp8_operand_bytes);
  routed_experts_forward(*kept, args, stream);
  routed_experts_backward(*kept, layer.device->backward_args(), stream);
  kept->check(stream);
  expect_bits_of_the_call(layer.device->out_TD(), "of a training prepared_fp8_weights context");
  expect_same_bits(Grads(*layer.device), per_call, "of a training prepared_fp8_weights context");
  layer.device->poison_outputs();
  // The backward's transposed copies prepared too (BackwardArgs::w13_fp8_t ...,
  // poise::quantize_fp8_weight_blocks_transposed): DGRAD reads them, the same bits; a half-set is
  // refused by name.
  std::vector<Prepared> transposed;
  std::vector<BackwardArgs> backward_args(layer.device->backward_args().begin(), layer.device->backward_args().end());
  for (int64_t r = 0; r < R; ++r) {
    const Prepared& t = transposed.emplace_back(prepare(args[r], E, D, F, /*transposed=*/true, stream));
    BackwardArgs& b = backward_args[r];
    b.w13_fp8_t = t.w13->data();
    b.w13_fp8_t_scales = static_cast<const float*>(t.w13_scales->data());
    b.w2_fp8_t = t.w2->data();
    b.w2_fp8_t_scales = static_cast<const float*>(t.w2_scales->data());
  }
  routed_experts_forward(*kept, args, stream);
  routed_experts_backward(*kept, backward_args, stream);
  kept->check(stream);
  expect_same_bits(Grads(*layer.device), per_call, "with prepared transposed copies");
  layer.device->poison_outputs();
  std::vector<BackwardArgs> half_t = backward_args;
  half_t[0].w2_fp8_t_scales = nullptr;
  const std::string half_backward = refusal([&] { routed_experts_backward(*kept, half_t, stream); });
  EXPECT_TRUE(contains(half_backward, "InvalidArgument: ") && contains(half_backward, "args[0].w2_fp8_t_scales"))
      << half_backward;

  Config bf16 = c;
  bf16.gemm_precision = GemmPrecision::bf16;
  auto bf16_context = testing::make_context(bf16, R);
  const std::string on_bf16 = refused([](ForwardArgs&, size_t) {}, *bf16_context);
  EXPECT_TRUE(contains(on_bf16, "InvalidArgument: ") && contains(on_bf16, "args[0].w13_fp8") &&
              contains(on_bf16, "gemm_precision"))
      << on_bf16;
  EXPECT_NO_THROW(context->check(stream));
  testing::expect_all_nan(layer.device->out_TD(), "out_TD after the refused calls");
}

INSTANTIATE_TEST_SUITE_P(Ranks, ContextFp8Refusals, ::testing::Values(int64_t{1}, int64_t{2}),
                         [](const ::testing::TestParamInfo<int64_t>& info) {
                           return "R" + std::to_string(info.param);
                         });

}  // namespace
}  // namespace poise
